"""``bertqa-bench sweep``: backend x batch size x batching, one run, one reference.

A sweep is a bench whose variants are expanded from a grid: ``eager-fp16@b64-sorted`` is the
variant ``eager-fp16`` run with batch size 64 and sorted batching. Every point is measured in
its own process and judged for parity against the suite's reference from the same run, so the
grid is one MLflow parent run with a child per point. On top of the bench's own outputs it
writes ``sweep.md`` (the best configuration of each backend among the points that keep parity)
and ``sweep.png`` (throughput against batch size, one line per backend and batching).
"""
from __future__ import annotations

from typing import Sequence

from ..backends.variants import VariantTable, note_once
from ..config import BATCHINGS, SuiteConfig, VariantConfig
from ..errors import ConfigError
from ..reporting.sweep import point_name


def expand(cfg: SuiteConfig, backends: Sequence[str], batch_sizes: Sequence[int], batchings: Sequence[str],
           devices: Sequence[int] = (1,)) -> list[str]:
    """Declare one suite variant per grid point; returns their names (the reference first)."""
    bad = [b for b in batchings if b not in BATCHINGS]
    if bad:
        raise ConfigError(f"unknown batching {', '.join(bad)}; valid: {', '.join(BATCHINGS)}")
    if not backends or not batch_sizes or not batchings:
        raise ConfigError("a sweep needs at least one backend, batch size and batching")

    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    backends = table.canonical_names(backends, note_once)  # old names: the catalogue's
    names = []
    for v in backends:
        for bt in batchings:
            for bs in batch_sizes:
                for d in devices:
                    name = point_name(v, int(bs), bt, int(d))
                    cfg.variants[name] = VariantConfig(base=v, batch_size=int(bs), batching=bt, devices=int(d))
                    names.append(name)
    return [cfg.bench.reference] + [n for n in names if n != cfg.bench.reference]
