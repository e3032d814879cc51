"""The process one backend variant runs in: ``python -m bertqa_bench.measuring.worker JOB.json``.

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
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


import numpy as np

from ..errors import BackendUnavailableError, BenchError, format_error  # noqa: F401 - format_error: worker's callers
from ..io import atomic_write_json, atomic_write_with
from ..record.schedule import shard_plan
from .ddp import execute_distributed
from .flops import model_dims, plan_flops
from .interrupt import watch_parent
from .job_setup import load_job
from .loadgen_job import execute as execute_loadgen
from .measure import Probe
from .progress import quiet_library_bars
from .runner import PreparedBackend, RunOutput, make_context, materialize, run_block


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
    # data-parallel prediction (ddp.py): this worker's rank of ``shard_count`` in a torch.distributed
    # group (MASTER_ADDR/PORT, RANK, WORLD_SIZE in its environment) and the group's timeout
    shard_index: int = 0
    shard_count: int = 1
    dist_timeout_s: float = 1800.0
    # "bench" (execute below: passes in one block), "rounds" (serve_rounds: one timed pass each
    # time the parent asks, interleaved with the other rows') or "loadgen": the variant as MLPerf
    # LoadGen's system under test (loadgen_job.execute); ``loadgen`` holds the scenario and its settings
    kind: str = "bench"
    loadgen: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.variant["name"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def prepared(job: Job, plan=None, inputs=None, shard: Optional[tuple[int, int]] = None, laps: bool = False):
    """The job's backend created and wrapped for its lifecycle (runner.PreparedBackend), not yet
    prepared: (PreparedBackend, plan) or (None, reason it cannot run here). ``shard`` (rank,
    world): only that rank's length-balanced share of the plan."""
    # N CPU ranks side by side: one thread each unless the suite says how many
    variant, why, inputs, plan = load_job(job, plan, inputs, threads=1 if shard else 0)
    if why:
        return None, why
    if shard is not None and shard[1] > 1:
        plan = shard_plan(plan, shard[1])[shard[0]]
    batches = materialize(inputs, plan)
    lengths = np.asarray(inputs["attention_mask"]).sum(axis=1)
    ctx = make_context(job.model_dir, job.task, job.artifacts_dir, job.output_names, plan, batches, job.max_seq_len)
    return PreparedBackend(variant.create(), ctx, plan, batches, token_outputs=tuple(job.token_outputs),
                           warmup_batches=job.warmup_batches, flops=plan_flops(model_dims(ctx.model_dir), plan, lengths),
                           probe=Probe(cuda=variant.device == "cuda"), laps=laps), plan


def record_of(run: RunOutput, job: Job, plan) -> dict:
    """The result record the parent reads (bench.py): timing, memory, prepare facts."""
    return {"status": "ok", "prepare_s": run.prepare_s, "warmup_batches": run.warmup_batches,
            "prepare_info": run.prepare_info, "timing": run.timing.summary(), "pass_s": run.timing.pass_s,
            "batch_ms": run.timing.batch_ms.tolist(), "measures": run.measures, "outputs": job.outputs,
            "rows": sorted({int(r) for b in plan.batches for r in b.rows}), "pid": os.getpid(),
            "host": socket.gethostname()}


def execute(job: Job, plan=None, inputs=None, shard: Optional[tuple[int, int]] = None,
            before_timing=None) -> tuple[dict, Optional[dict]]:
    """Run one job in this process, its passes in one block: (result record, dataset-order
    outputs or None). ``before_timing`` runs between warm-up and the timed passes (the
    data-parallel barrier)."""
    run, plan = prepared(job, plan, inputs, shard)
    if run is None:
        return {"status": "not run", "error": plan}, None
    out = run_block(run, min_passes=job.min_passes, min_duration_s=job.min_duration_s, progress=job.progress,
                    before_timing=before_timing)
    return record_of(out, job, plan), out.outputs


def ready_facts(run: PreparedBackend) -> dict:
    """What the parent needs to decide whether another row's process fits beside this one:
    this process's peak host memory while it prepared, and on a GPU its memory and the card's
    free memory now."""
    facts = {"prepare_s": run.prepare_s}
    values = run.probe.values if run.probe is not None else {}
    facts["host_peak_mib"] = max((v for k, v in values.items() if k.endswith("_host_peak_mib")), default=None)
    if run.probe is not None and run.probe.cuda:
        import torch  # a CUDA row's process has it loaded already

        free, _ = torch.cuda.mem_get_info()
        facts["device_free_mib"] = free / 2**20
        facts["device_reserved_mib"] = max((v for k, v in values.items() if k.endswith("_cuda_reserved_peak_mib")),
                                           default=0.0)
    return facts


def serve_rounds(job: Job, commands, replies) -> tuple[dict, Optional[dict]]:
    """A worker of interleaved rounds (rounds.py): prepare and warm up, say ``ready``, then one
    timed pass each time the parent says ``pass``, until it says ``finish`` (or closes the
    pipe: the parent is gone). ``commands``: lines in; ``replies``: a callable taking a dict."""
    run, plan = prepared(job, laps=True)
    if run is None:
        return {"status": "not run", "error": plan}, None
    try:
        run.prepare()
        replies({"event": "ready", **ready_facts(run)})
        for line in commands:
            what = line.strip()
            if what == "pass":
                replies({"event": "pass", "seconds": run.run_pass()})
            elif what == "finish":
                break
            else:
                raise BenchError(f"worker {job.name}: unknown command {what!r} from the parent")
        else:
            raise BenchError(f"worker {job.name}: the parent closed the command pipe before finish")
        if not run.timer.pass_s:
            raise BenchError(f"worker {job.name}: finished before any timed pass")
        out = run.finish()
    finally:
        run.close()
    return record_of(out, job, plan), out.outputs


def save_outputs(path: str | Path, outputs: dict) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **outputs)

    atomic_write_with(path, write, suffix=".npz")


def load_outputs(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def run_job_safely(job: Job, channel=None) -> dict:
    """Execute and save the outputs; exceptions become a failed (or not-run) record. What both
    the child process and the in-process mode report. ``channel`` (commands, replies): a rounds
    job's pipe to the parent."""
    try:
        if job.kind == "rounds":
            record, outputs = serve_rounds(job, *channel)
        elif job.kind == "loadgen":
            record, outputs = execute_loadgen(job)
        elif job.shard_count > 1:  # one rank of a data-parallel job (ddp.py)
            record, outputs = execute_distributed(job, execute)
        else:
            record, outputs = execute(job)
        if outputs is not None:
            save_outputs(job.outputs, outputs)
        return record
    except BackendUnavailableError as e:
        return {"status": "not run", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - reported as this variant's failure, never lost
        traceback.print_exc()
        return {"status": "failed", "error": format_error(e)}


REPLY_FD_ENV = "BERTQA_REPLY_FD"


def rounds_channel():
    """A rounds worker's pipe to the parent: commands on standard input, one JSON line per reply
    on the file descriptor the parent passed (standard output is the row's log)."""
    out = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w", buffering=1)

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")

    return sys.stdin, reply


def main(argv=None) -> int:
    watch_parent()  # a parent killed without cleaning up (kill -9) must not leave this process running
    quiet_library_bars()  # the parent keeps this process's output in a log file
    argv = sys.argv[1:] if argv is None else argv
    job = Job(**json.loads(Path(argv[0]).read_text()))
    result = run_job_safely(job, rounds_channel() if job.kind == "rounds" else None)
    atomic_write_json(job.result, result)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
