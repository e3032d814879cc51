"""What the training loop measures about itself: the step profiler window, the garbage-collector
watch, the compiled-graph count, and the batch prefetcher that keeps the host ahead of the GPU."""
from __future__ import annotations

import contextlib
import gc
import queue
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..io import atomic_write_json
from ..measuring.trace_tables import phase_times, top_kernels, write_profile


def profile_window(total_steps: int, n: int) -> Optional[tuple[int, int]]:
    """(first step, steps) to profile: ``n`` optimizer steps from half-way through training (after
    the first of 2 epochs every length bucket has been compiled and the allocator is warm), moved
    earlier when training is too short; None when off."""
    if n <= 0 or total_steps <= 0:
        return None
    n = min(n, total_steps)
    return min(total_steps - n, total_steps // 2), n


class StepProfiler:
    """torch.profiler over a window of optimizer steps (rank 0 only): CPU activity, and CUDA on a
    GPU. ``phase(name)`` marks the loop's parts (forward+backward, optimizer) in the trace, and is
    free outside the window. The tables are written after training (``write``), so the profiled
    run's own throughput pays only for the window's recording, not for the analysis."""

    def __init__(self, start: int, n: int, cuda: bool):
        self.start, self.n, self.cuda = start, n, cuda
        self.prof = None
        self.active = False
        self.t0 = self.wall_s = 0.0
        self.overhead_s = 0.0  # profiler start/stop on the host inside the timed loop

    def begin(self, step: int) -> None:
        if step != self.start or self.prof is not None:
            return

        t = time.perf_counter()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts, record_shapes=False)
        self.prof.__enter__()
        if self.cuda:
            torch.cuda.synchronize()  # one sync at each edge of the window: step time = wall / n
        self.active = True
        self.t0 = time.perf_counter()
        self.overhead_s += self.t0 - t

    def end(self, step: int) -> None:
        if not self.active or step != self.start + self.n:
            return
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        self.wall_s = t - self.t0
        self.prof.__exit__(None, None, None)
        self.active = False
        self.overhead_s += time.perf_counter() - t

    def phase(self, name: str):
        return record_function(f"train/{name}") if self.active else contextlib.nullcontext()

    def write(self, out: Path, top: int = 25) -> dict:
        """trace.json, top_kernels.{txt,csv} (profile.py's tables), kernels.md (kernel name,
        calls, total ms, % of the window) and profile.json (step time, GPU idle fraction, time
        per phase on the host)."""
        res = write_profile(self.prof, out, self.cuda, top=top)
        kernels = top_kernels(res["trace"], top=top) if self.cuda else []
        what = "kernel" if kernels else "operator (self CPU)"
        if not kernels:  # CPU: operators by self CPU time stand in for kernels
            total = sum(r["self_cpu_us"] for r in res["all_rows"]) or 1.0
            kernels = [{"name": r["name"], "calls": r["calls"], "total_ms": r["self_cpu_us"] / 1e3,
                        "pct": 100.0 * r["self_cpu_us"] / total} for r in res["rows"]]
        step_ms = 1e3 * self.wall_s / self.n
        idle = res["gpu_idle"]
        summary = {"dir": str(out), "steps": self.n, "first_step": self.start, "window_s": self.wall_s,
                   "step_ms": step_ms, "gpu_idle_fraction": idle["idle_fraction"] if idle else None,
                   "gpu_busy_ms": idle["busy_ms"] if idle else None,
                   "phases_ms_per_step": {k: v / self.n for k, v in phase_times(res["trace"], "train/").items()},
                   "top": kernels[:10]}
        lines = [f"# Training profile: {self.n} optimizer steps from step {self.start}", "",
                 f"- step time: {step_ms:.2f} ms (wall time of the window / {self.n}, synchronized at its edges)"]
        if idle:
            lines.append(f"- GPU idle: {idle['idle_fraction']:.1%} of {idle['window_ms']:.1f} ms "
                         f"(busy {idle['busy_ms']:.1f} ms: kernels, copies)")
        lines += [f"- host time per step in {k}: {v:.2f} ms" for k, v in summary["phases_ms_per_step"].items()]
        lines += ["", f"| {what} | calls | total ms | % |", "|---|---:|---:|---:|"]
        lines += [f"| {k['name'][:120].replace('|', '/')} | {k['calls']} | {k['total_ms']:.3f} | {k['pct']:.1f} |"
                  for k in kernels]
        (out / "kernels.md").write_text("\n".join(lines) + "\n")
        atomic_write_json(out / "profile.json", summary | {"kernels": kernels})
        return summary


class Prefetcher:
    """Builds the next micro-batches (trim, gather, pin) in a thread while the GPU works."""

    def __init__(self, make, items, depth: int = 4):
        self._q: "queue.Queue" = queue.Queue(maxsize=depth)
        self._err: list = []

        def work():
            try:
                for it in items:
                    self._q.put(make(it))
            except BaseException as e:  # noqa: BLE001 - re-raised in the training loop
                self._err.append(e)
            self._q.put(None)

        self._t = threading.Thread(target=work, daemon=True)
        self._t.start()

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is None:
                if self._err:
                    raise self._err[0]
                return
            yield item


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class GcWatch:
    """Python's garbage collections inside the timed loop: counted and timed (``gc.callbacks``)
    always; with ``manual``, the collector is off in the loop (everything alive before it frozen:
    ``gc.freeze``) and collects once per epoch end, at the same step on every rank."""

    def __init__(self, manual: bool):
        self.manual, self.n, self.pause_s, self._t0 = manual, 0, 0.0, None
        self._was_enabled = gc.isenabled()
        self._stopped = False
        # gc.unfreeze() thaws everything frozen, so only thaw when nothing was frozen before us
        self._frozen_before = gc.get_freeze_count()
        if manual:
            gc.collect()  # before the loop: not one of its pauses
            gc.freeze()
            gc.disable()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.n += 1
            self.pause_s += time.perf_counter() - self._t0
            self._t0 = None

    def epoch_end(self) -> None:
        if self.manual:
            gc.collect()

    def stop(self) -> dict:
        """Puts the collector back as it was (once; later calls only report); returns what the
        loop saw."""
        if not self._stopped:
            self._stopped = True
            gc.callbacks.remove(self._callback)
            if self.manual:
                if self._frozen_before == 0:
                    gc.unfreeze()
                if self._was_enabled:
                    gc.enable()
        return {"manual_gc": self.manual, "gc_collections_in_loop": self.n, "gc_pause_s": round(self.pause_s, 4)}
