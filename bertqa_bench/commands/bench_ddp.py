"""``bench-ddp``: ``Cluster``, the torchrun ranks of a data-parallel bench, where every torchrun
rank starts one worker rank per variant on its own host. The bench's own N ranks on one host
(and the naming of a rank that fails) are ``measuring/local_ranks.py``'s; the ranks' own side,
inside the workers, is ``measuring/ddp.py``.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Optional

from ..data.evalset import load_evalset
from ..envinfo import cuda_visible_devices
from ..errors import BenchError, ConfigError
from ..measuring.ddp import free_port, rank_env, read_phase, without_dist_env
from ..measuring.launcher import launch_all
from ..measuring.local_ranks import first_failure
from ..measuring.worker import Job, format_error
from ..tasks import get_task


# ---- bench-ddp: the torchrun ranks -------------------------------------------------------------


class Cluster:
    """The torchrun ranks of ``bertqa-bench bench-ddp``, over torchrun's own (gloo) group.

    Rank 0 runs the bench; for each variant it sends the job (and its plan) to the others, and
    every rank starts one worker rank of the job on its own host. A rank whose worker ends badly
    says so in torchrun's store at once, and every rank stops its own worker (no rank waits for
    the group timeout). Then all ranks exchange how their worker ended, and rank 0 records it."""

    CONTROL_TIMEOUT_S = float(os.environ.get("BERTQA_DDP_CONTROL_TIMEOUT_S", 6 * 3600))

    def __init__(self):
        import torch.distributed as dist

        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.host = socket.gethostname()
        if not dist.is_initialized():
            # the control group: CPU objects only, and a long timeout (rank 0 scores between variants)
            dist.init_process_group("gloo", timeout=timedelta(seconds=self.CONTROL_TIMEOUT_S))
        from torch.distributed import distributed_c10d

        self.store = distributed_c10d._get_default_store()
        self.seq = 0

    def _bcast(self, obj=None):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _all_gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    # rank 0 -----------------------------------------------------------------------------------
    def prepared(self, model, evalset) -> None:
        """Rank 0 has its model and evaluation set: the others load theirs (the caches, on a shared
        file system; built from the same suite otherwise) and must have the same ones."""
        self._bcast({"op": "prepare"})
        mine = {"host": self.host, "digest": model.digest, "evalset": evalset.key, "error": ""}
        peers = self._all_gather(mine)
        bad = [(i, p) for i, p in enumerate(peers) if p["error"] or p["digest"] != mine["digest"]
               or p["evalset"] != mine["evalset"]]
        if bad:
            i, p = bad[0]
            raise ConfigError(f"bench-ddp rank {i} ({p['host']}): " + (p["error"] or (
                f"model {p['digest']} / evaluation set {p['evalset']}, rank 0 has {mine['digest']} / "
                f"{mine['evalset']}; give every host the same models/ (copy it, or a shared file system)")))

    def run(self, job, timeout_s: float, logs_dir: Path) -> dict:
        self.seq += 1
        cmd = {"op": "predict", "job": job.to_dict(), "plan": Path(job.plan).read_bytes(), "timeout_s": timeout_s,
               "addr": self.master_addr, "port": free_port(), "key": f"bertqa/{self.seq}/{job.name}"}
        self._bcast(cmd)
        own = self._run_rank(job, cmd, logs_dir)
        recs = self._all_gather(own)
        if any(r["status"] != "ok" for r in recs):
            out = first_failure(recs, self.world, timeout_s)
            hosts = {i: r.get("host") for i, r in enumerate(recs)}
            if out.get("failed_rank") is not None:
                out["error"] = out["error"].replace(f"rank {out['failed_rank']} of {self.world}",
                                                    f"rank {out['failed_rank']} of {self.world} "
                                                    f"({hosts.get(out['failed_rank'])})", 1)
            return out
        return own

    def close(self, error: str = "", exit_code: int = 0) -> None:
        """Tell the other ranks the run is over (``error``: rank 0 failed, and so must they, or
        torchrun would hold their hosts at its exit barrier waiting for rank 0's); ``exit_code``:
        rank 0's (its verdict's), which every rank returns for the same reason."""
        import torch.distributed as dist

        try:
            self._bcast({"op": "done", "error": error, "exit_code": int(exit_code)})
        finally:
            dist.destroy_process_group()

    # every rank -------------------------------------------------------------------------------
    def _run_rank(self, job, cmd: dict, logs_dir: Path) -> dict:
        job = dataclasses.replace(job, shard_index=self.rank, shard_count=self.world,
                                  dist_timeout_s=cmd["timeout_s"])
        env = rank_env(cmd["addr"], cmd["port"], self.rank, self.world, self.local_rank, self.local_world)
        if job.variant.get("device") == "cuda":
            given = cuda_visible_devices()
            env["CUDA_VISIBLE_DEVICES"] = given[self.local_rank] if given else str(self.local_rank)
        failed_key = cmd["key"] + "/failed"

        def abort() -> Optional[str]:
            return "stopped: another rank failed" if self.store.add(failed_key, 0) > 0 else None

        rec = launch_all([job], timeout_s=cmd["timeout_s"], log_paths=[logs_dir / f"{job.name}.rank{self.rank}.log"],
                         envs=[env], abort=abort)[0]
        rec["phase"], rec["host"] = read_phase(job.result), self.host
        Path(job.result).with_suffix(".phase").unlink(missing_ok=True)
        if rec["status"] != "ok" and not rec.get("stopped_by_peer") and not rec.get("peer_failed"):
            rec["fail_order"] = self.store.add(failed_key, 1)  # first to fail gets 1
        return rec

    def serve(self, cfg, log=print) -> int:
        """A rank other than 0: load the model and evaluation set, then predict what rank 0 asks.
        Returns rank 0's exit code."""
        from .provision import ensure_model

        scratch = cfg.results_root / ".ddp" / f"rank{self.rank}"
        model = evalset = None
        while True:
            cmd = self._bcast()
            if cmd["op"] == "done":
                if cmd.get("error"):
                    raise BenchError(f"rank 0 failed, so this rank stops: {cmd['error']}")
                return int(cmd.get("exit_code", 0))
            if cmd["op"] == "prepare":
                info = {"host": self.host, "digest": "", "evalset": "", "error": ""}
                try:
                    with without_dist_env():
                        task = get_task(cfg.task.name)
                        model = ensure_model(cfg, log)
                        evalset = load_evalset(cfg.evalset_spec(), task, str(model.dir), log=log)
                    info.update(digest=model.digest, evalset=evalset.key)
                except Exception as e:  # noqa: BLE001 - rank 0 reports it and stops
                    info["error"] = format_error(e)
                self._all_gather(info)
                continue
            job = Job(**cmd["job"])
            name = job.name
            (scratch / "plans").mkdir(parents=True, exist_ok=True)
            plan = scratch / "plans" / f"{cmd['key'].replace('/', '_')}.npz"
            plan.write_bytes(cmd["plan"])
            job = dataclasses.replace(job, model_dir=str(model.dir), evalset=str(evalset.path), plan=str(plan),
                                      artifacts_dir=str(cfg.artifacts_root / name),
                                      outputs=str(scratch / "outputs" / f"{name}.npz"),
                                      result=str(scratch / "workers" / f"{name}.json"))
            for d in ("outputs", "workers"):
                (scratch / d).mkdir(parents=True, exist_ok=True)
            self._all_gather(self._run_rank(job, cmd, scratch / "logs"))
