"""Host <-> CUDA transfers shared by the GPU backends, and small option/availability helpers.

Every GPU backend copies the same three int64 inputs per batch. Doing it through reused pinned
host buffers and reused device buffers keeps the per-batch cost to two memcpys and gives
backends that need fixed device addresses (CUDA graphs, ORT IO binding, TensorRT) stable
pointers for free.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from .base import INPUT_NAMES, BackendContext


def merged_options(registered: Mapping[str, Any], ctx: BackendContext) -> dict[str, Any]:
    """Registered variant options, overridden by the suite's per-backend options."""
    return {**dict(registered), **dict(ctx.options or {})}


def cuda_unavailable_reason() -> Optional[str]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "needs torch with CUDA (pip install torch)"
    if torch.version.cuda is None:
        return f"needs a CUDA GPU, but torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; torch.cuda.is_available() is False on this machine"
    return None


def resolve_device(backend_device: str, options: Mapping[str, Any]) -> str:
    # The registered variant fixes the device; an explicit option may override it (e.g. to run
    # the eager-fp32 reference on the GPU under the same name).
    device = str(options.get("device") or backend_device or "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, not '{device}'")
    return device


def batch_shape(batch: Mapping[str, np.ndarray]) -> tuple[int, int]:
    b, s = np.shape(batch["input_ids"])
    return int(b), int(s)


class CudaStaging:
    """Pinned host and device buffers sized for the largest batch, reused for every batch.

    ``to_device(batch, pad_to=(B, S))`` zero-pads to a fixed shape (for CUDA graphs); padded
    rows get one unmasked token so no row is fully masked.
    """

    def __init__(self, max_batch_size: int, max_seq_len: int, *, device: str = "cuda",
                 dtypes: Optional[Mapping[str, Any]] = None, names=INPUT_NAMES):
        import torch

        self.capacity = max_batch_size * max_seq_len
        self.names = tuple(names)
        self.host: dict[str, Any] = {}
        self.dev: dict[str, Any] = {}
        for n in self.names:
            dt = (dtypes or {}).get(n, torch.int64)
            try:
                self.host[n] = torch.empty(self.capacity, dtype=dt, pin_memory=True)
            except RuntimeError:  # pinning can fail (locked-memory limits); pageable still works
                self.host[n] = torch.empty(self.capacity, dtype=dt)
            self.dev[n] = torch.empty(self.capacity, dtype=dt, device=device)

    def to_device(self, batch: Mapping[str, np.ndarray], pad_to: Optional[tuple[int, int]] = None) -> dict[str, Any]:
        """Copy the batch to device (on the current stream); returns contiguous [B, S] views."""
        b, s = batch_shape(batch)
        pb, ps = pad_to or (b, s)
        if pb < b or ps < s or pb * ps > self.capacity:
            raise ValueError(f"batch {b}x{s} (padded {pb}x{ps}) exceeds the prepared max shape")
        out = {}
        for n in self.names:
            # The previous batch's copy out of this pinned buffer is finished: predict() is
            # synchronous, so overwriting it here cannot race.
            host = self.host[n][: pb * ps].view(pb, ps)
            h = host.numpy()
            if (pb, ps) != (b, s):
                h.fill(0)
                h[:b, :s] = batch[n]
                if n == "attention_mask" and pb > b:
                    h[b:, 0] = 1
            else:
                h[...] = batch[n]
            dev = self.dev[n][: pb * ps].view(pb, ps)
            dev.copy_(host, non_blocking=True)
            out[n] = dev
        return out


def to_host(t, b: int, s: int, seq_axis: bool = True) -> np.ndarray:
    """Slice padding off a device output and bring it to the host as float32 (synchronises)."""
    t = t[:b, :s] if seq_axis and t.dim() >= 2 else t[:b]
    return t.float().cpu().numpy()


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": p.name, "gpu_capability": f"{p.major}.{p.minor}", "cuda_runtime": torch.version.cuda}
