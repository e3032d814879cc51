"""``bertqa-bench profile``: a torch.profiler trace and a top-kernels table for one backend.

Profiles a few real batches of the suite's plan after prepare and warm-up. On CUDA the table
ranks device kernels by total device time (that is what limits throughput); on CPU it ranks
operators by self CPU time.
Works for every backend, ONNX Runtime and TensorRT included, because their kernels show up
in the CUDA activity stream even though their operators are not torch ops.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..backends.variants import VariantTable
from ..config import SuiteConfig
from ..data.evalset import load_evalset
from ..errors import BackendUnavailableError
from ..measuring.jobs import plan_for, plan_key
from ..measuring.runner import make_context, materialize, stream, warm_up
from ..measuring.trace_tables import write_profile
from ..tasks import get_task


def profile_backend(cfg: SuiteConfig, name: str, *, n_batches: int = 5, top: int = 25) -> dict:
    """Prepare and warm up one variant in this process, then profile ``n_batches`` real batches."""
    from torch.profiler import ProfilerActivity, profile

    from .provision import ensure_model

    variant = VariantTable.for_suite(cfg.variants, cfg.bench.device).get(name)
    reason = variant.unavailable_reason()
    if reason:
        raise BackendUnavailableError(f"{name}: {reason}")
    task = get_task(cfg.task.name)
    model = ensure_model(cfg, print, None)
    evalset = load_evalset(cfg.evalset_spec(), task, str(model.dir), log=print)
    plan = plan_for(cfg.bench, evalset, plan_key(cfg.bench, variant), cfg.data.target_eval_features)
    batches = materialize(evalset.features.inputs(), plan)
    ctx = make_context(model.dir, task.name, cfg.artifacts_root / name, task.output_names, plan, batches,
                       evalset.features.seq_len)
    backend = variant.create()
    cuda = variant.device == "cuda"
    try:
        backend.prepare(ctx)
        warm_up(backend, plan, batches, cfg.bench.warmup_batches)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, record_shapes=True) as prof:
            # the timed runner's own loop: a backend that keeps batches in flight is profiled so
            for _ in stream(backend, batches[:max(1, n_batches)]):
                pass
    finally:
        backend.close()

    out = Path(cfg.results_root) / "profiles" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    res = write_profile(prof, out, cuda, top=top)
    return {k: res[k] for k in ("dir", "trace", "top_csv", "table", "rows", "gpu_idle")}
