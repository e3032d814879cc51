"""Natural Questions scoring: the official long/short P/R/F1 plus the Kaggle TF2-QA micro-F1.

Official definitions (google-research-datasets/natural-questions, nq_eval.py):

* Gold long (short) answer exists when at least 2 annotations have a non-null one (the
  5-way-annotated dev rule). A YES/NO annotation counts as a short answer. Examples with a
  single annotation (train-style files, the Kaggle set) are decided by that annotation.
* A non-null long prediction is correct when gold has a long answer and the predicted span
  equals any non-null annotated long span. A non-null short prediction (spans or YES/NO) is
  correct when gold has a short answer and either its YES/NO equals any annotation's, or
  its set of spans equals the span set of any annotation.
* Each prediction carries a score; for long and for short separately, the evaluator sorts by
  score and picks the threshold with the best F1 (ties: the highest such threshold).
  Predictions scoring below it count as null. Precision = correct / non-null predictions,
  recall = correct / examples with gold.

Micro-F1 (Kaggle TF2-QA): long and short pooled, at the thresholds chosen above, with
Kaggle's counts — TP: non-null and correct; FP: non-null and not correct (wrong span, or an
answer where gold has none); FN: null where gold has an answer. A wrong non-null answer where
gold exists is therefore one FP and *not* an FN, unlike the official recall's denominator.

P/R/F1 are percentages (0-100) like SQuAD EM/F1; thresholds are raw scores.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ...errors import DatasetFormatError
from .reader import NQExample, YES_NO_VALUES, load_nq_jsonl

SpanT = tuple[int, int]


@dataclass(frozen=True)
class NQPrediction:
    example_id: Union[int, str]
    long_span: Optional[SpanT]
    long_score: float
    short_spans: frozenset  # of SpanT
    short_score: float
    yes_no: str

    @property
    def has_long(self) -> bool:
        return self.long_span is not None

    @property
    def has_short(self) -> bool:
        return bool(self.short_spans) or self.yes_no != "NONE"


def _span(obj: Any, fail, field: str) -> Optional[SpanT]:
    if not isinstance(obj, dict):
        fail(field, f"must be an object with start_token/end_token, got {type(obj).__name__}")
    for k in ("start_token", "end_token"):
        v = obj.get(k)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{field}.{k}", f"must be an integer, got {v!r:.30}" if k in obj else "missing")
    s, e = obj["start_token"], obj["end_token"]
    if s < 0 and e < 0:
        return None
    if not 0 <= s < e:
        fail(field, f"token span [{s}, {e}) must be start_token=end_token=-1 (null) or 0 <= start < end "
                    "(end exclusive)")
    return s, e


def _score(entry: dict, key: str, fail, field: str, needed: bool) -> float:
    if key not in entry:
        if needed:
            fail(field, "missing (the evaluator picks its threshold from the scores)")
        return 0.0
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        fail(field, f"must be a finite number, got {v!r:.30}")
    return float(v)


def parse_predictions(obj: Any, source: Union[str, Path] = "<predictions>") -> dict[str, NQPrediction]:
    """Validate official-format predictions (``{"predictions": [...]}`` or the bare list) -> by example key."""
    if isinstance(obj, dict):
        if "predictions" not in obj:
            raise DatasetFormatError(source, "(top level)", "predictions", "missing: expected {\"predictions\": [...]}")
        obj = obj["predictions"]
    if not isinstance(obj, list):
        raise DatasetFormatError(source, "(top level)", "predictions", f"must be a list, got {type(obj).__name__}")
    out: dict[str, NQPrediction] = {}
    for i, entry in enumerate(obj):
        record = f"predictions[{i}]"

        def fail(field, reason, _record=record):
            raise DatasetFormatError(source, _record, field, reason)

        if not isinstance(entry, dict):
            fail("(entry)", f"must be an object, got {type(entry).__name__}")
        ex_id = entry.get("example_id")
        if isinstance(ex_id, bool) or not isinstance(ex_id, (int, str)) or ex_id == "":
            fail("example_id", "missing" if "example_id" not in entry else f"must be an integer or string, got {ex_id!r:.30}")
        if str(ex_id) in out:
            fail("example_id", f"duplicate prediction for {ex_id}")
        if "long_answer" not in entry:
            fail("long_answer", "missing (use start_token=end_token=-1 for no long answer)")
        long_span = _span(entry["long_answer"], fail, "long_answer")
        shorts = entry.get("short_answers", [])
        if not isinstance(shorts, list):
            fail("short_answers", f"must be a list, got {type(shorts).__name__}")
        short_spans = frozenset(s for j, sa in enumerate(shorts)
                                if (s := _span(sa, fail, f"short_answers[{j}]")) is not None)
        yn = entry.get("yes_no_answer", "NONE")
        if not isinstance(yn, str) or yn.upper() not in YES_NO_VALUES:
            fail("yes_no_answer", f"must be one of {', '.join(YES_NO_VALUES)}, got {yn!r:.20}")
        yn = yn.upper()
        for key in ("long_answer_score", "short_answers_score"):
            v = entry.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:  # json.loads reads Infinity, and ints too large for a float
                    finite = abs(float(v)) != float("inf")
                except OverflowError:
                    finite = False
                if not finite:
                    fail(key, f"must be a finite number, got {v!r:.30}")
        long_score = _score(entry, "long_answer_score", fail, "long_answer_score", long_span is not None)
        short_score = _score(entry, "short_answers_score", fail, "short_answers_score",
                             bool(short_spans) or yn != "NONE")
        out[str(ex_id)] = NQPrediction(ex_id, long_span, long_score, short_spans, short_score, yn)
    return out


def _gold_flags(ex: NQExample, long_needed: int, short_needed: int) -> tuple[bool, bool]:
    """Whether the gold has a long / short answer: at least that many non-null annotations
    (the official evaluator's --long_non_null_threshold / --short_non_null_threshold, default 2)."""
    return (sum(a.has_long for a in ex.annotations) >= long_needed,
            sum(a.has_short for a in ex.annotations) >= short_needed)


def _long_correct(ex: NQExample, p: NQPrediction) -> bool:
    return any(a.has_long and (a.long_start, a.long_end) == p.long_span for a in ex.annotations)


def _short_correct(ex: NQExample, p: NQPrediction) -> bool:
    if p.yes_no != "NONE":
        return any(a.yes_no_answer == p.yes_no for a in ex.annotations)
    return any(a.short_answers and frozenset(a.short_answers) == p.short_spans for a in ex.annotations)


def best_threshold(stats: Sequence[tuple[bool, bool, bool, float]]) -> tuple[float, float, float, float]:
    """(has_gold, has_pred, correct, score) per example -> (f1, precision, recall, threshold), P/R/F1 in 0-1.

    Sweeps thresholds from the highest score down, a tie group at a time. When no threshold
    gives F1 > 0 the threshold lies above every score (all predictions null).
    """
    n_gold = sum(1 for g, _, _, _ in stats if g)
    ordered = sorted(stats, key=lambda x: -x[3])
    pred_scores = [sc for _, has_pred, _, sc in stats if has_pred]
    best = (0.0, 0.0, 0.0, max(pred_scores) + 1.0 if pred_scores else 0.0)
    correct = n_pred = 0
    for i, (_, has_pred, ok, score) in enumerate(ordered):
        n_pred += has_pred
        correct += ok
        if i + 1 < len(ordered) and ordered[i + 1][3] == score:
            continue  # a threshold admits a whole tie group at once
        p = correct / n_pred if n_pred else 0.0
        r = correct / n_gold if n_gold else 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        if f1 > best[0]:
            best = (f1, p, r, score)
    return best


def _example_stats(gold_examples: Sequence[NQExample], predictions: Union[Mapping, list],
                   source: Union[str, Path], long_non_null_threshold: int, short_non_null_threshold: int):
    """(has_gold, has_pred, correct, score) per gold example, for long and short answers."""
    preds = predictions if _is_parsed(predictions) else parse_predictions(predictions, source)
    gold_keys = set()
    for ex in gold_examples:
        if not ex.annotations:
            raise ValueError(f"gold example {ex.example_id} has no annotations; cannot score")
        gold_keys.add(ex.key)
    unknown = [k for k in preds if k not in gold_keys]
    if unknown:
        raise DatasetFormatError(source, "(all)", "example_id",
                                 f"{len(unknown)} prediction(s) for example ids not in the gold set, "
                                 f"e.g. {', '.join(unknown[:3])}")

    long_stats, short_stats = [], []
    n_missing = 0
    for ex in gold_examples:
        gold_long, gold_short = _gold_flags(ex, long_non_null_threshold, short_non_null_threshold)
        p = preds.get(ex.key)
        if p is None:
            n_missing += 1
            long_stats.append((gold_long, False, False, float("-inf")))
            short_stats.append((gold_short, False, False, float("-inf")))
            continue
        long_stats.append((gold_long, p.has_long, gold_long and p.has_long and _long_correct(ex, p), p.long_score))
        short_stats.append((gold_short, p.has_short, gold_short and p.has_short and _short_correct(ex, p),
                            p.short_score))
    return long_stats, short_stats, n_missing


def nq_evaluate(gold_examples: Sequence[NQExample], predictions: Union[Mapping, list],
                source: Union[str, Path] = "<predictions>", *, long_non_null_threshold: int = 2,
                short_non_null_threshold: int = 2) -> dict[str, float]:
    """Official long/short P/R/F1 (percent) with F1-optimal thresholds, plus Kaggle micro-F1.

    An example without a prediction counts as a null prediction (and how many there were is
    printed on stderr); a prediction for an example not in the gold set is an error (it means
    the files do not belong together).
    """
    long_stats, short_stats, n_missing = _example_stats(gold_examples, predictions, source,
                                                        long_non_null_threshold, short_non_null_threshold)
    if n_missing:
        print(f"warning: {n_missing} of {len(gold_examples)} gold examples have no prediction; counted as null",
              file=sys.stderr)

    result: dict[str, float] = {"n_examples": float(len(gold_examples))}
    tp = fp = fn = 0
    for name, stats in (("long", long_stats), ("short", short_stats)):
        f1, p, r, thr = best_threshold(stats)
        result.update({f"{name}_precision": 100 * p, f"{name}_recall": 100 * r, f"{name}_f1": 100 * f1,
                       f"{name}_threshold": float(thr), f"{name}_n_gold": float(sum(s[0] for s in stats))})
        for has_gold, has_pred, ok, score in stats:
            answered = has_pred and score >= thr
            if answered and ok:
                tp += 1
            elif answered:
                fp += 1
            elif has_gold:
                fn += 1
    mp = tp / (tp + fp) if tp + fp else 0.0
    mr = tp / (tp + fn) if tp + fn else 0.0
    result.update({"micro_precision": 100 * mp, "micro_recall": 100 * mr,
                   "micro_f1": 100 * (2 * mp * mr / (mp + mr) if mp + mr else 0.0),
                   "micro_tp": float(tp), "micro_fp": float(fp), "micro_fn": float(fn)})
    return result


# Columns of question_scores, per answer kind: has gold, answered (above the threshold),
# answered correctly, gold but not answered.
_KIND_COLUMNS = 4


def question_scores(gold_examples: Sequence[NQExample], predictions: Union[Mapping, list], *,
                    long_non_null_threshold: int = 2, short_non_null_threshold: int = 2):
    """[examples, 8] per-example counts (long then short: gold, answered, correct, gold-unanswered)
    at this run's own F1-optimal thresholds; ``metrics_from_sums`` of their column sums gives
    ``nq_evaluate``'s long_f1, short_f1 and micro_f1. The bootstrap holds the thresholds fixed
    (re-optimizing them per resample would widen the interval slightly)."""
    long_stats, short_stats, _ = _example_stats(gold_examples, predictions, "<predictions>",
                                                long_non_null_threshold, short_non_null_threshold)
    out = np.zeros((len(gold_examples), 2 * _KIND_COLUMNS), dtype=np.float64)
    for j, stats in enumerate((long_stats, short_stats)):
        thr = best_threshold(stats)[3]
        for i, (has_gold, has_pred, ok, score) in enumerate(stats):
            answered = has_pred and score >= thr
            out[i, j * _KIND_COLUMNS:(j + 1) * _KIND_COLUMNS] = (has_gold, answered, answered and ok,
                                                                 has_gold and not answered)
    return out


def metrics_from_sums(sums, n: int) -> dict:
    """long_f1, short_f1, micro_f1 (percent) from column sums of ``question_scores``."""
    s = np.asarray(sums, dtype=np.float64)

    def f1(p, r):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(p + r > 0, 2 * p * r / np.where(p + r > 0, p + r, 1.0), 0.0)

    def ratio(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(b > 0, a / np.where(b > 0, b, 1.0), 0.0)

    out = {}
    tp = fp = fn = 0.0
    for j, name in enumerate(("long", "short")):
        gold, answered, correct, missed = (s[..., j * _KIND_COLUMNS + c] for c in range(_KIND_COLUMNS))
        out[f"{name}_f1"] = 100 * f1(ratio(correct, answered), ratio(correct, gold))
        tp, fp, fn = tp + correct, fp + answered - correct, fn + missed
    out["micro_f1"] = 100 * f1(ratio(tp, tp + fp), ratio(tp, tp + fn))
    return out


def _is_parsed(predictions) -> bool:
    return isinstance(predictions, Mapping) and "predictions" not in predictions and all(
        isinstance(v, NQPrediction) for v in predictions.values())


def score_nq_files(gold_path: Union[str, Path], predictions_path: Union[str, Path], *,
                   long_non_null_threshold: int = 2, short_non_null_threshold: int = 2) -> dict[str, float]:
    """``bertqa-bench score-nq GOLD.jsonl[.gz] PREDICTIONS.json``: validate both files, then nq_evaluate."""
    gold_path, predictions_path = Path(gold_path), Path(predictions_path)
    gold = load_nq_jsonl(gold_path)
    for ex in gold:
        if not ex.annotations:
            raise DatasetFormatError(gold_path, f"example_id {ex.example_id}", "annotations",
                                     "missing or empty: a gold file needs annotations (is this a test split?)")
    if not predictions_path.is_file():
        raise FileNotFoundError(f"predictions file not found: {predictions_path}")
    try:
        obj = json.loads(predictions_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetFormatError(predictions_path, f"line {e.lineno}", "(json)",
                                 f"not valid JSON: {e.msg} at column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise DatasetFormatError(predictions_path, "(file)", "(file)", f"not UTF-8: {e.reason}") from None
    return nq_evaluate(gold, parse_predictions(obj, predictions_path), source=predictions_path,
                       long_non_null_threshold=long_non_null_threshold, short_non_null_threshold=short_non_null_threshold)
