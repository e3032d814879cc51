"""Whether a fine-tune collapsed: its loss fell, then climbed back most of the way to where it began.

BERT-large fine-tunes are known to collapse on some seeds (Mosbach et al., "On the Stability of
Fine-tuning BERT", ICLR 2021). Seen here on an H200 on 2026-12-03 (suite gpu-bert-large, seed 42,
results/reference/h200-mlperf-bert-large-e4m3-dense.md): the loss fell from 5.9 to 0.45 by step 288,
was back at 5.95 by step 504 (a uniform guess over 384 positions scores ln 384 = 5.95) and ended at
5.3; dev F1 4.2. The bench then judged every row against a model that answers nothing, and reported
every FP8 row as failing parity. A collapsed model is refused where it is made, before it is saved.

The test is on the run's own losses, with no task's chance level in it: the best rolling mean, the
loss at the end (the mean of the last points, as ``final_loss``) and the loss at the start (the mean
of the first points). A run that never learned (flat from the start) is not a collapse here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

# Points per rolling mean: the logged losses are single batches', noisy, so the best is taken
# over means of 5, and the start and the end are the means of the first and last 5
SMOOTH = 5
# A healthy fine-tune ends near its best smoothed loss (a linear decay to 0 leaves it no room to
# climb far); the collapsed one ended 10x above it (0.45 -> 5.3). 4x sits between them.
CLIMB = 4.0
# ... and back above half its starting loss: a run whose losses are all small (0.01 -> 0.05 late
# in training) moves by a large ratio and a tiny amount, and is not a collapse
BACK = 0.5


@dataclass(frozen=True)
class Collapse:
    first: float  # the mean of the first SMOOTH points
    best: float
    best_point: int  # index of the last point of the best rolling mean
    final: float


def collapse(losses: Sequence[float]) -> Optional[Collapse]:
    """The collapse in ``losses`` (the logged training losses, in order), or None: None too where
    there are too few points to smooth (fewer than 2 x SMOOTH)."""
    values = [float(v) for v in losses]
    if len(values) < 2 * SMOOTH:
        return None
    means = [sum(values[i - SMOOTH:i]) / SMOOTH for i in range(SMOOTH, len(values) + 1)]
    best_i = min(range(len(means)), key=means.__getitem__)
    first, best, final = means[0], means[best_i], means[-1]
    if final >= CLIMB * best and final >= BACK * first:
        return Collapse(first=first, best=best, best_point=best_i + SMOOTH - 1, final=final)
    return None
