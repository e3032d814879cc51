"""The official SQuAD v1.1 evaluation (evaluate-v1.1.py), plus file-level scoring.

``normalize_answer``, ``f1_score``, ``exact_match_score``, ``metric_max_over_ground_truths``
and ``evaluate_dataset`` reproduce the official script exactly (including its quirks: two
empty strings are an exact match but score F1 0), so numbers are comparable with published
SQuAD v1.1 results.
"""
from __future__ import annotations

import json
import logging
import re
import string
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ...errors import DatasetFormatError
from .types import QAExample

log = logging.getLogger(__name__)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


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


def _aggregate(items: Iterable[tuple[str, list[str]]], predictions: Mapping[str, str]) -> dict[str, float]:
    """items: (question id, gold answer texts). Unanswered questions count as 0, like the official script."""
    exact_match = f1 = 0.0
    total = missing = 0
    for qid, golds in items:
        total += 1
        if qid not in predictions:
            missing += 1
            continue
        prediction = predictions[qid]
        exact_match += metric_max_over_ground_truths(exact_match_score, prediction, golds)
        f1 += metric_max_over_ground_truths(f1_score, prediction, golds)
    if missing:
        log.warning("%d of %d questions have no prediction and score 0", missing, total)
    if total == 0:
        # The official script divides by zero here; an empty set simply scores 0.
        return {"exact_match": 0.0, "f1": 0.0}
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def squad_evaluate(examples: list[QAExample], predictions: Mapping[str, str]) -> dict[str, float]:
    """EM and F1 in percent over ``examples``; a question without a prediction scores 0."""
    return _aggregate(((ex.id, [a.text for a in ex.answers]) for ex in examples), predictions)


def evaluate_dataset(dataset, predictions: Mapping[str, str]) -> dict[str, float]:
    """Official ``evaluate(dataset, predictions)``; ``dataset`` is the whole JSON dict or its ``data`` list."""
    articles = dataset["data"] if isinstance(dataset, dict) else dataset
    items = ((qa["id"], [a["text"] for a in qa["answers"]])
             for article in articles for paragraph in article["paragraphs"] for qa in paragraph["qas"])
    return _aggregate(items, predictions)


def load_predictions(path) -> dict[str, str]:
    """A predictions file: one JSON object mapping question id -> answer text."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetFormatError(path, "<file>", "<json>",
                                 f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise DatasetFormatError(path, "<file>", "<encoding>", f"not UTF-8 text: {e}") from None
    if not isinstance(obj, dict):
        raise DatasetFormatError(path, "<top level>", "<predictions>",
                                 f"expected a JSON object mapping question id -> answer text, "
                                 f"got {type(obj).__name__}")
    for qid, text in obj.items():
        if not isinstance(text, str):
            raise DatasetFormatError(path, f"predictions['{qid}']", qid,
                                     f"answer must be a string, got {type(text).__name__}")
    return obj


def score_files(dataset_path, predictions_path) -> dict:
    """Score a predictions file against a SQuAD v1.1 dataset file (both validated first).

    Returns the official ``exact_match``/``f1`` plus counts that explain them: questions in the
    dataset, how many have a prediction, and predictions whose id is not in the dataset.
    """
    from .reader import read_json, validate_squad

    raw = read_json(dataset_path)
    examples = validate_squad(raw, dataset_path)
    predictions = load_predictions(predictions_path)
    ids = {ex.id for ex in examples}
    result: dict = evaluate_dataset(raw, predictions)
    result.update(n_questions=len(examples), n_answered=sum(qid in predictions for qid in ids),
                  n_unknown_ids=sum(qid not in ids for qid in predictions))
    return result
