"""NQ examples -> model windows, BERT-joint style.

Context: the concatenation of the document's *top-level* long-answer candidates, HTML tokens
dropped (nested candidates lie inside top-level ones, and text outside every candidate can
never be a long answer, so neither is worth window space). Each top-level candidate is
preceded by one marker word-piece standing for ``[Paragraph=N]`` / ``[Table=N]`` /
``[List=N]`` / ``[Other=N]`` (type from the candidate's first tag, N its 1-based rank among
top-level candidates of that type, capped at 50) as in Alberti et al. 2019. The BERT
vocabulary has no such tokens and adding tokens would resize the embedding matrix of every
exported artifact, so markers reuse the reserved ``[unusedK]`` vocabulary entries
(K = type_index * 50 + N - 1). Tokenizers without ``[unused0..199]`` get no markers.

Mappings kept both ways: ``NQContext.piece_to_doc`` (word-piece -> document token, -1 for
markers) and ``doc_to_piece_start/end`` (document token -> first/last word-piece, -1 when the
token is HTML or outside every top-level candidate). Per feature, ``extra["token_to_doc"]``
maps each of the S positions to a document token (-1: question, special, marker, padding).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..features import Features
from .reader import Annotation, NQExample, is_html_token

MARKER_TYPES = ("Paragraph", "Table", "List", "Other")
MAX_MARKER_POSITION = 50

# answer_type labels of the BERT-joint answer-type head
UNKNOWN, YES, NO, SHORT, LONG = range(5)
ANSWER_TYPES = ("UNKNOWN", "YES", "NO", "SHORT", "LONG")

# BERT-joint keeps 2% of the answer-less windows of real NQ (~30 windows a document); the
# synthetic pages span 1-5 windows, where 2% would leave almost no null examples to learn
# "no answer" from. 0.25 keeps about one null window per five answer windows there
# (benchmarks/nq.yaml: 943 train windows). For real NQ set data.nq_null_window_keep: 0.02.
DEFAULT_NULL_WINDOW_KEEP = 0.25


def candidate_type(tokens: Sequence[str], start_token: int) -> str:
    first = tokens[start_token]
    if first == "<P>":
        return "Paragraph"
    if first == "<Table>":
        return "Table"
    if first in ("<Ul>", "<Ol>", "<Dl>"):
        return "List"
    return "Other"


def marker_token_ids(tokenizer) -> Optional[np.ndarray]:
    """[type, position-1] -> vocabulary id of the marker, or None when the vocab has no reserved tokens."""
    names = [f"[unused{t * MAX_MARKER_POSITION + p}]" for t in range(len(MARKER_TYPES))
             for p in range(MAX_MARKER_POSITION)]
    ids = tokenizer.convert_tokens_to_ids(names)
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        return None
    return np.asarray(ids, dtype=np.int64).reshape(len(MARKER_TYPES), MAX_MARKER_POSITION)


@dataclass
class NQContext:
    piece_ids: np.ndarray  # int64 [P]
    piece_to_doc: np.ndarray  # int32 [P], -1 for markers
    doc_to_piece_start: np.ndarray  # int32 [n_doc_tokens], -1 when not in the context
    doc_to_piece_end: np.ndarray  # int32 [n_doc_tokens], inclusive

    def piece_span(self, start_token: int, end_token: int) -> Optional[tuple[int, int]]:
        """Document span [start, end) -> inclusive word-piece span, or None if none of it is in the context."""
        inside = np.flatnonzero(self.doc_to_piece_start[start_token:end_token] >= 0)
        if inside.size == 0:
            return None
        return (int(self.doc_to_piece_start[start_token + inside[0]]),
                int(self.doc_to_piece_end[start_token + inside[-1]]))


def build_contexts(examples: Sequence[NQExample], tokenizer, *, markers: bool = True) -> list[NQContext]:
    marker_ids = marker_token_ids(tokenizer) if markers else None
    plans = []  # per example: (words, word_doc, candidate word ranges, marker ids)
    for ex in examples:
        toks = ex.document_tokens
        words, word_doc, ranges, mids = [], [], [], []
        counts = dict.fromkeys(MARKER_TYPES, 0)
        last_end = 0
        for c in ex.candidates:
            # Real NQ top-level candidates never overlap; the guard keeps a malformed file from
            # duplicating text (and doc->piece maps from being overwritten).
            if not c.top_level or c.start_token < last_end:
                continue
            last_end = c.end_token
            w0 = len(words)
            for d in range(c.start_token, c.end_token):
                if not is_html_token(toks[d]):
                    words.append(toks[d])
                    word_doc.append(d)
            if len(words) == w0:
                continue  # an all-markup candidate (empty table) gets no marker either
            kind = candidate_type(toks, c.start_token)
            counts[kind] = min(counts[kind] + 1, MAX_MARKER_POSITION)
            ranges.append((w0, len(words)))
            if marker_ids is not None:
                mids.append(int(marker_ids[MARKER_TYPES.index(kind), counts[kind] - 1]))
        plans.append((words, word_doc, ranges, mids))

    # One batched call: the Rust tokenizer is fast, per-word Python calls are not.
    batch = [p[0] if p[0] else ["."] for p in plans]
    enc = tokenizer(batch, is_split_into_words=True, add_special_tokens=False, verbose=False)

    out = []
    for b, (ex, (words, word_doc, ranges, mids)) in enumerate(zip(examples, plans)):
        n_doc = len(ex.document_tokens)
        d2s = np.full(n_doc, -1, dtype=np.int32)
        d2e = np.full(n_doc, -1, dtype=np.int32)
        if not words:
            out.append(NQContext(np.zeros(0, np.int64), np.zeros(0, np.int32), d2s, d2e))
            continue
        ids = np.asarray(enc["input_ids"][b], dtype=np.int64)
        wid = np.asarray(enc.word_ids(b), dtype=np.int64)
        # piece range of word w = [first[w], first[w+1])
        first = np.searchsorted(wid, np.arange(len(words) + 1), side="left")
        word_doc_a = np.asarray(word_doc, dtype=np.int32)
        parts_ids, parts_doc = [], []
        for k, (w0, w1) in enumerate(ranges):
            if mids:
                parts_ids.append(np.asarray([mids[k]], dtype=np.int64))
                parts_doc.append(np.asarray([-1], dtype=np.int32))
            p0, p1 = first[w0], first[w1]
            parts_ids.append(ids[p0:p1])
            parts_doc.append(word_doc_a[wid[p0:p1]])
        piece_ids = np.concatenate(parts_ids)
        p2d = np.concatenate(parts_doc)
        pos = np.arange(len(p2d), dtype=np.int32)
        real = p2d >= 0
        # first piece of a token = smallest position mapping to it; pieces of a token are contiguous
        d2s_rev = np.full(n_doc, np.iinfo(np.int32).max, dtype=np.int64)
        np.minimum.at(d2s_rev, p2d[real], pos[real])
        d2e_all = np.full(n_doc, -1, dtype=np.int64)
        np.maximum.at(d2e_all, p2d[real], pos[real])
        has = d2e_all >= 0
        d2s[has] = d2s_rev[has]
        d2e[has] = d2e_all[has]
        out.append(NQContext(piece_ids, p2d, d2s, d2e))
    return out


def target_of(annotation: Optional[Annotation]) -> tuple[int, Optional[tuple[int, int]]]:
    """Training target of one annotation: (answer_type, document span [start, end) or None).

    As BERT-joint: YES/NO point at the long answer, several short answers merge into one span
    from the first start to the last end, long-only points at the candidate.
    """
    if annotation is None:
        return UNKNOWN, None
    if annotation.yes_no_answer in ("YES", "NO") and annotation.has_long:
        return (YES if annotation.yes_no_answer == "YES" else NO), (annotation.long_start, annotation.long_end)
    if annotation.short_answers:
        return SHORT, (min(s for s, _ in annotation.short_answers), max(e for _, e in annotation.short_answers))
    if annotation.has_long:
        return LONG, (annotation.long_start, annotation.long_end)
    return UNKNOWN, None


class DocTokenOffsets(Sequence):
    """``Features.offsets`` for NQ, built on demand from ``token_to_doc``.

    Entry [i][t] is (d, d + 1) for document token d (units: document tokens, not characters)
    or None. Materializing tuples for every position of a real NQ dev set would cost GBs.
    """

    def __init__(self, token_to_doc: np.ndarray):
        self._t2d = token_to_doc

    def __len__(self) -> int:
        return len(self._t2d)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return [(int(d), int(d) + 1) if d >= 0 else None for d in self._t2d[i]]


def featurize_nq(examples: Sequence[NQExample], tokenizer, *, max_seq_len: int, doc_stride: int,
                 max_query_len: int, train: bool = False, markers: bool = True,
                 null_window_keep: float = DEFAULT_NULL_WINDOW_KEEP, seed: int = 0,
                 contexts: Optional[list[NQContext]] = None) -> Features:
    """``[CLS] question [SEP] context-window [SEP]`` features, windows ``doc_stride`` pieces apart.

    Training: start/end positions (0 = [CLS] when the target span is not wholly inside the
    window) and ``extra["answer_types"]``; answer-less windows are kept with probability
    ``null_window_keep`` (seeded, so the same features every run).
    """
    if contexts is None:
        contexts = build_contexts(examples, tokenizer, markers=markers)
    questions = tokenizer([ex.question for ex in examples], add_special_tokens=False, truncation=True,
                          max_length=max_query_len, verbose=False)["input_ids"]
    cls_id, sep_id, pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id or 0
    rng = np.random.default_rng(seed)

    rows_ids, rows_t2d, rows_type, ex_index, starts, ends, types = [], [], [], [], [], [], []
    for i, (ex, ctx, q) in enumerate(zip(examples, contexts, questions)):
        q = list(q)
        n_ctx = max_seq_len - len(q) - 3
        if n_ctx < 1:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for the context after a "
                             f"{len(q)}-piece question; lower data.max_query_len")
        P = len(ctx.piece_ids)
        offset = len(q) + 2  # context position 0 sits at this sequence position
        a_type, piece_target = UNKNOWN, None
        if train:
            a_type, span = target_of(ex.annotations[0] if ex.annotations else None)
            piece_target = ctx.piece_span(*span) if span else None
            if piece_target is None:
                a_type = UNKNOWN

        w_start = 0
        while True:
            w_len = min(P - w_start, n_ctx)
            label = (0, 0, UNKNOWN)
            if piece_target is not None and w_start <= piece_target[0] and piece_target[1] < w_start + w_len:
                label = (piece_target[0] - w_start + offset, piece_target[1] - w_start + offset, a_type)
            keep = not train or label[2] != UNKNOWN or rng.random() < null_window_keep
            if keep:
                seq = np.full(max_seq_len, pad_id, dtype=np.int64)
                t2d = np.full(max_seq_len, -1, dtype=np.int32)
                tt = np.zeros(max_seq_len, dtype=np.int64)
                seq[0] = cls_id
                seq[1:1 + len(q)] = q
                seq[1 + len(q)] = sep_id
                seq[offset:offset + w_len] = ctx.piece_ids[w_start:w_start + w_len]
                seq[offset + w_len] = sep_id
                t2d[offset:offset + w_len] = ctx.piece_to_doc[w_start:w_start + w_len]
                tt[offset:offset + w_len + 1] = 1
                rows_ids.append(seq)
                rows_t2d.append(t2d)
                rows_type.append(tt)
                ex_index.append(i)
                starts.append(label[0])
                ends.append(label[1])
                types.append(label[2])
            if w_start + w_len >= P:
                break
            w_start += min(w_len, doc_stride)

    n = len(rows_ids)
    input_ids = np.stack(rows_ids) if n else np.zeros((0, max_seq_len), np.int64)
    token_to_doc = np.stack(rows_t2d) if n else np.zeros((0, max_seq_len), np.int32)
    token_type_ids = np.stack(rows_type) if n else np.zeros((0, max_seq_len), np.int64)
    attention_mask = (np.arange(max_seq_len)[None, :] < _lengths(input_ids, sep_id)[:, None]).astype(np.int64)
    feats = Features(
        input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
        example_index=np.asarray(ex_index, dtype=np.int64), offsets=DocTokenOffsets(token_to_doc),
        extra={"token_to_doc": token_to_doc},
    )
    if train:
        feats.start_positions = np.asarray(starts, dtype=np.int64)
        feats.end_positions = np.asarray(ends, dtype=np.int64)
        feats.extra["answer_types"] = np.asarray(types, dtype=np.int64)
    return feats


def _lengths(input_ids: np.ndarray, sep_id: int) -> np.ndarray:
    """Real length = position after the last [SEP] (padding id may equal a real id in odd vocabs)."""
    if len(input_ids) == 0:
        return np.zeros(0, np.int64)
    S = input_ids.shape[1]
    last_sep = S - 1 - np.argmax((input_ids == sep_id)[:, ::-1], axis=1)
    return last_sep + 1
