"""The Backend interface: a batch of model inputs in, the model's named outputs out.

A backend knows nothing about datasets, tokenization, postprocessing, scoring or timing:
the evaluation set, the runner and the parity code own those, so every backend is compared
on identical features with identical postprocessing. What a backend is — implementation,
device, typed options — is a Variant (see variants.py); the class only implements it.

To add a backend, subclass ``Backend``:

* ``Options``: a dataclass of its settings (validated from YAML; unknown keys fail);
* ``precision_of(options)``: the precision label the options give (fp32, fp16, int8, ...);
* ``unavailable_reason(variant)``: why it cannot run here (missing package, no GPU), or None;
* ``prepare(ctx)``: load / export / optimize / compile / capture — timed as prepare time;
  ``ctx.shapes`` lists every (batch, sequence) shape the run will use, so per-shape work
  (CUDA graphs, compiled shapes, engine profiles) happens here, not during timing;
* ``predict(batch)``: one batch of host int64 arrays -> host float32 arrays, synchronously
  (when it returns, the device is done and the logits are on the host);
* optionally ``submit(batch)`` and ``in_flight()``: an accelerator backend that can queue the next
  batch while the current one computes returns a *waiter* from ``submit`` (call it for the
  outputs) and says how many batches may be submitted before the oldest is collected. The
  runner then keeps that many in flight, so the host's per-batch work (inputs, packing, the
  scatter of the previous outputs) overlaps the device's compute instead of leaving it idle.
  The default is synchronous: ``submit`` runs ``predict`` and ``in_flight()`` is 1;
* ``close()``: free sessions and device memory.

Then declare variants of it in a suite's ``variants:`` section (``implementation:
package.module:Class``) or register it through the ``bertqa_bench.backends`` entry-point group.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional

import numpy as np

from ..tasks.features import INPUT_NAMES

# Parity classes decide which tolerances apply (see parity.py).
FP32_CLASS = "fp32"
REDUCED_CLASS = "reduced"
DEVICES = ("cpu", "cuda")


def parity_class_of(precision: str) -> str:
    # TF32 keeps fp32 storage and accumulation (only matmul inputs are rounded to a 10-bit
    # mantissa), so it is held to the FP32-class tolerances.
    return FP32_CLASS if precision in ("fp32", "tf32") else REDUCED_CLASS


def batch_at_shape(sample: Mapping[str, np.ndarray], b: int, s: int) -> dict[str, np.ndarray]:
    """A batch of shape (b, s) cut and tiled from a real sample batch (never zeros: backends are
    compiled, captured, calibrated and validated on real tokens). Columns past the sample's
    length are padding."""
    sb, ss = np.shape(sample["input_ids"])
    rows = np.arange(b) % sb
    out = {}
    for n in INPUT_NAMES:
        a = np.asarray(sample[n])[rows][:, :min(s, ss)]
        if a.shape[1] < s:
            a = np.concatenate([a, np.zeros((b, s - a.shape[1]), dtype=a.dtype)], axis=1)
        out[n] = np.ascontiguousarray(a, dtype=np.int64)
    return out


@dataclass
class NoOptions:
    """For backends without settings."""


@dataclass
class BackendContext:
    """What a backend may use to prepare itself."""

    model_dir: Path  # a saved HF model directory (config.json + weights + tokenizer)
    task: str  # the task name: its model head class comes from tasks.get_task(task)
    artifacts_dir: Path  # where exported/compiled artifacts are cached (under models/artifacts/)
    output_names: tuple[str, ...]  # e.g. ("start_logits", "end_logits")
    sample_batches: tuple[Mapping[str, np.ndarray], ...]  # real batches of the run (largest shape first)
    shapes: tuple[tuple[int, int], ...]  # every (batch, seq) shape the run will hand to predict()
    max_batch_size: int
    max_seq_len: int

    @property
    def sample_batch(self) -> Mapping[str, np.ndarray]:
        return self.sample_batches[0]


class Backend(abc.ABC):
    Options: ClassVar[type] = NoOptions

    def __init__(self, variant):  # a variants.Variant (not imported: variants.py imports this module)
        self.variant = variant
        self.name = variant.name
        self.device = variant.device
        self.options = variant.options
        self.output_names: tuple[str, ...] = ()
        self.prepare_info: dict[str, Any] = {}  # facts logged as MLflow params (fusions, providers, recipe...)

    @classmethod
    def precision_of(cls, options) -> str:
        return "fp32"

    @classmethod
    def unavailable_reason(cls, variant) -> Optional[str]:
        return None

    @classmethod
    def batching_reason(cls, options, batching: str) -> Optional[str]:
        """Why these options cannot run this batching, or None. ``packed`` plans leave padding in
        the arrays that only a padding-free backend may skip; any backend runs the others."""
        if batching == "packed":
            return "batching 'packed' needs a backend that computes real tokens only (torch option packed: true)"
        return None

    @classmethod
    def family_reason(cls, options, family: str) -> Optional[str]:
        """Why these options cannot run a model of this family (config ``model_type``: bert,
        roberta, distilbert, ...), or None. A backend that would silently compute something else
        for a family (nothing swapped, a BERT-only rewrite) says so here: the row is ``not run``."""
        return None

    @abc.abstractmethod
    def prepare(self, ctx: BackendContext) -> None:
        """Load / export / optimize / compile / build / capture. Timed as prepare_s, never as prediction."""

    @abc.abstractmethod
    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; return outputs as host float32 numpy arrays once they are ready. They are
        the caller's: a later predict must not write into them (copy out of reused buffers)."""

    def in_flight(self) -> int:
        """How many submitted batches may be outstanding (not yet collected) at once: 1 means
        synchronous; 2 lets the caller hand over batch i+1 before collecting batch i."""
        return 1

    def submit(self, batch: Mapping[str, np.ndarray]) -> Callable[[], dict[str, np.ndarray]]:
        """Start one batch; returns a waiter that blocks until its outputs are on the host and
        returns them (as ``predict`` would). At most ``in_flight()`` waiters may be outstanding,
        and they are called in submission order. A waiter may be called on another thread than
        its submit (LoadGen's Server collects on its responder thread while the next batch is
        formed): it waits and copies out, and touches no per-thread state such as the current
        CUDA stream."""
        out = self.predict(batch)
        return lambda: out

    def close(self) -> None:
        """Free device memory and sessions."""


__all__ = ["Backend", "BackendContext", "NoOptions", "INPUT_NAMES", "FP32_CLASS", "REDUCED_CLASS", "DEVICES",
           "parity_class_of", "batch_at_shape"]
