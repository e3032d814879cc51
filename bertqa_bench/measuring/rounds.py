"""Interleaved rounds: every row alive at once, one timed pass of each per round.

Each row's process is prepared and warmed up first (one after the other), and stays alive. Then
the rounds: a fixed calibration workload is timed in this (idle) parent process, then each row
times one whole pass, one row at a time, in a rotating order (record/rounds.round_order). A
row's speedup is taken per round against the reference's pass of the same round
(record/rounds.paired_speedup), so a host whose speed drifts over minutes moves both sides of
each ratio together. A row may have several worker processes (``RowProcesses``): they take
turns by round, and the interval counts the spread between them.

How many rounds: the first ``min_rounds`` (a whole number of turns of every row's processes)
fix it, from their widest log-ratio spread, to what an interval within the target half-width
needs, within ``max_rounds`` and the time budget at their pace; then exactly that many run.
Stopping as soon as every interval looked narrow (the rule before) picked the runs whose rounds
happened to agree and narrowed their intervals.

The calibration's spread over rounds is the host's noise sensor: the load and steal counters do
not see a shared virtual machine's drift, a fixed workload does. On a GPU run a fixed CUDA
workload (gpu_sensor.py) is the GPU's; record/noise.py says which speaks for which row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..record.noise import GpuNoise, gpu_sensor_noise
from ..record.rounds import (PairedSpeedup, log_ratio_sd, paired_logs, paired_speedup, pooled_process_variance,
                             process_anova, round_order, rounds_needed, spread_pct)
from .sessions import SessionEnded

# The calibration: numpy's tanh over a fixed array of 2**20 float32 values, 300 times, on one
# thread whatever the machine (elementwise numpy does not use BLAS's thread pool, whose size and
# spin-waiting vary with the core count: a matrix product through it took 7 ms on a 16-core GPU
# host and jumped tenfold between rounds). About 0.1-0.2 s: long against a timer tick and a
# first call's cache misses, short against a pass.
_CAL_VALUES, _CAL_REPEATS = 1 << 20, 300
_CAL_ARRAY = np.random.default_rng(0).standard_normal(_CAL_VALUES).astype(np.float32)


def calibration_workload(clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds the fixed calibration workload took now."""
    out = np.empty_like(_CAL_ARRAY)
    t0 = clock()
    for _ in range(_CAL_REPEATS):
        np.tanh(_CAL_ARRAY, out=out)
    return clock() - t0


@dataclass(frozen=True)
class RoundsSettings:
    min_rounds: int = 3
    max_rounds: int = 20
    budget_s: float = 600.0
    target_halfwidth_pct: float = 5.0
    noise_cv_pct: float = 10.0
    rerun_spread_pct: float = 0.0  # bench.rerun_spread_pct: in the intervals reported, not in the plan
    pool_process_spread: bool = False  # bench.pool_process_spread: the process offsets' variance pooled over rows


class RowProcesses:
    """One row's worker processes (sessions.py), taking turns by round: round k's pass comes from
    process k mod n, as pyperf spreads a benchmark's runs over worker processes: what a rerun
    changes (the process's memory layout, where its threads land, the graph a runtime compiled
    in it) then varies inside the run too, and the interval sees it. A process that ends takes
    its row out of the rounds (the row fails, as a one-process row would)."""

    def __init__(self, name: str, sessions: Sequence):
        if not sessions:
            raise ValueError(f"row {name}: no worker process to time")
        self.name, self.sessions = name, list(sessions)

    def run_pass(self, round_index: int) -> tuple[float, int]:
        """(seconds, which process) of this round's pass."""
        i = round_index % len(self.sessions)
        return self.sessions[i].run_pass(), i


@dataclass
class RoundsLog:
    """What the rounds measured: each row's pass of each round (None where it took no part) and
    which of its processes timed it, the calibration and the GPU sensor of each round, the order
    each round ran in, the number of rounds fixed after the first ones, and why each row or the
    rounds ended."""

    names: list
    reference: str
    passes: dict = field(default_factory=dict)  # name -> [seconds or None per round]
    calibration_s: list = field(default_factory=list)
    orders: list = field(default_factory=list)
    ended: dict = field(default_factory=dict)  # name -> why it left the rounds early
    stop_reason: str = ""
    processes: dict = field(default_factory=dict)  # name -> [process index or None per round]
    gpu_sensor: list = field(default_factory=list)  # record/noise.sensor_round per round (GPU runs)
    planned_rounds: Optional[int] = None
    plan_note: str = ""
    rerun_spread_pct: float = 0.0
    pool_process_spread: bool = False

    @property
    def n_rounds(self) -> int:
        return len(self.calibration_s)

    def _groups(self, name: str) -> Optional[list]:
        """Each round's (reference process, row process): the label the interval groups by."""
        ref, row = self.processes.get(self.reference), self.processes.get(name)
        if not ref or not row:
            return None
        return list(zip(ref, row))

    def speedup(self, name: str, within_run: bool = False) -> Optional[PairedSpeedup]:
        """The row's speedup, its interval holding the between-run spread (``rerun_spread_pct``);
        ``within_run``: without it, as the rounds are printed while they run."""
        if self.reference not in self.passes or name not in self.passes:
            return None
        # the reference against itself is 1.0 in every run: no rerun moves it
        spread = 0.0 if within_run or name == self.reference else self.rerun_spread_pct
        pooled = self.pooled_between() if self.pool_process_spread and name != self.reference else None
        return paired_speedup(self.passes[self.reference], self.passes[name], groups=self._groups(name),
                              rerun_spread_pct=spread, pooled_between=pooled)

    def pooled_between(self) -> Optional[tuple[float, float]]:
        """The process offsets' variance pooled over the rows against the reference
        (record/rounds.pooled_process_variance; bench.pool_process_spread)."""
        ref = self.passes.get(self.reference, [])
        return pooled_process_variance([process_anova(*paired_logs(ref, self.passes[n], self._groups(n)))
                                        for n in self.passes if n != self.reference])

    def n_processes(self, name: str) -> int:
        return len({p for p in self.processes.get(name, []) if p is not None}) or 1

    @property
    def calibration_cv_pct(self) -> Optional[float]:
        return spread_pct(self.calibration_s)

    def noisy(self, threshold_pct: float) -> Optional[bool]:
        cv = self.calibration_cv_pct
        return None if cv is None else cv > threshold_pct

    @property
    def gpu_noise(self) -> Optional[GpuNoise]:
        return gpu_sensor_noise(self.gpu_sensor)

    def to_dict(self) -> dict:
        return {"names": list(self.names), "reference": self.reference, "passes": dict(self.passes),
                "calibration_s": list(self.calibration_s), "orders": list(self.orders), "ended": dict(self.ended),
                "stop_reason": self.stop_reason, "processes": dict(self.processes), "gpu_sensor": list(self.gpu_sensor),
                "planned_rounds": self.planned_rounds, "plan_note": self.plan_note,
                "rerun_spread_pct": self.rerun_spread_pct, "pool_process_spread": self.pool_process_spread}


def run_rounds(sessions: Sequence, reference: str, settings: RoundsSettings, *,
               calibrate: Callable[[], float] = calibration_workload, clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] = print, gpu_sensor: Optional[Callable[[], dict]] = None) -> RoundsLog:
    """Time ``sessions`` (started: measuring/sessions.py; a row of several processes as one
    ``RowProcesses``) in interleaved rounds; returns the log. A row that fails mid-round leaves
    the rounds (its passes so far stay in the log). ``gpu_sensor``: read each round after the
    calibration (GPU runs)."""
    alive = [s if isinstance(s, RowProcesses) else RowProcesses(s.name, [s]) for s in sessions]
    rec = RoundsLog([s.name for s in alive], reference, {s.name: [] for s in alive},
                    processes={s.name: [] for s in alive}, rerun_spread_pct=settings.rerun_spread_pct,
                    pool_process_spread=settings.pool_process_spread)
    started = clock()
    while alive:
        k = rec.n_rounds
        rec.calibration_s.append(calibrate())
        if gpu_sensor is not None:
            try:
                rec.gpu_sensor.append(gpu_sensor())
            except Exception as e:  # noqa: BLE001 - the rows' timing goes on; their GPU mark is then unknown
                log(f"GPU sensor failed ({type(e).__name__}: {e}); the GPU rows carry no noise mark")
                gpu_sensor = None
        order = [alive[i] for i in round_order(len(alive), k)]
        rec.orders.append([s.name for s in order])
        for s in order:
            try:
                seconds, proc = s.run_pass(k)
                rec.passes[s.name].append(seconds)
                rec.processes[s.name].append(proc)
            except SessionEnded as e:
                rec.ended[s.name] = str(e)
                alive.remove(s)
        for name in rec.passes:  # a row that left (this round or earlier): no pass in this round
            for column in (rec.passes[name], rec.processes[name]):
                if len(column) < rec.n_rounds:
                    column.append(None)
        elapsed = clock() - started
        log(_round_line(rec, elapsed))
        if rec.n_rounds == _pilot(alive, settings) and rec.planned_rounds is None:
            _plan(rec, [s.name for s in alive], settings, elapsed)
            log(f"rounds: {rec.plan_note}")
        rec.stop_reason = _stop_reason(rec, [s.name for s in alive], settings, elapsed)
        if rec.stop_reason:
            break
    return rec


def _pilot(alive: Sequence[RowProcesses], settings: RoundsSettings) -> int:
    """The first rounds, whose spread fixes how many rounds run: at least ``min_rounds``, and a
    whole number of turns of every row's processes, so each process is in them."""
    turns = max((len(s.sessions) for s in alive), default=1)
    return min(settings.max_rounds, max(settings.min_rounds, math.ceil(settings.min_rounds / turns) * turns))


def _plan(rec: RoundsLog, alive: Sequence[str], settings: RoundsSettings, elapsed: float) -> None:
    """Fix the number of rounds from the first rounds (Stein's two-stage rule): enough for the
    widest row's log-ratio spread to give an interval within the target, within max_rounds and
    what the time budget holds at the first rounds' pace. Whatever the later rounds show, that
    many run: stopping as soon as the intervals look narrow would pick the runs whose rounds
    happened to agree, and narrow the intervals."""
    n = rec.n_rounds
    sds = {name: log_ratio_sd(rec.passes[rec.reference], rec.passes[name])
           for name in alive if name != rec.reference and rec.reference in alive}
    if not sds:
        rec.planned_rounds, rec.plan_note = n, f"{n} rounds (no row to pair with the reference)"
        return
    worst = max(sds, key=lambda name: math.inf if sds[name] is None else sds[name])
    sd = sds[worst]
    needed = settings.max_rounds if sd is None else rounds_needed(sd, settings.target_halfwidth_pct, n,
                                                                  settings.max_rounds)
    fits = max(n, int(settings.budget_s // (elapsed / n))) if elapsed > 0 else settings.max_rounds
    rec.planned_rounds = min(needed, fits)
    rec.plan_note = (f"{rec.planned_rounds} rounds, fixed after the first {n} from their spread "
                     f"(`{worst}`: ±{settings.target_halfwidth_pct:g}% needs {needed}"
                     + (f"; the {settings.budget_s:g} s budget holds {fits}" if fits < needed else "") + ")")


def _stop_reason(rec: RoundsLog, alive: Sequence[str], settings: RoundsSettings, elapsed: float) -> str:
    n = rec.n_rounds
    if not alive:
        return "every row ended"
    if rec.planned_rounds is not None and n >= rec.planned_rounds:
        return rec.plan_note
    if n >= settings.max_rounds:
        return f"max_rounds ({settings.max_rounds}) reached"
    # a safety for rounds that run slower than the first ones did: it ends on time, not on the ratios
    if n >= settings.min_rounds and elapsed + elapsed / n > settings.budget_s:
        return f"time budget ({settings.budget_s:g} s) would be passed by another round"
    return ""


def _halfwidths(rec: RoundsLog, names: Sequence[str]) -> dict:
    out = {}
    for n in names:
        if n == rec.reference:
            continue
        sp = rec.speedup(n, within_run=True)
        out[n] = None if sp is None else sp.halfwidth_pct
    return out


def _round_line(rec: RoundsLog, elapsed: float) -> str:
    k = rec.n_rounds - 1
    parts = [f"{name} {rec.passes[name][k]:.2f}s" for name in rec.orders[k] if rec.passes[name][k] is not None]
    widths = {n: w for n, w in _halfwidths(rec, rec.orders[k]).items()}
    widest_txt = ""
    if widths:
        name, w = max(widths.items(), key=lambda kv: math.inf if kv[1] is None else kv[1])
        widest_txt = f"; widest interval {name} " + ("—" if w is None else f"±{w:.1f}%")
    return (f"round {k + 1}: calibration {rec.calibration_s[k] * 1e3:.0f} ms; " + ", ".join(parts)
            + widest_txt + f" ({elapsed:.0f} s)")


__all__ = ["RoundsLog", "RoundsSettings", "RowProcesses", "calibration_workload", "run_rounds"]
