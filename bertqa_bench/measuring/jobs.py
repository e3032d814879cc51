"""A suite's variant as a worker's job: the batch plan it runs and the job file that names it.
Shared by every command that starts workers (bench, loadgen, profile)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..backends.variants import Variant
from ..config import BenchConfig
from ..data.evalset import EvalSet
from ..record.results import RunBundle
from ..record.schedule import Plan, make_plan
from ..tasks import Task
from .worker import Job


def plan_key(b: BenchConfig, variant: Optional[Variant] = None) -> tuple[str, int]:
    """(batching, batch size) a variant runs with: its own, else the bench section's."""
    return ((variant.batching if variant and variant.batching else b.batching),
            (variant.batch_size if variant and variant.batch_size else b.batch_size))


def batch_budget(b: BenchConfig, batch_size: int) -> tuple[Optional[int], Optional[int]]:
    """(tokens_per_batch, max_batch_rows) of a sorted or packed batch at ``batch_size``: the bench
    section's, scaled by batch_size / bench.batch_size, so that a variant of twice the suite's batch
    size holds twice the tokens and up to twice the rows (a row cap left at the suite's would cut a
    64k-token packed batch of short features at the 32k batch's row count); None: the plan's default."""
    def scaled(v: Optional[int]) -> Optional[int]:
        return max(1, v * batch_size // b.batch_size) if v else None

    return scaled(b.tokens_per_batch), scaled(b.max_batch_rows)


def plan_for(b: BenchConfig, evalset: EvalSet, key: Optional[tuple[str, int]],
             target_rows: Optional[int]) -> Plan:
    """The batches of one (batching, batch size) over the evaluation set; ``target_rows``: the
    rows a pass covers when the set is tiled to a size (data.target_eval_features), else None."""
    batching, batch_size = key or plan_key(b)
    tokens, rows = batch_budget(b, batch_size)
    return make_plan(evalset.lengths(), batching=batching, batch_size=batch_size,
                     max_seq_len=evalset.features.seq_len, seq_multiple=b.seq_multiple,
                     tokens_per_batch=tokens, max_batch_rows=rows, target_rows=target_rows)


def plan_path(bundle: RunBundle, key: tuple[str, int]) -> Path:
    return bundle.path("plans", f"{key[0]}-b{key[1]}.npz")


def make_job(b: BenchConfig, artifacts_root: Path, task: Task, variant: Variant, model, evalset: EvalSet,
             bundle: RunBundle, tag: str = "", progress: bool = False, kind: str = "bench") -> Job:
    """``model``: the provisioned model (commands/provision.ModelInfo: its folder); ``b``: the
    bench section (passes, threads); ``artifacts_root``: where the variants' built files live."""
    name = variant.name + tag
    return Job(variant=variant.to_dict(), model_dir=str(model.dir), task=task.name,
               artifacts_dir=str(Path(artifacts_root) / variant.name), evalset=str(evalset.path),
               plan=str(plan_path(bundle, plan_key(b, variant))), outputs=str(bundle.path("outputs", f"{name}.npz")),
               result=str(bundle.path("workers", f"{name}.json")), output_names=list(task.output_names),
               token_outputs=list(task.token_outputs), max_seq_len=evalset.features.seq_len,
               warmup_batches=b.warmup_batches, min_passes=b.min_passes, min_duration_s=b.min_duration_s,
               num_threads=b.num_threads, progress=progress, kind=kind)
