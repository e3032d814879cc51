"""The Task interface: everything dataset-specific behind one object.

A task reads its examples (with errors that name file, record and field), turns them into
Features, names its model head and outputs, turns a backend's outputs back into predictions,
scores them and says when two predictions are the same answer. The runner, the backends and
the parity code only ever talk to this interface, so nothing outside ``tasks/<name>/`` branches
on a task's name. Each task also owns its config section (``task:`` in a suite YAML), a typed
dataclass validated like every other section.
"""
from __future__ import annotations

import abc
import hashlib
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

import numpy as np

from ..config import DataConfig, EvalSetSpec
from .features import Features

# Bump when featurization changes in a way that changes the features of the same inputs:
# cached evaluation sets keyed by an older version are then rebuilt.
FEATURIZER_VERSION = 2
_HASH_WHOLE_FILE_BELOW = 256 << 20  # larger files (NQ train is ~17 GB) are keyed by size + mtime


def file_fingerprint(path: str | os.PathLike) -> str:
    """Content hash of a data file (size + mtime for very large ones)."""
    p = Path(path)
    st = p.stat()
    if st.st_size > _HASH_WHOLE_FILE_BELOW:
        return f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Task(abc.ABC):
    name: ClassVar[str]
    output_names: ClassVar[tuple[str, ...]]
    token_outputs: ClassVar[tuple[str, ...]] = ("start_logits", "end_logits")  # outputs with one value per token
    metric_names: ClassVar[tuple[str, ...]]  # scores reported per backend, e.g. ("exact_match", "f1")
    primary_metric: ClassVar[str]  # the one parity tolerances use ("f1" / "micro_f1")
    metric_labels: ClassVar[dict] = {}  # column headers for the metrics, e.g. {"exact_match": "EM"}
    sources: ClassVar[tuple[str, ...]]  # data.source values this task reads
    Options: ClassVar[type]  # the task's config section (a dataclass)

    @abc.abstractmethod
    def model_class(self) -> type:
        """The transformers model class with this task's head (loads and saves like any HF model)."""

    @abc.abstractmethod
    def data_files(self, data: DataConfig, split: str) -> list[Path]:
        """The files ``split`` is read from (generated first for synthetic sources); [] for hub data."""

    def source_fingerprint(self, d: DataConfig, split: str) -> str:
        """What the examples of ``split`` depend on, for the evaluation-set cache key."""
        files = self.data_files(d, split)
        parts = [self.name, split, d.source, FEATURIZER_VERSION]
        parts += [file_fingerprint(f) for f in files] if files else [d.hf_name]
        cap = d.max_train_examples if split == "train" else d.max_eval_examples
        return repr(parts + [cap])

    @abc.abstractmethod
    def load_examples(self, data: DataConfig, split: str) -> list:
        """split: "train" or "dev"."""

    @abc.abstractmethod
    def featurize(self, examples: list, tokenizer, spec: EvalSetSpec, *, train: bool = False) -> Features:
        """The model's inputs (windows of ``spec.data.max_seq_len``), with labels when ``train``."""

    def train_labels(self, features: Features) -> dict[str, np.ndarray]:
        """Label arrays the model's forward takes, one row per training feature."""
        return {"start_positions": features.start_positions, "end_positions": features.end_positions}

    @abc.abstractmethod
    def postprocess(self, examples: list, features: Features, outputs: Mapping[str, np.ndarray],
                    options) -> Any:
        """Backend outputs for every feature -> predictions (JSON-serializable). ``options``: the
        task's own section (``Options``, TaskConfig.options), as every method below takes it."""

    @abc.abstractmethod
    def score(self, examples: list, predictions: Any, options) -> dict[str, float]: ...

    def score_files(self, gold: Path, predictions: Path, **options) -> dict:
        """The task's official evaluation of a predictions file against its gold file (``bertqa-bench
        score`` / ``score-nq``), with the official script's options."""
        raise NotImplementedError(f"task {self.name} has no file evaluation")

    def side_files(self, predictions: Any) -> dict[str, Any]:
        """Files written beside a backend's predictions, ``{suffix: JSON object}`` ->
        ``predictions/<backend>.<suffix>.json`` (SQuAD v2.0: the no-answer scores)."""
        return {}

    @abc.abstractmethod
    def agreement(self, predictions: Any, reference: Any) -> tuple[int, int]:
        """(questions whose predicted answer is identical to the reference's, questions compared)."""

    def question_scores(self, examples: list, predictions: Any, options) -> Optional[np.ndarray]:
        """Per-question contributions [questions, k], in ``examples`` order, whose column sums
        ``metrics_from_sums`` turns back into ``score``'s metrics: what parity's paired bootstrap
        resamples. None: the task's metric does not decompose (no interval is reported)."""
        return None

    def metrics_from_sums(self, sums: np.ndarray, n: int) -> dict[str, np.ndarray]:
        """``sums`` [..., k] of ``question_scores`` over ``n`` questions -> {metric: [...]}."""
        raise NotImplementedError(f"task {self.name} has no per-question decomposition")
