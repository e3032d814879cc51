"""Data-parallel prediction on a torch.distributed process group.

A variant with ``devices: N`` runs as N worker ranks (``python -m bertqa_bench.measuring.worker``, one
GPU each, or N gloo ranks on the CPU), which form one process group as torchrun's workers do
(MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK): NCCL when the variant runs on
CUDA, gloo on the CPU, plus a gloo side-group on CUDA for what the bench itself exchanges.

Every rank makes exactly two collectives per variant, whatever happens to it:

1. **the warm-up barrier**: an ``all_gather_object`` of each rank's state after prepare and
   warm-up ("ok", or its error). It is a barrier (nobody times before everyone is warm, so the
   timed passes overlap) that also carries failures: a rank whose prepare raised still enters
   it, with its error, so the others learn why at once instead of waiting for a timeout;
2. **the gather**: ``gather_object`` to rank 0 of each rank's result and only its own rows of
   the outputs; rank 0 puts them back in dataset order and writes the one outputs file and the
   one result record a single worker would (a pass lasts as long as the slowest rank's, memory
   peaks are the max over ranks, energy is summed).

Both run on a gloo group with a timeout (the variant's): gloo honours it and raises, where an
NCCL collective on a dead peer would hang until NCCL's watchdog aborts the whole process; the
outputs are on the host anyway (the Backend contract), so nothing is copied to a GPU for them.

A rank that dies without a word (SIGKILL, segfault) or hangs is the parent's to handle: the
launcher kills the other ranks as soon as one ends badly, and names the rank that failed first
("data-parallel rank 1 of 2: crashed: killed by SIGKILL"). Each rank writes its phase beside its
result file, so a timeout names the rank that was behind.

``bench-ddp`` under torchrun (several hosts): every torchrun rank starts one worker rank per
variant on its own host (``commands.bench_ddp.Cluster``); rank 0 runs the bench (results, report,
MLflow, parity) and tells the others, over torchrun's own gloo group, which variant to predict
next. This module is the rank's side only (the worker imports it); starting ranks is
``commands/bench_ddp.py``'s.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import numpy as np

from ..backends.variants import Variant
from ..data.evalset import load_inputs
from ..errors import BackendUnavailableError, BenchError, ConfigError, format_error
from ..record.schedule import Plan
from .flops import model_dims, plan_flops
from .runner import Timing

# What torchrun sets for its workers; a worker the bench starts gets its own values (or none).
RANK_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
KILL_ENV = "BERTQA_TEST_KILL_RANK"  # test hook: "RANK" or "VARIANT:RANK" kills that rank after warm-up


def is_dist_env(env=None) -> bool:
    env = os.environ if env is None else env
    return "WORLD_SIZE" in env and "RANK" in env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rank_env(addr: str, port: int, rank: int, world: int, local_rank: int, local_world: int) -> dict:
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)}


def strip_dist_env(env: dict) -> dict:
    """``env`` without torchrun's / torchelastic's variables (a worker must not join the wrong group)."""
    return {k: v for k, v in env.items() if k not in RANK_VARS and not k.startswith("TORCHELASTIC_")}


@contextlib.contextmanager
def without_dist_env():
    """In a torchrun rank: code that would read WORLD_SIZE (training a missing model) sees one process."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in RANK_VARS or k.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(saved)


class PeerFailed(BenchError):
    """Another rank of this data-parallel job failed; this one stops without its timed passes."""


@dataclass
class Group:
    rank: int
    world: int
    backend: str
    side: object = None  # the gloo group the bench's own collectives use (None: the default one)

    def all_gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.side)
        return out

    def gather(self, obj) -> Optional[list]:
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.side)
        return out


@contextlib.contextmanager
def worker_group(cuda: bool, timeout_s: float):
    """This worker's rank in the job's process group (env: MASTER_ADDR/PORT, RANK, WORLD_SIZE).

    The store is made here explicitly (rank 0 hosts it) rather than by ``env://``: a worker the
    bench-ddp ranks start must not join torchrun's own agent store, whatever its environment."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=float(timeout_s))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timeout, wait_for_workers=False)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        # NCCL's collectives do not return on a dead peer within their timeout (the watchdog
        # tears the process down instead); the barrier and the gather of host arrays go over gloo.
        side = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        yield Group(rank, world, backend, side)
    finally:
        dist.destroy_process_group()


def write_phase(job, phase: str) -> None:
    """Where this rank is (beside its result file): a timeout then names the rank that was behind."""
    try:
        Path(job.result).with_suffix(".phase").write_text(phase)
    except OSError:
        pass


PHASES = ("start", "prepare+warm-up", "warm-up barrier", "timed passes", "gather", "done")


def read_phase(result_path) -> str:
    try:
        return Path(result_path).with_suffix(".phase").read_text().strip()
    except OSError:
        return "start"


def maybe_kill_self(job, rank: int) -> None:
    """Test hook: BERTQA_TEST_KILL_RANK=1 (or VARIANT:1) SIGKILLs that rank after the warm-up barrier."""
    want = os.environ.get(KILL_ENV, "")
    if not want:
        return
    name, _, r = want.rpartition(":")
    if (not name or name == job.name) and r.strip() == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


def merge_records(recs: list, plan, flops: tuple, n: int, backend: str) -> dict:
    """One record from the ranks' own: a pass lasts as long as the slowest rank's, memory peaks
    are the max over ranks, energy adds up over GPUs."""
    passes = min(len(r["pass_s"]) for r in recs)
    pass_s = [max(r["pass_s"][k] for r in recs) for k in range(passes)]
    timing = Timing(pass_s, np.concatenate([np.asarray(r["batch_ms"]) for r in recs]), plan.n_rows,
                    len(plan.batches), flops[0], flops[1], all(r["timing"]["identical_passes"] for r in recs)).summary()
    measures: dict = {}
    for r in recs:
        for k, v in r.get("measures", {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                measures[k] = measures.get(k, 0.0) + v if k.startswith("energy") else max(measures.get(k, 0.0), v)
            else:
                measures.setdefault(k, v)
    if "energy_j" in measures:  # energy adds up over GPUs; per 1k features and power follow from the sum
        measures["energy_j_per_1k_features"] = measures["energy_j"] / (plan.n_rows * passes) * 1000.0
        measures["avg_power_w"] = measures["energy_j"] / sum(pass_s)
    info = dict(recs[0].get("prepare_info") or {})
    info["data_parallel"] = (f"{n} processes, one {'GPU' if backend == 'nccl' else 'CPU rank'} each, "
                             f"torch.distributed ({backend}), length-balanced shards, warm-up barrier, "
                             "gather to rank 0")
    return {"status": "ok", "prepare_s": max(r["prepare_s"] for r in recs), "prepare_info": info, "timing": timing,
            "pass_s": pass_s, "measures": measures,
            "ranks": [{"rank": i, "pid": r.get("pid"), "host": r.get("host"), "prepare_s": r["prepare_s"],
                       "pass_s": r["pass_s"], "rows": len(r["rows"])} for i, r in enumerate(recs)]}


def _status_of(e: BaseException) -> dict:
    if isinstance(e, PeerFailed):
        return {"status": "failed", "error": str(e), "peer_failed": True}
    if isinstance(e, BackendUnavailableError):
        return {"status": "not run", "error": str(e)}
    return {"status": "failed", "error": format_error(e)}


def execute_distributed(job, execute) -> tuple[dict, Optional[dict]]:
    """This worker's rank of a data-parallel job: its shard (``execute``, the worker's own, passed
    in: the worker imports this module), the barrier, the gather. Rank 0 returns the merged record
    and dataset-order outputs; the others their own record and None."""
    variant = Variant.from_dict(job.variant)
    write_phase(job, "start")
    with worker_group(variant.device == "cuda", job.dist_timeout_s) as g:
        if (g.rank, g.world) != (job.shard_index, job.shard_count):
            raise ConfigError(f"data-parallel job for rank {job.shard_index} of {job.shard_count} started as rank "
                              f"{g.rank} of {g.world}")
        state = {"synced": False}

        def barrier():
            state["synced"] = True
            write_phase(job, "warm-up barrier")
            peers = g.all_gather({"status": "ok"})
            bad = [(i, p) for i, p in enumerate(peers) if p["status"] != "ok"]
            if bad:
                i, p = bad[0]
                raise PeerFailed(f"rank {i} of {g.world} did not get ready: {p['error']}")
            maybe_kill_self(job, g.rank)
            write_phase(job, "timed passes")

        record, outputs, own = None, None, None
        write_phase(job, "prepare+warm-up")
        try:
            record, outputs = execute(job, shard=(g.rank, g.world), before_timing=barrier)
            if record["status"] != "ok":
                own = {"status": record["status"], "error": record.get("error", "")}
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then reported
            if not isinstance(e, PeerFailed):
                traceback.print_exc()
            own = _status_of(e)
        if not state["synced"]:  # this rank never reached the barrier: the others wait there for its word
            g.all_gather(own or {"status": "failed", "error": "no timed passes"})
        write_phase(job, "gather")
        if own is None:
            rows = np.asarray(record.pop("rows"), dtype=np.int64)
            part = {"rank": g.rank, "status": "ok", "record": record, "rows": rows,
                    "outputs": {k: v[rows] for k, v in outputs.items()}}
        else:
            part = {"rank": g.rank, **own}
        got = g.gather(part)
        write_phase(job, "done")
        if g.rank != 0:
            return ({"status": "ok", "rank": g.rank, "pid": os.getpid()} if own is None
                    else {**own, "rank": g.rank}), None
        return _merge_on_rank0(job, got, outputs, g)


def _merge_on_rank0(job, parts: list, outputs: Optional[dict], g: Group) -> tuple[dict, Optional[dict]]:
    n = len(parts)
    bad = [p for p in parts if p["status"] != "ok"]
    if bad:
        first = next((p for p in bad if not p.get("peer_failed")), bad[0])
        status = "failed" if any(p["status"] == "failed" for p in bad) else "not run"
        return {"status": status, "error": f"data-parallel rank {first['rank']} of {n}: {first['error']}",
                "failed_rank": first["rank"], "rank": 0}, None
    merged = {k: v.copy() for k, v in outputs.items()}  # rank 0's own: every row, its own ones filled
    for p in parts[1:]:
        for k, v in p["outputs"].items():
            merged[k][p["rows"]] = v
    plan = Plan.load(Path(job.plan))
    lengths = np.asarray(load_inputs(Path(job.evalset))["attention_mask"]).sum(axis=1)
    flops = plan_flops(model_dims(Path(job.model_dir)), plan, lengths)
    recs = [dict(p["record"], rows=p["rows"]) for p in parts]
    rec = merge_records(recs, plan, flops, n, g.backend)
    rec["outputs"] = job.outputs
    rec["rank"] = 0
    return rec, merged


# ---- the parent's side -------------------------------------------------------------------------
