"""PyTorch backends, composed: a model builder x an executor, chosen by typed options
(``torch_options.py``).

Model builder (``torch_builder.py``; ``TorchOptions``: ``weights``, ``attn_implementation``, ``fp8``): load the saved
model with the task's head in the weights dtype and attention implementation, move it to the
device; with ``fp8:`` calibrate activation ranges on real batches of the run and swap the
encoder GEMMs for FP8 ones (``fp8_surgery.py``).

Executor (this module; ``compile``, ``cuda_graph``, ``autocast``, ``tf32``):

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
from typing import Mapping, Optional

import numpy as np

from ..errors import BackendUnavailableError
from .base import INPUT_NAMES, Backend, BackendContext, batch_at_shape
from .device_io import (CudaStaging, HostOutputs, batch_shape, capture_streams, cuda_unavailable_reason, gpu_info,
                        memory_by_pool)
from .torch_builder import build_model, torch_dtype
from .torch_options import PACKED_FAMILIES, QUANT_FAMILIES, TorchOptions
from .transforms.fp8_rules import needs_nvmath

class _GraphReplay:
    """One captured torch.cuda.CUDAGraph per shape (and copy) around ``fn``, with static input
    buffers. The copies of a shape are independent (own static inputs and capture stream; every
    graph has a memory pool of its own), so they can replay at once on different streams."""

    def __init__(self, fn, device, copies: int = 1):
        self.fn, self.device = fn, device
        self.graphs: dict[tuple, tuple] = {}  # (b, s, copy) -> (graph, static inputs, outputs)
        # one capture stream per copy: torch keys cuBLAS's workspace by stream (capture_streams)
        self.capture_streams = capture_streams(device, copies)

    def capture(self, batch: Mapping[str, np.ndarray], copy: int = 0) -> None:
        import torch

        shape = (*batch_shape(batch), copy)
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
            with torch.cuda.graph(graph, stream=self.capture_streams[copy]):
                outs = tuple(self.fn(*static))
        self.graphs[shape] = (graph, static, outs)

    def __call__(self, batch: Mapping[str, np.ndarray], staging: CudaStaging, copy: int = 0):
        graph, static, outs = self.graphs[(*batch_shape(batch), copy)]
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
            return (f"the padding-free encoder (packed_encoder.py) computes {', '.join(PACKED_FAMILIES)}; a {family} "
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
            if o.packed_attention != "flash":
                return f"packed_attention: {o.packed_attention} is a CUDA kernel: it needs device: cuda"
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
        # what this machine lacks for the options (their combinations were checked when the suite
        # loaded: fp8_rules.check_fp8)
        if o.fp8 is not None and needs_nvmath(o.fp8):
            from ..kernels.cublaslt_epilogues import nvmath_unavailable_reason

            why = nvmath_unavailable_reason()
            if why:
                return why
        if o.fp8 is not None and o.fp8.attention == "fp8" and o.packed_attention == "cudnn":
            from ..kernels.cudnn_fp8_attention import unavailable_reason as fp8_attention_reason

            why = fp8_attention_reason()
            if why:
                return why
        if o.packed and o.packed_attention == "cudnn":
            from .transforms.packed_encoder import cudnn_unavailable_reason

            why = cudnn_unavailable_reason()
            if why:
                return why
        if o.packed and o.packed_attention == "triton":
            from ..kernels.varlen_attention import triton_unavailable_reason

            why = triton_unavailable_reason()
            if why:
                return why
        return None

    def __init__(self, variant):
        super().__init__(variant)
        self.module = None
        self._fn = None
        self._graphs: Optional[_GraphReplay] = None
        self._staging: list[CudaStaging] = []  # one per batch in flight
        self._slot = 0
        self._host = HostOutputs()
        self._packer = None  # packed_encoder.HostPacker (host_pack)
        self._streams: list = []  # option streams > 1: batch slot k runs on _streams[k % n], copy k % n's
        self._buckets = None  # packed_encoder.TokenBuckets (token_bucket)
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

        self.module, built = build_model(o, ctx, self.device, self.name)
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
                self._graphs = _GraphReplay(self._fn, "cuda", copies=o.streams)
                for copy in range(o.streams):
                    with self._plan_copy(copy):
                        for b, s in shapes:
                            self._graphs.capture(batch_at_shape(ctx.sample_batch, b, s), copy)
            if cuda and o.streams > 1:
                # each copy replays on the stream it was captured on: an eager op around the replay
                # (the scatter, a head left outside the graphs) then uses that stream's cuBLAS
                # workspace, which no other copy's graphs write into
                copies = self._graphs if self._graphs is not None else self._buckets
                self._streams = list(copies.capture_streams)
            # Every shape of the run once (graph trees: warm-up, record, replay), so compilation
            # and capture finish here and the runner's warm-up sees steady state; once per stream
            # with several (consecutive batches take consecutive copies), so that no copy's graph
            # replays for the first time inside the timed passes.
            calls = 3 if o.cuda_graph == "trees" else o.streams if cuda else 1
            for b, s in shapes if (o.compile != "none" or o.cuda_graph != "none" or o.token_bucket) else shapes[:1]:
                for _ in range(calls):
                    self.predict(batch_at_shape(ctx.sample_batch, b, s))
            warm_s = time.perf_counter() - t0
        self.prepare_info["streams"] = len(self._streams) or 1
        self.prepare_info.update(compile=o.compile, compile_mode=o.inductor_mode(), cuda_graph=o.cuda_graph,
                                 prepared_shapes=len(set(ctx.shapes)), compile_and_capture_s=round(warm_s, 3),
                                 sdpa_backend=o.sdpa_backend or "auto",
                                 inductor_config=",".join(f"{k}={v}" for k, v in sorted(o.inductor_config.items()))
                                 or "default")

    def _token_buckets(self, ctx: BackendContext, shapes) -> dict:
        """The packed encoder's static part per token bucket: compiled once with a dynamic token
        count (when compile is on), then one CUDA graph per bucket up to the run's largest batch."""
        import torch

        from .transforms.packed_encoder import TokenBuckets

        o: TorchOptions = self.options
        from .transforms.packed_encoder import encoder_of

        enc = encoder_of(self.module.model)
        encode = enc.encode
        if o.compile != "none":
            encode = torch.compile(enc.encode, mode=o.inductor_mode(), dynamic=True, fullgraph=o.fullgraph,
                                   backend="inductor")
        buckets = TokenBuckets(encode, bucket=o.token_bucket, max_len=ctx.max_seq_len,
                               max_rows=max(b for b, _ in shapes), max_tokens=max(b * s for b, s in shapes),
                               empty_dummies=o.token_bucket_dummies == "auto" and enc.takes_empty_sequences).attach(enc)
        captured = 0
        self._buckets = buckets
        info = {}
        if self.device == "cuda":
            with torch.inference_mode(), self._autocast():
                k = typical_batch(ctx.sample_batches)
                first = first_packed_batch(enc, ctx.sample_batches[k], torch.device("cuda"))
                captured = buckets.capture(torch.device("cuda"), copies=o.streams, around=self._plan_copy,
                                           first=first)
            t, rows = first[0].numel(), first[3].numel() - 1
            info["first_call_batch"] = (f"real: sample batch {k} of {len(ctx.sample_batches)}, {rows} sequences, "
                                        f"{t} tokens ({t / rows:.0f} a sequence), bucket {buckets.size_for(t, rows)}")
            if o.host_pack:
                from .transforms.packed_encoder import HostPacker

                self._packer = HostPacker(enc, torch.device("cuda"), slots=self.in_flight())
        info.update(token_bucket=o.token_bucket, token_buckets=len(buckets.sizes), token_bucket_graphs=captured,
                    token_bucket_dummies="may be empty" if buckets.empty_dummies else ">= 1 token each",
                    packing="host" if self._packer is not None else "device")
        if captured and o.fp8 is not None:
            from ..kernels.cublaslt_epilogues import plans_held

            info.update(plans_held())  # what the nvmath GEMMs' plans keep on the device across the buckets
        if captured:
            info.update(memory_by_pool(torch.cuda.memory_snapshot(), device=torch.cuda.current_device()))
        if o.packed_attention == "triton" and captured:
            from ..kernels.varlen_attention import autotune_timings, best_config, tuning_source

            # tuned on the run's typical real batch (``first_call_batch``), or taken from an earlier
            # process's tuning in Triton's cache, then captured as chosen; every timed configuration
            # is kept, so the margin of the choice shows
            info["attention_tuned_config"] = best_config()
            info["attention_tuning_source"] = tuning_source()
            info["attention_tuning_us"] = autotune_timings()
        return info

    @staticmethod
    def _plan_copy(copy: int):
        """The context a graph copy is captured in: its own cuBLASLt plans (their workspaces are
        written by every replay, so copies that replay at once must not share them)."""
        from ..kernels.cublaslt_epilogues import plan_copy

        return plan_copy(copy)

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
        return torch.autocast(device_type=self.device, dtype=torch_dtype(self.options.autocast))

    def in_flight(self) -> int:
        """Batches submitted before the oldest is collected: two a stream with pipeline on CUDA (the
        host prepares one while the GPU computes the other), else one."""
        return 2 * self.options.streams if self.options.pipeline and self.device == "cuda" else 1

    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(batch)()

    def submit(self, batch: Mapping[str, np.ndarray]):
        """Queue one batch on its stream (the current one; with ``streams`` > 1 its slot's): inputs
        in (pinned -> device), compute, outputs out (device -> pinned); the waiter blocks until
        they are on the host. Everything after the
        host's writes into pinned memory is ordered by the stream, so batch i+1's copies into a
        graph's static inputs run after batch i's replay, and its replay after batch i's outputs
        were copied out. With ``streams`` > 1 a batch's slot picks its stream and graph copy
        (slot k: stream k mod n), so the ordering above holds per copy, and the copies' batches
        overlap. On CPU the batch runs here and now."""
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
        if self._streams:  # slot k always on stream k mod n: its buffers are only ever used there
            copy = slot % len(self._streams)
            with torch.cuda.stream(self._streams[copy]):
                return self._queue(batch, b, slot, copy)
        return self._queue(batch, b, slot, 0)

    def _queue(self, batch, b: int, slot: int, copy: int):
        """``submit``'s CUDA work on the current stream, with graph copy ``copy``."""
        import torch

        staging = self._staging[slot]
        if self._graphs is not None:
            return self._host.stage(self.output_names, self._graphs(batch, staging, copy), b, slot)
        with torch.inference_mode(), self._autocast():
            if self._packer is not None:
                self._packer(batch, slot, copy)  # before the staging copy: both go out on the same stream
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

        if self._streams:  # work abandoned in flight on those streams may still write the buffers freed here
            torch.cuda.synchronize()
        self.module = self._fn = self._graphs = self._packer = self._buckets = None
        self._staging, self._streams = [], []
        if self.options.compile != "none":
            torch._dynamo.reset()
        if self._tf32_before is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_before
            self._tf32_before = None
        if self.device == "cuda":
            torch.cuda.empty_cache()


def typical_batch(batches) -> int:
    """Which of the run's sample batches (``BackendContext.sample_batches``: real batches spread over
    the plan) is typical of it: the one whose mean sequence length is the median of theirs (the
    lower median; the earliest on a tie). What tunes itself on one call tunes on it: the plan's
    batches run from few long sequences to many short ones, and the first sample batch, of the
    largest shape, sits at one end."""
    return median_index([float(np.asarray(b["attention_mask"]).sum()) / max(1, len(b["attention_mask"]))
                         for b in batches])


def median_index(values) -> int:
    """The index of the median of ``values`` (the lower median for an even count; the earliest
    index on a tie)."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    return order[(len(order) - 1) // 2]


def first_packed_batch(encoder, batch: Mapping[str, np.ndarray], device):
    """A real batch of the run, packed as ``encoder.forward`` packs it: (ids, positions, types,
    cumulative lengths) on ``device``, for ``TokenBuckets.capture(first=...)``."""
    import torch

    ids, mask, types = (torch.from_numpy(np.ascontiguousarray(batch[n], dtype=np.int64)).to(device)
                        for n in INPUT_NAMES)
    return encoder.pack(ids, mask, types)[:4]
