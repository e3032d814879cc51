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
