"""NQTask: Natural Questions (simplified format) behind the runner's Task interface.

NQ knobs live in the suite config: ``data.nq_null_window_keep`` (share of answer-less training
windows kept), ``data.nq_markers`` (candidate markers) and ``bench.nq_top_k`` (start/end
positions per window considered by postprocessing); ``bench.max_answer_len`` bounds short
answers (word-pieces).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..config import SuiteConfig, resolve_path
from ..data.types import Features
from ..tasks import Task
from .features import featurize_nq
from .metrics import nq_evaluate
from .model import NQ_OUTPUTS
from .postprocess import postprocess_nq
from .reader import load_nq_jsonl


def train_labels(features: Features) -> dict[str, np.ndarray]:
    """Labels the NQ model's forward takes beyond start/end positions (features from featurize(train=True))."""
    if "answer_types" not in features.extra:
        raise ValueError("these features carry no answer_types: featurize them with train=True")
    return {"answer_types": features.extra["answer_types"]}


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

    def load_examples(self, cfg: SuiteConfig, split: str) -> list:
        d = cfg.data
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        if d.source == "nq-synthetic":
            from .synthetic import ensure_nq_files

            train_path, dev_path = ensure_nq_files(resolve_path(d.data_dir), d.synthetic)
            path = train_path if split == "train" else dev_path
        elif d.source == "nq-jsonl":
            f = d.train_file if split == "train" else d.dev_file
            if not f:
                raise FileNotFoundError(f"data.{split}_file is not set for source nq-jsonl")
            path = resolve_path(f)
        else:
            raise ValueError(f"source {d.source} is not an NQ source (nq-jsonl, nq-synthetic)")
        # The cap is applied while reading: real NQ train is ~17 GB of jsonl.
        return load_nq_jsonl(path, limit=cap or None)

    def featurize(self, examples, tokenizer, cfg, *, train=False):
        d = cfg.data
        return featurize_nq(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=d.doc_stride,
                            max_query_len=d.max_query_len, train=train,
                            markers=d.nq_markers, null_window_keep=d.nq_null_window_keep,
                            seed=cfg.train.seed)

    def train_labels(self, features: Features) -> dict[str, np.ndarray]:
        return train_labels(features)

    def postprocess(self, examples, features, outputs, cfg):
        return postprocess_nq(examples, features, outputs["start_logits"], outputs["end_logits"],
                              outputs["answer_type_logits"], top_k=cfg.bench.nq_top_k,
                              max_answer_len=cfg.bench.max_answer_len)

    def score(self, examples, predictions):
        return nq_evaluate(examples, predictions)

    def agreement(self, predictions, reference):
        ref = _by_id(reference)
        if not ref:
            return 1.0
        pred = _by_id(predictions)
        return sum(k in pred and _answer_key(pred[k]) == _answer_key(r) for k, r in ref.items()) / len(ref)
