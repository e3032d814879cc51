"""PyTorch eager backends: the fp32 reference and its reduced-precision GPU variants.

Each registered name fixes its device and precision, so a result row always means one thing:
``eager-fp32`` is CPU fp32 (the reference), ``eager-fp32-cuda`` is GPU fp32 with TF32 off, and
``eager-tf32`` is the same GPU run with TF32 on. The TF32 switches are process-global in torch,
so they are set on every predict call (an earlier backend in the same process can't leak its
setting into a later one) and put back as they were on close().

The device belongs to the registered name; the option ``device`` may override it (e.g. to run
the ``eager-fp32`` reference on the GPU without renaming it in results).
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping, Optional

import numpy as np

from .base import FP32_CLASS, INPUT_NAMES, REDUCED_CLASS, Backend, BackendContext
from .device_io import CudaStaging, cuda_unavailable_reason, gpu_info, merged_options, resolve_device
from .registry import register

DEFAULT_ATTN = "sdpa"


def set_tf32(enabled: bool) -> tuple[bool, bool]:
    """Set both TF32 switches; returns the previous (matmul, cudnn) values."""
    import torch

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return before


def restore_tf32(before: Optional[tuple[bool, bool]]) -> None:
    import torch

    if before is not None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class TorchEagerBackend(Backend):
    """fp32 eager PyTorch: the reference. Subclasses change weights dtype, autocast or TF32."""

    precision = "fp32"
    parity_class = FP32_CLASS
    weights_dtype = "fp32"
    autocast_dtype: Optional[str] = None
    tf32 = False
    cuda_only = False

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.module = None
        self._device = "cpu"
        self._staging: Optional[CudaStaging] = None
        self._tf32_before: Optional[tuple[bool, bool]] = None

    @classmethod
    def unavailable_reason(cls, device: str) -> Optional[str]:
        if device == "cuda" or cls.cuda_only:
            why = cuda_unavailable_reason()
            if why:
                return f"{cls.precision} eager on CUDA {why}"
            if cls.weights_dtype == "bf16" or cls.autocast_dtype == "bf16":
                import torch

                if not torch.cuda.is_bf16_supported():
                    return "this GPU does not support bf16"
        return None

    # --- prepare -------------------------------------------------------------------------
    def _load(self, ctx: BackendContext, opts: Mapping[str, Any]):
        from ..modeling import load_inference_module

        attn = opts.get("attn_implementation") or DEFAULT_ATTN
        module = load_inference_module(ctx.model_dir, attn_implementation=attn, dtype=_torch_dtype(self.weights_dtype))
        return module.to(self._device).eval(), attn

    def prepare(self, ctx: BackendContext) -> None:
        import torch

        opts = merged_options(self.options, ctx)
        self._device = resolve_device(self.device, opts)
        if self._device == "cuda":
            why = cuda_unavailable_reason()
            if why:
                from ..errors import BackendUnavailableError

                raise BackendUnavailableError(f"{self.name}: {why}")
            self._tf32_before = set_tf32(self.tf32)
            self._staging = CudaStaging(ctx.max_batch_size, ctx.max_seq_len, device="cuda")
        self.module, attn = self._load(ctx, opts)
        self.output_names = tuple(ctx.output_names)
        self.prepare_info = {
            "device": self._device,
            "weights_dtype": self.weights_dtype,
            "autocast": self.autocast_dtype or "off",
            "attn_implementation": attn,
            "torch": torch.__version__,
        }
        if self._device == "cpu":
            self.prepare_info["threads"] = torch.get_num_threads()
        else:
            self.prepare_info.update(tf32=self.tf32, **gpu_info())

    # --- predict -------------------------------------------------------------------------
    def _autocast(self):
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device, dtype=_torch_dtype(self.autocast_dtype))

    def _inputs(self, batch: Mapping[str, np.ndarray]):
        import torch

        if self._device == "cuda":
            dev = self._staging.to_device(batch)
            return tuple(dev[n] for n in INPUT_NAMES)
        return tuple(torch.from_numpy(np.ascontiguousarray(batch[n], dtype=np.int64)) for n in INPUT_NAMES)

    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        if self._device == "cuda":
            set_tf32(self.tf32)
        with torch.inference_mode(), self._autocast():
            outs = self.module(*self._inputs(batch))
        # .cpu() waits for the GPU work of this batch (same stream), so the call is synchronous.
        return {n: o.float().cpu().numpy() for n, o in zip(self.output_names, outs)}

    def close(self) -> None:
        self.module = None
        self._staging = None
        if self._device == "cuda":
            import torch

            # The switches are process-wide: hand back what the process had before this backend.
            restore_tf32(self._tf32_before)
            self._tf32_before = None
            torch.cuda.empty_cache()


class TorchEagerTF32Backend(TorchEagerBackend):
    # TF32 is FP32-class in the parity rules: fp32 storage and accumulation, only the matmul
    # inputs are rounded to a 10-bit mantissa, so answers should essentially never change.
    precision = "tf32"
    parity_class = FP32_CLASS
    tf32 = True
    cuda_only = True


class TorchEagerAmpFp16Backend(TorchEagerBackend):
    precision = "amp-fp16"
    parity_class = REDUCED_CLASS
    autocast_dtype = "fp16"
    cuda_only = True


class TorchEagerFp16Backend(TorchEagerBackend):
    precision = "fp16"
    parity_class = REDUCED_CLASS
    weights_dtype = "fp16"
    cuda_only = True


class TorchEagerBf16Backend(TorchEagerBackend):
    precision = "bf16"
    parity_class = REDUCED_CLASS
    weights_dtype = "bf16"


register("eager-fp32", TorchEagerBackend, device="cpu",
         description="PyTorch eager fp32 on CPU, SDPA attention (the reference)")
register("eager-fp32-cuda", TorchEagerBackend, device="cuda",
         description="PyTorch eager fp32 on CUDA, TF32 off")
register("eager-tf32", TorchEagerTF32Backend, device="cuda",
         description="PyTorch eager fp32 weights on CUDA with TF32 matmuls")
register("eager-amp-fp16", TorchEagerAmpFp16Backend, device="cuda",
         description="PyTorch eager, fp32 weights, torch.autocast fp16 on CUDA")
register("eager-fp16", TorchEagerFp16Backend, device="cuda",
         description="PyTorch eager with .half() weights on CUDA")
register("eager-bf16", TorchEagerBf16Backend, device="cuda",
         description="PyTorch eager with bf16 weights on CUDA")
register("eager-bf16-cpu", TorchEagerBf16Backend, device="cpu",
         description="PyTorch eager with bf16 weights on CPU")
