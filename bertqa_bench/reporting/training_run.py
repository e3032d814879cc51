"""The live MLflow run of one training: loss and samples/s every few optimizer steps, each
point's rate timed between its own clock readings, ended FINISHED or FAILED."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

from .mlflow_views import numeric


# Live training: at most about this many points per metric, whatever the number of steps.
TRAIN_LOG_POINTS = 200


class TrainingRun:
    """The live MLflow run of one training (rank 0 only). Every call is guarded: a tracking
    problem prints a warning and never reaches the training; after a failed step it stops
    logging steps (a dead server would otherwise stall every step on retries)."""

    def __init__(self, tracker, run_id: Optional[str]):  # tracker: the tracking.Tracker that started it
        self.tracker = tracker
        self.run_id = run_id
        self.every = 1
        self._ended = False
        self._steps_off = False
        self._last_step = 0
        self._last_t = time.perf_counter()
        self._last_seen = 0
        self._losses: list[float] = []

    @property
    def active(self) -> bool:
        return self.run_id is not None and not self._ended

    def plan(self, total_steps: int, params: Optional[dict] = None) -> int:
        """Once the number of optimizer steps is known: log every ``every`` steps, so that a long
        training logs at most about TRAIN_LOG_POINTS points. Returns ``every``."""
        self.every = max(1, math.ceil(total_steps / TRAIN_LOG_POINTS))
        if self.active:
            extra = dict(params or {}) | {"total_steps": total_steps, "log_every_steps": self.every}
            self.tracker._try(self.tracker.log, self.run_id, {}, extra, {})
        self._last_t = time.perf_counter()
        return self.every

    def step(self, step: int, loss: float, seen: int, total_steps: Optional[int] = None,
             at_time: Optional[float] = None, **extra) -> None:
        """Called after optimizer steps (each one, or every few) with the loss and the samples seen
        so far (all ranks); logs ``train_loss`` (mean of the losses passed since the last point),
        ``samples_per_s`` (since the last point) and ``extra`` at least ``every`` steps apart and
        at the last step. ``at_time``: the ``time.perf_counter()`` at which ``seen`` samples were
        done, when the point is logged later than that (a loss read back one log step late): the
        rate is then samples over the time between those readings, not between the calls."""
        if not self.active or self._steps_off:
            return
        self._losses.append(float(loss))
        # At least ``every`` steps apart, whatever the caller's own cadence, and the last step.
        if step - self._last_step < self.every and step != total_steps:
            return
        self._last_step = step
        now = time.perf_counter() if at_time is None else at_time
        dt = now - self._last_t
        metrics = {"train_loss": sum(self._losses) / len(self._losses)} | extra
        if dt > 0 and seen > self._last_seen:
            metrics["samples_per_s"] = (seen - self._last_seen) / dt
        self._losses, self._last_seen = [], seen

        def go():
            self.tracker.log(self.run_id, numeric(metrics), {}, {}, step=step)
            return True

        if not self.tracker._try(go):
            print("warning: MLflow: no more per-step training metrics after this failure", file=sys.stderr)
            self._steps_off = True  # the final metrics and the run's end are still tried
        # the next interval starts here: at the clock reading the caller gave (intervals that tile
        # the training), else after this logging (the interval leaves it out)
        self._last_t = time.perf_counter() if at_time is None else at_time

    def finish(self, metrics: dict, model_dir: Path) -> None:
        """The final metrics and train_metrics.json, then the run ends FINISHED (now)."""
        if not self.active:
            return
        t = self.tracker

        def go():
            # The final numbers (dev scores, times, sizes) are params, ``final.<name>``, and all of
            # them are in train_metrics.json: as metrics each was a single-value bar chart, and the
            # run page opened on 19 of them in alphabetical order with the curves below. Its only
            # metrics are now the step-wise curves (train_loss, lr, samples_per_s).
            t.log(self.run_id, {}, {f"final.{k}": v for k, v in numeric(metrics).items()},
                  {"model_dir": str(model_dir)})
            t.artifacts(self.run_id, [Path(model_dir) / "train_metrics.json"])

        t._try(go)
        self._end("FINISHED")

    def fail(self, error: Optional[BaseException] = None) -> None:
        if not self.active:
            return
        if error is not None:
            self.tracker._try(self.tracker.log, self.run_id, {}, {},
                              {"error": f"{type(error).__name__}: {error}"})
        self._end("FAILED" if not isinstance(error, KeyboardInterrupt) else "KILLED")

    def _end(self, status: str) -> None:
        self._ended = True
        self.tracker._try(self.tracker._client.set_terminated, self.run_id, status, int(time.time() * 1000))

    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.fail(exc)
        elif self.active:  # left without finish(): nothing went wrong, but nothing was saved either
            self._end("FINISHED")
        return False
