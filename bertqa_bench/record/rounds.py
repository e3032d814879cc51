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

from .noise import spread_pct

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


def _paired(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]], groups: Optional[Sequence]) -> list:
    """(ratio, the round's process label) of every round both sides ran."""
    return [(a / b, None if groups is None else groups[k]) for k, (a, b) in enumerate(zip(ref_s, row_s))
            if a is not None and b is not None and a > 0 and b > 0]


def paired_logs(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]],
                groups: Optional[Sequence] = None) -> tuple[list[float], list]:
    """(log ratios, their rounds' process labels) over the rounds both sides ran."""
    kept = _paired(ref_s, row_s, groups)
    return [math.log(r) for r, _ in kept], [g for _, g in kept]


def paired_speedup(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]],
                   confidence: float = CONFIDENCE, groups: Optional[Sequence] = None,
                   rerun_spread_pct: float = 0.0,
                   pooled_between: Optional[tuple[float, float]] = None) -> Optional[PairedSpeedup]:
    """The row's paired speedup over the rounds both ran (None when no round paired).
    ``groups``: each round's pair of worker processes (the reference's, the row's), as any
    hashable label; with two or more, the interval includes the spread between processes
    (``log_mean_variance``; ``pooled_between``: that spread pooled over the run's rows,
    ``pooled_process_variance``). ``rerun_spread_pct``: a between-run standard deviation of the
    log ratio, known from reruns (``with_rerun_spread``)."""
    kept = _paired(ref_s, row_s, groups)
    if not kept:
        return None
    ratios = [r for r, _ in kept]
    med = float(statistics.median(ratios))
    n = len(ratios)
    if n < 2:
        return PairedSpeedup(med, None, None, None, n)
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    var_mean, df = with_rerun_spread(*log_mean_variance(logs, [g for _, g in kept], pooled_between),
                                     rerun_spread_pct)
    # sqrt(2): a rerun's mean carries its own sampling error (and its own processes) beside this run's
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * math.sqrt(2.0 * var_mean)
    return PairedSpeedup(med, math.exp(mean - half), math.exp(mean + half), 100.0 * math.expm1(half), n)


@dataclass(frozen=True)
class ProcessAnova:
    """One row's one-way analysis of its log ratios by worker process: the between- and
    within-process mean squares, the (unbalanced) group size n0, the processes m and rounds n."""

    msb: float
    msw: float
    n0: float
    m: int
    n: int

    @property
    def between_component(self) -> float:
        """The method-of-moments estimate of the process offsets' variance, not truncated."""
        return (self.msb - self.msw) / self.n0


def process_anova(logs: Sequence[float], groups: Sequence) -> Optional[ProcessAnova]:
    """The row's ``ProcessAnova``; None under two processes or with no round beyond one a process."""
    n = len(logs)
    by: dict = {}
    for y, g in zip(logs, groups):
        by.setdefault(g, []).append(y)
    m = len(by)
    if m < 2 or n - m < 1:
        return None
    means = {g: statistics.fmean(v) for g, v in by.items()}
    grand = statistics.fmean(logs)
    msw = sum((y - means[g]) ** 2 for g, v in by.items() for y in v) / (n - m)
    msb = sum(len(v) * (means[g] - grand) ** 2 for g, v in by.items()) / (m - 1)
    n0 = (n - sum(len(v) ** 2 for v in by.values()) / n) / (m - 1)  # the group size, unbalanced groups
    return ProcessAnova(msb, msw, n0, m, n)


def pooled_process_variance(anovas: Sequence[Optional[ProcessAnova]]) -> Optional[tuple[float, float]]:
    """(variance of a process offset, its degrees of freedom) pooled over a run's rows: each row's
    estimate weighted by its m - 1 degrees of freedom, truncated at zero once, after pooling, on
    the sum of the rows' m - 1. Two processes give a row's own estimate one degree of freedom, so
    its t quantile is 12.7 and one unlucky pair makes an interval several times too wide (a
    default-suite run gave openvino-fp32 [0.76-3.10]); the rows of one run share the reference's
    processes and the machine's, and pooling takes their offsets as alike in spread (on the log
    scale). None where no row has two processes."""
    rows = [a for a in anovas if a is not None]
    if not rows:
        return None
    df = sum(a.m - 1 for a in rows)
    return max(0.0, sum((a.m - 1) * a.between_component for a in rows) / df), float(df)


def log_mean_variance(logs: Sequence[float], groups: Sequence,
                      pooled_between: Optional[tuple[float, float]] = None) -> tuple[float, float]:
    """(variance of the mean log ratio, its degrees of freedom), counting the worker processes.

    One process (or no labels): s^2 / n on n - 1 degrees of freedom. Several: a one-way random
    effects model, log ratio = mu + process offset + round noise. A rerun runs in new processes
    with new offsets, so the mean's variance is sigma_b^2 / m + sigma_w^2 / n (m processes, n
    rounds), sigma_b^2 estimated as (MSB - MSW) / n0 (zero when the processes agree within their
    round noise), and Satterthwaite's degrees of freedom for that sum, each term on its own
    (n - m and m - 1): where two processes differ by more than their rounds' noise, they fall
    towards 1 and the interval widens as it must, since two processes say little about a
    third's offset. ``pooled_between``: (the offsets' variance, its degrees of freedom) pooled
    over the run's rows (``pooled_process_variance``), in place of this row's own estimate."""
    n = len(logs)
    anova = process_anova(logs, list(groups) if groups is not None else [None] * n)
    if anova is None:
        return statistics.variance(logs) / n, n - 1
    m = anova.m
    sigma_b2, df_b = pooled_between if pooled_between is not None else (max(0.0, anova.between_component), m - 1)
    within, between = anova.msw / n, sigma_b2 / m
    if between == 0.0 or within == 0.0:
        return within + between, (n - m) if between == 0.0 else df_b
    # each term on its own degrees of freedom: continuous from n - m (processes agree) to df_b
    df = (within + between) ** 2 / (within ** 2 / (n - m) + between ** 2 / df_b)
    return within + between, df


def with_rerun_spread(var_mean: float, df: float, rerun_spread_pct: float) -> tuple[float, float]:
    """(variance, degrees of freedom) with a between-run variance added: a run's mean log ratio
    is mu + its run's offset + the rounds' and processes' error, and a rerun draws a new offset,
    so the offset's variance joins the mean's. It is taken as known (measured over many reruns,
    not estimated from this run), so it adds no sampling error: Satterthwaite's degrees of
    freedom grow with its share, from ``df`` (no spread) towards a normal interval."""
    spread = math.log1p(rerun_spread_pct / 100.0) ** 2
    if spread == 0.0:
        return var_mean, df
    total = var_mean + spread
    return total, math.inf if var_mean == 0.0 else df * (total / var_mean) ** 2


def rounds_needed(sd_log: float, target_halfwidth_pct: float, at_least: int, at_most: int,
                  confidence: float = CONFIDENCE) -> int:
    """The fewest rounds (from ``at_least`` to ``at_most``) whose replication interval would be
    within +-``target_halfwidth_pct`` at a log-ratio standard deviation of ``sd_log``: the
    number the rounds are fixed to after the first rounds (measuring/rounds.py), so that when
    they stop does not depend on how the later rounds came out."""
    target = math.log1p(target_halfwidth_pct / 100.0)
    for n in range(max(2, at_least), max(2, at_most) + 1):
        if float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd_log * math.sqrt(2.0 / n) <= target:
            return max(n, at_least)
    return max(at_least, at_most)


def log_ratio_sd(ref_s: Sequence[Optional[float]], row_s: Sequence[Optional[float]]) -> Optional[float]:
    """Standard deviation of the paired log ratios (None under two paired rounds)."""
    logs = [math.log(r) for r in paired_ratios(ref_s, row_s)]
    return statistics.stdev(logs) if len(logs) > 1 else None


def block_speedup(ref_s: Sequence[float], row_s: Sequence[float]) -> PairedSpeedup:
    """The ratio of two blocks of passes timed at different times (a row that could not stay
    alive beside the others, a resumed run): the median pass against the median pass, and as its
    range the extremes of the passes. Host drift between the blocks is in it and not in the
    range: the row's note says it was block-timed."""
    med = float(statistics.median(ref_s)) / float(statistics.median(row_s))
    low, high = min(ref_s) / max(row_s), max(ref_s) / min(row_s)
    return PairedSpeedup(med, low, high, 100.0 * (math.sqrt(high / low) - 1.0), min(len(ref_s), len(row_s)))


def widest(halfwidths: Sequence[Optional[float]]) -> float:
    """The widest half-width among rows (infinite while a row has fewer than two paired rounds)."""
    return max((math.inf if h is None else h for h in halfwidths), default=0.0)


__all__ = ["CONFIDENCE", "PairedSpeedup", "ProcessAnova", "block_speedup", "log_mean_variance", "log_ratio_sd",
           "paired_logs", "paired_ratios", "paired_speedup", "pooled_process_variance", "process_anova", "round_order",
           "rounds_needed", "spread_pct", "widest", "with_rerun_spread"]
