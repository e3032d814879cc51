"""Batch plans: which features go into which batch, at which shape, and back to dataset order.

A plan is made once per run from the features' real lengths and handed to every backend, so
all of them run exactly the same shapes on exactly the same rows:

* ``padded`` — dataset order, every batch at (batch_size, max_seq_len): the classic table;
* ``trimmed`` — dataset order, each batch cut to its longest feature (rounded up to
  ``seq_multiple``); nearly every batch of 32 holds one long feature, so this saves little;
* ``sorted`` — features sorted by real length into buckets of ``seq_multiple`` tokens; within a
  bucket, batches hold ``tokens_per_batch // seq`` rows (at most ``max_batch_rows``), so short
  features travel in large batches and padding nearly vanishes. Shapes: one per bucket.
* ``packed`` — for backends that compute real tokens only (padding-free kernels): features
  sorted by length, each batch filled up to ``tokens_per_batch`` *real* tokens. The arrays still
  carry padding (up to the batch's longest row) but the backend never computes it.

The last batch of a bucket is padded with extra rows up to the bucket's batch size (copies of
a real row, never zeros; their outputs are dropped), so the set of shapes is small and known
before timing: compiled graphs, CUDA graphs and engine profiles are prepared for exactly
those. ``scatter`` writes each batch's outputs into arrays in dataset order, so
postprocessing never sees the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..io import atomic_write_with
from ..tasks.features import INPUT_NAMES

PAD_LOGIT = np.float32(-1e4)  # fills positions a trimmed batch never computed; postprocessing skips them


@dataclass(frozen=True)
class Batch:
    rows: np.ndarray  # indices into the evaluation set's features (real rows only)
    shape: tuple[int, int]  # (batch, seq) handed to the backend; batch >= len(rows)

    @property
    def n_real(self) -> int:
        return int(len(self.rows))


@dataclass
class Plan:
    batching: str
    batches: list
    n_features: int  # features in the evaluation set (each appears in at least one batch)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted({b.shape for b in self.batches}, key=lambda s: (s[0] * s[1], s), reverse=True)

    @property
    def n_rows(self) -> int:
        """Rows predicted per pass (more than n_features when the set is tiled to a target size)."""
        return int(sum(b.n_real for b in self.batches))

    @property
    def computed_tokens(self) -> int:
        return int(sum(b.shape[0] * b.shape[1] for b in self.batches))

    def real_tokens(self, lengths: np.ndarray) -> int:
        return int(sum(int(lengths[b.rows].sum()) for b in self.batches))

    def token_efficiency(self, lengths: np.ndarray) -> float:
        """Real tokens over the tokens the device computes (a packed batch computes real ones only)."""
        if self.batching == "packed":
            return 1.0
        return self.real_tokens(lengths) / max(1, self.computed_tokens)

    def save(self, path: Path) -> Path:
        rows = np.concatenate([b.rows for b in self.batches]).astype(np.int64)
        counts = np.array([b.n_real for b in self.batches], dtype=np.int64)
        shapes = np.array([b.shape for b in self.batches], dtype=np.int64).reshape(-1, 2)

        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, rows=rows, counts=counts, shapes=shapes, n_features=self.n_features,
                         batching=np.array(self.batching))

        return atomic_write_with(path, write, suffix=".npz")

    @classmethod
    def load(cls, path: Path) -> "Plan":
        with np.load(path) as z:
            rows, counts, shapes = z["rows"], z["counts"], z["shapes"]
            n_features, batching = int(z["n_features"]), str(z["batching"])
        bounds = np.concatenate([[0], np.cumsum(counts)])
        batches = [Batch(rows[bounds[i]:bounds[i + 1]], (int(shapes[i, 0]), int(shapes[i, 1])))
                   for i in range(len(counts))]
        return cls(batching, batches, n_features)


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def make_plan(lengths: np.ndarray, *, batching: str, batch_size: int, max_seq_len: int, seq_multiple: int = 32,
              tokens_per_batch: Optional[int] = None, max_batch_rows: Optional[int] = None,
              target_rows: Optional[int] = None) -> Plan:
    """The batch plan for features of these real ``lengths`` (see the module docstring).

    ``target_rows``: tile the set (row i is feature i mod n) up to this many rows per pass, to
    time a set of a given size (e.g. SQuAD dev's 10,784 features) from fewer distinct features.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        raise ValueError("no features to plan batches for")
    rows = np.arange(n) if not target_rows or target_rows <= n else np.resize(np.arange(n), int(target_rows))
    seq_of = np.minimum(max_seq_len, np.maximum(seq_multiple, [_round_up(v, seq_multiple) for v in lengths[rows]]))
    batches: list[Batch] = []
    if batching in ("padded", "trimmed"):
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            s = max_seq_len if batching == "padded" else int(seq_of[i:i + batch_size].max())
            batches.append(Batch(chunk, (batch_size, s)))
    elif batching == "sorted":
        budget = int(tokens_per_batch or batch_size * max_seq_len)
        cap = int(max_batch_rows or max(batch_size, budget // max(seq_multiple, 1)))
        order = np.argsort(-lengths[rows], kind="stable")  # longest first: the largest shapes warm up first
        rows, seq_of = rows[order], seq_of[order]
        for s in sorted(set(seq_of.tolist()), reverse=True):
            bucket = rows[seq_of == s]
            b = max(1, min(cap, budget // s))
            for i in range(0, len(bucket), b):
                batches.append(Batch(bucket[i:i + b], (b, int(s))))
    elif batching == "packed":
        budget = int(tokens_per_batch or batch_size * max_seq_len)
        order = np.argsort(-lengths[rows], kind="stable")
        rows = rows[order]
        start, used = 0, 0
        for i, length in enumerate(lengths[rows].tolist() + [None]):
            if length is None or (used + length > budget and i > start) or \
                    (max_batch_rows and i - start >= max_batch_rows):
                chunk = rows[start:i]
                batches.append(Batch(chunk, (len(chunk), int(min(max_seq_len, _round_up(lengths[chunk].max(), 8))))))
                start, used = i, 0
            if length is not None:
                used += length
    else:
        raise ValueError(f"unknown batching '{batching}'; valid: padded, trimmed, sorted, packed")
    return Plan(batching, batches, n)


def spread(n: int, k: int) -> list[int]:
    """``k`` indices of ``range(n)`` spread evenly, the first and the last among them (all when
    ``k`` is 0 or at least ``n``): which batches of a plan stand for all of them."""
    if k <= 0 or k >= n:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, num=k).round()})


def shard_plan(plan: Plan, n: int) -> list[Plan]:
    """Split a plan's batches over ``n`` workers with equal work: batches go, largest first, to
    the worker with the fewest computed tokens so far (every batch to exactly one worker)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    loads, shards = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(plan.batches)), key=lambda i: -plan.batches[i].shape[0] * plan.batches[i].shape[1]):
        w = loads.index(min(loads))
        shards[w].append(i)
        loads[w] += plan.batches[i].shape[0] * plan.batches[i].shape[1]
    return [Plan(plan.batching, [plan.batches[i] for i in sorted(idx)], plan.n_features) for idx in shards]


def batch_inputs(features: Mapping[str, np.ndarray], batch: Batch) -> dict[str, np.ndarray]:
    """Host int64 inputs of one batch at its plan shape; extra rows repeat the first real row."""
    b, s = batch.shape
    rows = batch.rows if batch.n_real == b else np.concatenate(
        [batch.rows, np.full(b - batch.n_real, batch.rows[0], dtype=batch.rows.dtype)])
    return {n: np.ascontiguousarray(features[n][rows, :s], dtype=np.int64) for n in INPUT_NAMES}


def empty_outputs(example: Mapping[str, np.ndarray], n_features: int, max_seq_len: int,
                  token_outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Dataset-order output arrays shaped like one batch's outputs; ``token_outputs`` (one value
    per token, e.g. start/end logits) get the full sequence axis, filled with PAD_LOGIT."""
    out = {}
    for name, o in example.items():
        tail = (max_seq_len, *o.shape[2:]) if name in token_outputs else o.shape[1:]
        out[name] = np.full((n_features, *tail), PAD_LOGIT, dtype=np.float32)
    return out


def scatter(outputs: dict[str, np.ndarray], batch: Batch, out: Mapping[str, np.ndarray]) -> None:
    """Write one batch's outputs (real rows only) into the dataset-order arrays."""
    k = batch.n_real
    for name, o in out.items():
        dst = outputs[name]
        if dst.shape[1:] == o.shape[1:]:
            dst[batch.rows] = o[:k]
        else:  # a token axis shorter than max_seq_len (trimmed / sorted batches)
            dst[batch.rows, : o.shape[1]] = o[:k]


def mask_padding(outputs: dict[str, np.ndarray], attention_mask: np.ndarray, token_outputs: tuple[str, ...]) -> dict:
    """Set token outputs at padding positions to PAD_LOGIT, in place.

    What a backend computes at a padding position depends on how much padding its batch had, and
    postprocessing's n-best (run_qa's rule: candidates are ranked before invalid ones are
    dropped) would let those values take candidate slots — so the answers of a padded and a
    length-sorted run could differ with identical logits on every real token. Blanking them
    makes postprocessing depend on real tokens only, for every backend and batching alike.
    """
    pad = np.asarray(attention_mask) == 0
    for name in token_outputs:
        if name in outputs:
            o = outputs[name]
            o[pad[:, : o.shape[1]]] = PAD_LOGIT
    return outputs
