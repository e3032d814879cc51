"""A run owns its folder (bertqa_bench/record/run_folder.py): unique ids under concurrency, a taken
--run-id refused unless --resume or --overwrite, the MLflow store created once when two runs
start together, and unwritable or full disks named before any work."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_SYN, tiny_squad_and_checkpoint
from bertqa_bench import exit_codes
from bertqa_bench.cli import main
from bertqa_bench.record import run_folder
from bertqa_bench.record.results import RunBundle, new_run_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    _, ck = tiny_squad_and_checkpoint(root)
    return root, ck


def _suite(setup, tmp_path, backends=("eager-fp32",), isolation="inprocess"):
    root, _ = setup
    raw = {"name": "own",
           "data": {"source": "synthetic", "data_dir": str(root / "data"), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(TINY_SYN)},
           "bench": {"backends": list(backends), "batch_size": 8, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": isolation},
           "variants": {"onnxruntime": {"base": "onnxruntime", "options": {"exporter": "torchscript"}}},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    p = tmp_path / "own.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _bench(setup, tmp_path, *extra, mlflow=False):
    return main(["bench", "--suite", str(_suite(setup, tmp_path)), "--model", str(setup[1]), "--no-progress",
                 *([] if mlflow else ["--no-mlflow"]), *extra])


def test_generated_ids_differ_within_a_second_and_a_clash_draws_another(tmp_path):
    import re

    ids = {new_run_id("s") for _ in range(50)}  # 50 in the same second or two: 16 bits of random apart
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}-s", i) for i in ids) and len(ids) >= 45
    ids = iter(["20260101-000000-abcd-s", "20260101-000000-abcd-s", "20260101-000000-ef01-s"])
    first = run_folder.claim(tmp_path, None, lambda: next(ids))
    second = run_folder.claim(tmp_path, None, lambda: next(ids))
    assert (first, second) == ("20260101-000000-abcd-s", "20260101-000000-ef01-s")


def test_a_taken_run_id_is_refused_before_any_work_and_overwrite_empties_it(setup, tmp_path, capsys):
    assert _bench(setup, tmp_path, "--run-id", "mine") == 0
    run = tmp_path / "results" / "mine"
    stale = run / "predictions" / "another-model.json"
    stale.write_text("{}")
    before = (run / "run.json").read_text()
    capsys.readouterr()
    assert _bench(setup, tmp_path, "--run-id", "mine") == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert f"{run} already exists (run mine of suite own, complete)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (run / "run.json").read_text() == before and stale.exists()  # untouched
    # --overwrite: emptied first, so nothing of the earlier run is left beside the new one
    assert _bench(setup, tmp_path, "--run-id", "mine", "--overwrite") == 0
    assert not stale.exists() and RunBundle.load(run).meta.status == "complete"
    assert _bench(setup, tmp_path, "--resume", str(run), "--overwrite") == exit_codes.BAD_INPUT


def test_overwrite_deletes_the_old_runs_mlflow_parent_and_children(setup, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert _bench(setup, tmp_path, "--run-id", "again", mlflow=True) == 0
    old = RunBundle.load(tmp_path / "results" / "again").meta
    assert old.mlflow_parent_id and old.mlflow_children
    assert _bench(setup, tmp_path, "--run-id", "again", "--overwrite", mlflow=True) == 0
    new = RunBundle.load(tmp_path / "results" / "again").meta
    client = MlflowClient(uri)
    assert new.mlflow_parent_id != old.mlflow_parent_id
    for rid in [old.mlflow_parent_id, *old.mlflow_children.values()]:
        assert client.get_run(rid).info.lifecycle_stage == "deleted"
    assert client.get_run(new.mlflow_parent_id).info.lifecycle_stage == "active"


def test_overwrite_empties_only_run_folders_and_run_ids_are_names(setup, tmp_path, capsys):
    other = tmp_path / "results" / "notes"
    other.mkdir(parents=True)
    (other / "keep.txt").write_text("mine")
    assert _bench(setup, tmp_path, "--run-id", "notes", "--overwrite") == exit_codes.BAD_INPUT
    assert "empties run folders only" in capsys.readouterr().err and (other / "keep.txt").exists()
    for bad in ("../escape", "mlruns", "a/b"):
        assert _bench(setup, tmp_path, "--run-id", bad) == exit_codes.BAD_INPUT
        assert "a run id is one folder name" in capsys.readouterr().err


def test_an_unwritable_results_folder_is_named_before_any_work(setup, tmp_path, monkeypatch, capsys):
    real = run_folder.tempfile.TemporaryFile

    def read_only(*a, dir=None, **k):
        if "results" in str(dir) or str(dir) == str(tmp_path):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(run_folder.tempfile, "TemporaryFile", read_only)
    assert _bench(setup, tmp_path) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"results folder {tmp_path / 'results'} is not writable (read-only file system" in err
    assert not (tmp_path / "cache").exists()  # refused before the evaluation set was built


def test_a_full_disk_is_named_before_any_work(setup, tmp_path, monkeypatch, capsys):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda p: usage(10 * 2**30, 10 * 2**30 - 5 * 2**20, 5 * 2**20))
    assert _bench(setup, tmp_path) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "only 5 MiB free on its disk" in err and str(tmp_path) in err and "needs at least 64 MiB" in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "results").exists()


def test_two_benches_started_together_into_one_results_folder_each_keep_their_own(setup, tmp_path):
    """Both complete, each in its own folder with its own rows, and each with its own MLflow parent
    and children in a store neither had created (the store's migration ran once, under the lock)."""
    from mlflow.tracking import MlflowClient

    from bertqa_bench.reporting.tracking import default_tracking_uri

    suite = _suite(setup, tmp_path, backends=("eager-fp32", "onnxruntime"), isolation="process")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bertqa_bench.cli", "bench", "--suite", str(suite), "--model", str(setup[1]),
           "--no-progress"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "MLflow tracking failed" not in out, out[-3000:]
    runs = sorted((tmp_path / "results").glob("*-own"))
    assert len(runs) == 2, runs
    for run in runs:
        bundle = RunBundle.load(run)
        assert bundle.meta.status == "complete" and bundle.meta.verdict == "PASS"
        assert [r.backend for r in bundle.results] == ["eager-fp32", "onnxruntime"]
        assert all(r.ok for r in bundle.results), [r.error for r in bundle.results]
    client = MlflowClient(default_tracking_uri(tmp_path / "results"))
    exp = client.get_experiment_by_name("bertqa-own")
    parents = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("kind") == "bench"]
    assert sorted(r.data.tags["run_id"] for r in parents) == sorted(r.name for r in runs)
    for parent in parents:
        assert parent.info.status == "FINISHED"
        kids = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(k.data.params["backend"] for k in kids) == ["eager-fp32", "onnxruntime"]
        meta = json.loads((tmp_path / "results" / parent.data.tags["run_id"] / "run.json").read_text())
        assert meta["mlflow_parent_id"] == parent.info.run_id


def test_a_write_that_fails_names_the_file_it_was_writing(tmp_path):
    """np.savez through a file handle on a full disk raised "[Errno 28] No space left on device"
    with no path; the atomic writers name their target."""
    from bertqa_bench.io import atomic_write_with

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "outputs" / "onnxruntime.npz"
    with pytest.raises(OSError, match=r"No space left on device: '.*outputs/onnxruntime.npz'"):
        atomic_write_with(target, full, suffix=".npz")
    assert not list((tmp_path / "outputs").iterdir())  # nothing half-written left


def test_a_disk_that_fills_mid_run_leaves_run_json_failed_not_running(setup, tmp_path, monkeypatch):
    """A full disk while a finished row is written (after the free-space check passed): the error
    names itself, and run.json says failed with it instead of running for ever."""
    real_put = RunBundle.put

    def full_disk(self, r, order=None):
        if r.backend == "eager-fp32":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.csv_path))
        return real_put(self, r, order=order)

    monkeypatch.setattr(RunBundle, "put", full_disk)
    code = _bench(setup, tmp_path, "--run-id", "full")
    assert code != 0
    meta = json.loads((tmp_path / "results" / "full" / "run.json").read_text())
    assert meta["status"] == "failed"
    assert any("No space left on device" in n and "results.csv" in n for n in meta["notes"]), meta["notes"]


def test_results_csv_keeps_enough_digits_to_round_as_the_run_did():
    """A rate written to results.csv and read back prints as the run's own summary printed it:
    at six significant digits 6,028.500062 came back as 6028.5, which the reference table then
    rounded to 6,028 (half to even) where the summary said 6,029."""
    import csv
    import io

    from bertqa_bench.record.results import rows_to_csv

    values = [6028.500062373395, 182.92635066550562, 0.91749999, 12345.6789012]
    text = rows_to_csv([{"v": v} for v in values])
    back = [float(r["v"]) for r in csv.DictReader(io.StringIO(text))]
    for v, b in zip(values, back):
        assert f"{b:,.0f}" == f"{v:,.0f}" and f"{b:.3f}" == f"{v:.3f}", (v, b)
