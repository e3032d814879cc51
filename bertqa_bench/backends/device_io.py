"""Host <-> CUDA transfers shared by the GPU backends, and the CUDA availability check.

Every GPU backend copies the same three int64 inputs per batch. Doing it through reused pinned
host buffers and reused device buffers keeps the per-batch cost to two memcpys and gives
backends that need fixed device addresses (CUDA graphs, ORT IO binding, TensorRT) stable
pointers for free.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..data.features import INPUT_NAMES


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
            self.host[n] = pinned_empty(self.capacity, dt)
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


def pinned_empty(shape, dtype):
    import torch

    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:  # pinning can fail (locked-memory limits); pageable still works
        return torch.empty(shape, dtype=dtype)


class HostOutputs:
    """Pinned host buffers the outputs of a batch are copied into, all under one synchronize.

    ``fetch(names, tensors, b)`` copies device outputs (the first ``b`` rows) to pinned memory
    asynchronously on the current stream, waits once, and returns numpy copies (the pinned
    buffers are reused by the next batch).
    """

    def __init__(self):
        self._bufs: dict[tuple, Any] = {}

    def fetch(self, names: Sequence[str], tensors: Sequence[Any], b: int) -> dict[str, np.ndarray]:
        import torch

        staged = []
        for n, t in zip(names, tensors):
            t = t[:b]
            key = (n, tuple(t.shape))
            if key not in self._bufs:
                self._bufs[key] = pinned_empty(tuple(t.shape), torch.float32)
            h = self._bufs[key]
            h.copy_(t, non_blocking=True)  # converts to fp32 on the way
            staged.append((n, h))
        torch.cuda.current_stream().synchronize()
        return {n: h.numpy().copy() for n, h in staged}


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": p.name, "gpu_capability": f"{p.major}.{p.minor}", "cuda_runtime": torch.version.cuda}
