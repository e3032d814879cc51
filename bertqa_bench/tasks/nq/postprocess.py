"""Backend outputs for every NQ window -> predictions in the official NQ format.

The BERT-joint rule (Alberti et al. 2019, google-research/language ``bert_joint``): per window
the top-k start and top-k end positions among context tokens (markers, question, special
tokens and padding are never picked); every pair with start <= end is scored
``start + end - ([CLS] start + [CLS] end)`` (the window's own null score). Pairs longer than
``max_answer_len`` word-pieces are dropped, except a pair whose first and last document
tokens are exactly the first and last in-context tokens of a long-answer candidate
(top-level or nested): the model is trained to point at whole candidates for long-only and
yes/no answers, and those are often longer than a short answer. The best pair over all the
example's windows is *the* answer span:

* Long answer: the top-level candidate containing that span (a span that coincides with a
  nested candidate — a list item, a table row — still gets its top-level list or table),
  scored with the span's score. A span inside no candidate at all gets no long answer.
* Answer type: the answer-type head of the window that produced the span decides. SHORT or
  UNKNOWN -> the span is the short answer (UNKNOWN is left to the score threshold, which the
  evaluator picks); YES/NO -> ``yes_no_answer`` with no short spans; LONG -> no short answer.
  A winning whole-candidate span longer than ``max_answer_len`` is never a short answer: it
  gives the long answer alone.

Scores are not thresholded here; ``long_answer_score``/``short_answers_score`` carry the
confidence for the evaluator's threshold sweep.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..features import Features
from .features import LONG, NO, YES
from .reader import NQExample

NULL_SCORE = -1e9  # score of an example with no scorable pair at all (empty context)
DEFAULT_TOP_K = 5


def null_span() -> dict:
    return {"start_token": -1, "end_token": -1, "start_byte": -1, "end_byte": -1}


def token_span(start: int, end: int) -> dict:
    return {"start_token": int(start), "end_token": int(end), "start_byte": -1, "end_byte": -1}


def _candidate_bounds(ex: NQExample, present: np.ndarray) -> set[tuple[int, int]]:
    """(first, last) in-context document token of every candidate, top-level or nested."""
    bounds: set[tuple[int, int]] = set()
    for c in ex.candidates:
        inside = np.flatnonzero(present[c.start_token:c.end_token])
        if inside.size:
            bounds.add((c.start_token + int(inside[0]), c.start_token + int(inside[-1])))
    return bounds


def _containing_candidate(ex: NQExample, start: int, end: int) -> Optional[int]:
    """Top-level candidate containing doc span [start, end); else the smallest containing one."""
    best = None
    for ci, c in enumerate(ex.candidates):
        if c.start_token <= start and end <= c.end_token:
            if c.top_level:
                return ci
            if best is None or (c.end_token - c.start_token) < (ex.candidates[best].end_token
                                                                 - ex.candidates[best].start_token):
                best = ci
    return best


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest finite entries, best first."""
    finite = np.flatnonzero(np.isfinite(x))
    if finite.size <= k:
        idx = finite
    else:
        idx = finite[np.argpartition(-x[finite], k - 1)[:k]]
    return idx[np.argsort(-x[idx], kind="stable")]


def postprocess_nq(examples: Sequence[NQExample], features: Features, start_logits: np.ndarray,
                   end_logits: np.ndarray, answer_type_logits: np.ndarray, *, top_k: int = DEFAULT_TOP_K,
                   max_answer_len: int = 30) -> dict:
    start_logits = np.asarray(start_logits, dtype=np.float32)
    end_logits = np.asarray(end_logits, dtype=np.float32)
    answer_type_logits = np.asarray(answer_type_logits, dtype=np.float32)
    # Backends run with per-batch padding may return fewer positions than the features hold.
    S = min(start_logits.shape[1], features.seq_len)
    t2d = features.extra["token_to_doc"][:, :S]

    by_example: dict[int, list[int]] = {}
    for f, e in enumerate(features.example_index.tolist()):
        by_example.setdefault(e, []).append(f)

    predictions = []
    for e, ex in enumerate(examples):
        feats = by_example.get(e, [])
        present = np.zeros(len(ex.document_tokens), dtype=bool)
        for f in feats:
            row = t2d[f]
            present[row[row >= 0]] = True
        bounds = _candidate_bounds(ex, present)

        best = None  # (score, doc start, doc end exclusive, feature, fits max_answer_len)
        for f in feats:
            row = t2d[f]
            valid = row >= 0
            if not valid.any():
                continue
            s_log, e_log = start_logits[f, :S], end_logits[f, :S]
            null = float(s_log[0] + e_log[0])
            starts = _top_k(np.where(valid, s_log, -np.inf), top_k)
            ends = _top_k(np.where(valid, e_log, -np.inf), top_k)
            for s in starts.tolist():
                for t in ends.tolist():
                    if t < s:
                        continue
                    ds, de = int(row[s]), int(row[t])
                    fits = t - s + 1 <= max_answer_len
                    if not fits and (ds, de) not in bounds:
                        continue
                    score = float(s_log[s] + e_log[t]) - null
                    if best is None or score > best[0]:
                        best = (score, ds, de + 1, f, fits)

        long_ans, long_score = null_span(), NULL_SCORE
        shorts, short_score, yes_no = [], NULL_SCORE, "NONE"
        if best is not None:
            score, ds, de, f, fits = best
            ci = _containing_candidate(ex, ds, de)
            if ci is not None:
                c = ex.candidates[ci]
                long_ans = token_span(c.start_token, c.end_token)
            long_score = short_score = score
            a_type = int(np.argmax(answer_type_logits[f]))
            if a_type in (YES, NO):
                yes_no = "YES" if a_type == YES else "NO"
            elif a_type != LONG and fits:
                shorts = [token_span(ds, de)]

        predictions.append({
            "example_id": ex.example_id,
            "long_answer": long_ans,
            "long_answer_score": float(long_score),
            "short_answers": shorts,
            "short_answers_score": float(short_score),
            "yes_no_answer": yes_no,
        })
    return {"predictions": predictions}
