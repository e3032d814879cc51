"""The timing loop and the per-backend benchmark.

For each backend: prepare (timed on its own), warm up on real batches (untimed), predict every
feature in batches (timed: total wall time plus per-batch latencies), postprocess, score, and
compare with the reference. Each backend's row is written the moment it finishes; a failing
backend is recorded as failed and the others still run.
"""
from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import backends as registry
from .backends.base import Backend, BackendContext
from .config import SuiteConfig
from .data.types import Features
from .errors import BackendUnavailableError, BenchError
from .flops import qa_flops_per_sequence

PAD_LOGIT = np.float32(-1e4)  # fills positions a trimmed batch never computed; postprocessing skips them


@dataclass
class Batch:
    rows: slice
    seq_len: int  # columns handed to the backend (== features.seq_len for max_length padding)


@dataclass
class Timing:
    predict_s: float
    batch_ms: np.ndarray
    n_features: int
    flops: float  # matrix FLOPs of the timed work, at the shapes actually run

    def summary(self) -> dict:
        ms = self.batch_ms
        return {
            "predict_s": self.predict_s,
            "latency_p50_ms": float(np.percentile(ms, 50)),
            "latency_p90_ms": float(np.percentile(ms, 90)),
            "latency_p99_ms": float(np.percentile(ms, 99)),
            "latency_mean_ms": float(ms.mean()),
            "n_batches": int(len(ms)),
            "features_per_s": self.n_features / self.predict_s,
            "achieved_tflops": self.flops / self.predict_s / 1e12,
        }


def make_batches(features: Features, batch_size: int, padding: str, multiple: int = 8) -> list[Batch]:
    """Consecutive batches in dataset order. ``longest`` trims each batch to its longest real
    feature (rounded up to ``multiple`` for tensor-core friendly shapes), the "real length" case."""
    n, full = len(features), features.seq_len
    lengths = features.lengths() if padding == "longest" else None
    out = []
    for i in range(0, n, batch_size):
        rows = slice(i, min(i + batch_size, n))
        s = full
        if lengths is not None:
            s = min(full, int(-(-int(lengths[rows].max()) // multiple) * multiple))
        out.append(Batch(rows, s))
    return out


def batch_inputs(features: Features, b: Batch) -> dict:
    return features.inputs(b.rows, trim_to=None if b.seq_len == features.seq_len else b.seq_len)


def warm_up(backend: Backend, features: Features, batches: list[Batch], n: int) -> None:
    # Real batches, never zeros; the distinct shapes come first so every shape is compiled/captured.
    seen, order = set(), []
    for b in batches:
        key = (b.rows.stop - b.rows.start, b.seq_len)
        if key not in seen:
            seen.add(key)
            order.append(b)
    order += batches[: max(0, n - len(order))]
    for b in order[: max(n, len(seen))]:
        backend.predict(batch_inputs(features, b))


def timed_predict(backend: Backend, features: Features, batches: list[Batch], output_names: tuple[str, ...],
                  config, *, progress: bool = True) -> tuple[dict, Timing]:
    """Predict every feature; wall time from the first batch handed over until the last logits are on the host."""
    from tqdm.auto import tqdm

    n, s = len(features), features.seq_len
    outputs: dict[str, np.ndarray] = {}
    lat = np.empty(len(batches))
    flops = 0.0
    it = tqdm(batches, desc=f"predict {backend.name}", unit="batch", disable=not progress, leave=False)
    start = time.perf_counter()
    for i, b in enumerate(it):
        t0 = time.perf_counter()
        out = backend.predict(batch_inputs(features, b))  # synchronous: results are on the host
        lat[i] = (time.perf_counter() - t0) * 1e3
        for name in output_names:
            o = out[name]
            if name not in outputs:
                shape = (n, s) if o.ndim == 2 and o.shape[1] == b.seq_len else (n, *o.shape[1:])
                outputs[name] = np.full(shape, PAD_LOGIT, dtype=np.float32)
            if outputs[name].ndim == 2 and outputs[name].shape[1] == s and o.ndim == 2:
                outputs[name][b.rows, : o.shape[1]] = o
            else:
                outputs[name][b.rows] = o
        flops += (b.rows.stop - b.rows.start) * qa_flops_per_sequence(config, b.seq_len)
    predict_s = time.perf_counter() - start
    return outputs, Timing(predict_s, lat, n, flops)


def backend_context(cfg: SuiteConfig, name: str, model_dir: Path, features: Features,
                    output_names: tuple[str, ...], device: str) -> BackendContext:
    bs = min(cfg.bench.batch_size, len(features))
    return BackendContext(
        model_dir=Path(model_dir),
        artifacts_dir=Path(model_dir).parent / "artifacts" / Path(model_dir).name / name,
        output_names=tuple(output_names),
        sample_batch=features.inputs(slice(0, bs)),
        max_batch_size=cfg.bench.batch_size,
        max_seq_len=features.seq_len,
        device=device,
        options=dict(cfg.bench.backend_options.get(name, {})),
    )


@dataclass
class BackendRun:
    """Everything one backend produced: timings, outputs and prepare facts."""

    backend: Backend
    prepare_s: float
    timing: Timing
    outputs: dict


def run_backend(name: str, model_dir: Path, features: Features, output_names: tuple[str, ...],
                cfg: SuiteConfig, *, progress: bool = True) -> BackendRun:
    spec = registry.get_spec(name)
    reason = spec.unavailable_reason()
    if reason:
        raise BackendUnavailableError(reason)
    backend = spec.create()
    try:
        ctx = backend_context(cfg, name, model_dir, features, output_names, spec.device)
        import transformers

        config = transformers.AutoConfig.from_pretrained(str(model_dir))
        t0 = time.perf_counter()
        backend.prepare(ctx)
        prepare_s = time.perf_counter() - t0
        batches = make_batches(features, cfg.bench.batch_size, cfg.bench.padding)
        warm_up(backend, features, batches, cfg.bench.warmup_batches)
        outputs, timing = timed_predict(backend, features, batches, output_names, config, progress=progress)
        return BackendRun(backend, prepare_s, timing, outputs)
    finally:
        backend.close()


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def format_error(e: BaseException) -> str:
    if isinstance(e, BenchError):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.split('/')[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
