"""One colour per backend, the same in every view of a run: comparison.png, sweep.png and the
MLflow charts (each child run's ``mlflow.runColor`` tag).

A backend's *family* is its variant without the batching suffix or sweep point
(``onnxruntime-sorted`` and ``onnxruntime@b64-padded`` are family ``onnxruntime``). Families get
the hues of matplotlib's tab20 palette in the order they first appear in the run (the suite's
backend order, reference first), so two families of one run never share a hue while there are at
most 10 of them; after 10, tab20b's hues follow. Within a family, padded rows take the dark shade of
the hue and length-aware rows (sorted, packed) the light one: ``onnxruntime`` and
``onnxruntime-sorted`` are visibly related and still told apart (MLflow's own run colours gave
them two near-identical blues).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

# matplotlib's tab20 (dark, light) pairs, then tab20b's (darkest, lightest) pairs, as hex: the
# same values matplotlib draws with, written out so MLflow's tag needs no matplotlib import.
_PAIRS = [
    ("#1f77b4", "#aec7e8"), ("#ff7f0e", "#ffbb78"), ("#2ca02c", "#98df8a"), ("#d62728", "#ff9896"),
    ("#9467bd", "#c5b0d5"), ("#8c564b", "#c49c94"), ("#e377c2", "#f7b6d2"), ("#7f7f7f", "#c7c7c7"),
    ("#bcbd22", "#dbdb8d"), ("#17becf", "#9edae5"),
    ("#393b79", "#9c9ede"), ("#637939", "#cedb9c"), ("#8c6d31", "#e7cb94"), ("#843c39", "#e7969c"),
    ("#7b4173", "#de9ed6"),
]
BATCHINGS = ("padded", "sorted", "packed")


def family(name: str, batching: Optional[str] = None) -> str:
    """``onnxruntime-sorted`` -> ``onnxruntime``; ``eager-fp16@b64-sorted-x2`` -> ``eager-fp16``."""
    base = name.split("@", 1)[0]
    for b in ([batching] if batching else []) + list(BATCHINGS):
        if b and base.endswith(f"-{b}") and base != b:
            return base[: -len(b) - 1]
    return base


def batching_of(name: str, batching: Optional[str] = None) -> str:
    if batching:
        return batching
    m = re.search(r"-(padded|sorted|packed)(?:-x\d+)?$", name)
    return m.group(1) if m else "padded"


class BackendColors:
    """Colours for the backends of one run, assigned in the order given."""

    def __init__(self, names: Iterable[str] = ()):
        self._families: list[str] = []
        for n in names:
            self._family_index(family(n))

    def _family_index(self, fam: str) -> int:
        if fam not in self._families:
            self._families.append(fam)
        return self._families.index(fam)

    def __call__(self, name: str, batching: Optional[str] = None) -> str:
        i = self._family_index(family(name, batching))
        dark, light = _PAIRS[i % len(_PAIRS)]
        return dark if batching_of(name, batching) == "padded" else light


def for_results(results, variants=()) -> BackendColors:
    """The run's colours: every variant it was asked for in its order (RunMeta.variants, the
    reference first), then any backend not among them; so a run cut short, or resumed, colours a
    backend as the full run does."""
    return BackendColors([*variants, *(r.backend for r in results)])
