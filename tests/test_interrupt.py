"""Runs that survive interruption: SIGTERM / kill -9 of a running bench leave no process behind,
keep every finished row, close MLflow, and `--resume` finishes the run as an uninterrupted one
would have. The bench runs as a user runs it: `python -m bertqa_bench.cli bench` in a process of
its own."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertqa_bench.config import PROJECT_ROOT
from bertqa_bench.record.results import RunBundle

pytestmark = pytest.mark.slow

PLUGINS = "tests.backend_plugins"
BACKENDS = ["eager-fp32", "slow", "sorted-eager"]
# What must be identical between a resumed run and an uninterrupted one.
ACCURACY = ("status", "parity", "parity_failures", "primary_ratio", "primary_ratio_low", "primary_ratio_high",
            "answer_agreement", "n_agree", "n_compared", "agreement_ci_low", "agreement_ci_high",
            "parity_within_noise", "questions_to_decide", "max_abs_logit_diff", "start_argmax_agreement",
            "end_argmax_agreement")


VARIANTS = {"slow": {"implementation": f"{PLUGINS}:Slow", "device": "cpu"},
            "sorted-eager": {"base": "eager-fp32", "batching": "sorted"}}


@pytest.fixture
def suite(tiny_suite):
    # rows in blocks, one after the other: the reference has finished (and is kept) when the
    # second row's worker is interrupted
    return tiny_suite(backends=BACKENDS, variants=VARIANTS, bench={"timing": "block"})


def _env(tmp_path, slow_s):
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), env.get("PYTHONPATH", "")]),
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "BERTQA_TEST_SLOW_S": str(slow_s),
                "PYTHONUNBUFFERED": "1"})
    return env


def _start(args, tmp_path, slow_s):
    return subprocess.Popen([sys.executable, "-m", "bertqa_bench.cli", *args, "--no-progress"], cwd=PROJECT_ROOT,
                            env=_env(tmp_path, slow_s), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(args, tmp_path, slow_s=0, timeout=600):
    p = _start(args, tmp_path, slow_s)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _wait_for(path: Path, proc, timeout=300):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"bench ended before {path.name} appeared:\n{proc.stdout.read()}"
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.2)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone: it runs nothing)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.2)
    return False


def _mlflow_runs(tmp_path, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bertqa-tiny")
    runs = client.search_runs([exp.experiment_id], run_view_type=1)  # active only
    parents = [r for r in runs if r.data.tags.get("kind") == "bench" and r.data.tags.get("run_id") == run_id]
    assert len(parents) == 1, [r.data.tags for r in parents]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], children


def _accuracy(run_dir):
    return {r.backend: {c: getattr(r, c) for c in ACCURACY} | {"scores": r.scores, "deltas": r.deltas,
                                                                "delta_ci": r.delta_ci}
            for r in RunBundle.load(run_dir).results}


def _interrupt(suite, tmp_path, run_id, sig):
    """Start a bench, wait until the second variant's worker runs, send ``sig`` to the bench."""
    results = tmp_path / "results"  # the tiny suite's results_dir
    proc = _start(["bench", "--suite", str(suite), "--run-id", run_id], tmp_path, slow_s=60)
    pid_file = results / run_id / "workers" / "slow.pid"
    _wait_for(pid_file, proc)
    worker = int(pid_file.read_text())
    time.sleep(1.0)  # the worker is importing or predicting: either way it must not outlive the bench
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, worker, results / run_id


def test_sigterm_keeps_rows_kills_the_worker_and_resume_equals_an_uninterrupted_run(suite, tmp_path):
    rc, out, worker, run_dir = _interrupt(suite, tmp_path, "stopped", signal.SIGTERM)
    assert rc == 143, out
    assert _gone(worker), f"worker {worker} outlived the interrupted bench"
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "interrupted" and meta["interrupted_by"] == "SIGTERM"
    assert meta["verdict"] == "PASS"  # the verdict of what finished: the reference alone
    rows = RunBundle.load(run_dir).results
    assert [r.backend for r in rows] == ["eager-fp32"] and rows[0].ok
    assert "--resume" in out
    parent, children = _mlflow_runs(tmp_path, "stopped")
    assert parent.info.status == "KILLED" and parent.data.tags["interrupted_by"] == "SIGTERM"
    assert all(c.info.status != "RUNNING" for c in children)
    ref_before = (run_dir / "workers" / "eager-fp32.json").read_text()

    # a resume with another config is refused, naming what differs
    rc, out = _run(["bench", "--resume", str(run_dir), "--suite", str(suite), "--set", "bench.batch_size=4"], tmp_path)
    assert rc == 2 and "bench.batch_size: 8 -> 4" in out

    rc, out = _run(["bench", "--resume", str(run_dir)], tmp_path)
    assert rc == 0, out
    assert "keeping eager-fp32" in out
    # the reference was not run again: its worker record is the interrupted run's
    assert (run_dir / "workers" / "eager-fp32.json").read_text() == ref_before
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "complete" and meta["verdict"] == "PASS" and len(meta["resumes"]) == 1
    parent, children = _mlflow_runs(tmp_path, "stopped")  # the same parent, reopened, now finished
    assert parent.info.status == "FINISHED" and sorted(c.data.params["backend"] for c in children) == sorted(BACKENDS)

    rc, out = _run(["bench", "--suite", str(suite), "--run-id", "straight"], tmp_path)
    assert rc == 0, out
    resumed, straight = _accuracy(run_dir), _accuracy(tmp_path / "results" / "straight")
    assert list(resumed) == BACKENDS == list(straight)
    differ = {(b, k): (v, straight[b][k]) for b in resumed for k, v in resumed[b].items() if v != straight[b][k]}
    assert not differ


def test_kill_9_of_the_bench_leaves_no_worker_and_resume_finishes_it(suite, tmp_path):
    rc, out, worker, run_dir = _interrupt(suite, tmp_path, "killed", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    # nobody cleaned up: the worker notices its parent is gone and takes its process group down
    assert _gone(worker, within_s=15), f"worker {worker} kept running after its bench was killed"
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    # The resumed rows must be judged against the logits the reference wrote, not a fresh run of
    # it: move one real-token logit of the saved reference by 0.5 and the comparison must see it.
    import numpy as np

    saved = run_dir / "outputs" / "eager-fp32.npz"
    with np.load(saved) as z:
        logits = {k: z[k].copy() for k in z.files}
    logits["start_logits"][0, 1] += 0.5
    with open(saved, "wb") as f:
        np.savez(f, **logits)
    rc, out = _run(["bench", "--resume", str(run_dir)], tmp_path)
    assert rc == 0, out
    rows = {r.backend: r for r in RunBundle.load(run_dir).results}
    assert list(rows) == BACKENDS and all(r.ok and r.parity == "pass" for r in rows.values())
    for name in ("slow", "sorted-eager"):
        assert rows[name].max_abs_logit_diff == pytest.approx(0.5, abs=1e-3), name


def test_sigterm_during_the_rounds_kills_every_live_worker_and_resume_runs_them_all(tiny_suite, tmp_path):
    suite = tiny_suite(backends=BACKENDS, variants=VARIANTS)  # interleaved rounds: every row's worker alive
    rc, out, worker, run_dir = _interrupt(suite, tmp_path, "rounds", signal.SIGTERM)
    assert rc == 143, out
    pids = [int(p.read_text()) for p in (run_dir / "workers").glob("*.pid")]
    assert len(pids) >= 2 and all(_gone(pid) for pid in pids), "a row's worker outlived the interrupted bench"
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "interrupted" and RunBundle.load(run_dir).results == []  # no row had finished
    rc, out = _run(["bench", "--resume", str(run_dir)], tmp_path)
    assert rc == 0, out
    rows = RunBundle.load(run_dir).results
    assert [r.backend for r in rows] == BACKENDS and all(r.ok for r in rows)
    assert all(r.timing_mode == "block" for r in rows[1:])  # a resumed run's rows: blocks, said so
    assert "resumed run" in rows[1].timing_mode_note
