"""Backend variants: name -> implementation + device + typed options, declared, not coded.

Three sources, one table:

* the built-in variants below (``BUILTIN``);
* installed packages that declare the entry-point group ``bertqa_bench.backends``: each entry
  point names a Backend subclass, registered as an implementation under the entry point's
  name; its ``variants`` class attribute (``{variant name: {"device": ..., "options": {...}}}``)
  adds variants, and with none the entry-point name itself becomes a variant on
  ``default_device``;
* a suite's ``variants:`` section (``config.VariantConfig``): ``base:`` an existing variant
  with some options changed, or ``implementation:`` + ``device:`` + ``options:``.

Options are checked against the implementation's ``Options`` dataclass when the table is
built, so a typo fails before any work with the valid keys listed. Precision and parity
class follow from the options (``Backend.precision_of``), the device from the variant: one
source of truth each.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from ..config import SuiteConfig, build
from ..errors import ConfigError, UnknownBackendError
from .base import DEVICES, Backend, parity_class_of

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bertqa_bench.backends"

# Implementation name -> "module:Class". Modules import their heavy packages lazily.
IMPLEMENTATIONS = {
    "torch": "bertqa_bench.backends.torch_backend:TorchBackend",
    "onnxruntime": "bertqa_bench.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "bertqa_bench.backends.tensorrt:TensorRTBackend",
    "openvino": "bertqa_bench.backends.openvino_backend:OpenVinoBackend",
}


def import_object(target: str):
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(f"'{target}' is not an import path of the form package.module:Class")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"cannot import {module} (for {target}): {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module} has no attribute '{attr}' (for {target})") from None
    return obj


def _as_backend_class(obj, where: str) -> type[Backend]:
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise ConfigError(f"{where}: {obj!r} is not a subclass of bertqa_bench.backends.Backend")
    return obj


def options_dict(options) -> dict:
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})


@dataclass(frozen=True)
class Variant:
    """One way of running the model, fully specified."""

    name: str
    implementation: str  # key of the implementation table, or package.module:Class
    device: str
    options: Any  # the implementation's Options dataclass instance
    description: str = ""
    source: str = "builtin"  # builtin | suite | entry point <dist>
    # How this variant is run, where it differs from the suite's bench section: a length-aware
    # variant beside padded ones in one table, a sweep point, a slow build with more time.
    timeout_s: Optional[float] = None
    batching: Optional[str] = None
    batch_size: Optional[int] = None
    devices: Optional[int] = None  # data-parallel prediction over this many GPUs (one process each)

    @property
    def backend_class(self) -> type[Backend]:
        return _implementation_class(self.implementation)

    @property
    def precision(self) -> str:
        return self.backend_class.precision_of(self.options)

    @property
    def parity_class(self) -> str:
        return parity_class_of(self.precision)

    def create(self) -> Backend:
        return self.backend_class(self)

    def unavailable_reason(self) -> Optional[str]:
        return self.backend_class.unavailable_reason(self)

    def to_dict(self) -> dict:
        """Plain data (for a worker's job file and the results); ``from_dict`` reverses it."""
        return {"name": self.name, "implementation": self.implementation, "device": self.device,
                "options": options_dict(self.options), "description": self.description, "source": self.source,
                **{k: getattr(self, k) for k in RUN_FIELDS}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Variant":
        return make_variant(d["name"], d["implementation"], d["device"], d.get("options") or {},
                            d.get("description", ""), d.get("source", "builtin"),
                            **{k: d.get(k) for k in RUN_FIELDS})


_EXTRA_IMPLEMENTATIONS: dict[str, str] = {}  # from entry points
_ENTRY_POINTS_READ = False


def _implementation_class(name: str) -> type[Backend]:
    target = IMPLEMENTATIONS.get(name) or _EXTRA_IMPLEMENTATIONS.get(name)
    if target is None and ":" in name:
        target = name
    if target is None and not _ENTRY_POINTS_READ:  # e.g. in a worker process: read the plug-ins once
        _entry_point_variants()
        target = _EXTRA_IMPLEMENTATIONS.get(name)
    if target is None:
        known = sorted(IMPLEMENTATIONS) + sorted(_EXTRA_IMPLEMENTATIONS)
        raise ConfigError(f"unknown backend implementation '{name}'; known: {', '.join(known)} "
                          "(or an import path package.module:Class)")
    return _as_backend_class(import_object(target), name)


RUN_FIELDS = ("timeout_s", "batching", "batch_size", "devices")


def make_variant(name: str, implementation: str, device: str, options: Mapping | Any = None,
                 description: str = "", source: str = "builtin", **run) -> Variant:
    if device not in DEVICES:
        raise ConfigError(f"variant '{name}': device '{device}' is not one of {', '.join(DEVICES)}")
    cls = _implementation_class(implementation)
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        options = build(cls.Options, dict(options or {}), f"variant '{name}' options")
    return Variant(name, implementation, device, options, description, source,
                   **{k: run.get(k) for k in RUN_FIELDS})


def _v(name: str, impl: str, device: str, description: str, **options) -> dict:
    return {"name": name, "implementation": impl, "device": device, "options": options, "description": description}


_FP8 = {"scaling": "tensor", "gemms": "qkv,ffn_in,ffn_out"}

# The built-in variants. Each name means one thing in every results table.
BUILTIN = (
    _v("eager-fp32", "torch", "cpu", "PyTorch eager fp32 on CPU, SDPA attention (the CPU reference)"),
    _v("eager-bf16-cpu", "torch", "cpu", "PyTorch eager with bf16 weights on CPU", weights="bf16"),
    _v("torch-compile", "torch", "cpu", "torch.compile (inductor) fp32 on CPU", compile="default"),
    _v("onnxruntime", "onnxruntime", "cpu", "ONNX Runtime CPU, fp32, fused BERT graph"),
    # per_channel: measured on the CI model, per-tensor weight scales cost 13% of F1, per-channel 0.1%.
    _v("onnxruntime-int8", "onnxruntime", "cpu",
       "ONNX Runtime CPU, dynamic int8 (per-channel QInt8 weights) on the fused graph", graph="int8",
       per_channel=True),
    # Static INT8 (QDQ): activation ranges calibrated on real batches of the run, u8s8 per-channel
    # weights, the QA head in fp32, attention left unfused so Q/K/V are int8 too (ort_static.py).
    _v("onnxruntime-int8-static", "onnxruntime", "cpu",
       "ONNX Runtime CPU, static int8 QDQ (calibrated on the run's batches, per-channel weights, head fp32)",
       graph="int8-static"),
    {**_v("onnxruntime-int8-static-sorted", "onnxruntime", "cpu",
          "as onnxruntime-int8-static, with length-sorted batches", graph="int8-static"), "batching": "sorted"},
    # OpenVINO's CPU plugin (openvino_backend.py): fp32, bf16 where the CPU has it natively, and
    # NNCF's static INT8 (calibrated on the run's batches, SmoothQuant, the QA head fp32).
    _v("openvino", "openvino", "cpu", "OpenVINO CPU, fp32 (inference precision f32), from the ONNX export"),
    _v("openvino-bf16", "openvino", "cpu", "OpenVINO CPU, bf16 inference precision (native BF16 CPUs only)",
       precision="bf16"),
    _v("openvino-int8", "openvino", "cpu",
       "OpenVINO CPU, NNCF static INT8 (calibrated on the run's batches, SmoothQuant, head fp32)", precision="int8"),
    _v("eager-fp32-cuda", "torch", "cuda", "PyTorch eager fp32 on CUDA, TF32 off (the GPU reference)"),
    _v("eager-tf32", "torch", "cuda", "PyTorch eager fp32 weights on CUDA with TF32 matmuls", tf32=True),
    _v("eager-amp-fp16", "torch", "cuda", "PyTorch eager, fp32 weights, torch.autocast fp16", autocast="fp16"),
    _v("eager-fp16", "torch", "cuda", "PyTorch eager with fp16 weights", weights="fp16"),
    _v("eager-bf16", "torch", "cuda", "PyTorch eager with bf16 weights", weights="bf16"),
    _v("torch-compile-fp16", "torch", "cuda", "torch.compile (inductor) with fp16 weights", weights="fp16",
       compile="default"),
    _v("torch-compile-fp16-max-autotune", "torch", "cuda", "torch.compile max-autotune (no CUDA graphs), fp16",
       weights="fp16", compile="max-autotune-no-cudagraphs"),
    _v("torch-compile-fp16-cudagraphs", "torch", "cuda",
       "torch.compile with inductor's CUDA graph trees (mode reduce-overhead), fp16", weights="fp16",
       compile="default", cuda_graph="trees"),
    _v("torch-compile-fp16-graph", "torch", "cuda",
       "torch.compile, one captured torch.cuda.CUDAGraph per shape of the run, fp16", weights="fp16",
       compile="default", cuda_graph="manual"),
    {**_v("eager-fp16-packed", "torch", "cuda",
          "PyTorch fp16, padding-free: real tokens only, variable-length FlashAttention (packed_bert.py)",
          weights="fp16", packed=True), "batching": "packed"},
    # The levers the packed row's profile names (results/reference/h100-batching.md): fused
    # elementwise work (compile, the token count dynamic: it changes every batch) and FP8 GEMMs.
    {**_v("torch-compile-fp16-packed", "torch", "cuda",
          "as eager-fp16-packed, under torch.compile with a dynamic token count", weights="fp16", compile="default",
          dynamic=True, packed=True), "batching": "packed"},
    {**_v("eager-fp8-packed", "torch", "cuda",
          "padding-free with the FP8 GEMMs of torch-compile-fp8 (calibrated on the padded model), eager",
          weights="fp16", packed=True, fp8=_FP8), "batching": "packed"},
    {**_v("torch-compile-fp8-packed", "torch", "cuda",
          "padding-free with FP8 GEMMs, under torch.compile with a dynamic token count", weights="fp16",
          compile="default", dynamic=True, packed=True, fp8=_FP8), "batching": "packed"},
    # The packed rows' GPU idled 22% (h100-batching.md): one CUDA graph per 1,024-token bucket
    # (packed_bert.TokenBuckets) removes the host's launches, for up to ~4% of dummy tokens a batch.
    {**_v("eager-fp16-packed-graph", "torch", "cuda",
          "as eager-fp16-packed, one CUDA graph per 1,024-token bucket of the token count", weights="fp16",
          packed=True, token_bucket=1024), "batching": "packed"},
    {**_v("torch-compile-fp8-packed-graph", "torch", "cuda",
          "as torch-compile-fp8-packed, one CUDA graph per 1,024-token bucket of the token count",
          weights="fp16", compile="default", packed=True, token_bucket=1024, fp8=_FP8), "batching": "packed"},
    _v("torch-compile-fp8", "torch", "cuda",
       "FP8 e4m3 GEMMs (_scaled_mm; fused QKV and the FFN; static activation scales calibrated in prepare), "
       "fp16 elsewhere, torch.compile, one CUDA graph per shape", weights="fp16", compile="default",
       cuda_graph="manual", fp8=_FP8),
    _v("torch-compile-fp8-all", "torch", "cuda", "as torch-compile-fp8, with the attention output projection in FP8 too",
       weights="fp16", compile="default", cuda_graph="manual", fp8={**_FP8, "gemms": "all"}),
    _v("torch-compile-fp8-rowwise", "torch", "cuda",
       "as torch-compile-fp8, with dynamic per-token x per-channel FP8 scales (bf16 GEMM output)",
       weights="fp16", compile="default", cuda_graph="manual", fp8={**_FP8, "scaling": "rowwise"}),
    # torchao's FP8 inference (the maintained library), beside the suite's own FP8 rows: if it
    # matches them at parity, the hand-written path goes. bf16: torchao's row-wise GEMMs write bf16.
    _v("torchao-fp8", "torch", "cuda",
       "torchao Float8DynamicActivationFloat8WeightConfig (per-row dynamic scales) on the encoder GEMMs, bf16 "
       "elsewhere, torch.compile, one CUDA graph per shape", weights="bf16", compile="default", cuda_graph="manual",
       torchao={"granularity": "row"}),
    _v("torchao-fp8-tensor", "torch", "cuda", "as torchao-fp8 with per-tensor dynamic scales", weights="bf16",
       compile="default", cuda_graph="manual", torchao={"granularity": "tensor"}),
    {**_v("torchao-fp8-packed-graph", "torch", "cuda",
          "padding-free with torchao's FP8 (per-row), compiled, one CUDA graph per 1,024-token bucket, packed on "
          "the host", weights="bf16", compile="default", packed=True, token_bucket=1024, host_pack=True,
          torchao={"granularity": "row"}), "batching": "packed"},
    # The packed FP8 graph row's GPU idled 14%: its packing (nonzero, the longest length) waits
    # on the device twice a batch; here the host packs into the graph's inputs (HostPacker).
    {**_v("torch-compile-fp8-packed-host", "torch", "cuda",
          "as torch-compile-fp8-packed-graph, each batch packed on the host into the bucket graph's inputs",
          weights="fp16", compile="default", packed=True, token_bucket=1024, host_pack=True, fp8=_FP8),
     "batching": "packed"},
    {**_v("eager-fp16-packed-host", "torch", "cuda", "as eager-fp16-packed-graph, each batch packed on the host",
          weights="fp16", packed=True, token_bucket=1024, host_pack=True), "batching": "packed"},
    # Hopper-native attention for the padded rows: SDPA restricted to cuDNN's kernel while
    # compiling/capturing (measured 0.209 ms against FlashAttention-2's 0.302 ms for 174
    # sequences padded to 384 on an H100).
    _v("torch-compile-fp16-graph-cudnn", "torch", "cuda", "as torch-compile-fp16-graph, SDPA on cuDNN attention",
       weights="fp16", compile="default", cuda_graph="manual", sdpa_backend="cudnn"),
    _v("torch-compile-fp8-cudnn", "torch", "cuda", "as torch-compile-fp8, SDPA on cuDNN attention", weights="fp16",
       compile="default", cuda_graph="manual", fp8=_FP8, sdpa_backend="cudnn"),
    # The packed FP8 row's GPU idled 14.8% with host packing too (h100-perf.md): each predict
    # waited for its logits before the host built the next batch. Pipelined, the host prepares
    # batch i+1 and scatters batch i while the GPU computes (Backend.submit, two in flight).
    {**_v("torch-compile-fp8-packed-pipelined", "torch", "cuda",
          "as torch-compile-fp8-packed-host, two batches in flight (the host's work overlaps the GPU's)",
          weights="fp16", compile="default", packed=True, token_bucket=1024, host_pack=True, fp8=_FP8,
          pipeline=True), "batching": "packed"},
    _v("torch-compile-fp8-cudnn-pipelined", "torch", "cuda", "as torch-compile-fp8-cudnn, two batches in flight",
       weights="fp16", compile="default", cuda_graph="manual", fp8=_FP8, sdpa_backend="cudnn", pipeline=True),
    _v("torch-compile-fp16-graph-pipelined", "torch", "cuda", "as torch-compile-fp16-graph, two batches in flight",
       weights="fp16", compile="default", cuda_graph="manual", pipeline=True),
    # GELU + FP8 quantize after the FFN-up GEMM is 17.6% of the packed FP8 row's GPU time as its
    # own pass (h100-perf.md). Inductor fuses such epilogues only into its own GEMM templates: here
    # it may pick, per GEMM, cuBLAS or its persistent TMA Triton template with the epilogue fused.
    {**_v("torch-compile-fp8-packed-autotune", "torch", "cuda",
          "as torch-compile-fp8-packed-pipelined, GEMMs autotuned between cuBLAS and Inductor's persistent TMA "
          "Triton templates (epilogues fused into the template)", weights="fp16", compile="max-autotune",
          packed=True, token_bucket=1024, host_pack=True, fp8=_FP8, pipeline=True,
          inductor_config={"max_autotune_gemm_backends": "ATEN,TRITON", "triton.enable_persistent_tma_matmul": True}),
     "batching": "packed", "timeout_s": 420},  # autotuning is prepare time, and it can be long
    # Inductor's fused epilogue did not pay in isolation either (0.311-0.351 ms against 0.332 for
    # the cuBLAS GEMM + GELU/quantize pass, h100-perf.md). What cuBLASLt can do instead: write the
    # FFN-up GEMM's output in e4m3 itself, so the GELU + quantize pass between the FFN GEMMs moves
    # one byte per element each way instead of two in (and two out of the GEMM) and one out.
    {**_v("torch-compile-fp8-packed-ffn8", "torch", "cuda",
          "as torch-compile-fp8-packed-pipelined, the FFN's hidden activations in e4m3 (the FFN-up GEMM writes "
          "FP8, GELU reads it)", weights="fp16", compile="default", packed=True, token_bucket=1024,
          host_pack=True, fp8={**_FP8, "ffn_hidden_fp8": True}, pipeline=True), "batching": "packed"},
    _v("torch-compile-fp8-cudnn-ffn8", "torch", "cuda",
       "as torch-compile-fp8-cudnn-pipelined, the FFN's hidden activations in e4m3", weights="fp16",
       compile="default", cuda_graph="manual", fp8={**_FP8, "ffn_hidden_fp8": True}, sdpa_backend="cudnn",
       pipeline=True),
    # The e4m3 hidden path halved that pass's bytes and it did not get faster (185 us per layer per
    # 32k tokens, ~3x its memory floor, h100-perf.md): it is bound by the erf polynomial's
    # instructions. The tanh form of GELU in one Triton kernel with the GPU's tanh.approx.f32.
    {**_v("torch-compile-fp8-packed-ffn8-tanh", "torch", "cuda",
          "as torch-compile-fp8-packed-ffn8, the GELU between the FFN GEMMs in its tanh form (one Triton kernel, "
          "e4m3 in and out)", weights="fp16", compile="default", packed=True, token_bucket=1024, host_pack=True,
          fp8={**_FP8, "ffn_hidden_fp8": True, "ffn_gelu": "tanh"}, pipeline=True), "batching": "packed"},
    # After the encoder, scattering the packed [T, 768] back to [batch, 384, 768] (index_put at ~4x
    # its memory floor), zeroing that tensor and the QA head over the padded rows took ~1.6% of
    # this row's GPU time (h100-perf.md): the head runs on the packed rows inside the graph instead.
    {**_v("torch-compile-fp8-packed-ffn8-tanh-head", "torch", "cuda",
          "as torch-compile-fp8-packed-ffn8-tanh, the QA span head on the packed tokens inside the token buckets' "
          "graphs (2 logits a token scattered back instead of the hidden states)", weights="fp16",
          compile="default", packed=True, token_bucket=1024, host_pack=True,
          fp8={**_FP8, "ffn_hidden_fp8": True, "ffn_gelu": "tanh"}, pipeline=True, head_first=True),
     "batching": "packed"},
    _v("torch-compile-fp8-cudnn-ffn8-tanh", "torch", "cuda",
       "as torch-compile-fp8-cudnn-ffn8, the GELU in its tanh form (one Triton kernel)", weights="fp16",
       compile="default", cuda_graph="manual", fp8={**_FP8, "ffn_hidden_fp8": True, "ffn_gelu": "tanh"},
       sdpa_backend="cudnn", pipeline=True),
    _v("torch-compile-int8", "torch", "cuda",
       "INT8 W8A8 GEMMs (torch._int_mm; per-channel weights, dynamic per-token activations), fp16 elsewhere, "
       "torch.compile, one CUDA graph per shape", weights="fp16", compile="default", cuda_graph="manual", int8={}),
    _v("ort-cuda-fp32", "onnxruntime", "cuda", "ONNX Runtime CUDA EP, fp32 (TF32 off), IO binding"),
    _v("ort-cuda-fp16", "onnxruntime", "cuda", "ONNX Runtime CUDA EP, fp16 fused graph, IO binding", graph="fp16"),
    _v("ort-cuda-fp16-graph", "onnxruntime", "cuda", "ONNX Runtime CUDA EP, fp16, one CUDA graph per shape",
       graph="fp16", cuda_graph=True),
    _v("tensorrt-fp16", "tensorrt", "cuda", "TensorRT 10 fp16 engine from the ONNX export (execute_async_v3)"),
)


def _entry_point_variants() -> list[dict]:
    global _ENTRY_POINTS_READ
    _ENTRY_POINTS_READ = True
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point '{ep.name}' ({ep.value})"
        try:
            cls = _as_backend_class(ep.load(), where)
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not take the built-in backends down
            log.warning("skipping %s: %s", where, e)
            continue
        _EXTRA_IMPLEMENTATIONS[ep.name] = ep.value
        declared = getattr(cls, "variants", None) or {
            ep.name: {"device": getattr(cls, "default_device", "cpu")}}
        dist = getattr(ep, "dist", None)
        source = f"entry point {dist.name if dist else ep.name}"
        for vname, spec in declared.items():
            out.append(_plugin_variant(vname, spec, ep.name, getattr(cls, "default_device", "cpu"),
                                       cls.__doc__ or "", source, where))
    return out


# What a plug-in's ``variants`` entry may say: the same fields as a suite's ``variants:`` entry.
PLUGIN_VARIANT_KEYS = ("device", "options", "description") + RUN_FIELDS


def _plugin_variant(name, spec, implementation: str, default_device: str, doc: str, source: str, where: str) -> dict:
    """A plug-in's declared variant, its keys checked like a suite's: an unknown key (a typo of
    timeout_s, say) is an error naming the valid ones, kept with the variant and raised when it is
    used, so one bad plug-in never takes the other backends down."""
    d = {"name": name, "implementation": implementation, "source": source, "device": default_device,
         "options": {}, "description": doc}
    if not isinstance(spec, Mapping):
        d["error"] = f"{where}: variant '{name}' must be a mapping of {', '.join(PLUGIN_VARIANT_KEYS)}, not {spec!r:.80}"
        return d
    unknown = sorted(map(str, set(spec) - set(PLUGIN_VARIANT_KEYS)))
    if unknown:
        d["error"] = (f"{where}: variant '{name}' has unknown field(s) {', '.join(unknown)}; "
                      f"valid: {', '.join(sorted(PLUGIN_VARIANT_KEYS))}")
        return d
    d.update({k: v for k, v in spec.items() if k != "options" or v is not None})
    return d


class VariantTable:
    """Every variant a suite can name, resolved and validated."""

    def __init__(self, declared: Iterable[dict]):
        self._raw: dict[str, dict] = {}
        for d in declared:
            self._raw[d["name"]] = d
        self._resolved: dict[str, Variant] = {}

    @classmethod
    def for_suite(cls, cfg: Optional[SuiteConfig] = None) -> "VariantTable":
        table = cls(list(BUILTIN) + _entry_point_variants())
        for name, decl in ((cfg.variants if cfg else {}) or {}).items():
            table._raw[name] = table._from_suite(name, decl)
        for name in list(table._raw):  # validate everything now: a bad option fails before any work
            if not table._raw[name].get("error"):  # (a broken plug-in variant fails when it is used)
                table.get(name)
        return table

    def _from_suite(self, name: str, decl) -> dict:
        if decl.base:
            if decl.base not in self._raw:
                raise UnknownBackendError(decl.base, self._raw, what=f"base of variant '{name}'")
            base = self._raw[decl.base]
            options = _merge(base.get("options") or {}, decl.options)
            run = {k: getattr(decl, k) if getattr(decl, k) is not None else base.get(k) for k in RUN_FIELDS}
            return {"name": name, "implementation": base["implementation"], "device": decl.device or base["device"],
                    "options": options, "description": decl.description or _describe(decl), "source": "suite", **run}
        return {"name": name, "implementation": decl.implementation, "device": decl.device or "cpu",
                "options": decl.options, "description": decl.description, "source": "suite",
                **{k: getattr(decl, k) for k in RUN_FIELDS}}

    def names(self) -> list[str]:
        return sorted(self._raw)

    def get(self, name: str) -> Variant:
        if name not in self._resolved:
            if name not in self._raw:
                raise UnknownBackendError(name, self._raw)
            d = self._raw[name]
            if d.get("error"):
                raise ConfigError(d["error"])
            self._resolved[name] = make_variant(d["name"], d["implementation"], d["device"], d.get("options"),
                                                d.get("description", ""), d.get("source", "builtin"),
                                                **{k: d.get(k) for k in RUN_FIELDS})
        return self._resolved[name]

    def require(self, names: Iterable[str]) -> list[Variant]:
        return [self.get(n) for n in names]

    def all(self) -> list[Variant]:
        return [self.get(n) for n in self.names() if not self._raw[n].get("error")]

    def broken(self) -> dict[str, str]:
        """Declared variants that cannot be used, with why (plug-ins with bad fields)."""
        return {n: d["error"] for n, d in self._raw.items() if d.get("error")}


def _describe(decl) -> str:
    parts = [f"{decl.base}"] + [f"{k}={getattr(decl, k)}" for k in RUN_FIELDS if getattr(decl, k) is not None]
    return " ".join(parts) + (f" with {decl.options}" if decl.options else "")


def _merge(base: Mapping, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def default_table() -> VariantTable:
    return VariantTable.for_suite(None)


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "IMPLEMENTATIONS", "Variant", "VariantTable", "default_table",
           "import_object", "make_variant"]
