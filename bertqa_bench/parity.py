"""Accuracy parity: a backend's outputs and answers against the reference's, and the verdict.

Pure functions over numpy arrays, score dicts and result records, so the gate is easy to test.
``compare`` judges one backend; ``verdict`` is the one rule that turns a run's records (plus
any run-level problems: a non-deterministic reference, a drift from the expected scores) into
PASS / FAIL — the same function for ``bench``, ``parity`` and the MLflow parent run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from .backends.base import FP32_CLASS
from .config import ParityConfig, Tolerance


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n: how far an agreement could move by chance."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class ParityResult:
    parity_class: str
    min_f1_ratio: float
    min_agreement: float
    metric_deltas: dict  # {metric: backend - reference}
    primary_ratio: float  # backend primary metric / reference primary metric
    answer_agreement: float
    n_agree: int
    n_compared: int
    agreement_ci_low: float
    agreement_ci_high: float
    start_argmax_agreement: float
    end_argmax_agreement: float
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    failures: list = field(default_factory=list)
    status: str = ""  # pass | FAIL | n/a

    def __post_init__(self):
        if not self.status:
            self.status = "pass" if not self.failures else "FAIL"

    @property
    def passed(self) -> bool:
        return self.status != "FAIL"

    @property
    def within_noise(self) -> bool:
        """The agreement tolerance lies inside the agreement's confidence interval: with this many
        questions the pass/fail on agreement could flip by chance."""
        return self.agreement_ci_low < self.min_agreement <= self.agreement_ci_high


def tolerance_for(cfg: ParityConfig, backend: str, parity_class: str) -> Tolerance:
    if backend in cfg.overrides:
        return cfg.overrides[backend]
    return cfg.fp32 if parity_class == FP32_CLASS else cfg.reduced


def logit_diffs(ref: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray], mask: np.ndarray) -> tuple[float, float]:
    """Max and mean |Δ| over real tokens only: padding logits are never used, so they don't count."""
    mx, total, count = 0.0, 0.0, 0
    for name, r in ref.items():
        o = out[name]
        if r.ndim == 2 and r.shape == mask.shape:
            d = np.abs(o.astype(np.float64) - r.astype(np.float64))[mask.astype(bool)]
        else:  # per-feature heads (e.g. NQ answer type)
            d = np.abs(o.astype(np.float64) - r.astype(np.float64)).ravel()
        if d.size:
            if not np.all(np.isfinite(d)):
                return float("inf"), float("inf")
            mx = max(mx, float(d.max()))
            total += float(d.sum())
            count += d.size
    return mx, (total / count if count else 0.0)


def argmax_agreement(ref: np.ndarray, out: np.ndarray, mask: np.ndarray) -> float:
    """Share of features whose argmax token is the same; padding is masked out of both."""
    neg = np.float32(-1e9)
    r = np.where(mask.astype(bool), ref, neg).argmax(axis=1)
    o = np.where(mask.astype(bool), out, neg).argmax(axis=1)
    return float((r == o).mean()) if len(r) else 1.0


def compare(*, parity_class: str, tolerance: Tolerance, primary_metric: str, ref_scores: Mapping[str, float],
            scores: Mapping[str, float], agreement: tuple[int, int], ref_outputs: Mapping[str, np.ndarray],
            outputs: Mapping[str, np.ndarray], attention_mask: np.ndarray) -> ParityResult:
    """``agreement``: (questions with the identical answer, questions compared)."""
    deltas = {k: float(scores[k]) - float(ref_scores[k]) for k in ref_scores if k in scores}
    ref_primary = float(ref_scores[primary_metric])
    ratio = float(scores[primary_metric]) / ref_primary if ref_primary > 0 else (
        1.0 if float(scores[primary_metric]) == ref_primary else 0.0)
    mx, mean = logit_diffs(ref_outputs, outputs, attention_mask)
    start = argmax_agreement(ref_outputs["start_logits"], outputs["start_logits"], attention_mask)
    end = argmax_agreement(ref_outputs["end_logits"], outputs["end_logits"], attention_mask)
    k, n = agreement
    share = k / n if n else 1.0
    low, high = wilson_interval(k, n)
    failures = []
    if not ratio >= tolerance.min_f1_ratio:
        failures.append(f"{primary_metric} {scores[primary_metric]:.2f} is {ratio:.2%} of reference "
                        f"{ref_primary:.2f} (< {tolerance.min_f1_ratio:.1%})")
    if not share >= tolerance.min_agreement:
        failures.append(f"answer agreement {share:.2%} ({k}/{n}, 95% CI {low:.1%}-{high:.1%}) "
                        f"< {tolerance.min_agreement:.1%}")
    if not np.isfinite(mx):
        failures.append("non-finite logits")
    return ParityResult(parity_class, tolerance.min_f1_ratio, tolerance.min_agreement, deltas, ratio, share, k, n,
                        low, high, start, end, mx, mean, failures)


def determinism(first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray], attention_mask: np.ndarray,
                first_predictions: Any, second_predictions: Any) -> dict:
    """Two runs of the reference on the same features: identical logits and answers, or say how not."""
    mx, _ = logit_diffs(first, second, attention_mask)
    same_answers = first_predictions == second_predictions
    return {"max_abs_logit_diff": mx, "identical_answers": bool(same_answers),
            "deterministic": bool(mx == 0.0 and same_answers)}


def check_expected(results: Iterable, expected: list[dict], metric_names: Sequence[str],
                   tolerance_points: float) -> list[str]:
    """Each backend's scores against its committed expected row; the breaches."""
    by_backend = {r["backend"]: r for r in expected}
    failures = []
    for res in results:
        exp: Optional[dict] = by_backend.get(res.backend)
        if exp is None or res.status != "ok":
            continue
        for m in metric_names:
            if m in exp and m in res.scores:
                delta = float(res.scores[m]) - float(exp[m])
                if abs(delta) > tolerance_points:
                    failures.append(f"{res.backend}: {m} {float(res.scores[m]):.2f} vs expected {float(exp[m]):.2f} "
                                    f"(|Δ| {abs(delta):.2f} > {tolerance_points:.2f} points)")
    return failures


@dataclass
class Verdict:
    status: str  # PASS | FAIL | NO REFERENCE | N/A
    reasons: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("PASS", "N/A")

    def __str__(self) -> str:
        if self.status == "N/A":
            return "N/A (random weights, timing only: parity is judged on a trained model)"
        return self.status if not self.reasons else f"{self.status}: " + "; ".join(self.reasons)


def verdict(results: Sequence, reference: str, *, timing_only: bool = False,
            problems: Iterable[str] = ()) -> Verdict:
    """The run's verdict: FAIL when the reference did not run, a backend broke its tolerance or
    crashed, or a run-level problem was found; backends that could not run here ("not run")
    are reported in the table but fail nothing."""
    ref = next((r for r in results if r.backend == reference), None)
    if ref is None or ref.status != "ok":
        why = "never ran" if ref is None else f"{ref.status}: {ref.error}"
        return Verdict("NO REFERENCE", [f"reference {reference} {why}"])
    reasons = [f"{r.backend}: failed: {r.error}" for r in results if r.status == "failed"]
    reasons += [f"{r.backend}: {r.parity_failures}" for r in results if r.parity == "FAIL"]
    reasons += list(problems)
    if reasons:
        return Verdict("FAIL", reasons)
    return Verdict("N/A") if timing_only else Verdict("PASS")
