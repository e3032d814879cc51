"""A row that stays alive between its timed passes: the parent's handle on it in interleaved rounds.

``WorkerSession`` is a row's own spawned worker process (launcher.py's, same job file, log and
time limit) running ``worker.serve_rounds``: it prepares and warms up, says ``ready``, then times
one pass each time the parent writes ``pass`` on its standard input and answers with the
seconds on a pipe of its own; ``finish`` makes it write its outputs and result record and exit,
exactly as a block-timed worker does. ``InProcessSession`` is the same in this process
(``bench.isolation: inprocess``: tests, debugging).

Every session answers the same calls: ``start`` (prepare; returns the ready facts, or None if it
ended: then ``result`` says how), ``run_pass`` (seconds; raises ``SessionEnded`` if the process
died, hung or failed), ``finish`` (the result record), ``kill``.
"""
from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import BackendUnavailableError, BenchError, format_error
from .launcher import _Child
from .runner import RunOutput
from .worker import REPLY_FD_ENV, Job, prepared, ready_facts, record_of, save_outputs


class SessionEnded(BenchError):
    """The row's process ended (or was killed) before it answered."""


class WorkerSession:
    """One row's worker process, driven pass by pass over two pipes."""

    def __init__(self, job: Job, log_path: Path, timeout_s: float, echo: bool = False):
        self.job, self.name, self.timeout_s = job, job.name, timeout_s
        self.log_path, self.echo = Path(log_path), echo
        self.child: Optional[_Child] = None
        self._reply_r: Optional[int] = None
        self._buffer = b""
        self.ready: Optional[dict] = None
        self._result: Optional[dict] = None

    def start(self) -> Optional[dict]:
        read_fd, write_fd = os.pipe()
        try:
            self.child = _Child(self.job, self.log_path, self.echo, env={REPLY_FD_ENV: str(write_fd)},
                                stdin=subprocess.PIPE, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the child holds its own copy: EOF here once it ends
        self._reply_r = read_fd
        message = self._read(self.timeout_s)
        if message is None:
            return None
        self.ready = message
        return message

    def run_pass(self) -> float:
        self._send("pass")
        message = self._read(self.timeout_s)
        if message is None or message.get("event") != "pass":
            raise SessionEnded(self.result().get("error", "ended"))
        return float(message["seconds"])

    def finish(self) -> dict:
        if self._result is None:
            try:
                self._send("finish")
                self.child.proc.stdin.close()
            except (OSError, SessionEnded):
                pass
            self.child.wait(time.monotonic() + self.timeout_s)
        return self.result()

    def result(self) -> dict:
        """How it ended (launcher._Child's rules: its result file, a signal, a timeout)."""
        if self._result is None:
            if self.child.proc.poll() is None:
                self.child.kill()
            self._result = self.child.result(self.timeout_s)
            self._close_pipe()
        return self._result

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()
        self._close_pipe()

    # --- the pipes ------------------------------------------------------------------------------
    def _send(self, command: str) -> None:
        try:
            self.child.proc.stdin.write((command + "\n").encode())
            self.child.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise SessionEnded(f"{self.name}: its process is gone ({e})") from None

    def _read(self, timeout_s: float) -> Optional[dict]:
        """The next reply line, or None when the process ended (or was killed at the time limit)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.child.timed_out = True
                self.child.kill()
                return None
            ready, _, _ = select.select([self._reply_r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._reply_r, 65536)
            if not chunk:  # the child ended: its result file (or its exit) says how
                self.child.wait(time.monotonic() + 10)
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _close_pipe(self) -> None:
        if self._reply_r is not None:
            os.close(self._reply_r)
            self._reply_r = None


class InProcessSession:
    """The same row in this process (``bench.isolation: inprocess``): no isolation, same record."""

    def __init__(self, job: Job):
        self.job, self.name = job, job.name
        self.run = None
        self.plan = None
        self.ready: Optional[dict] = None
        self._result: Optional[dict] = None

    def start(self) -> Optional[dict]:
        try:
            self.run, self.plan = prepared(self.job, laps=True)
            if self.run is None:
                self._result = {"status": "not run", "error": self.plan}
                return None
            self.run.prepare()
            self.ready = {"event": "ready", **ready_facts(self.run)}
            return self.ready
        except Exception as e:  # noqa: BLE001 - this row's failure, as a worker would report it
            self._fail(e)
            return None

    def run_pass(self) -> float:
        try:
            return self.run.run_pass()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            raise SessionEnded(self._result["error"]) from e

    def finish(self) -> dict:
        if self._result is None:
            try:
                out: RunOutput = self.run.finish()
                save_outputs(self.job.outputs, out.outputs)
                self._result = record_of(out, self.job, self.plan)
            except Exception as e:  # noqa: BLE001
                self._fail(e, close=False)
            finally:
                self.run.close()
        return self._result

    def result(self) -> dict:
        return self._result or {"status": "failed", "error": "ended before finishing"}

    def kill(self) -> None:
        if self.run is not None and self._result is None:
            self.run.close()
            self._result = {"status": "failed", "error": "stopped"}

    def _fail(self, e: BaseException, close: bool = True) -> None:
        if close and self.run is not None:
            self.run.close()
        status = "not run" if isinstance(e, BackendUnavailableError) else "failed"
        self._result = {"status": status, "error": str(e) if status == "not run" else format_error(e)}


# What a row's record takes from each of its processes (``merge_records``): sums, the worst, the
# largest, or the median of the processes' own values
_SUM_MEASURES = ("energy_j",)
_MAX_MEASURES = ("prepare_host_peak_mib", "predict_host_peak_mib", "prepare_cuda_allocated_peak_mib",
                 "predict_cuda_allocated_peak_mib", "predict_cuda_reserved_peak_mib", "predict_device_used_mib",
                 "other_cpu_cores", "cpu_steal_pct", "load_avg_1m", "gpu_other_processes")
_MEDIAN_MEASURES = ("gpu_sm_clock_mhz", "gpu_power_w", "gpu_busy_pct")


def merge_records(records: list) -> dict:
    """One row's record from the records of its processes (each ``worker.record_of``'s): the
    first process's outputs and prepare facts (its prepare is the row's prepare time), every
    process's passes and batch latencies, and their machine state combined so that a busy or
    throttled process marks the row."""
    if len(records) == 1 or any(r.get("status") != "ok" for r in records):
        return next((r for r in records if r.get("status") != "ok"), records[0])
    first = records[0]
    pass_s = [p for r in records for p in r["pass_s"]]
    batch_ms = np.concatenate([np.asarray(r["batch_ms"], dtype=float) for r in records])
    t = dict(first["timing"])
    p = float(statistics.median(pass_s))
    scale = t["predict_s"] / p  # throughput figures are per pass of the median time
    t.update(predict_s=p, predict_min_s=min(pass_s), predict_max_s=max(pass_s),
             predict_stdev_s=float(statistics.stdev(pass_s)) if len(pass_s) > 1 else 0.0, n_passes=len(pass_s),
             latency_p50_ms=float(np.percentile(batch_ms, 50)), latency_p90_ms=float(np.percentile(batch_ms, 90)),
             latency_p99_ms=float(np.percentile(batch_ms, 99)), latency_mean_ms=float(batch_ms.mean()),
             identical_passes=all(r["timing"].get("identical_passes") for r in records),
             **{k: t[k] * scale for k in ("features_per_s", "achieved_tflops", "real_tflops") if t.get(k) is not None})
    return {**first, "timing": t, "pass_s": pass_s, "batch_ms": batch_ms.tolist(),
            "measures": _merge_measures([r.get("measures") or {} for r in records]),
            "pids": [r.get("pid") for r in records]}


def _merge_measures(ms: list) -> dict:
    out = dict(ms[0])
    for k in _MAX_MEASURES + _MEDIAN_MEASURES + _SUM_MEASURES:
        vals = [m[k] for m in ms if m.get(k) is not None]
        if vals:
            out[k] = max(vals) if k in _MAX_MEASURES else sum(vals) if k in _SUM_MEASURES else statistics.median(vals)
    if all(m.get("energy_j") is not None for m in ms) and all(m.get("energy_j_per_1k_features") for m in ms):
        rows = sum(m["energy_j"] / m["energy_j_per_1k_features"] * 1000.0 for m in ms)
        seconds = sum(m["energy_j"] / m["avg_power_w"] for m in ms if m.get("avg_power_w"))
        out["energy_j_per_1k_features"] = out["energy_j"] / rows * 1000.0 if rows else None
        out["avg_power_w"] = out["energy_j"] / seconds if seconds else None
    for k in ("timing_reliable", "gpu_power_capped"):  # a busy process makes the row busy; a capped one capped
        vals = [m[k] for m in ms if m.get(k) is not None]
        if vals:
            out[k] = all(vals) if k == "timing_reliable" else any(vals)
    for k in ("timing_note", "gpu_throttle"):
        out[k] = "; ".join(dict.fromkeys(m[k] for m in ms if m.get(k)))
    return out
