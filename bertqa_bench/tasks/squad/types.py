"""SQuAD records: a question over a context, with its gold answers."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    text: str
    answer_start: int  # character offset into the context


@dataclass(frozen=True)
class QAExample:
    """One SQuAD-style question over one context."""

    id: str
    question: str
    context: str
    answers: tuple[Answer, ...] = ()
    title: str = ""
    # SQuAD v2.0: a question the context does not answer (answers empty), with the spans
    # annotators found plausible (distractors; never gold). ``version_2``: read from a v2.0 file,
    # so postprocessing may answer "" (no answer) and scoring is the v2.0 evaluator's.
    is_impossible: bool = False
    plausible_answers: tuple[Answer, ...] = ()
    version_2: bool = False
