"""Examples -> fixed-length model windows ("features"), the way Hugging Face's run_qa.py does it.

Each input is ``[CLS] question [SEP] context-window [SEP] [PAD]...``. A context longer than
one window is split into several overlapping windows.

``doc_stride`` follows run_qa.py: it is passed to the tokenizer as ``stride``, which is the
number of context tokens two consecutive windows SHARE (the overlap), not the step between
window starts as in the original google-research run_squad.py. With max_seq_len=384 and
doc_stride=128, SQuAD v1.1 dev gives the 10784 features that HF-based reports quote.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..features import Features
from .types import Answer, QAExample

_CHUNK = 1024  # examples per tokenizer call: batched for speed, bounded for memory


def _max_question_tokens(tokenizer, max_seq_len: int, doc_stride: int, max_query_len: int) -> int:
    # The tokenizer refuses to window a context when fewer than stride+1 context tokens fit,
    # so a long question is cut harder than max_query_len when the window is small.
    room = max_seq_len - tokenizer.num_special_tokens_to_add(pair=True) - doc_stride - 1
    if room < 1:
        raise ValueError(f"max_seq_len={max_seq_len} leaves no room for a question next to "
                         f"doc_stride={doc_stride} overlapping context tokens")
    return min(max_query_len, room)


def truncate_questions(questions: Sequence[str], tokenizer, max_tokens: int) -> list[str]:
    """Cut each question to its first ``max_tokens`` tokens (original BERT's max_query_length).

    Cutting the text at a token's end offset keeps the cut on a token boundary, so the
    shortened question re-tokenizes to exactly those tokens.
    """
    enc = tokenizer(list(questions), add_special_tokens=False, return_offsets_mapping=True)
    return [q if len(offs) <= max_tokens else q[:offs[max_tokens - 1][1]]
            for q, offs in zip(questions, enc["offset_mapping"])]


def answer_token_span(offsets: list, start_char: int, end_char: int) -> tuple[int, int]:
    """Token indices of the answer [start_char, end_char) inside one window; (0, 0) = [CLS]
    when the answer is not fully inside the window's context (run_qa.py's rule)."""
    ctx = [t for t, o in enumerate(offsets) if o is not None]
    if not ctx:
        return 0, 0
    first, last = ctx[0], ctx[-1]
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return 0, 0
    s = first
    while s <= last and offsets[s][0] <= start_char:
        s += 1
    e = last
    while e >= first and offsets[e][1] >= end_char:
        e -= 1
    return s - 1, e + 1


def tokenize_examples(examples: Sequence[QAExample], tokenizer, *, max_seq_len: int = 384,
                      doc_stride: int = 128, max_query_len: int = 64, train: bool = False) -> Features:
    """Tokenize question/context pairs into windows of ``max_seq_len`` tokens.

    ``doc_stride`` is the overlap in tokens between consecutive windows of one context (HF
    semantics, see the module docstring). Questions are cut to ``max_query_len`` tokens.
    With ``train=True`` the first answer's token span is set per window (0/0 = [CLS] where
    the window does not hold the whole answer).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("a fast (Rust) tokenizer is required: offsets and overflow windows come from it")
    q_cap = _max_question_tokens(tokenizer, max_seq_len, doc_stride, max_query_len)

    ids, mask, types, example_index, offsets = [], [], [], [], []
    for lo in range(0, len(examples), _CHUNK):
        chunk = examples[lo:lo + _CHUNK]
        # run_qa.py strips leading whitespace: some tokenizers turn it into tokens.
        questions = truncate_questions([ex.question.lstrip() for ex in chunk], tokenizer, q_cap)
        enc = tokenizer(questions, [ex.context for ex in chunk], truncation="only_second",
                        max_length=max_seq_len, stride=doc_stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, return_token_type_ids=True, padding="max_length")
        ids.extend(enc["input_ids"])
        mask.extend(enc["attention_mask"])
        types.extend(enc["token_type_ids"])
        example_index.extend(lo + j for j in enc["overflow_to_sample_mapping"])
        for i, row in enumerate(enc["offset_mapping"]):
            offsets.append([tuple(o) if s == 1 else None for o, s in zip(row, enc.sequence_ids(i))])

    def as_array(rows) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64).reshape(len(rows), max_seq_len)

    type_ids = as_array(types)
    if "token_type_ids" not in tokenizer.model_input_names:
        # run_qa passes only what the tokenizer returns: a tokenizer that does not take segment ids
        # (RoBERTa, ALBERT) leaves the model its default, all zeros. The array stays (one input
        # layout for every backend); QAModule drops it for models without the argument.
        type_ids = np.zeros_like(type_ids)
    features = Features(input_ids=as_array(ids), attention_mask=as_array(mask), token_type_ids=type_ids,
                        example_index=np.asarray(example_index, dtype=np.int64), offsets=offsets)
    if train:
        features.start_positions, features.end_positions = _train_positions(examples, features)
    return features


def _train_positions(examples: Sequence[QAExample], features: Features) -> tuple[np.ndarray, np.ndarray]:
    starts = np.zeros(len(features), dtype=np.int64)
    ends = np.zeros(len(features), dtype=np.int64)
    for i, (ex_i, offs) in enumerate(zip(features.example_index, features.offsets)):
        answer = _first_answer(examples[ex_i])
        if answer is not None:
            starts[i], ends[i] = answer_token_span(offs, answer.answer_start, answer.answer_start + len(answer.text))
    return starts, ends


def _first_answer(example: QAExample) -> Optional[Answer]:
    return example.answers[0] if example.answers else None
