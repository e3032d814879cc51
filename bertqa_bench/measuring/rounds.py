"""Interleaved rounds: every row alive at once, one timed pass of each per round.

Each row's process is prepared and warmed up first (one after the other), and stays alive. Then
the rounds: a fixed calibration workload is timed in this (idle) parent process, then each row
times one whole pass, one row at a time, in a rotating order (record/rounds.round_order). A
row's speedup is taken per round against the reference's pass of the same round
(record/rounds.paired_speedup), so a host whose speed drifts over minutes moves both sides of
each ratio together. Rounds go on until every row's interval is within the target half-width,
or the time budget would be passed by one more round, or ``max_rounds``; never fewer than
``min_rounds``.

The calibration's spread over rounds is the run's noise sensor: the load and steal counters do
not see a shared virtual machine's drift, a fixed workload does.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..record.rounds import PairedSpeedup, paired_speedup, round_order, spread_pct, widest
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


@dataclass
class RoundsLog:
    """What the rounds measured: each row's pass of each round (None where it took no part),
    the calibration of each round, the order each round ran in, and why each row or the rounds
    ended."""

    names: list
    reference: str
    passes: dict = field(default_factory=dict)  # name -> [seconds or None per round]
    calibration_s: list = field(default_factory=list)
    orders: list = field(default_factory=list)
    ended: dict = field(default_factory=dict)  # name -> why it left the rounds early
    stop_reason: str = ""

    @property
    def n_rounds(self) -> int:
        return len(self.calibration_s)

    def speedup(self, name: str) -> Optional[PairedSpeedup]:
        if self.reference not in self.passes or name not in self.passes:
            return None
        return paired_speedup(self.passes[self.reference], self.passes[name])

    @property
    def calibration_cv_pct(self) -> Optional[float]:
        return spread_pct(self.calibration_s)

    def noisy(self, threshold_pct: float) -> Optional[bool]:
        cv = self.calibration_cv_pct
        return None if cv is None else cv > threshold_pct

    def to_dict(self) -> dict:
        return {"names": list(self.names), "reference": self.reference, "passes": dict(self.passes),
                "calibration_s": list(self.calibration_s), "orders": list(self.orders), "ended": dict(self.ended),
                "stop_reason": self.stop_reason}


def run_rounds(sessions: Sequence, reference: str, settings: RoundsSettings, *,
               calibrate: Callable[[], float] = calibration_workload, clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] = print) -> RoundsLog:
    """Time ``sessions`` (started: measuring/sessions.py) in interleaved rounds; returns the log.
    A session that fails mid-round leaves the rounds (its passes so far stay in the log)."""
    alive = list(sessions)
    rec = RoundsLog([s.name for s in sessions], reference, {s.name: [] for s in sessions})
    started = clock()
    while alive:
        k = rec.n_rounds
        rec.calibration_s.append(calibrate())
        order = [alive[i] for i in round_order(len(alive), k)]
        rec.orders.append([s.name for s in order])
        for s in order:
            try:
                rec.passes[s.name].append(s.run_pass())
            except SessionEnded as e:
                rec.passes[s.name].append(None)
                rec.ended[s.name] = str(e)
                alive.remove(s)
        for name in rec.passes:  # a row that left earlier: no pass in this round either
            if len(rec.passes[name]) < rec.n_rounds:
                rec.passes[name].append(None)
        elapsed = clock() - started
        log(_round_line(rec, elapsed))
        rec.stop_reason = _stop_reason(rec, [s.name for s in alive], settings, elapsed)
        if rec.stop_reason:
            break
    return rec


def _halfwidths(rec: RoundsLog, names: Sequence[str]) -> dict:
    out = {}
    for n in names:
        if n == rec.reference:
            continue
        sp = rec.speedup(n)
        out[n] = None if sp is None else sp.halfwidth_pct
    return out


def _stop_reason(rec: RoundsLog, alive: Sequence[str], settings: RoundsSettings, elapsed: float) -> str:
    n = rec.n_rounds
    if not alive:
        return "every row ended"
    if n < settings.min_rounds:
        return ""
    widths = _halfwidths(rec, alive) if rec.reference in alive else {}
    if widths and widest(widths.values()) <= settings.target_halfwidth_pct:
        return f"every interval within ±{settings.target_halfwidth_pct:g}%"
    if not widths:  # nothing to pair (only the reference, or no reference): the minimum is enough
        return f"{n} rounds (no row to pair with the reference)"
    if n >= settings.max_rounds:
        return f"max_rounds ({settings.max_rounds}) reached"
    if elapsed + elapsed / n > settings.budget_s:
        return f"time budget ({settings.budget_s:g} s) would be passed by another round"
    return ""


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


__all__ = ["RoundsLog", "RoundsSettings", "calibration_workload", "run_rounds"]
