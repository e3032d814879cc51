"""The process one backend variant runs in: ``python -m bertqa_bench.worker JOB.json``.

A job names the variant, the model, the cached evaluation set, the batch plan and where to
write. The worker prepares the backend, warms it up, times its passes (runner.py), writes
the dataset-order outputs to ``.npz`` and a result JSON, and exits. Everything it reports
goes through those two files: the parent (bench.py) postprocesses, scores and compares.
Running in its own spawned process means CUDA state, TF32 switches and compile caches never
leak between variants, and a segfault, hang or OOM costs only this variant's row.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import BackendUnavailableError, BenchError
from .io import atomic_write_json, atomic_write_with


@dataclass
class Job:
    variant: dict  # Variant.to_dict()
    model_dir: str
    task: str
    artifacts_dir: str
    evalset: str  # the evaluation-set cache entry (evalset.py)
    plan: str  # Plan.save() file
    outputs: str  # where the .npz of outputs goes
    result: str  # where the result JSON goes
    output_names: list
    token_outputs: list
    max_seq_len: int
    warmup_batches: int = 3
    min_passes: int = 1
    min_duration_s: float = 0.0
    num_threads: Optional[int] = None
    progress: bool = False
    # data-parallel prediction: this worker's share of the plan, and the folder where all
    # shards meet before timing, so their timed passes overlap
    shard_index: int = 0
    shard_count: int = 1
    barrier_dir: str = ""
    barrier_timeout_s: float = 1800.0

    @property
    def name(self) -> str:
        return self.variant["name"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def format_error(e: BaseException) -> str:
    if isinstance(e, BenchError):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.split('/')[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def execute(job: Job, plan=None, inputs=None) -> tuple[dict, Optional[dict]]:
    """Run one job in this process: (result record, dataset-order outputs or None)."""
    from .backends.variants import Variant
    from .evalset import load_inputs
    from .flops import model_dims, plan_flops
    from .measure import Probe
    from .runner import make_context, materialize, run_backend
    from .schedule import Plan

    variant = Variant.from_dict(job.variant)
    why = variant.unavailable_reason()
    if why:
        return {"status": "not run", "error": why}, None
    if job.num_threads and variant.device == "cpu":
        import torch

        torch.set_num_threads(int(job.num_threads))
    from .schedule import shard_plan

    inputs = inputs if inputs is not None else load_inputs(Path(job.evalset))
    plan = plan if plan is not None else Plan.load(Path(job.plan))
    if job.shard_count > 1:
        plan = shard_plan(plan, job.shard_count)[job.shard_index]
    batches = materialize(inputs, plan)
    lengths = np.asarray(inputs["attention_mask"]).sum(axis=1)
    ctx = make_context(job.model_dir, job.task, job.artifacts_dir, job.output_names, plan, batches, job.max_seq_len)
    probe = Probe(cuda=variant.device == "cuda")
    run = run_backend(variant.create(), ctx, plan, batches, token_outputs=tuple(job.token_outputs),
                      warmup_batches=job.warmup_batches, min_passes=job.min_passes, min_duration_s=job.min_duration_s,
                      flops=plan_flops(model_dims(ctx.model_dir), plan, lengths), progress=job.progress, probe=probe,
                      before_timing=(lambda: barrier(job)) if job.shard_count > 1 else None)
    record = {"status": "ok", "prepare_s": run.prepare_s, "warmup_batches": run.warmup_batches,
              "prepare_info": run.prepare_info, "timing": run.timing.summary(), "pass_s": run.timing.pass_s,
              "batch_ms": run.timing.batch_ms.tolist(), "measures": run.measures, "outputs": job.outputs,
              "rows": sorted({int(r) for b in plan.batches for r in b.rows}), "pid": os.getpid()}
    return record, run.outputs


def barrier(job: Job) -> None:
    """Wait until every shard of a data-parallel job is warmed up (files in barrier_dir)."""
    import time

    d = Path(job.barrier_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"ready-{job.shard_index}").touch()
    deadline = time.monotonic() + job.barrier_timeout_s
    while len(list(d.glob("ready-*"))) < job.shard_count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other {job.shard_count - 1} data-parallel workers never got ready")
        time.sleep(0.01)


def save_outputs(path: str | Path, outputs: dict) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **outputs)

    atomic_write_with(path, write, suffix=".npz")


def load_outputs(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def run_job_safely(job: Job) -> dict:
    """Execute and save the outputs; exceptions become a failed (or not-run) record. What both
    the child process and the in-process mode report."""
    try:
        record, outputs = execute(job)
        if outputs is not None:
            save_outputs(job.outputs, outputs)
        return record
    except BackendUnavailableError as e:
        return {"status": "not run", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - reported as this variant's failure, never lost
        traceback.print_exc()
        return {"status": "failed", "error": format_error(e)}


def main(argv=None) -> int:
    from .interrupt import watch_parent
    from .progress import quiet_library_bars

    watch_parent()  # a parent killed without cleaning up (kill -9) must not leave this process running
    quiet_library_bars()  # the parent keeps this process's output in a log file
    argv = sys.argv[1:] if argv is None else argv
    job = Job(**json.loads(Path(argv[0]).read_text()))
    result = run_job_safely(job)
    atomic_write_json(job.result, result)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
