"""Start/end logits per window -> one answer text per question (run_qa.py's rule, vectorized).

For every window, the top ``n_best`` start and the top ``n_best`` end positions are paired;
a pair is kept when both tokens are context tokens, end >= start and the span is at most
``max_answer_len`` tokens. Its score is start_logit + end_logit, and a question's answer is
the best pair over all of its windows, cut from the context with the token offsets.
Like run_qa.py, candidates are picked before invalid ones are dropped, so question or
padding tokens with high logits use up n-best slots; ties go to the earlier window, then
the higher-ranked start, then the higher-ranked end.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..features import Features
from .types import QAExample

_CHUNK = 4096  # windows scored at once: the [chunk, n_best, n_best] score tensor stays small


def _top_indices(logits: np.ndarray, n: int) -> np.ndarray:
    """Row-wise indices of the n largest values, best first, ties to the lower index."""
    return np.argsort(-logits, axis=1, kind="stable")[:, :n]


def _is_context(offsets: list, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """offsets[row][col] is not None, for index arrays of any shape (only n-best cells are looked up)."""
    flat = [c < len(offsets[r]) and offsets[r][c] is not None for r, c in zip(rows.ravel(), cols.ravel())]
    return np.asarray(flat, dtype=bool).reshape(rows.shape)


def best_spans(features: Features, start_logits: np.ndarray, end_logits: np.ndarray, *,
               n_best: int = 20, max_answer_len: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window: (score, start token, end token) of its best valid span; score -inf when none."""
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    if start_logits.shape != end_logits.shape or start_logits.ndim != 2 or len(start_logits) != len(features):
        raise ValueError(f"logits of shape {start_logits.shape}/{end_logits.shape} do not match "
                         f"{len(features)} features")
    n = len(features)
    scores = np.full(n, -np.inf)
    starts = np.zeros(n, dtype=np.int64)
    ends = np.zeros(n, dtype=np.int64)
    k = min(n_best, start_logits.shape[1])
    for lo in range(0, n, _CHUNK):
        rows = np.arange(lo, min(lo + _CHUNK, n))
        s_idx = _top_indices(start_logits[rows], k)  # [r, k]
        e_idx = _top_indices(end_logits[rows], k)
        rr = rows[:, None]
        s_ok = _is_context(features.offsets, np.broadcast_to(rr, s_idx.shape), s_idx)
        e_ok = _is_context(features.offsets, np.broadcast_to(rr, e_idx.shape), e_idx)
        length = e_idx[:, None, :] - s_idx[:, :, None] + 1  # [r, k_start, k_end]
        valid = s_ok[:, :, None] & e_ok[:, None, :] & (length >= 1) & (length <= max_answer_len)
        pair = start_logits[rr, s_idx][:, :, None] + end_logits[rr, e_idx][:, None, :]
        # NaN logits (a broken backend) must not win over a real span of another window.
        pair = np.where(valid & ~np.isnan(pair), pair, -np.inf).reshape(len(rows), -1)
        best = np.argmax(pair, axis=1)  # first maximum = run_qa's stable-sort tie order
        scores[rows] = pair[np.arange(len(rows)), best]
        starts[rows] = s_idx[np.arange(len(rows)), best // k]
        ends[rows] = e_idx[np.arange(len(rows)), best % k]
    return scores, starts, ends


def postprocess_qa(examples: Sequence[QAExample], features: Features, start_logits, end_logits, *,
                   n_best: int = 20, max_answer_len: int = 30) -> dict[str, str]:
    """Question id -> predicted answer text ("" when no window offers a valid span)."""
    scores, starts, ends = best_spans(features, start_logits, end_logits, n_best=n_best,
                                      max_answer_len=max_answer_len)
    ex_index = np.asarray(features.example_index, dtype=np.int64)
    # Best window per example: order windows by (example, -score, window) and take each example's first.
    order = np.lexsort((np.arange(len(ex_index)), -scores, ex_index))
    first = np.ones(len(order), dtype=bool)
    first[1:] = ex_index[order][1:] != ex_index[order][:-1]
    predictions = {ex.id: "" for ex in examples}
    for f in order[first]:
        if np.isfinite(scores[f]):
            ex = examples[ex_index[f]]
            offs = features.offsets[f]
            predictions[ex.id] = ex.context[offs[starts[f]][0]:offs[ends[f]][1]]
    return predictions


def nbest_for_example(examples: Sequence[QAExample], features: Features, start_logits, end_logits,
                      example_idx: int, *, n_best: int = 20, max_answer_len: int = 30) -> list[dict]:
    """Up to n_best candidate answers for ``examples[example_idx]``, best first (for inspection).

    A plain loop over the same rule as postprocess_qa; entries hold text, score, start_logit,
    end_logit, feature (window index), start and end (token indices).
    """
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    example = examples[example_idx]
    k = min(n_best, start_logits.shape[1])
    candidates = []
    for f in np.flatnonzero(np.asarray(features.example_index) == example_idx):
        offs = features.offsets[f]
        for s in _top_indices(start_logits[f:f + 1], k)[0]:
            for e in _top_indices(end_logits[f:f + 1], k)[0]:
                if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                    continue
                if e < s or e - s + 1 > max_answer_len:
                    continue
                candidates.append({"text": example.context[offs[s][0]:offs[e][1]],
                                   "score": float(start_logits[f, s] + end_logits[f, e]),
                                   "start_logit": float(start_logits[f, s]), "end_logit": float(end_logits[f, e]),
                                   "feature": int(f), "start": int(s), "end": int(e)})
    candidates.sort(key=lambda c: c["score"], reverse=True)  # stable: keeps run_qa's tie order
    return candidates[:n_best]


class V2Predictions(dict):
    """Question id -> answer text ("" = no answer), with ``na_scores``: per question, the null
    score minus the best non-null span's score (run_qa's ``null_odds``, in logits), and
    ``na_probs``: the no-answer probabilities written for the official v2.0 evaluator's
    ``--na-prob-file`` (na_probability)."""

    na_scores: dict
    na_probs: dict

    def __init__(self, *a, na_scores: Optional[dict] = None, na_probs: Optional[dict] = None, **kw):
        super().__init__(*a, **kw)
        self.na_scores = dict(na_scores or {})
        self.na_probs = dict(na_probs or {})


def na_probability(na_score: float, threshold: float = 0.0) -> float:
    """The no-answer probability the official v2.0 evaluator reads: sigmoid(na_score - threshold).

    The evaluator takes probabilities: at its default ``--na-prob-thresh 1.0`` a question whose
    value is above 1.0 is scored as answered "" whatever its text. Raw null-score differences (up
    to ~16 on a trained model) would override text answers the suite gave whenever the suite's
    threshold lets a difference above 1 answer, and ``score --na-prob-file`` would then disagree
    with results.csv. A probability never exceeds 1.0, so at the defaults the evaluator keeps every
    answer as the suite decided it, and exact/F1/HasAns/NoAns are the suite's. The map is
    monotone, so ``best_exact``/``best_f1`` (one pass over the questions sorted by this value) are
    the ones the differences give, their thresholds in probability (a threshold t is the
    difference threshold + logit(t)); and 0.5 is the suite's own decision point: a question
    whose value is above 0.5 answers "" (so does one whose windows hold no valid span). Above
    a difference of ~37 past the threshold, float64 rounds the value to 1.0 (ties there keep the
    file's order, in the suite's scores and the evaluator's alike: both read these values)."""
    x = float(na_score) - float(threshold)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # no overflow for very negative x
    return e / (1.0 + e)


def postprocess_qa_v2(examples: Sequence[QAExample], features: Features, start_logits, end_logits, *,
                      n_best: int = 20, max_answer_len: int = 30,
                      null_score_diff_threshold: float = 0.0) -> V2Predictions:
    """SQuAD v2.0: the best non-null span (as ``postprocess_qa``) against the null answer, as
    run_qa's ``postprocess_qa_predictions(version_2_with_negative=True)`` decides.

    The null score of a question is the lowest ``start_logits[0] + end_logits[0]`` (the [CLS] /
    ``<s>`` token every featurizer here puts first) over its windows; its answer is "" when
    ``null score - best span score > null_score_diff_threshold``. A question whose windows offer no
    valid span answers "" (run_qa would answer the placeholder text "empty"); its na-score is
    then the null score against run_qa's placeholder span of score 0.
    """
    start = np.asarray(start_logits, dtype=np.float64)
    end = np.asarray(end_logits, dtype=np.float64)
    scores, starts, ends = best_spans(features, start, end, n_best=n_best, max_answer_len=max_answer_len)
    ex_index = np.asarray(features.example_index, dtype=np.int64)
    n_ex = len(examples)
    null = np.full(n_ex, np.inf)
    np.minimum.at(null, ex_index, start[:, 0] + end[:, 0])
    order = np.lexsort((np.arange(len(ex_index)), -scores, ex_index))
    first = np.ones(len(order), dtype=bool)
    first[1:] = ex_index[order][1:] != ex_index[order][:-1]
    best_feature = np.full(n_ex, -1)
    best_feature[ex_index[order[first]]] = order[first]
    out = V2Predictions()
    for i, ex in enumerate(examples):
        f = best_feature[i]
        span = float(scores[f]) if f >= 0 and np.isfinite(scores[f]) else None
        diff = float(null[i]) - (span if span is not None else 0.0)
        out.na_scores[ex.id] = diff
        out.na_probs[ex.id] = na_probability(diff, null_score_diff_threshold)
        if span is None or diff > null_score_diff_threshold:
            out[ex.id] = ""
        else:
            offs = features.offsets[f]
            out[ex.id] = ex.context[offs[starts[f]][0]:offs[ends[f]][1]]
    return out
