"""The training loss read back to the host without stopping the GPU.

``float(loss)`` waits until the GPU has run everything queued so far: the end of the backward,
the all-reduce and the optimizer step. The GPU then idles while the host launches the next
step's first kernels. The trainer logs every ``log_every`` steps, which is every step in a run
of fewer than 400 steps. ``DeferredLoss`` instead copies each logged loss into pinned host memory
behind the work already queued (no wait) and hands it out at the next log step. By then that
copy has finished, unless the host runs more than a log interval ahead, in which case it waits
for that copy alone. The values are the same; they arrive one log interval late.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class DeferredLoss:
    """``push(loss, **info)`` at a log step returns the entries ready by then, as
    ``(float loss, info)``; ``flush()`` returns the rest (call it after the loop's last sync).
    ``defer=False``: each loss is read at once (the old way, a sync at every log step)."""

    def __init__(self, defer: bool = True):
        self.defer = defer
        self._pending: list[tuple[torch.Tensor, Optional[torch.cuda.Event], dict]] = []

    def push(self, loss: torch.Tensor, **info: Any) -> list[tuple[float, dict]]:
        loss = loss.detach()
        if not self.defer:
            return self.flush() + [(float(loss), info)]
        if loss.device.type == "cuda":
            host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            host.copy_(loss, non_blocking=True)  # queued on the loss's device's current stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(loss.device))  # the stream the copy was queued on
        else:  # a CPU loss is there already; kept the same way, so both devices log alike
            host, event = loss.clone(), None
        ready = self.flush()
        self._pending.append((host, event, info))
        return ready

    def flush(self) -> list[tuple[float, dict]]:
        out = []
        for host, event, info in self._pending:
            if event is not None:
                event.synchronize()  # done long ago, unless the host ran more than a log interval ahead
            out.append((float(host), info))
        self._pending.clear()
        return out
