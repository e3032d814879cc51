"""torch.compile backends (inductor), compiled and warmed up in prepare.

Compilation happens on the first call at a given input shape, so prepare() runs the run's
sample batch through the compiled module (three times with CUDA graphs: cudagraph trees warm
up, then record, then replay) and compile time lands in prepare_s, not in the timed batches.

Shapes: with ``dynamic: false`` (the default) every new input shape is a new compilation, and
after torch._dynamo's recompile limit (8 by default) dynamo silently falls back to eager. So:

* the last, smaller batch is padded up to the max batch size (``pad_batch``, on by default
  for static shapes) and its outputs sliced, instead of compiling a second graph for it;
* with ``padding: longest`` the sequence length changes from batch to batch, and each new one
  recompiles at prediction time: use ``dynamic: true`` (one shape-generic graph; torch may
  also mark dims dynamic itself after one recompile with ``dynamic: null``), or
  ``seq_multiple: 64`` to pad sequences up to a few buckets, or ``static_seq_len: true`` to
  pad everything to max_seq_len. ``prepare_info["compiled_shapes"]`` counts shapes seen.
* CUDA graphs (mode ``reduce-overhead``) replay only at a recorded shape and address set, so
  they pad both batch and sequence to the max shape by default.

Mode ``max-autotune`` in torch also turns on CUDA graphs; the ``-max-autotune`` variant uses
``max-autotune-no-cudagraphs`` so that it measures autotuned kernels alone, and the
``-cudagraphs`` variant measures graphs alone (``reduce-overhead``).
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from .base import FP32_CLASS, INPUT_NAMES, REDUCED_CLASS, BackendContext
from .device_io import batch_shape, merged_options
from .registry import register
from .torch_eager import TorchEagerBackend, set_tf32

CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def pad_host_batch(batch: Mapping[str, np.ndarray], pb: int, ps: int) -> dict[str, np.ndarray]:
    b, s = batch_shape(batch)
    if (pb, ps) == (b, s):
        return {n: np.ascontiguousarray(batch[n], dtype=np.int64) for n in INPUT_NAMES}
    out = {}
    for n in INPUT_NAMES:
        a = np.zeros((pb, ps), dtype=np.int64)
        a[:b, :s] = batch[n]
        if n == "attention_mask":
            a[b:, 0] = 1  # no fully-masked rows in the padding
        out[n] = a
    return out


class TorchCompileBackend(TorchEagerBackend):
    precision = "fp32"
    parity_class = FP32_CLASS
    weights_dtype = "fp32"

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.compiled = None
        self._shapes: set[tuple[int, int]] = set()

    def prepare(self, ctx: BackendContext) -> None:
        import torch

        super().prepare(ctx)  # loads the module onto the device, sets TF32 off, allocates staging
        opts = merged_options(self.options, ctx)
        mode = opts.get("mode") or "default"
        backend = opts.get("backend") or "inductor"
        dynamic = opts.get("dynamic", False)
        self._cudagraphs = self._device == "cuda" and backend == "inductor" and mode in CUDAGRAPH_MODES
        self._pad_batch = bool(opts.get("pad_batch", dynamic is False or self._cudagraphs))
        self._static_seq = bool(opts.get("static_seq_len", self._cudagraphs))
        self._seq_multiple = opts.get("seq_multiple")
        self._max_batch, self._max_seq = ctx.max_batch_size, ctx.max_seq_len

        kwargs: dict[str, Any] = {"dynamic": dynamic, "backend": backend, "fullgraph": bool(opts.get("fullgraph", False))}
        if backend == "inductor":  # torch.compile accepts mode only for inductor
            kwargs["mode"] = mode
        self.compiled = torch.compile(self.module, **kwargs)

        n_warm = 3 if self._cudagraphs else 1
        t0 = time.perf_counter()
        self.predict(ctx.sample_batch)
        first = time.perf_counter() - t0
        for _ in range(n_warm - 1):
            self.predict(ctx.sample_batch)
        self.prepare_info.update(
            compile_mode=mode, compile_backend=backend, dynamic=str(dynamic), cudagraphs=self._cudagraphs,
            pad_batch=self._pad_batch, static_seq_len=self._static_seq, seq_multiple=self._seq_multiple,
            compile_first_call_s=round(first, 3), warmup_calls=n_warm,
            compiled_shapes=len(self._shapes),
        )

    def _target_shape(self, b: int, s: int) -> tuple[int, int]:
        pb = self._max_batch if self._pad_batch else b
        if self._static_seq:
            ps = self._max_seq
        elif self._seq_multiple:
            m = int(self._seq_multiple)
            ps = min(self._max_seq, -(-s // m) * m)
        else:
            ps = s
        return max(pb, b), max(ps, s)

    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        b, s = batch_shape(batch)
        pb, ps = self._target_shape(b, s)
        if (pb, ps) not in self._shapes:
            # A new shape means a (re)compile in this call; counted so a run can see it happened.
            self._shapes.add((pb, ps))
            self.prepare_info["compiled_shapes"] = len(self._shapes)
        if self._device == "cuda":
            set_tf32(self.tf32)
            dev = self._staging.to_device(batch, pad_to=(pb, ps))
            args = tuple(dev[n] for n in INPUT_NAMES)
        else:
            host = pad_host_batch(batch, pb, ps)
            args = tuple(torch.from_numpy(host[n]) for n in INPUT_NAMES)
        with torch.inference_mode(), self._autocast():
            if self._cudagraphs:
                # Tells cudagraph trees the previous outputs are dead, so replay may reuse them.
                torch.compiler.cudagraph_mark_step_begin()
            outs = self.compiled(*args)
            # Copy out while still inside: a cudagraph replay overwrites its output buffers.
            return {n: _slice(o, b, s, ps).float().cpu().numpy() for n, o in zip(self.output_names, outs)}

    def close(self) -> None:
        import torch

        self.compiled = None
        super().close()
        torch._dynamo.reset()


def _slice(t, b: int, s: int, ps: int):
    t = t[:b]
    if t.dim() >= 2 and t.shape[1] == ps and ps != s:
        t = t[:, :s]
    return t


class TorchCompileFp16Backend(TorchCompileBackend):
    precision = "fp16"
    parity_class = REDUCED_CLASS
    weights_dtype = "fp16"
    cuda_only = True


register("torch-compile", TorchCompileBackend, device="cpu", mode="default", dynamic=False,
         description="torch.compile (inductor) fp32 on CPU, static shapes")
register("torch-compile-fp16", TorchCompileFp16Backend, device="cuda", mode="default", dynamic=False,
         description="torch.compile (inductor) with fp16 weights on CUDA")
register("torch-compile-fp16-max-autotune", TorchCompileFp16Backend, device="cuda",
         mode="max-autotune-no-cudagraphs", dynamic=False,
         description="torch.compile max-autotune (no CUDA graphs) with fp16 weights on CUDA")
register("torch-compile-fp16-cudagraphs", TorchCompileFp16Backend, device="cuda", mode="reduce-overhead",
         dynamic=False, description="torch.compile reduce-overhead (CUDA graphs, padded static shapes), fp16")
