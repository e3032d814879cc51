"""Tasks: everything dataset-specific (read, tokenize, postprocess, score) behind one interface.

The runner and the backends are task-agnostic: a task turns examples into Features, and
turns a backend's named outputs back into predictions and scores. SQuAD lives here; NQ in
``bertqa_bench/nq/task.py``.
"""
from __future__ import annotations

import abc
from typing import Any, Mapping

import numpy as np

from .config import SuiteConfig, resolve_path
from .data.types import Features


class Task(abc.ABC):
    name: str
    output_names: tuple[str, ...]
    metric_names: tuple[str, ...]  # scores reported per backend, e.g. ("exact_match", "f1")
    primary_metric: str  # the one parity tolerances use ("f1" / "micro_f1")

    @abc.abstractmethod
    def load_examples(self, cfg: SuiteConfig, split: str) -> list:
        """split: "train" or "dev"."""

    @abc.abstractmethod
    def featurize(self, examples: list, tokenizer, cfg: SuiteConfig, *, train: bool = False) -> Features: ...

    @abc.abstractmethod
    def postprocess(self, examples: list, features: Features, outputs: Mapping[str, np.ndarray],
                    cfg: SuiteConfig) -> Any:
        """Backend outputs for every feature -> predictions (JSON-serializable)."""

    @abc.abstractmethod
    def score(self, examples: list, predictions: Any) -> dict[str, float]: ...

    @abc.abstractmethod
    def agreement(self, predictions: Any, reference: Any) -> float:
        """Share of questions whose predicted answer is identical to the reference's."""

    def n_questions(self, examples: list) -> int:
        return len(examples)


class SquadTask(Task):
    name = "squad"
    output_names = ("start_logits", "end_logits")
    metric_names = ("exact_match", "f1")
    primary_metric = "f1"

    def load_examples(self, cfg: SuiteConfig, split: str) -> list:
        from .data import squad, synthetic

        d = cfg.data
        if d.source == "synthetic":
            train_path, dev_path = synthetic.ensure_squad_files(resolve_path(d.data_dir), d.synthetic)
            path = train_path if split == "train" else dev_path
            examples = squad.load_squad_json(path)
        elif d.source == "squad-json":
            f = d.train_file if split == "train" else d.dev_file
            if not f:
                raise FileNotFoundError(f"data.{split}_file is not set for source squad-json")
            examples = squad.load_squad_json(resolve_path(f))
        elif d.source == "hf":
            examples = squad.load_squad_hf(d.hf_name, "train" if split == "train" else "validation")
        else:
            raise ValueError(f"source {d.source} is not a SQuAD source")
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        return examples[:cap] if cap else examples

    def featurize(self, examples, tokenizer, cfg, *, train=False):
        from .data.features import tokenize_examples

        d = cfg.data
        return tokenize_examples(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=d.doc_stride,
                                 max_query_len=d.max_query_len, train=train)

    def postprocess(self, examples, features, outputs, cfg):
        from .data.postprocess import postprocess_qa

        return postprocess_qa(examples, features, outputs["start_logits"], outputs["end_logits"],
                              n_best=cfg.bench.n_best, max_answer_len=cfg.bench.max_answer_len)

    def score(self, examples, predictions):
        from .data.metrics import squad_evaluate

        return squad_evaluate(examples, predictions)

    def agreement(self, predictions, reference):
        keys = list(reference)
        if not keys:
            return 1.0
        return sum(predictions.get(k) == reference[k] for k in keys) / len(keys)


def get_task(name: str) -> Task:
    if name == "squad":
        return SquadTask()
    if name == "nq":
        from .nq.task import NQTask

        return NQTask()
    raise ValueError(f"unknown task '{name}'; tasks: squad, nq")
