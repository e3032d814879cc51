"""The official SQuAD v1.1 evaluation (evaluate-v1.1.py), plus file-level scoring.

``normalize_answer``, ``f1_score``, ``exact_match_score``, ``metric_max_over_ground_truths``
and ``evaluate_dataset`` reproduce the official script exactly (including its quirks: two
empty strings are an exact match but score F1 0), so numbers are comparable with published
SQuAD v1.1 results.

``score_files`` (``bertqa-bench score``) reads a dataset file as leniently as the official script
(only question ids and answer texts matter; what the strict training reader would reject is
tolerated and reported on stderr) and keeps the official script's stderr messages.
"""
from __future__ import annotations

import logging
import re
import string
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from ...errors import DatasetFormatError
from .reader import read_json
from .types import QAExample

log = logging.getLogger(__name__)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
EXPECTED_VERSION = "1.1"


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def metric_max_over_ground_truths(metric_fn: Callable[[str, str], float], prediction: str,
                                  ground_truths: Iterable[str]) -> float:
    ground_truths = list(ground_truths)
    if not ground_truths:
        # The official script would crash on max([]); say which input is at fault instead.
        raise ValueError("a question has no gold answers (SQuAD v1.1 needs at least one)")
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def _aggregate(items: Iterable[tuple[str, list[str]]], predictions: Mapping[str, str],
               on_unanswered: Optional[Callable[[str], None]] = None) -> dict[str, float]:
    """items: (question id, gold answer texts). Unanswered questions count as 0, like the official script.

    ``on_unanswered(qid)`` is called for each question without a prediction (the official script
    prints "Unanswered question <id> will receive score 0." there); without it one summary is logged.
    """
    exact_match = f1 = 0.0
    total = missing = 0
    for qid, golds in items:
        total += 1
        if qid not in predictions:
            missing += 1
            if on_unanswered is not None:
                on_unanswered(qid)
            continue
        prediction = predictions[qid]
        exact_match += metric_max_over_ground_truths(exact_match_score, prediction, golds)
        f1 += metric_max_over_ground_truths(f1_score, prediction, golds)
    if missing and on_unanswered is None:
        log.warning("%d of %d questions have no prediction and score 0", missing, total)
    if total == 0:
        # The official script divides by zero here; an empty set simply scores 0.
        return {"exact_match": 0.0, "f1": 0.0}
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def squad_evaluate(examples: list[QAExample], predictions: Mapping[str, str]) -> dict[str, float]:
    """EM and F1 in percent over ``examples``; a question without a prediction scores 0."""
    return _aggregate(((ex.id, [a.text for a in ex.answers]) for ex in examples), predictions)


def question_scores(examples: list[QAExample], predictions: Mapping[str, str]):
    """[questions, 2] per-question (exact match, F1) in 0-1, in ``examples`` order: the terms whose
    means are ``squad_evaluate``'s scores (a missing prediction scores 0, as there)."""
    out = np.zeros((len(examples), 2), dtype=np.float64)
    for i, ex in enumerate(examples):
        if ex.id in predictions:
            golds = [a.text for a in ex.answers]
            out[i, 0] = metric_max_over_ground_truths(exact_match_score, predictions[ex.id], golds)
            out[i, 1] = metric_max_over_ground_truths(f1_score, predictions[ex.id], golds)
    return out


def evaluate_dataset(dataset, predictions: Mapping[str, str]) -> dict[str, float]:
    """Official ``evaluate(dataset, predictions)``; ``dataset`` is the whole JSON dict or its ``data`` list."""
    articles = dataset["data"] if isinstance(dataset, dict) else dataset
    items = ((qa["id"], [a["text"] for a in qa["answers"]])
             for article in articles for paragraph in article["paragraphs"] for qa in paragraph["qas"])
    return _aggregate(items, predictions)


class _PairsDict(dict):
    """A JSON object that remembers which keys it had more than once (json keeps the last value)."""

    duplicates: tuple = ()


def _pairs_hook(pairs: list) -> dict:
    d = _PairsDict(pairs)
    if len(d) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        d.duplicates = tuple(k for k, n in counts.items() if n > 1)
    return d


def _read_predictions_object(path: Path) -> dict:
    """The predictions file's top-level JSON object (values unchecked), as ``json.load`` reads it."""
    obj = read_json(path, object_pairs_hook=_pairs_hook)
    if not isinstance(obj, dict):
        raise DatasetFormatError(path, "<top level>", "<predictions>",
                                 f"expected a JSON object mapping question id -> answer text, "
                                 f"got {_type_name(obj)}")
    return obj


def load_predictions(path) -> dict[str, str]:
    """A predictions file: one JSON object mapping question id -> answer text (every value a string)."""
    path = Path(path)
    obj = _read_predictions_object(path)
    for qid, text in obj.items():
        if not isinstance(text, str):
            raise DatasetFormatError(path, f"predictions['{qid}']", _id_field(qid),
                                     f"answer must be a string, got {_type_name(text)}")
    return dict(obj)


def _id_field(qid: str) -> str:
    """The field of a prediction is its id; the empty id is shown as '' so the field is never blank."""
    return qid or "''"


# ---------------------------------------------------------------------------------------------
# Scoring a dataset file: as lenient as the official script.
#
# evaluate-v1.1.py reads dataset['data'][*]['paragraphs'][*]['qas'][*], and of each question only
# qa['id'] and [a['text'] for a in qa['answers']]. Everything the training reader also demands
# (context, question, answer_start aligned with the context, non-empty answers, unique ids) is
# irrelevant to the score, so scoring tolerates it and says so on stderr. What the official script
# cannot score (it would crash) stays an error naming file, record and field.

_TOLERATED = {
    # key: (how one instance is described, what scoring does with it)
    "no_context": ("paragraph(s) without a string 'context'", "answer_start not checked there"),
    "no_question": ("question(s) without a string 'question'", ""),
    "no_answer_start": ("answer(s) without an integer 'answer_start'", ""),
    "misaligned": ("answer(s) whose answer_start does not match the context", ""),
    "empty_text": ("empty answer text(s)", "an empty prediction matches them exactly"),
    "duplicate_id": ("duplicate question id(s)",
                     "every occurrence is scored against its own answers and counts in the total, "
                     "as the official script does"),
    "no_answers": ("question(s) with no gold answers and no prediction", "scored 0 as unanswered"),
    "unknown_non_string": ("prediction(s) for ids not in the dataset whose value is not a string", "ignored"),
    "duplicate_prediction": ("id(s) given more than once in the predictions file",
                             "the last value is used, as json.load does"),
}
_MAX_EXAMPLES = 3


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


@dataclass
class ScoringDataset:
    """What scoring reads from a dataset file: (id, gold texts, record) per question, in file order."""

    path: Path
    questions: list[tuple[str, list[str], str]] = field(default_factory=list)
    version: Any = None
    has_version: bool = False
    tolerated: dict[str, list[str]] = field(default_factory=dict)

    def note(self, key: str, example: str) -> None:
        self.tolerated.setdefault(key, []).append(example)


def read_scoring_dataset(path) -> ScoringDataset:
    """Read a SQuAD v1.1 dataset file the way evaluate-v1.1.py does: ids and answer texts only.

    Raises DatasetFormatError (file, record, field) for what the official script cannot score and
    for a file with no questions; records everything else it tolerates in ``.tolerated``.
    """
    path = Path(path)
    obj = read_json(path)
    ds = ScoringDataset(path)

    def fail(record, field_, reason):
        raise DatasetFormatError(path, record, field_, reason)

    def obj_at(value, record, what):
        if not isinstance(value, dict):
            fail(record, what, f"expected an object, got {_type_name(value)}")
        return value

    def typed_at(container, key, record, kind, kind_name, why=""):
        if key not in container:
            fail(record, key, "missing")
        value = container[key]
        if not isinstance(value, kind):
            fail(record, key, f"expected {kind_name}, got {_type_name(value)}{why}")
        return value

    def list_at(container, key, record):
        return typed_at(container, key, record, list, "a list")

    def str_at(container, key, record, why=""):
        return typed_at(container, key, record, str, "str", why)

    top = obj_at(obj, "<top level>", "<root>")
    ds.has_version, ds.version = "version" in top, top.get("version")
    seen: set[str] = set()
    for a, article in enumerate(list_at(top, "data", "<top level>")):
        rec_a = f"data[{a}]"
        article = obj_at(article, rec_a, "<article>")
        for p, paragraph in enumerate(list_at(article, "paragraphs", rec_a)):
            rec_p = f"{rec_a}.paragraphs[{p}]"
            paragraph = obj_at(paragraph, rec_p, "<paragraph>")
            context = paragraph.get("context")
            if not isinstance(context, str):
                context = None
                ds.note("no_context", rec_p)
            for q, qa in enumerate(list_at(paragraph, "qas", rec_p)):
                rec_q = f"{rec_p}.qas[{q}]"
                qa = obj_at(qa, rec_q, "<qa>")
                qid = str_at(qa, "id", rec_q, " (prediction keys are strings)")
                rec_q = f"{rec_q} (id '{qid}')"
                if qid in seen:
                    ds.note("duplicate_id", f"'{qid}'")
                seen.add(qid)
                if not isinstance(qa.get("question"), str):
                    ds.note("no_question", f"'{qid}'")
                texts = []
                for k, ans in enumerate(list_at(qa, "answers", rec_q)):
                    rec_k = f"{rec_q}.answers[{k}]"
                    ans = obj_at(ans, rec_k, "<answer>")
                    text = str_at(ans, "text", rec_k)
                    texts.append(text)
                    if not text:
                        ds.note("empty_text", f"'{qid}' answers[{k}]")
                    start = ans.get("answer_start")
                    if isinstance(start, bool) or not isinstance(start, int):
                        ds.note("no_answer_start", f"'{qid}' answers[{k}]")
                    elif context is not None and (start < 0 or context[start:start + len(text)] != text):
                        ds.note("misaligned", f"'{qid}' answers[{k}]")
                ds.questions.append((qid, texts, rec_q))
    if not ds.questions:
        fail("<top level>", "data", "no questions to score (the official script would divide by zero)")
    return ds


def warn_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def read_scoring_files(dataset_path, predictions_path):
    """What ``bertqa-bench score`` reads for a v1.1 or a v2.0 dataset: (dataset path, predictions
    path, the dataset's questions, the raw predictions object)."""
    dataset_path, predictions_path = Path(dataset_path), Path(predictions_path)
    return dataset_path, predictions_path, read_scoring_dataset(dataset_path), _read_predictions_object(predictions_path)


def score_files(dataset_path, predictions_path, *, warn: Optional[Callable[[str], None]] = None) -> dict:
    """Score a predictions file against a SQuAD v1.1 dataset file, accepting what evaluate-v1.1.py accepts.

    Returns the official ``exact_match``/``f1`` plus counts that explain them: questions in the
    dataset (every occurrence, the official denominator), how many of them have a prediction, and
    predictions whose id is not in the dataset. ``warn`` (default: print to stderr) receives the
    official script's per-question "Unanswered question ..." lines and one summary line of what was
    tolerated.
    """
    warn = warn or warn_stderr
    dataset_path, predictions_path, ds, raw_predictions = read_scoring_files(dataset_path, predictions_path)
    ids = {qid for qid, _, _ in ds.questions}
    predictions: dict[str, str] = {}
    for key, value in raw_predictions.items():
        if isinstance(value, str):
            predictions[key] = value
        elif key in ids:  # the official script would crash in normalize_answer
            raise DatasetFormatError(predictions_path, f"predictions['{key}']", _id_field(key),
                                     f"answer must be a string, got {_type_name(value)}")
        else:
            ds.note("unknown_non_string", f"'{key}'")
    for key in getattr(raw_predictions, "duplicates", ()):
        ds.note("duplicate_prediction", f"'{key}'")
    for qid, golds, record in ds.questions:
        if not golds:
            if qid in predictions:  # the official script crashes on max() of no scores
                raise DatasetFormatError(dataset_path, record, "answers",
                                         "empty: a question with a prediction needs at least one gold answer "
                                         "(SQuAD 2.0 unanswerable questions are not supported)")
            ds.note("no_answers", f"'{qid}'")

    if not ds.has_version:
        warn(f"warning: {dataset_path}: no 'version' field (the official script requires one); scored as v-1.1")
    elif not isinstance(ds.version, str):  # the official script would crash concatenating it
        warn(f"warning: {dataset_path}: 'version' is {ds.version!r:.40}, not a string; scored as v-1.1")
    elif ds.version != EXPECTED_VERSION:  # the official script's own message
        warn(f"Evaluation expects v-{EXPECTED_VERSION}, but got dataset with v-{ds.version}")
    if ds.tolerated:
        parts = []
        for key, (what, consequence) in _TOLERATED.items():
            examples = ds.tolerated.get(key)
            if examples:
                shown = ", ".join(examples[:_MAX_EXAMPLES]) + (", ..." if len(examples) > _MAX_EXAMPLES else "")
                parts.append(f"{len(examples)} {what} ({consequence + '; ' if consequence else ''}e.g. {shown})")
        warn(f"warning: {dataset_path}: tolerated " + "; ".join(parts))

    result: dict = _aggregate(((qid, golds) for qid, golds, _ in ds.questions), predictions,
                              on_unanswered=lambda qid: warn(f"Unanswered question {qid} will receive score 0."))
    result.update(n_questions=len(ds.questions),
                  n_answered=sum(qid in predictions for qid, _, _ in ds.questions),
                  n_unknown_ids=sum(key not in ids for key in raw_predictions))
    return result
