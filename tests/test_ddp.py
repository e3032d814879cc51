"""Data-parallel prediction on a torch.distributed process group (ddp.py), on the CPU (gloo):
a rank that dies or fails fails its variant, named, and leaves nothing behind; several
"hosts" (torchrun --nnodes 2 on one machine) give the single process's answers, and train."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bertqa_bench.commands.bench import run_bench
from bertqa_bench.record.results import RunBundle
from bertqa_bench.suite import load_suite
from tests.conftest import TINY_BERT

pytestmark = pytest.mark.slow

PLUGINS = "tests.backend_plugins"


def _live_workers_of(parent_pid: int) -> list[int]:
    """Processes still alive that a launcher of ``parent_pid`` started (their BERTQA_PARENT_PID)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"BERTQA_PARENT_PID={parent_pid}".encode() in env and state != "Z":
            found.append(int(d.name))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rank_named_is_the_one_that_failed_first_on_its_own():
    from bertqa_bench.measuring.local_ranks import first_failure

    ok = {"status": "ok"}
    stopped = {"status": "failed", "error": "stopped: rank 2 failed first", "stopped_by_peer": True}
    dead = {"status": "failed", "error": "crashed: killed by SIGKILL", "fail_order": 1}
    peer = {"status": "failed", "error": "rank 2 of 3 did not get ready", "peer_failed": True, "fail_order": 2}
    assert first_failure([stopped, peer, dead], 3, 60)["error"] == "data-parallel rank 2 of 3: crashed: killed by SIGKILL"
    # rank 0 heard the cause in the gather: its word wins
    told = {"status": "failed", "error": "data-parallel rank 1 of 2: RuntimeError: x", "failed_rank": 1}
    assert first_failure([told, {**dead, "fail_order": 1}], 2, 60)["failed_rank"] == 1
    # everyone timed out: the rank furthest behind is named, with where it was
    late = [{"status": "failed", "error": "timed out", "timed_out": True, "phase": p}
            for p in ("warm-up barrier", "prepare+warm-up", "warm-up barrier")]
    assert first_failure(late, 3, 60)["error"] == (
        "data-parallel rank 1 of 3: timed out after 60 s in prepare+warm-up (bench.timeout_s); every rank killed")
    assert first_failure([ok, {"status": "not run", "error": "no CUDA"}], 2, 60) == {
        "status": "not run", "error": "data-parallel rank 1 of 2: no CUDA", "failed_rank": 1}


def test_a_rank_that_dies_or_fails_fails_its_variant_named_and_nothing_is_left(tiny_suite, monkeypatch):
    monkeypatch.setenv("BERTQA_TEST_KILL_RANK", "eager-fp32-x2:1")  # rank 1 SIGKILLs itself after warm-up
    suite = tiny_suite(backends=["eager-fp32", "eager-fp32-x2", "fails-x2", "ort-fp32"],
                       variants={"eager-fp32-x2": {"base": "eager-fp32", "devices": 2},
                                 "fails-x2": {"implementation": f"{PLUGINS}:FailsOnRank1", "device": "cpu",
                                              "devices": 2}})
    out = run_bench(load_suite(str(suite)), progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    killed, failed = rows["eager-fp32-x2"], rows["fails-x2"]
    assert killed.status == "failed", killed
    assert killed.error.startswith("data-parallel rank 1 of 2: crashed: killed by SIGKILL"), killed.error
    # rank 1's prepare raised: it told rank 0 at the warm-up barrier, which stopped there
    assert failed.status == "failed" and failed.error.startswith("data-parallel rank 1 of 2: RuntimeError: kaboom on rank 1"), failed.error
    # the other backends' results are all there
    assert rows["eager-fp32"].ok and rows["ort-fp32"].ok and rows["ort-fp32"].parity == "pass"
    # no worker left behind: every rank's pid is gone, and no process names this one as its parent
    pids = [int(p.read_text()) for p in (out.run_dir / "workers").glob("*.pid")]
    # eager-fp32 and ort-fp32 two processes each (bench.processes), 2 ranks each of the data-parallel variants
    assert len(pids) == 8
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not _live_workers_of(os.getpid())


def test_a_hung_rank_times_out_named(tiny_suite, monkeypatch):
    suite = tiny_suite(backends=["eager-fp32", "hangs-x2"],
                       variants={"hangs-x2": {"implementation": f"{PLUGINS}:FailsOnRank1", "device": "cpu",
                                              "devices": 2, "timeout_s": 15}})
    monkeypatch.setenv("BERTQA_TEST_HOW", "hang")  # rank 1's warm-up never returns
    out = run_bench(load_suite(str(suite)), progress=False)
    row = next(r for r in RunBundle.load(out.run_dir).results if r.backend == "hangs-x2")
    # rank 1 never finished its warm-up; rank 0 waited at the barrier: rank 1 is the one named
    assert row.status == "failed" and row.error.startswith(
        "data-parallel rank 1 of 2: timed out after 15 s in prepare+warm-up"), row.error
    assert not _live_workers_of(os.getpid())


def _torchrun_nodes(args: list, env: dict, cwd, nnodes: int = 2, timeout: int = 300, codes: list | None = None) -> list:
    """Each node's output; every node must exit 0 unless ``codes`` is given (it gets the exit codes)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"localhost:{port}", "--rdzv-id", "test", "--node-rank", str(i),
                               "-m", "bertqa_bench.cli", *args],
                              env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(nnodes)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if codes is not None:
        codes.extend(p.returncode for p in procs)
        return outs
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    return outs


def test_bench_ddp_on_two_torchrun_nodes_gives_the_single_process_answers(tiny_suite, tmp_path):
    from bertqa_bench.measuring.launcher import child_env
    from bertqa_bench.measuring.worker import load_outputs

    suite = tiny_suite(backends=["eager-fp32", "sorted-eager"], bench={"keep_outputs": True},
                       variants={"sorted-eager": {"base": "eager-fp32", "batching": "sorted"},
                                 "killed": {"base": "eager-fp32"}})
    cfg = load_suite(str(suite))
    t0 = time.monotonic()
    one = run_bench(cfg, progress=False, run_id="one")  # trains the model; one process per backend
    # the worker of rank 1 (the second "host") SIGKILLs itself after warm-up in variant "killed"
    env = child_env({"OMP_NUM_THREADS": "1", "BERTQA_TEST_KILL_RANK": "killed:1"})
    t1 = time.monotonic()
    codes: list = []
    outs = _torchrun_nodes(["bench-ddp", "--suite", str(suite), "--no-mlflow", "--no-progress", "--run-id", "two",
                            "--backends", "eager-fp32,killed,sorted-eager"], env, tmp_path, codes=codes)
    print(f"one process {t1 - t0:.1f} s, two torchrun nodes {time.monotonic() - t1:.1f} s")
    # the killed row makes the verdict FAIL: exit 1 (exit_codes.py) on every node, rank 0's code
    assert codes == [1, 1], (codes, outs[0][-2000:])
    assert sum("verdict:" in o for o in outs) == 1  # rank 0 alone records
    rows1 = {r.backend: r for r in RunBundle.load(one.run_dir).results}
    rows2 = {r.backend: r for r in RunBundle.load(cfg.results_root / "two").results}
    for name in ("eager-fp32", "sorted-eager"):
        a, b = rows1[name], rows2[name]
        assert b.ok and b.n_devices == 2 and a.n_devices == 1, b.error
        assert b.scores == a.scores and b.n_features == a.n_features
        assert "torch.distributed (gloo)" in b.prepare_info["data_parallel"]
        p1 = json.loads((one.run_dir / "predictions" / f"{name}.json").read_text())
        p2 = json.loads((cfg.results_root / "two" / "predictions" / f"{name}.json").read_text())
        assert p1 == p2
        o1 = load_outputs(one.run_dir / "outputs" / f"{name}.npz")
        o2 = load_outputs(cfg.results_root / "two" / "outputs" / f"{name}.npz")
        real = one.evalset.features.attention_mask.astype(bool)
        for k in o1:
            np.testing.assert_allclose(o2[k][real], o1[k][real], atol=1e-5)
    assert rows2["sorted-eager"].parity == "pass" and rows2["sorted-eager"].n_shapes > 1
    # a rank lost on another host: its torchrun rank told the others through torchrun's store, rank 0
    # stopped its own worker at once, the row names rank 1 and its host, and the run went on
    killed = rows2["killed"]
    assert killed.status == "failed" and killed.error.startswith(
        f"data-parallel rank 1 of 2 ({socket.gethostname()}): crashed: killed by SIGKILL"), killed.error
    assert list(rows2) == ["eager-fp32", "killed", "sorted-eager"]
    logs = sorted(p.name for p in (cfg.results_root / "two" / "logs").glob("eager-fp32.rank*.log"))
    assert logs == ["eager-fp32.rank0.log"]  # rank 1's log lies on its own host (results/.ddp/rank1)
    assert (cfg.results_root / ".ddp" / "rank1" / "logs" / "eager-fp32.rank1.log").exists()
    # bench-ddp --resume on the same two nodes: the failed row runs again, the finished ones stay
    run = str(cfg.results_root / "two")
    outs = _torchrun_nodes(["bench-ddp", "--resume", run, "--no-mlflow", "--no-progress"],
                           child_env({"OMP_NUM_THREADS": "1"}), tmp_path)
    assert sum("verdict:" in o for o in outs) == 1
    bundle = RunBundle.load(cfg.results_root / "two")
    rows3 = {r.backend: r for r in bundle.results}
    assert list(rows3) == ["eager-fp32", "killed", "sorted-eager"] and len(bundle.meta.resumes) == 1
    assert rows3["killed"].ok and rows3["killed"].n_devices == 2 and rows3["killed"].parity == "pass"
    for name in ("eager-fp32", "sorted-eager"):  # kept as they were measured, not run again
        assert rows3[name] == rows2[name]


def test_bench_ddp_resume_of_a_missing_run_fails_on_rank_0_and_no_rank_waits(tiny_suite, tmp_path):
    from bertqa_bench.measuring.launcher import child_env

    suite = tiny_suite(backends=["eager-fp32"])
    codes: list = []
    t0 = time.monotonic()
    outs = _torchrun_nodes(["bench-ddp", "--resume", str(tmp_path / "no-such-run"), "--suite", str(suite),
                            "--no-mlflow", "--no-progress"], child_env({"OMP_NUM_THREADS": "1"}), tmp_path,
                           timeout=240, codes=codes)
    # rank 0 refuses, naming what is missing; rank 1 (the "other host") is told, and fails too: a
    # rank that ended well would wait at torchrun's exit barrier (300 s) for the failed one
    assert codes[0] != 0 and "nothing to resume" in outs[0], outs[0][-2000:]
    assert codes[1] != 0 and "rank 0 failed, so this rank stops" in outs[1], outs[1][-2000:]
    assert time.monotonic() - t0 < 120


def test_training_on_two_torchrun_nodes_matches_one_process(tiny_suite, tmp_path):
    from safetensors.torch import load_file

    from bertqa_bench.measuring.launcher import child_env

    # no dropout: its masks are drawn per process, the one thing that differs between 1 and 2 ranks
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": {
        **TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}})
    cfg = load_suite(str(suite))
    env = child_env({"OMP_NUM_THREADS": "1"})
    one = subprocess.run([sys.executable, "-m", "bertqa_bench.cli", "train", "--suite", str(suite), "--no-mlflow",
                          "--set", "model.name=one", "--set", "train.grad_accum=2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    _torchrun_nodes(["train", "--suite", str(suite), "--no-mlflow", "--set", "model.name=two"], env, tmp_path)
    d1, d2 = cfg.model_dir.parent / "one", cfg.model_dir.parent / "two"
    m1, m2 = (json.loads((d / "train_metrics.json").read_text()) for d in (d1, d2))
    assert m2["world_size"] == 2 and m1["train_steps"] == m2["train_steps"] and "dev_f1" in m2
    assert m2["command"].startswith("torchrun --nnodes=2 --nproc_per_node=1 -m bertqa_bench.cli train")
    w1, w2 = load_file(str(d1 / "model.safetensors")), load_file(str(d2 / "model.safetensors"))
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    # The same steps on the same rows: the same model up to float rounding, which AdamW (lr 1e-3,
    # 20 steps) amplifies to ~1e-3: one process with grad_accum 1 vs 2 differs by 1.3e-3 too
    # (measured); two nodes gave 2.5e-3.
    assert worst < 1e-2, worst
    assert m2["dev_f1"] == pytest.approx(m1["dev_f1"], abs=1.0)
