#!/usr/bin/env python3
"""Follow the suite's config through one bench run and count how often it climbs back up the layers.

A use of the config is a function of bertqa_bench called with the SuiteConfig itself among its
arguments (the whole config handed to a stage), or an attribute read on it (``cfg.bench``), with
the module of that function or reader. A stage that takes the section it needs (``cfg.bench``,
the training recipe) is handed a section, not the config: its own reads are not uses. Uses in a
row by one module collapse into one visit. Then, over the first ``--uses`` uses:

- modules: how many modules the config passed through;
- climbs: visits whose module sits in a higher layer than the visit before it (the layer order of
  tests/test_architecture.py): the config handed back up after a stage below had it;
- returns: visits to a module the trace had already left once.

    python scripts/config_trace.py            # a tiny generated suite, trained and benched here (~1 min)
    python scripts/config_trace.py --suite benchmarks/ci.yaml --backends eager-fp32 --uses 400
    python scripts/config_trace.py --visits   # also print the visits, one per line
"""
from __future__ import annotations

import argparse
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
    """The modules that used the config, in order, one entry per use."""

    def __init__(self, cfg):
        self.cfg, self.uses = cfg, []

    def __enter__(self):
        cls, cfg = type(self.cfg), self.cfg

        def __getattribute__(obj, name):  # a read on the config: its reader
            if obj is cfg and not name.startswith("_"):
                self._use(sys._getframe(1))
            return object.__getattribute__(obj, name)

        self._restore = cls.__dict__.get("__getattribute__")
        cls.__getattribute__ = __getattribute__
        sys.setprofile(self._call)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        if self._restore is None:
            del type(self.cfg).__getattribute__
        else:
            type(self.cfg).__getattribute__ = self._restore

    def _call(self, frame, event, arg):
        """A function called with the config among its arguments: the function's module."""
        if event != "call":
            return
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        if any(frame.f_locals.get(v) is self.cfg for v in code.co_varnames[:n]):
            self._use(frame)

    def _use(self, frame):
        who = frame.f_globals.get("__name__", "")
        if who.startswith("bertqa_bench.") and who != config_module.__name__:
            self.uses.append(who)


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

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_suite(str(_suite_file(args, Path(tmp))))
        backends = args.backends.split(",") if args.backends else None
        with Trace(cfg) as trace:  # from run_bench on: loading the suite builds and checks it first
            run_bench(cfg, backends=backends, progress=False, log=lambda s: None)
    path = visits(trace.uses[: args.uses])
    if args.visits:
        print("\n".join(path))
    print(f"config uses traced: {len(trace.uses)} (counted: the first {min(args.uses, len(trace.uses))})")
    print(f"modules: {len(set(path))}  visits: {len(path)}  climbs back up: {climbs(path)}  "
          f"returns: {returns(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
