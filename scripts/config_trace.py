#!/usr/bin/env python3
"""Follow the suite's config through one bench run and count how often it climbs back up the layers.

Every attribute read on the typed config (SuiteConfig and its sections) is recorded with the
module that read it (reads inside config.py itself, such as a property's own, are not uses). Runs
of reads by one module collapse into one visit. Then, over the first ``--uses`` reads:

- modules: how many modules read the config;
- climbs: visits whose module sits in a higher layer than the visit before it (the layer order of
  tests/test_architecture.py), i.e. the config handed back up after a stage below used it;
- returns: visits to a module the trace had already left once.

A stage that takes the section it needs and hands back a result reads it in one visit; a stage
that takes the whole config and reads it piecemeal, between its caller's own reads, climbs.

    python scripts/config_trace.py            # a tiny generated suite, trained and benched here (~1 min)
    python scripts/config_trace.py --suite benchmarks/ci.yaml --backends eager-fp32 --uses 400
    python scripts/config_trace.py --visits   # also print the visits, one per line
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402

from bertqa_bench import config as config_module  # noqa: E402
from test_architecture import RANK, layer_of  # noqa: E402  (the layer order's one definition)

TINY = {
    "name": "trace",
    "data": {"source": "synthetic", "max_seq_len": 96, "doc_stride": 48, "max_query_len": 32,
             "synthetic": {"seed": 3, "n_train_contexts": 6, "n_dev_contexts": 3, "questions_per_context": 2,
                           "min_words": 40, "max_words": 120, "mean_words": 60, "long_context_fraction": 0.0}},
    "model": {"name": "trace-qa", "base": "embedded:all-MiniLM-L6-v2", "random_init": True,
              "config_overrides": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                   "intermediate_size": 64}},
    "train": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "seed": 1},
    "bench": {"backends": ["eager-fp32", "ort-fp32"], "batch_size": 8, "warmup_batches": 1, "min_passes": 2,
              "min_duration_s": 0, "max_rounds": 2},
}


class Trace:
    """The modules that read the config, in order, one entry per read."""

    def __init__(self):
        self.reads: list[str] = []

    def install(self) -> None:
        """Record every public attribute read on the config's dataclasses, with its reader."""
        for cls in vars(config_module).values():
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == config_module.__name__:
                cls.__getattribute__ = self._reader()

    def _reader(self):
        reads = self.reads

        def __getattribute__(obj, name):
            if not name.startswith("_"):
                who = sys._getframe(1).f_globals.get("__name__", "")
                if who.startswith("bertqa_bench.") and who != config_module.__name__:
                    reads.append(who)
            return object.__getattribute__(obj, name)

        return __getattribute__


def visits(reads: list[str]) -> list[str]:
    """Consecutive reads by one module are one visit."""
    return [m for i, m in enumerate(reads) if i == 0 or reads[i - 1] != m]


def climbs(path: list[str]) -> int:
    """Visits to a module in a higher layer (nearer the command) than the visit before it."""
    rank = [RANK.get(layer_of(m), len(RANK)) for m in path]
    return sum(1 for a, b in zip(rank, rank[1:]) if b < a)


def returns(path: list[str]) -> int:
    """Visits to a module the trace had left before."""
    seen, n = set(), 0
    for i, m in enumerate(path):
        if m in seen:
            n += 1
        if i + 1 < len(path):
            seen.add(m)
    return n


def _suite_file(args, workdir: Path) -> Path:
    if args.suite:
        return Path(args.suite)
    raw = dict(TINY, models_dir=str(workdir / "models"), results_dir=str(workdir / "results"),
               cache_dir=str(workdir / "cache"))
    raw["data"] = dict(raw["data"], data_dir=str(workdir / "data"))
    path = workdir / "trace.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", help="a suite YAML (default: a tiny generated suite in a temporary folder)")
    ap.add_argument("--backends", help="comma-separated variants (default: the suite's)")
    ap.add_argument("--uses", type=int, default=400, help="count over the first N reads (default 400)")
    ap.add_argument("--visits", action="store_true", help="print the visits, one per line")
    args = ap.parse_args(argv)
    from bertqa_bench.commands.bench import run_bench  # after the tracer: the config classes are patched first
    from bertqa_bench.suite import load_suite

    trace = Trace()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_suite(str(_suite_file(args, Path(tmp))))
        trace.install()  # loading builds and checks the config (config.py's own reads); tracing starts at the run
        backends = args.backends.split(",") if args.backends else None
        run_bench(cfg, backends=backends, progress=False, log=lambda s: None)
    path = visits(trace.reads[: args.uses])
    if args.visits:
        print("\n".join(path))
    print(f"config reads traced: {len(trace.reads)} (counted: the first {min(args.uses, len(trace.reads))})")
    print(f"modules: {len(set(path))}  visits: {len(path)}  climbs back up: {climbs(path)}  "
          f"returns: {returns(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
