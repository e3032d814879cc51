"""Interleaved rounds: the order rows are timed in, and the statistics of their paired passes.

A shared virtual machine's speed wanders over minutes (a fixed matrix workload timed once a
second for four minutes on an idle 2-core host: 15.5 % coefficient of variation, slowest 1.99x
the fastest, lag-1 autocorrelation 0.33). A row timed in one block and the reference in another
block a minute earlier carry that drift into their ratio, and an interval over passes within a
block cannot see it: two idle runs minutes apart gave 0.83x [0.77-0.89] and 1.42x [1.17-1.72]
for the same row. So every row is timed one pass per round, the rows of a round one after the
other in a rotating order, and a row's speedup is taken per round, against the reference's pass
of the same round: whatever the host did in that minute moves both sides of the ratio.

Pure functions: round order, paired speedups and their interval, the calibration's spread.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from scipy import stats

CONFIDENCE = 0.95


def round_order(n_rows: int, round_index: int) -> list[int]:
    """The rows of round ``round_index`` in timing order: A B C, B C A, C A B, ... so that no row
    is always timed first (right after the calibration) or right after the same neighbour."""
    if n_rows < 1:
        return []
    k = round_index % n_rows
    return [(k + i) % n_rows for i in range(n_rows)]


@dataclass(frozen=True)
class PairedSpeedup:
    """A row's speed against the reference over paired rounds.

    ``speedup``: the median over rounds of (reference pass / row pass) of the same round.
    ``low``, ``high``: a 95 % interval for what a rerun with as many rounds will show: a t
    interval of the mean log ratio, widened by sqrt(2) because a rerun's mean carries its own
    sampling error beside this run's (a replication interval, not only one for the mean).
    ``halfwidth_pct``: half the interval's width in log terms, as a percentage (5 means about
    +-5 %). None where fewer than two rounds paired."""

    speedup: float
    low: Optional[float]
    high: Optional[float]
    halfwidth_pct: Optional[float]
    rounds: int

    @property
    def straddles_one(self) -> bool:
        return self.low is None or self.low <= 1.0 <= self.high


def paired_ratios(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]]) -> list[float]:
    """Reference pass / row pass, round by round; a round where either side has no pass (a row
    that joined late or failed) pairs nothing."""
    return [a / b for a, b in zip(ref_s, row_s) if a is not None and b is not None and a > 0 and b > 0]


def paired_speedup(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]],
                   confidence: float = CONFIDENCE) -> Optional[PairedSpeedup]:
    """The row's paired speedup over the rounds both ran (None when no round paired)."""
    ratios = paired_ratios(ref_s, row_s)
    if not ratios:
        return None
    med = float(statistics.median(ratios))
    n = len(ratios)
    if n < 2:
        return PairedSpeedup(med, None, None, None, n)
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd * math.sqrt(2.0 / n)
    return PairedSpeedup(med, math.exp(mean - half), math.exp(mean + half), 100.0 * math.expm1(half), n)


def block_speedup(ref_s: Sequence[float], row_s: Sequence[float]) -> PairedSpeedup:
    """The ratio of two blocks of passes timed at different times (a row that could not stay
    alive beside the others, a resumed run): the median pass against the median pass, and as its
    range the extremes of the passes. Host drift between the blocks is in it and not in the
    range: the row's note says it was block-timed."""
    med = float(statistics.median(ref_s)) / float(statistics.median(row_s))
    low, high = min(ref_s) / max(row_s), max(ref_s) / min(row_s)
    return PairedSpeedup(med, low, high, 100.0 * (math.sqrt(high / low) - 1.0), min(len(ref_s), len(row_s)))


def spread_pct(values: Sequence[float]) -> Optional[float]:
    """Coefficient of variation in percent (standard deviation over mean); None under two values."""
    vals = [float(v) for v in values if v is not None]
    if len(vals) < 2 or statistics.fmean(vals) <= 0:
        return None
    return 100.0 * statistics.stdev(vals) / statistics.fmean(vals)


def widest(halfwidths: Sequence[Optional[float]]) -> float:
    """The widest half-width among rows (infinite while a row has fewer than two paired rounds)."""
    return max((math.inf if h is None else h for h in halfwidths), default=0.0)


__all__ = ["CONFIDENCE", "PairedSpeedup", "block_speedup", "paired_ratios", "paired_speedup", "round_order",
           "spread_pct", "widest"]
