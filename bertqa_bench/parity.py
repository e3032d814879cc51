"""Accuracy parity: compare a backend's outputs and answers with the reference (eager FP32).

Pure functions over numpy arrays and prediction dicts, so the gate itself is easy to test.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from .backends.base import FP32_CLASS
from .config import ParityConfig, Tolerance


@dataclass
class ParityResult:
    backend: str
    parity_class: str
    min_f1_ratio: float
    min_agreement: float
    metric_deltas: dict  # {metric: backend - reference}
    primary_ratio: float  # backend primary metric / reference primary metric
    answer_agreement: float
    start_argmax_agreement: float
    end_argmax_agreement: float
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def status(self) -> str:
        return "pass" if self.passed else "FAIL"

    def as_row(self) -> dict:
        d = asdict(self)
        d.pop("metric_deltas")
        d.pop("failures")
        # "em_delta" is the name the results table promises for exact match
        d.update({("em" if k == "exact_match" else k) + "_delta": v for k, v in self.metric_deltas.items()})
        d["parity"] = self.status
        d["parity_failures"] = "; ".join(self.failures)
        return d


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


def compare(*, backend: str, parity_class: str, tolerance: Tolerance, primary_metric: str,
            ref_scores: Mapping[str, float], scores: Mapping[str, float], answer_agreement: float,
            ref_outputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
            attention_mask: np.ndarray) -> ParityResult:
    deltas = {k: float(scores[k]) - float(ref_scores[k]) for k in ref_scores if k in scores}
    ref_primary = float(ref_scores[primary_metric])
    ratio = float(scores[primary_metric]) / ref_primary if ref_primary > 0 else (
        1.0 if float(scores[primary_metric]) == ref_primary else 0.0)
    mx, mean = logit_diffs(ref_outputs, outputs, attention_mask)
    start = argmax_agreement(ref_outputs["start_logits"], outputs["start_logits"], attention_mask)
    end = argmax_agreement(ref_outputs["end_logits"], outputs["end_logits"], attention_mask)
    failures = []
    if not ratio >= tolerance.min_f1_ratio:
        failures.append(f"{primary_metric} {scores[primary_metric]:.2f} is {ratio:.2%} of reference "
                        f"{ref_primary:.2f} (< {tolerance.min_f1_ratio:.1%})")
    if not answer_agreement >= tolerance.min_agreement:
        failures.append(f"answer agreement {answer_agreement:.2%} < {tolerance.min_agreement:.1%}")
    if not np.isfinite(mx):
        failures.append("non-finite logits")
    return ParityResult(backend, parity_class, tolerance.min_f1_ratio, tolerance.min_agreement, deltas, ratio,
                        float(answer_agreement), start, end, mx, mean, failures)


def determinism(first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray], attention_mask: np.ndarray,
                first_predictions: Any, second_predictions: Any) -> dict:
    """Two runs of the reference on the same features: identical logits and answers, or say how not."""
    mx, _ = logit_diffs(first, second, attention_mask)
    same_answers = first_predictions == second_predictions
    return {"max_abs_logit_diff": mx, "identical_answers": bool(same_answers),
            "deterministic": bool(mx == 0.0 and same_answers)}


def check_expected(rows: list[dict], expected: list[dict], metric_names: tuple[str, ...],
                   tolerance_points: float) -> list[str]:
    """Compare each backend's scores with its committed expected row; return the breaches."""
    by_backend = {r["backend"]: r for r in expected}
    failures = []
    for row in rows:
        exp: Optional[dict] = by_backend.get(row["backend"])
        if exp is None or row.get("status") != "ok":
            continue
        for m in metric_names:
            if m in exp and m in row:
                delta = float(row[m]) - float(exp[m])
                if abs(delta) > tolerance_points:
                    failures.append(f"{row['backend']}: {m} {float(row[m]):.2f} vs expected {float(exp[m]):.2f} "
                                    f"(|Δ| {abs(delta):.2f} > {tolerance_points})")
    return failures
