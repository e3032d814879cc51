"""SquadTask: SQuAD v1.1 (and files in its format) behind the Task interface.

Sources: ``synthetic`` (the seeded offline generator), ``squad-json`` (official files),
``hf`` (``datasets.load_dataset(data.hf_name)``). Model: BertForQuestionAnswering. Outputs:
start/end logits. Metric: the official EM/F1. Options (``task:`` section): postprocessing's
``n_best`` and ``max_answer_len``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...config import DataConfig, SuiteConfig, resolve_path
from ...errors import ConfigError
from ..base import Task


@dataclass
class SquadOptions:
    n_best: int = 20  # start and end candidates per window (run_qa.py's n_best_size)
    max_answer_len: int = 30  # tokens

    def __post_init__(self):
        if self.n_best < 1 or self.max_answer_len < 1:
            raise ConfigError("task: n_best and max_answer_len must be >= 1")


class SquadTask(Task):
    name = "squad"
    output_names = ("start_logits", "end_logits")
    metric_names = ("exact_match", "f1")
    primary_metric = "f1"
    metric_labels = {"exact_match": "EM", "f1": "F1"}
    sources = ("synthetic", "squad-json", "hf")
    Options = SquadOptions

    def model_class(self) -> type:
        from transformers import BertForQuestionAnswering

        return BertForQuestionAnswering

    def data_files(self, data: DataConfig, split: str) -> list[Path]:
        if data.source == "synthetic":
            from .synthetic import ensure_squad_files

            train, dev = ensure_squad_files(resolve_path(data.data_dir), data.synthetic)
            return [train if split == "train" else dev]
        if data.source == "squad-json":
            f = data.train_file if split == "train" else data.dev_file
            if not f:
                raise ConfigError(f"data.{split}_file is not set for source squad-json")
            return [resolve_path(f)]
        return []

    def load_examples(self, cfg: SuiteConfig, split: str) -> list:
        from .reader import load_squad_hf, load_squad_json

        d = cfg.data
        files = self.data_files(d, split)
        if files:
            examples = load_squad_json(files[0])
        else:
            examples = load_squad_hf(d.hf_name, "train" if split == "train" else "validation")
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        return examples[:cap] if cap else examples

    def featurize(self, examples, tokenizer, cfg, *, train=False):
        from .features import tokenize_examples

        d = cfg.data
        return tokenize_examples(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=d.doc_stride,
                                 max_query_len=d.max_query_len, train=train)

    def postprocess(self, examples, features, outputs, cfg):
        from .postprocess import postprocess_qa

        o = cfg.task.options
        return postprocess_qa(examples, features, outputs["start_logits"], outputs["end_logits"],
                              n_best=o.n_best, max_answer_len=o.max_answer_len)

    def score(self, examples, predictions, cfg):
        from .metrics import squad_evaluate

        return squad_evaluate(examples, predictions)

    def question_scores(self, examples, predictions, cfg):
        from .metrics import question_scores

        return question_scores(examples, predictions)

    def metrics_from_sums(self, sums, n):
        sums = np.asarray(sums, dtype=np.float64)  # columns: exact match, F1 (0-1 per question)
        return {"exact_match": 100.0 * sums[..., 0] / n, "f1": 100.0 * sums[..., 1] / n}

    def agreement(self, predictions, reference):
        same = sum(predictions.get(k) == v for k, v in reference.items())
        return same, len(reference)
