"""Host <-> CUDA transfers shared by the GPU backends, and the CUDA availability check.

Every GPU backend copies the same three int64 inputs per batch. Doing it through reused pinned
host buffers and reused device buffers keeps the per-batch cost to two memcpys and gives
backends that need fixed device addresses (CUDA graphs, ORT IO binding, TensorRT) stable
pointers for free.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ..tasks.features import INPUT_NAMES


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
            # The previous copy out of this pinned buffer is finished: a backend that keeps
            # batches in flight gives each its own CudaStaging, and collects a batch before its
            # staging is used again.
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
    """Pinned host buffers the outputs of a batch are copied into, all under one wait.

    ``stage(names, tensors, b, slot)`` enqueues the device outputs' copies (their first ``b`` rows)
    into pinned memory on the current stream and records an event; the waiter it returns blocks
    on that event and returns numpy copies. ``fetch`` is stage-and-wait. A backend that keeps
    two batches in flight uses two slots, so batch i+1's copies never land in the buffers batch
    i is still being read from; a slot whose waiter has not run yet refuses a new batch (it
    would overwrite outputs nobody has read). Each slot's buffer per output name is one flat
    pinned allocation, grown when a larger batch comes (pinning is slow: not once per shape).
    """

    def __init__(self):
        self._bufs: dict[tuple, Any] = {}
        self._busy: dict[int, Any] = {}  # slot -> the event of the batch that holds it

    def reserve(self, names: Sequence[str], slots: int, rows: int, seq: int) -> None:
        """Pin each slot's output buffers at the run's largest batch in prepare, so no batch of
        the timed passes pins memory (pinning is slow; with two slots each sees half the shapes
        during warm-up)."""
        for slot in range(slots):
            for n in names:
                self._buffer(slot, n, (rows, seq))

    def _buffer(self, slot: int, name: str, shape: tuple):
        import torch

        n = int(np.prod(shape))
        buf = self._bufs.get((slot, name))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(slot, name)] = pinned_empty(n, torch.float32)
        return buf[:n].view(shape)

    def check_free(self, slot: int) -> None:
        """Called before a batch touches any of its slot's buffers (inputs and packing too)."""
        if slot in self._busy:
            raise RuntimeError(f"slot {slot} still holds a batch nobody collected: more batches were submitted "
                               "than the backend keeps in flight")

    def stage(self, names: Sequence[str], tensors: Sequence[Any], b: int, slot: int = 0) -> Callable[[], dict]:
        import torch

        self.check_free(slot)
        staged = []
        for n, t in zip(names, tensors):
            t = t[:b]
            h = self._buffer(slot, n, tuple(t.shape))
            h.copy_(t, non_blocking=True)  # converts to fp32 on the way
            staged.append((n, h))
        done = torch.cuda.Event()
        done.record()
        self._busy[slot] = done

        def wait() -> dict[str, np.ndarray]:
            try:
                done.synchronize()
                return {n: h.numpy().copy() for n, h in staged}
            finally:
                # released even when the device failed (else every later batch of this slot would
                # be refused as "too many in flight"), and only by its own batch's waiter
                if self._busy.get(slot) is done:
                    del self._busy[slot]

        return wait

    def fetch(self, names: Sequence[str], tensors: Sequence[Any], b: int) -> dict[str, np.ndarray]:
        return self.stage(names, tensors, b)()


def capture_streams(device, copies: int) -> list:
    """The stream each copy of a set of CUDA graphs is captured (and then replayed) on: torch's
    default capture stream (None) for a single copy; one stream of its own per copy when there
    are several. Torch gives cuBLAS one workspace per stream, and a captured GEMM writes into its
    capture stream's workspace on every replay: copies captured on one stream would share it, and
    corrupt each other's results when they replay at once (seen: answer agreement 44% on a padded
    FP8 row). ``torch.cuda.Stream()`` hands out streams from a fixed pool in turn, so distinctness
    is checked, not assumed."""
    if copies < 1:
        raise ValueError(f"{copies} copies of the graphs: at least one")
    if copies == 1:
        return [None]
    import torch

    streams = [torch.cuda.Stream(device) for _ in range(copies)]
    if len({s.cuda_stream for s in streams}) != copies:
        raise RuntimeError(f"torch's stream pool gave {copies} graph copies fewer than {copies} distinct CUDA streams")
    return streams


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": p.name, "gpu_capability": f"{p.major}.{p.minor}", "cuda_runtime": torch.version.cuda}


def memory_by_pool(segments: Sequence[Mapping], top: int = 6, device: Optional[int] = None) -> dict[str, Any]:
    """Where a process's CUDA memory sits, from ``torch.cuda.memory_snapshot()``'s segments: the
    caching allocator's default pool (weights, static buffers, whatever lives between calls)
    against the CUDA graphs' private pools (each captured graph's intermediates and outputs), and
    the largest allocated block sizes of each. A packed FP8 row held 7.5 GiB at 32k tokens and
    25.8 GiB at 64k (H200, 2026-12-04) with no cuBLASLt workspace at all: this says which pool
    grows with the batch before any guess is built on. ``device``: that device's segments only (the
    snapshot has every device's)."""
    graph_pools = set()
    sums = {kind: {"allocated": 0, "reserved": 0, "blocks": {}} for kind in ("default", "graph")}
    for seg in segments:
        if device is not None and seg.get("device") != device:
            continue
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        if pid != (0, 0):
            graph_pools.add(pid)
        p = sums["default" if pid == (0, 0) else "graph"]
        p["allocated"] += int(seg.get("allocated_size", 0))
        p["reserved"] += int(seg.get("total_size", 0))
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated":
                p["blocks"][int(b["size"])] = p["blocks"].get(int(b["size"]), 0) + 1
    default, graph = sums["default"], sums["graph"]

    def largest(blocks: dict[int, int]) -> str:
        return ", ".join(f"{size / 2**20:.1f} x {n}" for size, n in sorted(blocks.items(), reverse=True)[:top])

    mib = lambda v: round(v / 2**20, 1)  # noqa: E731
    return {"cuda_default_pool_mib": mib(default["allocated"]),
            "cuda_graph_pools": len(graph_pools),
            "cuda_graph_pools_mib": mib(graph["allocated"]),
            "cuda_graph_pools_reserved_mib": mib(graph["reserved"]),
            "cuda_default_largest_blocks_mib": largest(default["blocks"]),
            "cuda_graph_largest_blocks_mib": largest(graph["blocks"])}
