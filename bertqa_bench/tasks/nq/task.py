"""NQTask: Natural Questions (simplified format) behind the Task interface.

Sources: ``nq-jsonl`` (official simplified jsonl, plain or .gz) and ``nq-synthetic`` (the
offline generator). Model: BERT-joint (span head + 5-way answer type). Metric: the official
NQ long/short P/R/F1 and the Kaggle micro-F1. Options (``task:`` section): see NQOptions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ...config import DataConfig, resolve_path
from ...errors import ConfigError
from ..base import Task
from ..features import Features
from .features import featurize_nq
from . import metrics
from .model import NQ_OUTPUTS, BertJointForNaturalQuestions
from .postprocess import postprocess_nq
from .reader import load_nq_jsonl
from .synthetic import ensure_nq_files


@dataclass
class NQOptions:
    top_k: int = 5  # start/end positions per window considered by postprocessing
    max_answer_len: int = 30  # short answers, word-pieces; long answers are whole candidates
    null_window_keep: float = 0.25  # share of answer-less training windows kept (0.02 for real NQ)
    markers: bool = True  # [Paragraph=N]/[Table=N]/[List=N] candidate markers in the context
    # The official evaluator's --long_non_null_threshold / --short_non_null_threshold: a gold
    # long (short) answer needs at least this many non-null annotations.
    long_non_null_threshold: int = 2
    short_non_null_threshold: int = 2

    def __post_init__(self):
        if self.top_k < 1 or self.max_answer_len < 1:
            raise ConfigError("task: top_k and max_answer_len must be >= 1")
        if not 0.0 <= float(self.null_window_keep) <= 1.0:
            raise ConfigError("task: null_window_keep must be in [0, 1]")
        if self.long_non_null_threshold < 1 or self.short_non_null_threshold < 1:
            raise ConfigError("task: long/short_non_null_threshold must be >= 1")


def _answer_key(pred: Mapping) -> tuple:
    la = pred.get("long_answer") or {}
    shorts = sorted((s.get("start_token", -1), s.get("end_token", -1)) for s in pred.get("short_answers") or [])
    return ((la.get("start_token", -1), la.get("end_token", -1)), tuple(shorts),
            str(pred.get("yes_no_answer", "NONE")).upper())


def _by_id(predictions: Any) -> dict[str, Mapping]:
    items = predictions["predictions"] if isinstance(predictions, Mapping) else predictions
    return {str(p["example_id"]): p for p in items}


class NQTask(Task):
    name = "nq"
    output_names = NQ_OUTPUTS
    metric_names = ("long_f1", "short_f1", "micro_f1")
    primary_metric = "micro_f1"
    metric_labels = {"long_f1": "Long F1", "short_f1": "Short F1", "micro_f1": "Micro-F1"}
    sources = ("nq-jsonl", "nq-synthetic")
    Options = NQOptions

    def model_class(self) -> type:
        return BertJointForNaturalQuestions

    def data_files(self, data: DataConfig, split: str) -> list[Path]:
        if data.source == "nq-synthetic":
            train, dev = ensure_nq_files(resolve_path(data.data_dir), data.synthetic)
            return [train if split == "train" else dev]
        f = data.train_file if split == "train" else data.dev_file
        if not f:
            raise ConfigError(f"data.{split}_file is not set for source nq-jsonl")
        return [resolve_path(f)]

    def load_examples(self, d: DataConfig, split: str) -> list:
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        # The cap is applied while reading: real NQ train is ~17 GB of jsonl.
        return load_nq_jsonl(self.data_files(d, split)[0], limit=cap or None)

    def featurize(self, examples, tokenizer, spec, *, train=False):
        d, o = spec.data, spec.options
        return featurize_nq(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=d.doc_stride,
                            max_query_len=d.max_query_len, train=train, markers=o.markers,
                            null_window_keep=o.null_window_keep, seed=spec.seed)

    def train_labels(self, features: Features) -> dict[str, np.ndarray]:
        if "answer_types" not in features.extra:
            raise ValueError("these features carry no answer_types: featurize them with train=True")
        return {**super().train_labels(features), "answer_types": features.extra["answer_types"]}

    def postprocess(self, examples, features, outputs, options):
        o = options
        return postprocess_nq(examples, features, outputs["start_logits"], outputs["end_logits"],
                              outputs["answer_type_logits"], top_k=o.top_k, max_answer_len=o.max_answer_len)

    def score_files(self, gold, predictions, long_non_null_threshold: int = 2, short_non_null_threshold: int = 2,
                    **_) -> dict:
        """The official NQ evaluator's long/short P/R/F1 and the micro-F1 of a predictions file."""
        return metrics.score_nq_files(gold, predictions, long_non_null_threshold=long_non_null_threshold,
                                      short_non_null_threshold=short_non_null_threshold)

    def score(self, examples, predictions, options):
        o = options
        return metrics.nq_evaluate(examples, predictions, long_non_null_threshold=o.long_non_null_threshold,
                                   short_non_null_threshold=o.short_non_null_threshold)

    def question_scores(self, examples, predictions, options):
        o = options
        return metrics.question_scores(examples, predictions, long_non_null_threshold=o.long_non_null_threshold,
                                       short_non_null_threshold=o.short_non_null_threshold)

    def metrics_from_sums(self, sums, n):
        return metrics.metrics_from_sums(sums, n)

    def agreement(self, predictions, reference):
        ref, pred = _by_id(reference), _by_id(predictions)
        same = sum(k in pred and _answer_key(pred[k]) == _answer_key(r) for k, r in ref.items())
        return same, len(ref)
