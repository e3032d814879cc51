"""The interface every inference backend implements.

A backend maps a batch of model inputs (host numpy arrays) to the model's named
outputs (host numpy float32 arrays). It knows nothing about datasets, tokenization,
postprocessing or scoring: the runner owns those, so every backend is compared on
identical features with identical postprocessing.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# Inputs every BERT QA backend receives, in this order (the ONNX/TensorRT input names too).
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")

# Parity classes decide which tolerances apply (see bertqa_bench/parity.py).
FP32_CLASS = "fp32"
REDUCED_CLASS = "reduced"


@dataclass
class BackendContext:
    """What a backend may use to prepare itself."""

    model_dir: Path  # a saved HF model directory (config.json + weights + tokenizer)
    artifacts_dir: Path  # where exported/compiled artifacts are cached (under models/)
    output_names: tuple[str, ...]  # e.g. ("start_logits", "end_logits")
    sample_batch: Mapping[str, np.ndarray]  # a real batch at the run's shape, for export checks/warm-up
    max_batch_size: int
    max_seq_len: int
    device: str = "cpu"  # "cpu" or "cuda" (resolved by the runner)
    options: dict[str, Any] = field(default_factory=dict)  # per-backend options from the suite YAML


class Backend(abc.ABC):
    """One way of running the model. Subclasses set the class attributes."""

    name: str = "?"
    precision: str = "fp32"  # fp32 | tf32 | fp16 | bf16 | amp-fp16 | int8 | ...
    parity_class: str = FP32_CLASS
    device: str = "cpu"

    def __init__(self, **options: Any):
        self.options = dict(options)
        self.prepare_info: dict[str, Any] = {}  # free-form facts logged as MLflow params (fusion counts, providers, ...)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """Why this backend cannot run here (missing package, no GPU), or None if it can."""
        return None

    @abc.abstractmethod
    def prepare(self, ctx: BackendContext) -> None:
        """Load / export / optimize / compile / build. Timed as prepare_s, never as prediction."""

    @abc.abstractmethod
    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; return outputs as host float32 numpy arrays once they are ready.

        Must be synchronous: when it returns, the device work for this batch is finished
        and the logits are on the host, so a host clock around it is honest.
        """

    def close(self) -> None:
        """Free device memory and sessions."""
