"""The evaluation set, built once: examples, features, real lengths, feature -> question map.

This plays the part of MLPerf's query sample library: every stage that needs the dev (or
train) features — the benchmark, training's evaluation, the parity gate, the profiler and
each backend's worker process — gets them from here. Building means reading the dataset and
tokenizing it into windows; the result is cached on disk under ``<cache_dir>/evalsets/<key>``,
keyed by the data (file contents, or the generator's config), the tokenizer's files, the
windowing settings and the task's options, so a change to any of them builds a new entry and
nothing else does.

A cache entry holds the model inputs as ``.npy`` files (workers memory-map them without
unpickling anything) and the examples, offsets and task extras in one pickle for the parent.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import tokenizers

from ..config import ADDED_DEFAULTS, DataConfig, EvalSetSpec
from ..errors import BenchError
from ..io import atomic_dir
from ..model.checkpoint import TOKENIZER_FILES
from ..tasks import Task
from ..tasks.features import INPUT_NAMES, Features

_ARRAYS = INPUT_NAMES + ("example_index",)


@dataclass
class EvalSet:
    key: str
    path: Path  # the cache entry
    split: str
    examples: list
    features: Features
    build_s: float  # reading + tokenizing, when the entry was built
    cache_hit: bool

    @property
    def n_questions(self) -> int:
        return len(self.examples)

    @property
    def n_features(self) -> int:
        return len(self.features)

    def lengths(self) -> np.ndarray:
        return self.features.lengths()


_FIRST_KEY_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def _tokenizer_fingerprint(tokenizer_source: str) -> str:
    from ..model.modeling import resolve_base

    d = Path(resolve_base(tokenizer_source))
    if not d.is_dir():
        return tokenizer_source  # a hub name
    h = hashlib.sha256()
    # The files keys were first made of, in their order (so existing keys stay as they were), then
    # every other file a tokenizer of a supported family is made from (checkpoint.TOKENIZER_FILES);
    # files absent from a folder add nothing.
    names = _FIRST_KEY_FILES + tuple(n for n in TOKENIZER_FILES if n not in _FIRST_KEY_FILES)
    for name in names:
        if (d / name).exists():
            h.update(name.encode())
            h.update((d / name).read_bytes())
    return h.hexdigest()


def evalset_key(spec: EvalSetSpec, task: Task, tokenizer_source: str, split: str, train: bool) -> str:
    d = spec.data
    options = dataclasses.asdict(spec.options) if dataclasses.is_dataclass(spec.options) else {}
    # options added later, at their defaults, keep existing keys (config.ADDED_DEFAULTS)
    options = {k: v for k, v in options.items() if ADDED_DEFAULTS.get(f"task_options.{k}", object()) != v}
    import transformers

    # The library versions too: the same tokenizer files gave different overflow windows under
    # transformers 5.17 and 5.24 (924 vs 1,091 training features of the ci suite).
    parts = {"source": task.source_fingerprint(d, split), "tokenizer": _tokenizer_fingerprint(tokenizer_source),
             "libraries": [transformers.__version__, tokenizers.__version__],
             "max_seq_len": d.max_seq_len, "doc_stride": d.doc_stride, "max_query_len": d.max_query_len,
             "train": train, "task_options": options, "seed": spec.seed if train else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load_evalset(spec: EvalSetSpec, task: Task, tokenizer_source: str, *, split: str = "dev", train: bool = False,
                 log: Optional[Callable[[str], None]] = None) -> EvalSet:
    """The cached evaluation set for this suite's data (``SuiteConfig.evalset_spec()``) and
    tokenizer, built first if missing."""
    key = evalset_key(spec, task, tokenizer_source, split, train)
    path = Path(spec.cache_root) / "evalsets" / f"{task.name}-{split}-{key}"
    if (path / "meta.json").exists():
        if json.loads((path / "meta.json").read_text()).get("n_features"):
            evalset = _read(path, key, split)
            warn_empty_questions(evalset.examples, _source_name(spec.data, task, split), log)
            return evalset
        # an empty entry an older version cached: removed, and the set is refused below
        shutil.rmtree(path, ignore_errors=True)
    from ..model.modeling import load_tokenizer

    t0 = time.perf_counter()
    examples = task.load_examples(spec.data, split)
    if not examples:  # refused before anything is tokenized or cached: an empty entry would be reused
        raise BenchError(f"{_source_name(spec.data, task, split)}: the {split} set has no questions; nothing to "
                         f"{'train on' if train else 'evaluate'} (give a file with at least one question)")
    warn_empty_questions(examples, _source_name(spec.data, task, split), log)
    features = task.featurize(examples, load_tokenizer(tokenizer_source), spec, train=train)
    if not len(features):
        raise BenchError(f"{_source_name(spec.data, task, split)}: its {len(examples)} {split} questions gave no "
                         f"features at max_seq_len {spec.data.max_seq_len} (every one dropped in tokenizing)")
    build_s = time.perf_counter() - t0
    if log:
        log(f"data: {split} {len(examples)} questions -> {len(features)} features (seq {features.seq_len}) "
            f"in {build_s:.1f}s; cached in {path}")
    with atomic_dir(path, replace=False) as tmp:
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(features, name), dtype=np.int64))
        records = {"examples": examples, "offsets": features.offsets, "extra": features.extra,
                   "start_positions": features.start_positions, "end_positions": features.end_positions}
        with open(tmp / "records.pkl", "wb") as f:
            pickle.dump(records, f, protocol=pickle.HIGHEST_PROTOCOL)
        (tmp / "meta.json").write_text(json.dumps({"key": key, "task": task.name, "split": split, "train": train,
                                                    "n_questions": len(examples), "n_features": len(features),
                                                    "max_seq_len": features.seq_len, "build_s": build_s}))
    return EvalSet(key, path, split, examples, features, build_s, cache_hit=False)


def empty_questions(examples) -> list:
    """The examples whose question is empty or only whitespace (a missing one is refused by the reader)."""
    return [ex for ex in examples if isinstance(getattr(ex, "question", None), str) and not ex.question.strip()]


def warn_empty_questions(examples, source: str, log: Optional[Callable[[str], None]]) -> None:
    """Said, not refused: such a question is valid JSON and the model still reads its context,
    but its answer comes from the context alone, so a user should know how many there are."""
    empty = empty_questions(examples)
    if empty and log:
        log(f"warning: {source}: {len(empty)} of {len(examples)} questions are empty or whitespace only "
            f"(first: id '{empty[0].id}'); they are kept, and their answers come from the context alone")


def _source_name(data: DataConfig, task: Task, split: str) -> str:
    """The file a split is read from, else the data source's name."""
    try:
        files = task.data_files(data, split)
    except BenchError:
        files = []
    return str(files[0]) if files else f"data source {data.source}" + (
        f" ({data.hf_name})" if getattr(data, "hf_name", None) else "")


def _read(path: Path, key: str, split: str) -> EvalSet:
    meta = json.loads((path / "meta.json").read_text())
    arrays = load_inputs(path, mmap=False)
    with open(path / "records.pkl", "rb") as f:
        r = pickle.load(f)
    features = Features(*(arrays[n] for n in _ARRAYS), offsets=r["offsets"], start_positions=r["start_positions"],
                        end_positions=r["end_positions"], extra=r["extra"])
    return EvalSet(key, path, split, r["examples"], features, float(meta["build_s"]), cache_hit=True)


def load_inputs(path: Path, mmap: bool = True) -> dict[str, np.ndarray]:
    """The model-input arrays of a cache entry (memory-mapped by default: what a worker needs)."""
    return {n: np.load(Path(path) / f"{n}.npy", mmap_mode="r" if mmap else None) for n in _ARRAYS}
