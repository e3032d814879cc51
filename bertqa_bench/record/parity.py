"""Accuracy parity: a backend's outputs and answers against the reference's, and the verdict.

Pure functions over numpy arrays, score dicts and result records, so the gate is easy to test.
``compare`` judges one backend; ``verdict`` is the one rule that turns a run's records (plus
any run-level problems: a non-deterministic reference, a drift from the expected scores) into
PASS / FAIL / INCONCLUSIVE — the same function for ``bench``, ``parity`` and the MLflow parent run.

Every rule is a point rule (the MLPerf rule: F1 >= 99% of the reference; answer agreement >=
the class's share), and every point comes with its uncertainty over questions: a paired
bootstrap (the same resampled questions for backend and reference) for the metric deltas and the
F1 ratio, a Wilson interval for agreement. When the interval of the quantity that decided a
verdict straddles its tolerance the verdict is kept but labelled ``within noise``, with the
number of questions that would decide it; a run whose only failures are within noise is
INCONCLUSIVE, which a gate treats as not passed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..backends.base import FP32_CLASS
from ..config import ParityConfig, Tolerance


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n: how far an agreement could move by chance."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


Z95 = 1.959963984540054  # two-sided 95%
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20261126  # fixed: the same run gives the same intervals


@dataclass
class Bootstrap:
    """Paired-bootstrap 95% intervals over questions (percentile method)."""

    delta_ci: dict  # {metric: (low, high)} of backend - reference
    ratio_ci: tuple  # (low, high) of backend primary / reference primary
    ratio_se: float  # bootstrap standard error of that ratio
    n_questions: int
    n_resamples: int


def paired_bootstrap(ref: np.ndarray, out: np.ndarray, metrics: Callable[[np.ndarray, int], Mapping[str, np.ndarray]],
                     primary: str, *, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Bootstrap:
    """Resample questions with replacement, the same questions for both sides.

    ``ref``/``out``: per-question contributions [n_questions, k] (a task's ``question_scores``);
    ``metrics(sums [B, k], n)`` turns column sums of a resample into the task's metrics, so any
    metric that is a function of per-question counts (SQuAD's means, NQ's micro-F1) is covered.
    Pure numpy, seeded.
    """
    ref, out = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
    if ref.shape != out.shape or ref.ndim != 2:
        raise ValueError(f"paired bootstrap needs two [questions, k] arrays of one shape, got {ref.shape} and {out.shape}")
    n, k = ref.shape
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_resamples, 4_000_000 // max(1, n * k)))
    deltas: dict[str, list] = {}
    ratios: list = []
    done = 0
    while done < n_resamples:
        b = min(chunk, n_resamples - done)
        idx = rng.integers(0, n, size=(b, n))
        m_ref, m_out = metrics(ref[idx].sum(axis=1), n), metrics(out[idx].sum(axis=1), n)
        for name in m_ref:
            deltas.setdefault(name, []).append(np.asarray(m_out[name]) - np.asarray(m_ref[name]))
        r_ref, r_out = np.asarray(m_ref[primary], dtype=np.float64), np.asarray(m_out[primary], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios.append(np.where(r_ref > 0, r_out / np.where(r_ref > 0, r_ref, 1.0), np.where(r_out == r_ref, 1.0, 0.0)))
        done += b
    ci = {name: _percentiles(np.concatenate(v)) for name, v in deltas.items()}
    all_ratios = np.concatenate(ratios)
    return Bootstrap(ci, _percentiles(all_ratios), float(all_ratios.std(ddof=1)) if len(all_ratios) > 1 else 0.0,
                     n, n_resamples)


def _percentiles(x: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(lo), float(hi)


def straddles(low: Optional[float], high: Optional[float], threshold: float) -> bool:
    """The interval holds values on both sides of the threshold (the rule could go either way)."""
    if low is None or high is None:
        return False
    return low < threshold <= high if low != high else False


def questions_to_decide_ratio(ratio: float, threshold: float, se: float, n: int) -> Optional[int]:
    """Questions at which the ratio's 95% interval would clear the threshold, if the per-question
    spread stays as observed (the standard error falls as 1/sqrt(n))."""
    gap = abs(ratio - threshold)
    if se <= 0:
        return n
    if gap == 0:
        return None  # on the line: no number of questions decides it
    return int(math.ceil(n * (Z95 * se / gap) ** 2))


def questions_to_decide_agreement(share: float, threshold: float, n: int) -> Optional[int]:
    """Questions at which a Wilson interval around the observed share would clear the threshold."""
    if share == threshold:
        return None
    k = max(n, 1)
    while k < 10 ** 9:
        low, high = wilson_interval(int(round(share * k)), k)
        if not (low < threshold <= high):
            return k
        k = int(k * 1.25) + 1
    return None


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
    delta_ci: dict = field(default_factory=dict)  # {metric: (low, high)} paired bootstrap, backend - reference
    ratio_ci_low: Optional[float] = None
    ratio_ci_high: Optional[float] = None
    ratio_within_noise: bool = False  # the ratio's interval straddles min_f1_ratio
    # The verdict's own uncertainty: within noise when every rule that decided it (a FAIL: the
    # broken rules; a pass: any rule) could go the other way at this many questions.
    verdict_within_noise: bool = False
    questions_to_decide: Optional[int] = None  # questions that would decide it, at the observed spread
    decided_by: str = ""  # the rule(s) behind the verdict: "f1 ratio", "agreement"

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
        return straddles(self.agreement_ci_low, self.agreement_ci_high, self.min_agreement)


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
            outputs: Mapping[str, np.ndarray], attention_mask: np.ndarray,
            question_scores: Optional[tuple[np.ndarray, np.ndarray]] = None,
            metrics_from_sums: Optional[Callable] = None) -> ParityResult:
    """``agreement``: (questions with the identical answer, questions compared).
    ``question_scores``: (reference, backend) per-question contributions and ``metrics_from_sums``
    the task's way back to its metrics, for the paired bootstrap; without them no metric interval."""
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
    boot = None
    if question_scores is not None and metrics_from_sums is not None:
        boot = paired_bootstrap(question_scores[0], question_scores[1], metrics_from_sums, primary_metric)
    ratio_fails = not ratio >= tolerance.min_f1_ratio
    agree_fails = not share >= tolerance.min_agreement
    failures = []
    if ratio_fails:
        ci = f", 95% CI {boot.ratio_ci[0]:.2%}-{boot.ratio_ci[1]:.2%}" if boot else ""
        failures.append(f"{primary_metric} {scores[primary_metric]:.2f} is {ratio:.2%} of reference "
                        f"{ref_primary:.2f}{ci} (< {tolerance.min_f1_ratio:.1%})")
    if agree_fails:
        failures.append(f"answer agreement {share:.2%} ({k}/{n}, 95% CI {low:.1%}-{high:.1%}) "
                        f"< {tolerance.min_agreement:.1%}")
    finite = bool(np.isfinite(mx))
    if not finite:
        failures.append("non-finite logits")
    res = ParityResult(parity_class, tolerance.min_f1_ratio, tolerance.min_agreement, deltas, ratio, share, k, n,
                       low, high, start, end, mx, mean, failures)
    # Which rules decided the verdict, and could each have gone the other way?
    rules = {}  # rule -> (straddles its tolerance, questions that would decide it)
    if boot is not None:
        res.delta_ci = dict(boot.delta_ci)
        res.ratio_ci_low, res.ratio_ci_high = boot.ratio_ci
        res.ratio_within_noise = straddles(*boot.ratio_ci, tolerance.min_f1_ratio)
        rules[f"{primary_metric} ratio"] = (res.ratio_within_noise, questions_to_decide_ratio(
            ratio, tolerance.min_f1_ratio, boot.ratio_se, n or boot.n_questions))
    agree_noise = straddles(low, high, tolerance.min_agreement)
    rules["agreement"] = (agree_noise, questions_to_decide_agreement(share, tolerance.min_agreement, n))
    if res.status == "FAIL":
        deciding = {r: v for r, v in rules.items() if (r == "agreement" and agree_fails)
                    or (r != "agreement" and ratio_fails)}
        # a failure is within noise only if every broken rule is, and the logits were finite
        res.verdict_within_noise = finite and bool(deciding) and all(v[0] for v in deciding.values())
    else:
        deciding = dict(rules)
        res.verdict_within_noise = any(v[0] for v in deciding.values())
    res.decided_by = ", ".join(deciding)
    if res.verdict_within_noise:
        needed = [v[1] for v in deciding.values() if v[0]]
        res.questions_to_decide = None if any(q is None for q in needed) else max(needed)
    return res


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
    status: str  # PASS | FAIL | INCONCLUSIVE | NO REFERENCE | N/A
    reasons: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """What a gate may pass: decided passes only (INCONCLUSIVE is not a pass)."""
        return self.status in ("PASS", "N/A")

    def __str__(self) -> str:
        if self.status == "N/A":
            return "N/A (random weights, timing only: parity is judged on a trained model)"
        return self.status if not self.reasons else f"{self.status}: " + "; ".join(self.reasons)


def noise_note(r) -> str:
    """How a row's verdict reads beside its label: '' when decided."""
    if not getattr(r, "parity_within_noise", None):
        return ""
    q = getattr(r, "questions_to_decide", None)
    return "within noise" + (f": ~{q:,} questions would decide it" if q else ": on the tolerance line")


def verdict(results: Sequence, reference: str, *, timing_only: bool = False,
            problems: Iterable[str] = ()) -> Verdict:
    """The run's verdict: FAIL when the reference did not run, a backend crashed, broke its
    tolerance by a decided margin, or a run-level problem was found; INCONCLUSIVE when every
    parity failure lies within noise (the interval straddles the tolerance) and nothing else
    failed; PASS otherwise. Backends that could not run here ("not run") are reported in the
    table but fail nothing."""
    ref = next((r for r in results if r.backend == reference), None)
    if ref is None or ref.status != "ok":
        why = "never ran" if ref is None else f"{ref.status}: {ref.error}"
        return Verdict("NO REFERENCE", [f"reference {reference} {why}"])
    decided = [f"{r.backend}: failed: {r.error}" for r in results if r.status == "failed"]
    decided += [f"{r.backend}: {r.parity_failures}" for r in results
                if r.parity == "FAIL" and not getattr(r, "parity_within_noise", False)]
    decided += list(problems)
    if decided:
        return Verdict("FAIL", decided)
    noisy = [f"{r.backend}: {r.parity_failures} ({noise_note(r)})" for r in results
             if r.parity == "FAIL" and getattr(r, "parity_within_noise", False)]
    if noisy:
        return Verdict("INCONCLUSIVE", noisy)
    return Verdict("N/A") if timing_only else Verdict("PASS")
