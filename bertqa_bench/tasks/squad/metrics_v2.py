"""The official SQuAD v2.0 evaluation (evaluate-v2.0.py), for examples and for files.

Numbers match the official script's, quirks included, so they compare with published v2.0
results:

* a gold answer that normalizes to nothing is dropped; a question left without gold answers
  (unanswerable) has the single gold answer "";
* F1 of an empty prediction or gold is 1 when both are empty, else 0 (unlike v1.1, where two
  empty strings score F1 0);
* ``--na-prob-thresh`` (default 1.0): a question whose no-answer probability is above it is
  scored as answered "" whatever the text;
* with a no-answer-probability file, ``best_exact``/``best_f1`` and their thresholds come from
  one pass over the questions sorted by that probability (stable: ties keep the file's order),
  a threshold recorded only where the running score strictly improves;
* the denominator is the questions that have a prediction (the official script skips a missing
  one with a message; its HasAns/NoAns breakdown would then crash, so a file-level score
  refuses a missing prediction with a named error instead).

``normalize_answer`` is v1.1's (metrics.py): the same function in both official scripts.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from ...errors import DatasetFormatError
from .metrics import normalize_answer, read_scoring_files, warn_stderr
from .reader import read_json


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def exact_v2(gold: str, pred: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(pred))


def f1_v2(gold: str, pred: str) -> float:
    g, p = _tokens(gold), _tokens(pred)
    if not g or not p:  # a no-answer on either side: 1 if both are, else 0
        return float(g == p)
    same = sum((Counter(g) & Counter(p)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def raw_scores(items: Iterable[tuple[str, list[str]]], predictions: Mapping[str, str],
               on_missing: Optional[Callable[[str], None]] = None) -> tuple[dict, dict, dict]:
    """(exact, f1, has_answer) per question id; questions without a prediction are skipped."""
    exact, f1, has_ans = {}, {}, {}
    for qid, golds in items:
        has_ans[qid] = bool(golds)
        kept = [g for g in golds if normalize_answer(g)] or [""]
        if qid not in predictions:
            if on_missing is not None:
                on_missing(qid)
            continue
        pred = predictions[qid]
        exact[qid] = max(exact_v2(g, pred) for g in kept)
        f1[qid] = max(f1_v2(g, pred) for g in kept)
    return exact, f1, has_ans


def _threshold(scores: dict, na_probs: Mapping[str, float], has_ans: dict, thresh: float) -> dict:
    return {qid: float(not has_ans[qid]) if na_probs[qid] > thresh else s for qid, s in scores.items()}


def _block(exact: dict, f1: dict, qids: list) -> dict:
    n = len(qids)
    return {"exact": 100.0 * sum(exact[q] for q in qids) / n, "f1": 100.0 * sum(f1[q] for q in qids) / n, "total": n}


def _best(predictions: Mapping[str, str], scores: dict, na_probs: Mapping[str, float], has_ans: dict):
    # start from "answer nothing": every unanswerable question right, every answerable one wrong
    score = best = sum(1 for v in has_ans.values() if not v)
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        score += scores[qid] if has_ans[qid] else (-1 if predictions[qid] else 0)
        if score > best:
            best, best_thresh = score, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def evaluate_v2(items: Iterable[tuple[str, list[str]]], predictions: Mapping[str, str],
                na_probs: Optional[Mapping[str, float]] = None, na_prob_thresh: float = 1.0,
                on_missing: Optional[Callable[[str], None]] = None) -> dict:
    """The official v2.0 result dict: exact, f1, total, HasAns_*, NoAns_*, and with ``na_probs``
    best_exact(_thresh), best_f1(_thresh). ``items``: (question id, gold answer texts)."""
    items = list(items)
    exact_raw, f1_raw, has_ans = raw_scores(items, predictions, on_missing)
    if not exact_raw:
        return {"exact": 0.0, "f1": 0.0, "total": 0}
    probs = dict(na_probs) if na_probs is not None else {k: 0.0 for k in predictions}
    exact = _threshold(exact_raw, probs, has_ans, na_prob_thresh)
    f1 = _threshold(f1_raw, probs, has_ans, na_prob_thresh)
    out = _block(exact, f1, list(exact))
    for prefix, want in (("HasAns", True), ("NoAns", False)):
        qids = [q for q, v in has_ans.items() if v is want]
        if qids:
            out.update({f"{prefix}_{k}": v for k, v in _block(exact, f1, qids).items()})
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = _best(predictions, exact_raw, probs, has_ans)
        out["best_f1"], out["best_f1_thresh"] = _best(predictions, f1_raw, probs, has_ans)
    return out


def squad_v2_evaluate(examples, predictions: Mapping[str, str], na_probs: Optional[Mapping[str, float]] = None) -> dict:
    """The suite's view for a v2.0 evaluation set: ``exact_match`` and ``f1`` (the official
    ``exact``/``f1``, under the names every table uses) plus the official HasAns_/NoAns_ keys."""
    res = evaluate_v2(((ex.id, [a.text for a in ex.answers]) for ex in examples), predictions, na_probs)
    out = {"exact_match": res.pop("exact"), "f1": res.pop("f1")}
    out.update({k: float(v) for k, v in res.items() if k != "total"})
    return out


def question_scores_v2(examples, predictions: Mapping[str, str]):
    """[questions, 2] per-question (exact, F1) in 0-1, in ``examples`` order: the terms whose
    means are ``squad_v2_evaluate``'s exact_match and f1 (parity's paired bootstrap resamples
    them). A missing prediction scores 0."""
    exact, f1, _ = raw_scores(((ex.id, [a.text for a in ex.answers]) for ex in examples), predictions)
    return np.array([[exact.get(ex.id, 0.0), f1.get(ex.id, 0.0)] for ex in examples], dtype=np.float64).reshape(-1, 2)


def _read_na_probs(path: Path) -> dict:
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise DatasetFormatError(path, "<top level>", "<na probs>", "expected a JSON object: question id -> number")
    for k, v in obj.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise DatasetFormatError(path, f"na_probs['{k}']", k or "''", f"expected a number, got {type(v).__name__}")
    return obj


def score_v2_files(dataset_path, predictions_path, *, na_prob_file=None, na_prob_thresh: float = 1.0,
                   warn: Optional[Callable[[str], None]] = None) -> dict:
    """``bertqa-bench score`` on a v2.0 dataset: the official script's keys, in its order."""
    warn = warn or warn_stderr
    dataset_path, predictions_path, ds, raw = read_scoring_files(dataset_path, predictions_path)
    ids = [qid for qid, _, _ in ds.questions]
    for qid, _, record in ds.questions:
        if qid not in raw:
            raise DatasetFormatError(predictions_path, f"predictions['{qid}']", qid or "''",
                                     f"missing: the v2.0 evaluator scores complete files only (question at {record}; "
                                     "for an unanswerable one predict \"\")")
        if not isinstance(raw[qid], str):
            raise DatasetFormatError(predictions_path, f"predictions['{qid}']", qid or "''",
                                     f"answer must be a string, got {type(raw[qid]).__name__}")
    predictions = {k: v for k, v in raw.items() if isinstance(v, str)}
    na_probs = None
    if na_prob_file:
        na_path = Path(na_prob_file)
        na_probs = _read_na_probs(na_path)
        missing = [q for q in ids if q not in na_probs]
        if missing:
            raise DatasetFormatError(na_path, f"na_probs['{missing[0]}']", missing[0] or "''",
                                     f"missing ({len(missing)} question(s) have no no-answer probability)")
    # official: gold texts per question, in file order (a repeated id keeps its last occurrence)
    items: dict[str, list[str]] = {}
    for qid, golds, _ in ds.questions:
        items[qid] = golds
    extra = [k for k in predictions if k not in items]
    if extra:
        warn(f"warning: {predictions_path}: {len(extra)} prediction(s) for ids not in the dataset (e.g. {extra[0]!r})")
    return evaluate_v2(items.items(), predictions, na_probs, na_prob_thresh)
