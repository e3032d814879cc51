"""PyTorch backends, composed: a model builder x an executor, chosen by typed options.

Model builder (``TorchOptions``: ``weights``, ``attn_implementation``, ``fp8``): load the saved
model with the task's head in the weights dtype and attention implementation, move it to the
device; with ``fp8:`` calibrate activation ranges on real batches of the run and swap the
encoder GEMMs for FP8 ones (``torch_fp8.py``).

Executor (``compile``, ``cuda_graph``, ``autocast``, ``tf32``):

* eager — the module as is (``autocast`` wraps it in ``torch.autocast``);
* compiled — ``torch.compile`` with inductor (``compile: default | max-autotune |
  max-autotune-no-cudagraphs``), compiled in prepare at every shape of the run, so compile
  time is prepare time and no shape recompiles while timing;
* ``cuda_graph: trees`` — inductor's CUDA graph trees (``mode=reduce-overhead``);
* ``cuda_graph: manual`` — one ``torch.cuda.CUDAGraph`` captured per shape of the run around
  the (compiled or eager) module, replayed with inputs copied into its static buffers and all
  outputs copied to pinned host memory under one synchronize (~0.15 ms of host time per batch,
  against ~0.6 ms for graph trees at this size).

The batch shapes come from the run's plan (``BackendContext.shapes``): the scheduler already
pads the last batch of a bucket to the bucket's shape, so a bounded set of shapes is known
before timing and each is compiled / captured once in prepare.

TF32 switches are process-wide in torch; each variant runs in its own process, and in the
in-process (test) mode ``close()`` puts them back as they were.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from ..errors import BackendUnavailableError, ConfigError
from .base import INPUT_NAMES, Backend, BackendContext, batch_at_shape
from .device_io import CudaStaging, HostOutputs, batch_shape, cuda_unavailable_reason, gpu_info
from .torch_fp8 import SCALINGS, check_ffn_hidden, parse_gemms

DTYPES = ("fp32", "fp16", "bf16")
# Families whose encoder is BertModel's layout (tests/test_checkpoint.py checks the FP8/INT8
# target Linears are found in each).
QUANT_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
from ..model.checkpoint import PACKED_FAMILIES  # noqa: E402 - the families the padding-free encoder computes
COMPILE_MODES = ("none", "default", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPHS = ("none", "trees", "manual")
SDPA_BACKENDS = ("cudnn", "efficient", "flash", "math")


def parse_layers(text: str) -> tuple[int, ...]:
    """'0, 11' -> (0, 11): encoder layers named in an option."""
    return tuple(int(x) for x in str(text).split(",") if x.strip())


@dataclass
class Fp8Options:
    scaling: str = "tensor"  # tensor | rowwise | static-rowwise
    gemms: str = "qkv,ffn_in,ffn_out"  # some of qkv, attn_out, ffn_in, ffn_out, or "all"
    fuse_qkv: bool = True
    fast_accum: bool = True
    act_margin: float = 2.0  # static scale = calibrated amax x margin / 448
    calibration_batches: int = 8  # real batches of the run the activation ranges are taken over
    keep_layers: str = ""  # encoder layers left in 16 bits, e.g. "0,11"
    # keep this many more layers in 16 bits: the most sensitive ones by a per-layer sweep in
    # prepare (quantize one layer at a time, measure max |Δ logit| on the calibration batches)
    sensitivity_keep: int = 0
    # the FFN's hidden activations in e4m3: the up-projection GEMM writes FP8 and GELU reads it
    # (torch_fp8.Fp8Intermediate); needs scaling: tensor and both FFN GEMMs in FP8
    ffn_hidden_fp8: bool = False
    # that hidden path's GELU: exact (the model's erf form) or tanh (one Triton kernel with the
    # GPU's tanh.approx; torch_fp8.FFN_GELUS, gelu_fp8.py); tanh needs ffn_hidden_fp8
    ffn_gelu: str = "exact"

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ConfigError(f"fp8.scaling '{self.scaling}' is not one of {', '.join(SCALINGS)}")
        try:
            parse_gemms(self.gemms)
        except ValueError as e:
            raise ConfigError(f"fp8.gemms: {e}") from None
        try:
            check_ffn_hidden(self.scaling, self.gemms, self.ffn_hidden_fp8, self.ffn_gelu)
        except ValueError as e:
            raise ConfigError(f"fp8.{e}") from None
        if self.act_margin <= 0 or self.calibration_batches < 1:
            raise ConfigError("fp8: act_margin must be > 0 and calibration_batches >= 1")
        try:
            self.layers_kept()
        except ValueError:
            raise ConfigError(f"fp8.keep_layers must be comma-separated layer indices, not {self.keep_layers!r}") from None

    def layers_kept(self) -> tuple[int, ...]:
        return parse_layers(self.keep_layers)


@dataclass
class Int8Options:
    gemms: str = "all"  # some of qkv, attn_out, ffn_in, ffn_out, or "all"
    keep_layers: str = ""
    sensitivity_keep: int = 0  # as Fp8Options.sensitivity_keep
    calibration_batches: int = 8  # batches the sensitivity sweep measures on

    def __post_init__(self):
        try:
            parse_gemms(self.gemms)
            self.layers_kept()
        except ValueError as e:
            raise ConfigError(f"int8: {e}") from None
        if self.sensitivity_keep < 0 or self.calibration_batches < 1:
            raise ConfigError("int8: sensitivity_keep must be >= 0 and calibration_batches >= 1")

    def layers_kept(self) -> tuple[int, ...]:
        return parse_layers(self.keep_layers)


TORCHAO_GRANULARITIES = ("tensor", "row")


@dataclass
class TorchaoOptions:
    """torchao's FP8 inference (``Float8DynamicActivationFloat8WeightConfig``), the maintained
    library beside the suite's own FP8 path (``fp8:``): dynamic activation scales, e4m3 weights,
    swapped into the same encoder Linears by ``torchao.quantization.quantize_``."""

    granularity: str = "row"  # tensor | row (per-token activations x per-channel weights)
    gemms: str = "qkv,ffn_in,ffn_out"  # the encoder Linears, named as fp8.gemms names them
    keep_layers: str = ""  # encoder layers left in 16 bits

    def __post_init__(self):
        if self.granularity not in TORCHAO_GRANULARITIES:
            raise ConfigError(f"torchao.granularity '{self.granularity}' is not one of "
                              f"{', '.join(TORCHAO_GRANULARITIES)}")
        try:
            parse_gemms(self.gemms)
            parse_layers(self.keep_layers)
        except ValueError as e:
            raise ConfigError(f"torchao: {e}") from None


def torchao_targets(module, t: TorchaoOptions) -> set[str]:
    """The encoder Linears torchao quantizes: the kinds ``t.gemms`` names outside the kept layers."""
    from .torch_fp8 import layer_index, target_linears

    keep = set(parse_layers(t.keep_layers))
    return {n for n in target_linears(module, parse_gemms(t.gemms)) if layer_index(n) not in keep}


@dataclass
class TorchOptions:
    weights: str = "fp32"  # fp32 | fp16 | bf16
    autocast: str = "none"  # none | fp16 | bf16 (weights stay as they are; matmuls run in this dtype)
    tf32: bool = False  # TF32 matmuls on CUDA
    attn_implementation: str = "sdpa"  # sdpa | eager
    compile: str = "none"  # none | default | max-autotune | max-autotune-no-cudagraphs
    dynamic: Optional[bool] = False  # torch.compile(dynamic=...)
    fullgraph: bool = False
    cuda_graph: str = "none"  # none | trees (inductor's) | manual (one torch.cuda.CUDAGraph per shape)
    fp8: Optional[Fp8Options] = None
    int8: Optional[Int8Options] = None  # W8A8 dynamic int8 encoder GEMMs (quantize.py)
    torchao: Optional[TorchaoOptions] = None  # torchao's FP8 inference instead of the suite's own
    sdpa_backend: Optional[str] = None  # restrict SDPA's kernel while compiling/capturing
    inductor_config: dict = field(default_factory=dict)  # patched into torch._inductor.config while compiling
    num_threads: Optional[int] = None  # CPU threads (default: torch's)
    packed: bool = False  # real tokens only: the padding-free encoder (packed_bert.py)
    # packed only: round each batch's token count up to a multiple of this and capture one CUDA
    # graph per bucket (packed_bert.TokenBuckets); 0 = the exact token count, no graphs
    token_bucket: int = 0
    # token_bucket on CUDA only: pack each batch on the host into the bucket graph's inputs
    # (packed_bert.HostPacker) instead of on the device (two host syncs and ~15 kernels a batch)
    host_pack: bool = False
    # packed only: the QA span head runs on the packed tokens inside the encoder (and its token
    # buckets' graphs), so 2 logits a token are scattered back instead of the hidden states
    # (packed_bert.fuse_token_head)
    head_first: bool = False
    # CUDA only: keep two batches in flight (Backend.submit), so the host prepares batch i+1 and
    # scatters batch i's outputs while the GPU computes; every buffer the host writes or reads
    # (pinned inputs, packing, outputs) has one copy per batch in flight
    pipeline: bool = False

    def __post_init__(self):
        for name, value, valid in (("weights", self.weights, DTYPES), ("autocast", self.autocast, ("none",) + DTYPES[1:]),
                                   ("compile", self.compile, COMPILE_MODES), ("cuda_graph", self.cuda_graph, CUDA_GRAPHS),
                                   ("attn_implementation", self.attn_implementation, ("sdpa", "eager"))):
            if value not in valid:
                raise ConfigError(f"torch option {name} '{value}' is not one of {', '.join(valid)}")
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise ConfigError(f"torch option sdpa_backend '{self.sdpa_backend}' is not one of {', '.join(SDPA_BACKENDS)}")
        if self.cuda_graph == "trees" and self.compile == "none":
            raise ConfigError("cuda_graph: trees are inductor's; they need compile other than none")
        if self.fp8 is not None and self.weights == "fp32":
            raise ConfigError("fp8 needs 16-bit weights for the parts that stay out of FP8 (weights: fp16 or bf16)")
        if sum(q is not None for q in (self.fp8, self.int8, self.torchao)) > 1:
            raise ConfigError("fp8, int8 and torchao are three ways of quantizing the same GEMMs: name one")
        if self.torchao is not None and self.weights == "fp32":
            raise ConfigError("torchao FP8 keeps the rest of the model in 16 bits (weights: bf16 or fp16)")
        if self.packed and self.cuda_graph != "none":
            raise ConfigError("packed (padding-free) runs eager or compiled; its token count changes every batch, "
                              "so no whole-model CUDA graphs (cuda_graph: none); token_bucket captures its graphs")
        if self.token_bucket < 0 or (self.token_bucket and not self.packed):
            raise ConfigError(f"token_bucket {self.token_bucket}: a bucket size in tokens (>= 1) for packed: true, "
                              "or 0 for none")
        if self.head_first and not self.packed:
            raise ConfigError("head_first runs the QA head on the packed tokens before the scatter: it needs packed: true")
        if self.host_pack and not self.token_bucket:
            raise ConfigError("host_pack feeds the token buckets' CUDA graphs: it needs packed: true and token_bucket")

    def inductor_mode(self) -> str:
        """torch.compile's mode: graph trees come with reduce-overhead / max-autotune."""
        if self.cuda_graph == "trees":
            return "reduce-overhead" if self.compile == "default" else "max-autotune"
        return "max-autotune-no-cudagraphs" if self.compile == "max-autotune" else self.compile


def _gelu_info(gelu: str, module) -> str:
    """What computes the FFN's GELU between e4m3 GEMMs (prepare_info's fp8_ffn_gelu)."""
    if gelu == "exact":
        return "exact (the model's own GELU, fused by Inductor)"
    from .gelu_fp8 import implementation

    return f"tanh form, {implementation(next(module.parameters()).is_cuda)}"


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class _GraphReplay:
    """One captured torch.cuda.CUDAGraph per shape around ``fn``, with static input buffers."""

    def __init__(self, fn, device):
        self.fn, self.device = fn, device
        self.graphs: dict[tuple[int, int], tuple] = {}

    def capture(self, batch: Mapping[str, np.ndarray]) -> None:
        import torch

        shape = batch_shape(batch)
        static = tuple(torch.from_numpy(np.ascontiguousarray(batch[n])).to(self.device) for n in INPUT_NAMES)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles (if not yet) and settles the allocator before capture
                    self.fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = tuple(self.fn(*static))
        self.graphs[shape] = (graph, static, outs)

    def __call__(self, batch: Mapping[str, np.ndarray], staging: CudaStaging):
        graph, static, outs = self.graphs[batch_shape(batch)]
        dev = staging.to_device(batch)  # pinned host -> staging device buffers
        for dst, n in zip(static, INPUT_NAMES):
            dst.copy_(dev[n], non_blocking=True)
        graph.replay()
        return outs


class TorchBackend(Backend):
    Options = TorchOptions

    @classmethod
    def precision_of(cls, o: TorchOptions) -> str:
        if o.fp8 is not None or o.torchao is not None:
            return "fp8"
        if o.int8 is not None:
            return "int8"
        if o.autocast != "none":
            return f"amp-{o.autocast}"
        if o.weights == "fp32" and o.tf32:
            return "tf32"
        return o.weights

    @classmethod
    def batching_reason(cls, options, batching: str) -> Optional[str]:
        return None if options.packed else super().batching_reason(options, batching)

    @classmethod
    def family_reason(cls, options, family: str) -> Optional[str]:
        o: TorchOptions = options
        if o.packed and family not in PACKED_FAMILIES:
            return (f"the padding-free encoder (packed_bert.py) computes {', '.join(PACKED_FAMILIES)}; a {family} "
                    "model is not packed here")
        if (o.fp8 is not None or o.int8 is not None or o.torchao is not None) and family not in QUANT_FAMILIES:
            kind = "INT8" if o.int8 is not None else "FP8"
            return (f"{kind} GEMMs are swapped into BERT-layout encoder Linears (encoder.layer.N.attention.self.query, "
                    f"...); a {family} model has other module names, so nothing would be quantized")
        return None

    @classmethod
    def unavailable_reason(cls, variant) -> Optional[str]:
        o: TorchOptions = variant.options
        if variant.device != "cuda":
            if o.cuda_graph != "none" or o.fp8 is not None or o.torchao is not None:
                return "CUDA graphs and FP8 GEMMs need device: cuda"
            if o.pipeline:
                return ("pipeline overlaps the host's work with an accelerator's; on device: cpu the host is the "
                        "device (pipeline: false)")
            return None
        if o.int8 is not None and not hasattr(__import__("torch"), "_int_mm"):
            return "this torch has no torch._int_mm (int8 GEMMs)"
        why = cuda_unavailable_reason()
        if why:
            return f"{cls.precision_of(o)} on CUDA {why}"
        import torch

        if "bf16" in (o.weights, o.autocast) and not torch.cuda.is_bf16_supported():
            return "this GPU does not support bf16"
        if o.torchao is not None:
            try:
                import torchao  # noqa: F401
            except ImportError as e:
                return f"torchao is not installed (pip install torchao): {e}"
        if o.fp8 is not None and (not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn")):
            return f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn (FP8 GEMMs)"
        if o.fp8 is not None or o.torchao is not None:
            cap = torch.cuda.get_device_capability()
            if cap < (8, 9):
                return f"FP8 tensor cores need Hopper/Ada (sm_89+); {torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}"
            if o.fp8 is not None and o.fp8.scaling != "tensor" and cap < (9, 0):
                return "rowwise FP8 scaling needs sm_90 (Hopper)"
        return None

    def __init__(self, variant):
        super().__init__(variant)
        self.module = None
        self._fn = None
        self._graphs: Optional[_GraphReplay] = None
        self._staging: list[CudaStaging] = []  # one per batch in flight
        self._slot = 0
        self._host = HostOutputs()
        self._packer = None  # packed_bert.HostPacker (host_pack)
        self._tf32_before: Optional[tuple[bool, bool]] = None

    # --- prepare -------------------------------------------------------------------------
    def prepare(self, ctx: BackendContext) -> None:
        import torch

        o: TorchOptions = self.options
        why = self.unavailable_reason(self.variant)
        if why:
            raise BackendUnavailableError(f"{self.name}: {why}")
        self.output_names = tuple(ctx.output_names)
        cuda = self.device == "cuda"
        if cuda:
            self._tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(o.tf32)
            self._staging = [CudaStaging(ctx.max_batch_size, ctx.max_seq_len, device="cuda")
                             for _ in range(self.in_flight())]
            self._host.reserve(ctx.output_names, self.in_flight(), ctx.max_batch_size, ctx.max_seq_len)
        elif o.num_threads:
            torch.set_num_threads(int(o.num_threads))

        self.module, built = self._build_model(ctx)
        # the attention the model really runs: a family without SDPA (DeBERTa-v2) loads its own
        loaded_attn = getattr(self.module.model.config, "_attn_implementation", o.attn_implementation)
        self.prepare_info = {"device": self.device, "batches_in_flight": self.in_flight(),
                             "weights_dtype": o.weights, "autocast": o.autocast,
                             "attn_implementation": loaded_attn, "torch": torch.__version__, **built}
        if cuda:
            self.prepare_info.update(tf32=bool(o.tf32), **gpu_info())
        else:
            self.prepare_info["threads"] = torch.get_num_threads()

        with self._compile_guard():
            self._fn = self.module
            if o.compile != "none" and not o.token_bucket:  # bucketed: only the encoder's static part compiles
                self._fn = torch.compile(self.module, mode=o.inductor_mode(), dynamic=o.dynamic,
                                         fullgraph=o.fullgraph, backend="inductor")
            t0 = time.perf_counter()
            shapes = sorted(set(ctx.shapes), reverse=True)
            if o.token_bucket:
                self.prepare_info.update(self._token_buckets(ctx, shapes))
            if o.cuda_graph == "manual":
                self._graphs = _GraphReplay(self._fn, "cuda")
                for b, s in shapes:
                    self._graphs.capture(batch_at_shape(ctx.sample_batch, b, s))
            # Every shape of the run once (graph trees: warm-up, record, replay), so compilation
            # and capture finish here and the runner's warm-up sees steady state.
            calls = 3 if o.cuda_graph == "trees" else 1
            for b, s in shapes if (o.compile != "none" or o.cuda_graph != "none" or o.token_bucket) else shapes[:1]:
                for _ in range(calls):
                    self.predict(batch_at_shape(ctx.sample_batch, b, s))
            warm_s = time.perf_counter() - t0
        self.prepare_info.update(compile=o.compile, compile_mode=o.inductor_mode(), cuda_graph=o.cuda_graph,
                                 prepared_shapes=len(set(ctx.shapes)), compile_and_capture_s=round(warm_s, 3),
                                 sdpa_backend=o.sdpa_backend or "auto",
                                 inductor_config=",".join(f"{k}={v}" for k, v in sorted(o.inductor_config.items()))
                                 or "default")

    def _token_buckets(self, ctx: BackendContext, shapes) -> dict:
        """The packed encoder's static part per token bucket: compiled once with a dynamic token
        count (when compile is on), then one CUDA graph per bucket up to the run's largest batch."""
        import torch

        from .packed_bert import TokenBuckets

        o: TorchOptions = self.options
        from .packed_bert import encoder_of

        enc = encoder_of(self.module.model)
        encode = enc.encode
        if o.compile != "none":
            encode = torch.compile(enc.encode, mode=o.inductor_mode(), dynamic=True, fullgraph=o.fullgraph,
                                   backend="inductor")
        buckets = TokenBuckets(encode, bucket=o.token_bucket, max_len=ctx.max_seq_len,
                               max_rows=max(b for b, _ in shapes), max_tokens=max(b * s for b, s in shapes)).attach(enc)
        captured = 0
        if self.device == "cuda":
            with torch.inference_mode(), self._autocast():
                captured = buckets.capture(torch.device("cuda"))
            if o.host_pack:
                from .packed_bert import HostPacker

                self._packer = HostPacker(enc, torch.device("cuda"), slots=self.in_flight())
        return {"token_bucket": o.token_bucket, "token_buckets": len(buckets.sizes),
                "token_bucket_graphs": captured, "packing": "host" if self._packer is not None else "device"}

    def _build_model(self, ctx: BackendContext):
        import torch

        from ..model.modeling import load_inference_module

        o: TorchOptions = self.options
        module = load_inference_module(ctx.model_dir, ctx.task, attn_implementation=o.attn_implementation,
                                       dtype=_torch_dtype(o.weights)).to(self.device).eval()
        info: dict = {}
        if o.head_first:  # before calibration and the sensitivity sweep, which a refusal would waste
            from .packed_bert import head_first_reason

            why = head_first_reason(module.model)
            if why:
                raise BackendUnavailableError(f"{self.name}: {why}")
        as_tensors = lambda bs: [tuple(torch.from_numpy(np.ascontiguousarray(b[n], dtype=np.int64))  # noqa: E731
                                       .to(self.device) for n in INPUT_NAMES) for b in bs]
        # Quantize first, on the padded model (calibration and the sensitivity sweep run it), then
        # pack: the padding-free encoder calls the swapped Linears as they are.
        if o.int8 is not None:
            info = self._int8(module, o.int8, as_tensors(ctx.sample_batches[:o.int8.calibration_batches]))
        elif o.fp8 is not None:
            info = self._fp8(module, o.fp8, as_tensors(ctx.sample_batches[:o.fp8.calibration_batches]))
        elif o.torchao is not None:
            info = self._torchao(module, o.torchao)
        if o.packed:
            from .packed_bert import pack_model

            pack_model(module.model, head_first=o.head_first)
            from .packed_bert import encoder_of

            info.update(packed=True, attention_kernel=encoder_of(module.model).kernel_name, head_first=o.head_first)
        return module, info

    @staticmethod
    def _sweep(module, batches, quantize_layer, keep: int) -> tuple[tuple[int, ...], dict]:
        from .quantize import choose_kept_layers, layer_sensitivity

        if keep <= 0:
            return (), {}
        t0 = time.perf_counter()
        scores = layer_sensitivity(module, batches, quantize_layer)
        kept = choose_kept_layers(scores, keep)
        return kept, {"sensitivity_max_abs_logit_shift": ";".join(f"{l}:{v:.3g}" for l, v in scores),
                      "sensitivity_kept": ",".join(map(str, kept)), "sensitivity_s": round(time.perf_counter() - t0, 2)}

    def _int8(self, module, f: Int8Options, batches) -> dict:
        from .quantize import n_encoder_layers, swap_to_int8

        n = n_encoder_layers(module)
        kept, info = self._sweep(module, batches, lambda m, layer: swap_to_int8(
            m, gemms=f.gemms, keep_layers=[i for i in range(n) if i != layer]), f.sensitivity_keep)
        keep = sorted(set(f.layers_kept()) | set(kept))
        done = swap_to_int8(module, gemms=f.gemms, keep_layers=keep)
        return {**info, "int8_scheme": "W8A8 dynamic: per-channel weights, per-token activations, torch._int_mm",
                "int8_gemm_kinds": ",".join(parse_gemms(f.gemms)), "int8_linears": len(done["swapped"]),
                "int8_keep_layers": ",".join(map(str, keep)) or "none"}

    @staticmethod
    def _torchao(module, t: TorchaoOptions) -> dict:
        """torchao's FP8 swapped into the same encoder Linears as the suite's own FP8 path (the
        QA head and the kept layers stay 16-bit), before any compile."""
        import torchao
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        names = torchao_targets(module, t)
        keep = set(parse_layers(t.keep_layers))
        gran = PerRow() if t.granularity == "row" else PerTensor()
        quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=gran),
                  filter_fn=lambda m, fqn: fqn in names)
        return {"torchao": torchao.__version__, "fp8_scheme": f"torchao Float8DynamicActivationFloat8WeightConfig "
                f"({'per-token x per-channel' if t.granularity == 'row' else 'per-tensor'} dynamic scales)",
                "fp8_gemm_kinds": ",".join(parse_gemms(t.gemms)), "fp8_linears": len(names),
                "fp8_keep_layers": ",".join(map(str, sorted(keep))) or "none"}

    def _fp8(self, module, f: Fp8Options, batches) -> dict:
        from .quantize import n_encoder_layers
        from .torch_fp8 import calibrate_amax, ffn_up_names, swap_to_fp8, target_linears

        gemms = parse_gemms(f.gemms)
        targets = target_linears(module, gemms)
        amax, t0 = None, time.perf_counter()
        if f.scaling != "rowwise":
            amax = calibrate_amax(module, batches, targets, ffn_up_names(targets) if f.ffn_hidden_fp8 else ())
        calib_s = time.perf_counter() - t0
        n = n_encoder_layers(module)

        def swap(m, keep):
            return swap_to_fp8(m, amax, scaling=f.scaling, gemms=gemms, fuse_qkv=f.fuse_qkv, fast_accum=f.fast_accum,
                               act_margin=f.act_margin, keep_layers=keep, ffn_hidden_fp8=f.ffn_hidden_fp8,
                               ffn_gelu=f.ffn_gelu)

        kept, info = self._sweep(module, batches, lambda m, layer: swap(m, [i for i in range(n) if i != layer]),
                                 f.sensitivity_keep)
        keep = sorted(set(f.layers_kept()) | set(kept))
        done = swap(module, keep)
        info.update({
            "fp8_scaling": f.scaling, "fp8_gemm_kinds": ",".join(gemms),
            "fp8_weight_scale": "per-tensor" if f.scaling == "tensor" else "per-output-channel",
            "fp8_act_scale": "dynamic per-token" if f.scaling == "rowwise" else "static per-tensor (calibrated)",
            "fp8_linears": len(done["swapped"]), "fp8_gemms_per_forward": done["gemms"],
            "fp8_fused_qkv": bool(done["fused_qkv"]), "fp8_fast_accum": f.fast_accum,
            "fp8_keep_layers": ",".join(map(str, keep)) or "none", "fp8_kept_linears": len(done["kept"]),
            "fp8_ffn_hidden": f"e4m3 in {len(done['ffn_hidden_fp8'])} layers" if f.ffn_hidden_fp8 else "16-bit",
            "fp8_ffn_gelu": _gelu_info(f.ffn_gelu, module),
            "fp8_not_fp8": "embeddings, layernorms, attention softmax/PV (SDPA), qa head"
                           + ("" if "attn_out" in gemms else ", attention output projection"),
        })
        if amax is not None:
            vals = [v for k, v in amax.items() if k in targets]  # the GEMM inputs' ranges
            info.update(calibration_batches=len(batches), calibration_rows=int(sum(int(b[0].shape[0]) for b in batches)),
                        act_margin=f.act_margin, calibration_s=round(calib_s, 3),
                        act_amax_min=round(min(vals), 4), act_amax_max=round(max(vals), 4))
        return info

    def _compile_guard(self):
        """SDPA kernel choice and inductor settings are read while tracing/compiling, which
        happens in prepare: restricting them around prepare fixes them in the compiled graph."""
        o: TorchOptions = self.options
        stack = contextlib.ExitStack()
        if o.sdpa_backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                     "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
            stack.enter_context(sdpa_kernel([kinds[o.sdpa_backend]]))
        if o.inductor_config:
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(dict(o.inductor_config)))
        return stack

    # --- predict -------------------------------------------------------------------------
    def _autocast(self):
        import torch

        if self.options.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=_torch_dtype(self.options.autocast))

    def in_flight(self) -> int:
        return 2 if self.options.pipeline and self.device == "cuda" else 1

    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(batch)()

    def submit(self, batch: Mapping[str, np.ndarray]):
        """Queue one batch on the current stream: inputs in (pinned -> device), compute, outputs
        out (device -> pinned); the waiter blocks until they are on the host. Everything after the
        host's writes into pinned memory is ordered by the stream, so batch i+1's copies into a
        graph's static inputs run after batch i's replay, and its replay after batch i's outputs
        were copied out. On CPU the batch runs here and now."""
        import torch

        b, _ = batch_shape(batch)
        if self.device != "cuda":
            with torch.inference_mode(), self._autocast():
                args = (torch.from_numpy(np.ascontiguousarray(batch[n], dtype=np.int64)) for n in INPUT_NAMES)
                outs = self._fn(*args)
                out = {n: o.float().numpy().copy() for n, o in zip(self.output_names, outs)}
            return lambda: out
        slot = (self._slot + 1) % len(self._staging)
        self._host.check_free(slot)  # before its pinned buffers are written
        self._slot = slot
        staging = self._staging[slot]
        if self._graphs is not None:
            return self._host.stage(self.output_names, self._graphs(batch, staging), b, slot)
        with torch.inference_mode(), self._autocast():
            if self._packer is not None:
                self._packer(batch, slot)  # before the staging copy: both go out on the same stream
            dev = staging.to_device(batch)
            if self.options.cuda_graph == "trees":
                # Tells cudagraph trees the previous outputs are dead, so replay may reuse them
                # (their copy out is already queued before this replay).
                torch.compiler.cudagraph_mark_step_begin()
            outs = self._fn(*(dev[n] for n in INPUT_NAMES))
            # Copied out before the next call's work: a graph replay overwrites its outputs.
            return self._host.stage(self.output_names, outs, b, slot)

    def close(self) -> None:
        import torch

        self.module = self._fn = self._graphs = self._packer = None
        self._staging = []
        if self.options.compile != "none":
            torch._dynamo.reset()
        if self._tf32_before is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_before
            self._tf32_before = None
        if self.device == "cuda":
            torch.cuda.empty_cache()
