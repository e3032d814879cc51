"""The parent's side of a data-parallel job on one host: its ``n`` ranks started as torchrun would
(one GPU each, or N gloo ranks on the CPU), watched, and their records merged or the failing rank
named. The ranks' own side is ``ddp.py``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ..envinfo import cuda_visible_devices
from ..errors import ConfigError
from .ddp import PHASES, free_port, rank_env, read_phase
from .launcher import launch_all, limit_setting


def visible_gpus(n: int) -> list[str]:
    """The first ``n`` GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: the parent's
    own list when it was given one (a share of a host), else indices 0..n-1."""
    given = cuda_visible_devices()
    if given and len(given) < n:
        raise ConfigError(f"data-parallel prediction on {n} GPUs, but CUDA_VISIBLE_DEVICES={','.join(given)} "
                          f"names only {len(given)}")
    return given[:n] if given else [str(i) for i in range(n)]


def first_failure(recs: list, n: int, timeout_s: float) -> dict:
    """The failed record of a data-parallel job, naming the rank that failed first on its own."""
    status = "failed" if any(r["status"] == "failed" for r in recs) else "not run"
    r0 = recs[0]
    if r0["status"] != "ok" and "failed_rank" in r0:  # rank 0 heard it from the rank itself, in the gather
        return {"status": r0["status"], "error": r0["error"], "failed_rank": r0["failed_rank"]}
    own = [(r.get("fail_order") or 0, i) for i, r in enumerate(recs)
           if r["status"] != "ok" and not r.get("stopped_by_peer") and not r.get("peer_failed")
           and not r.get("timed_out")]
    if own:
        i = min(own)[1]
        return {"status": status, "error": f"data-parallel rank {i} of {n}: {recs[i].get('error')}", "failed_rank": i}
    late = [i for i, r in enumerate(recs) if r.get("timed_out")]
    if late:  # the rank furthest behind is the one the others waited for
        i = min(late, key=lambda i: (PHASES.index(recs[i].get("phase", "start"))
                                     if recs[i].get("phase", "start") in PHASES else 0, i))
        where = recs[i].get("phase", "start")
        return {"status": "failed", "error": f"data-parallel rank {i} of {n}: timed out after {timeout_s:g} s "
                                             f"in {where} ({limit_setting(timeout_s)}); every rank killed",
                "failed_rank": i}
    i = next(i for i, r in enumerate(recs) if r["status"] != "ok")
    return {"status": status, "error": f"data-parallel rank {i} of {n}: {recs[i].get('error')}", "failed_rank": i}


def annotate(recs: list, jobs: list) -> list:
    for r, j in zip(recs, jobs):
        r["phase"] = read_phase(j.result)
    return recs


def run_local_ranks(job, n: int, timeout_s: float, logs_dir: Path, gpus: Optional[list]) -> dict:
    """The single-host case: this process starts the ``n`` ranks itself (as torchrun would, on a
    free port), waits for them (killing the rest as soon as one ends badly) and returns rank 0's
    merged record, or the failure naming the rank."""
    port = free_port()
    jobs = [dataclasses.replace(job, shard_index=i, shard_count=n, dist_timeout_s=timeout_s,
                                result=job.result if i == 0 else job.result.replace(".json", f".rank{i}.json"))
            for i in range(n)]
    envs = [rank_env("127.0.0.1", port, i, n, i, n) | ({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {})
            for i in range(n)]
    recs = annotate(launch_all(jobs, timeout_s=timeout_s, envs=envs,
                               log_paths=[logs_dir / f"{job.name}.rank{i}.log" for i in range(n)]), jobs)
    for j in jobs:  # the ranks' job and pid files stay (what a supervisor checks after a kill)
        Path(j.result).with_suffix(".phase").unlink(missing_ok=True)
        if j is not jobs[0]:
            Path(j.result).unlink(missing_ok=True)
    if any(r["status"] != "ok" for r in recs):
        return first_failure(recs, n, timeout_s)
    return recs[0]
