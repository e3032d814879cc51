"""SquadTask: SQuAD v1.1 and v2.0 (and files in their format) behind the Task interface.

Sources: ``synthetic`` (the seeded offline generator), ``squad-json`` (official files),
``hf`` (``datasets.load_dataset(data.hf_name)``, e.g. squad or squad_v2). Model: any encoder
family's span head (AutoModelForQuestionAnswering). Outputs: start/end logits. Metric: the
official v1.1 EM/F1, or on v2.0 data the official v2.0 evaluator's (no-answer postprocessing
with ``null_score_diff_threshold``). Options (``task:`` section): postprocessing's ``n_best``,
``max_answer_len``, ``null_score_diff_threshold`` and ``version_2``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...config import DataConfig, resolve_path
from ...errors import ConfigError
from ..base import Task
from .features import tokenize_examples
from . import metrics, reader
from .metrics_v2 import question_scores_v2, score_v2_files, squad_v2_evaluate
from .postprocess import postprocess_qa, postprocess_qa_v2
from .reader import load_squad_hf, load_squad_json, read_json
from .synthetic import ensure_squad_files


@dataclass
class SquadOptions:
    n_best: int = 20  # start and end candidates per window (run_qa.py's n_best_size)
    max_answer_len: int = 30  # tokens
    # SQuAD v2.0: answer "" when the null score beats the best span by more than this (run_qa's
    # null_score_diff_threshold, in logits)
    null_score_diff_threshold: float = 0.0
    # v2.0 postprocessing and scoring: None = as the data says (a v2.0 file or squad_v2), or force
    version_2: Optional[bool] = None

    def __post_init__(self):
        if self.n_best < 1 or self.max_answer_len < 1:
            raise ConfigError("task: n_best and max_answer_len must be >= 1")
        self.null_score_diff_threshold = float(self.null_score_diff_threshold)


class SquadTask(Task):
    name = "squad"
    output_names = ("start_logits", "end_logits")
    metric_names = ("exact_match", "f1")
    primary_metric = "f1"
    metric_labels = {"exact_match": "EM", "f1": "F1"}
    sources = ("synthetic", "squad-json", "hf")
    Options = SquadOptions

    def model_class(self) -> type:
        # Any encoder family's span head (BERT, RoBERTa, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2):
        # a folder saved by BertForQuestionAnswering loads back as that class.
        from transformers import AutoModelForQuestionAnswering

        return AutoModelForQuestionAnswering

    def data_files(self, data: DataConfig, split: str) -> list[Path]:
        if data.source == "synthetic":
            train, dev = ensure_squad_files(resolve_path(data.data_dir), data.synthetic)
            return [train if split == "train" else dev]
        if data.source == "squad-json":
            f = data.train_file if split == "train" else data.dev_file
            if not f:
                raise ConfigError(f"data.{split}_file is not set for source squad-json")
            return [resolve_path(f)]
        return []

    def load_examples(self, d: DataConfig, split: str) -> list:
        files = self.data_files(d, split)
        if files:
            examples = load_squad_json(files[0])
        else:
            examples = load_squad_hf(d.hf_name, "train" if split == "train" else "validation")
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        return examples[:cap] if cap else examples

    def featurize(self, examples, tokenizer, spec, *, train=False):
        d = spec.data
        return tokenize_examples(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=d.doc_stride,
                                 max_query_len=d.max_query_len, train=train)

    @staticmethod
    def is_v2(examples, options) -> bool:
        forced = getattr(options, "version_2", None)
        return bool(forced) if forced is not None else any(ex.version_2 or ex.is_impossible for ex in examples)

    def postprocess(self, examples, features, outputs, options):
        o = options
        if self.is_v2(examples, o):
            return postprocess_qa_v2(examples, features, outputs["start_logits"], outputs["end_logits"],
                                     n_best=o.n_best, max_answer_len=o.max_answer_len,
                                     null_score_diff_threshold=o.null_score_diff_threshold)
        return postprocess_qa(examples, features, outputs["start_logits"], outputs["end_logits"],
                              n_best=o.n_best, max_answer_len=o.max_answer_len)

    def score_files(self, gold, predictions, na_prob_file=None, na_prob_thresh: float = 1.0, **_) -> dict:
        """The official v1.1 EM/F1, or for a v2.0 file the official v2.0 script's keys (with its
        no-answer probability file and threshold)."""
        if reader.is_v2(read_json(gold)):  # the file's own version (the method below: the examples')
            return score_v2_files(gold, predictions, na_prob_file=na_prob_file, na_prob_thresh=na_prob_thresh)
        if na_prob_file:
            raise ConfigError(f"{gold} is a SQuAD v1.1 file: --na-prob-file applies to v2.0 files only")
        return metrics.score_files(gold, predictions)

    def score(self, examples, predictions, options):
        if self.is_v2(examples, options):
            # exact/f1 and HasAns/NoAns as the official script gives them without a na-prob file
            # (and with the one side_files writes, at its defaults: those values are probabilities,
            # postprocess.na_probability); best_exact/best_f1 and their thresholds from that file's
            # values, so `score --na-prob-file` prints what results.csv holds
            scores = squad_v2_evaluate(examples, predictions)
            na = getattr(predictions, "na_probs", None)
            if na:
                with_na = squad_v2_evaluate(examples, predictions, na_probs=na)
                scores.update({k: v for k, v in with_na.items() if k.startswith("best_")})
            return scores
        return metrics.squad_evaluate(examples, predictions)

    def side_files(self, predictions) -> dict:
        # v2.0: the no-answer probabilities beside the predictions, for `bertqa-bench score --na-prob-file`
        na = getattr(predictions, "na_probs", None)
        return {"na_prob": na} if na is not None else {}

    def question_scores(self, examples, predictions, options):
        if self.is_v2(examples, options):
            # the v2.0 evaluator's per-question exact/F1 (no-answer rules): their means are score()'s
            return question_scores_v2(examples, predictions)
        return metrics.question_scores(examples, predictions)

    def metrics_from_sums(self, sums, n):
        sums = np.asarray(sums, dtype=np.float64)  # columns: exact match, F1 (0-1 per question)
        return {"exact_match": 100.0 * sums[..., 0] / n, "f1": 100.0 * sums[..., 1] / n}

    def agreement(self, predictions, reference):
        # Identical answer text; on v2.0 "" is the no-answer, so a flip to or from no answer is a
        # disagreement like any other change of answer.
        same = sum(predictions.get(k) == v for k, v in reference.items())
        return same, len(reference)
