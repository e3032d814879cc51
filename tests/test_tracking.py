"""MLflow tracking: the experiment's kind, the live training run, the bench's comparison table.
Every test uses a temporary SQLite store (``Tracker(results_root=tmp_path)``)."""
import json
import tempfile
from pathlib import Path

import pytest

from bertqa_bench.parity import Verdict
from bertqa_bench.results import BackendResult, RunBundle, RunMeta
from bertqa_bench.suite import load_suite
from bertqa_bench.tracking import Tracker
from bertqa_bench.train import train

pytest.importorskip("mlflow")

# MLflow's names, spelled out (not imported) so that these tests say what the store must hold.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
COMPARISON_TABLE = "comparison.json"


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _client(tracker):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracker.uri)


def _runs(tracker, suite="tiny", kind=None):
    client = _client(tracker)
    exp = client.get_experiment_by_name(f"bertqa-{suite}")
    runs = client.search_runs([exp.experiment_id]) if exp is not None else []
    return [r for r in runs if kind is None or r.data.tags.get("kind") == kind]


# --- the experiment opens as a "Machine learning" experiment, not a GenAI one ----------------
def test_new_experiment_is_tagged_as_model_development(tmp_path):
    tracker = Tracker(tmp_path)
    exp_id = tracker.experiment("tiny")
    exp = _client(tracker).get_experiment(exp_id)
    assert exp.tags.get(EXPERIMENT_KIND_TAG) == EXPERIMENT_KIND
    assert "workflowType=machine_learning" in Tracker.ui_url(exp_id)


def test_existing_experiment_gets_the_kind_once_and_keeps_a_chosen_one(tmp_path):
    tracker = Tracker(tmp_path)
    client = _client(tracker)
    where = (tmp_path / "mlruns").as_uri()
    old = client.create_experiment("bertqa-old", artifact_location=where)  # made by an earlier version: no kind
    chosen = client.create_experiment("bertqa-chosen", artifact_location=where,
                                      tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert tracker.experiment("old") == old
    assert client.get_experiment(old).tags.get(EXPERIMENT_KIND_TAG) == EXPERIMENT_KIND
    assert tracker.experiment("chosen") == chosen
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


# --- training is logged live ------------------------------------------------------------------
def test_training_run_is_live_with_per_step_metrics(tiny_suite, tmp_path):
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    tracker = Tracker(tmp_path / "store")
    seen = {}

    def spy(message):
        """What the store holds at two moments of the training, read through MLflow: no clocks."""
        moment = "before steps" if message.startswith("train: ") and " questions -> " in message \
            else "saved" if message.startswith("train: saved") else None
        if moment:
            runs = _runs(tracker, kind="train")
            assert moment not in seen
            seen[moment] = [(r.info.status, len(_client(tracker).get_metric_history(r.info.run_id, "train_loss")))
                            for r in runs]

    metrics = train(cfg, tracker=tracker, log=spy)

    (run,) = _runs(tracker, kind="train")
    info = run.info
    assert info.status == "FINISHED"
    # the run spans the real training: it exists (running, no steps yet) before the first step, is
    # still running with every step's loss logged once the model is saved, and ends after that
    assert seen["before steps"] == [("RUNNING", 0)]
    (status, n_points), = seen["saved"]
    assert status == "RUNNING" and n_points >= 2
    # params at the start, final metrics and train_metrics.json at the end
    assert run.data.params["train.seed"] == "1" and run.data.params["total_steps"] == str(metrics["train_steps"])
    assert run.data.metrics["train_s"] == pytest.approx(metrics["train_s"])
    assert "dev_f1" in run.data.metrics
    client = _client(tracker)
    assert "train_metrics.json" in [a.path for a in client.list_artifacts(info.run_id)]
    # per-step loss and throughput, with increasing steps up to the last one
    for key in ("train_loss", "samples_per_s"):
        hist = client.get_metric_history(info.run_id, key)
        steps = [m.step for m in hist]
        assert len(hist) >= 2, key
        assert steps == sorted(set(steps)) and steps[-1] == metrics["train_steps"], (key, steps)
        assert all(m.value > 0 for m in hist), key
        # inside the run's span, all by MLflow's one clock (an order, not a margin)
        assert info.start_time <= hist[0].timestamp <= hist[-1].timestamp <= info.end_time, key


def test_a_long_training_logs_a_few_hundred_points_at_most(tmp_path):
    from types import SimpleNamespace

    tracker = Tracker(tmp_path)
    cfg = SimpleNamespace(name="tiny", model=SimpleNamespace(name="m", base="b"), task=SimpleNamespace(name="squad"),
                          data=SimpleNamespace(max_seq_len=96, doc_stride=48, source="synthetic"),
                          train=SimpleNamespace(seed=1), model_dir=tmp_path / "m")
    with tracker.training(cfg) as run:
        every = run.plan(10_000)
        for step in range(1, 10_001):
            run.step(step, loss=1.0, seen=step * 8, total_steps=10_000)
    hist = _client(tracker).get_metric_history(run.run_id, "train_loss")
    assert every > 1 and 10 <= len(hist) <= 300 and hist[-1].step == 10_000


def test_a_training_that_raises_ends_failed(tiny_suite, tmp_path, monkeypatch):
    import bertqa_bench.train as train_mod

    def broken(*a, **kw):
        raise RuntimeError("evaluation blew up")

    monkeypatch.setattr(train_mod, "evaluate_model", broken)
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    tracker = Tracker(tmp_path / "store")
    with pytest.raises(RuntimeError, match="evaluation blew up"):
        train(cfg, tracker=tracker, log=lambda m: None)
    runs = _runs(tracker, kind="train")
    assert len(runs) == 1, "a training that raised left no run"
    run = runs[0]
    assert run.info.status == "FAILED"
    assert "evaluation blew up" in run.data.tags["error"]
    # the steps it did make were logged as they happened, inside the run's span (MLflow's one clock)
    hist = _client(tracker).get_metric_history(run.info.run_id, "train_loss")
    assert len(hist) >= 2
    assert run.info.start_time <= hist[0].timestamp <= hist[-1].timestamp <= run.info.end_time


def test_tracking_problems_never_stop_training_and_disabled_tracking_logs_nothing(tiny_suite, tmp_path, capsys):
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    off = Tracker(tmp_path / "off", enabled=False)
    assert not off.training(cfg).active
    broken = Tracker(tmp_path / "broken")

    def fail(*a, **kw):
        raise OSError("store is gone")

    broken._client.log_batch = fail
    broken._client.set_terminated = fail
    metrics = train(cfg, tracker=broken, log=lambda m: None, evaluate=False)
    assert metrics["train_steps"] > 0 and (cfg.model_dir / "train_metrics.json").exists()
    assert "store is gone" in capsys.readouterr().err
    assert not (tmp_path / "off").exists()


# --- the bench's comparison table -------------------------------------------------------------
def _table(client, run_id):
    """The run's comparison table as MLflow wrote it (``load_table`` searches the global store)."""
    import pandas as pd

    path = client.download_artifacts(run_id, COMPARISON_TABLE, dst_path=str(Path(tempfile.mkdtemp())))
    return pd.read_json(path, orient="split")


def _bundle(tmp_path):
    meta = RunMeta(suite="tiny", run_id="20260101-000000-tiny", task="squad", metric_names=["exact_match", "f1"],
                   primary_metric="f1", reference="eager-fp32", metric_labels={"f1": "F1"})
    bundle = RunBundle.create(tmp_path / "results", meta, {}, {})
    ref = BackendResult("eager-fp32", predict_s=1.0, features_per_s=300.0, speedup=1.0, scores={"f1": 80.0,
                        "exact_match": 70.0}, parity="pass")
    ort = BackendResult("onnxruntime", predict_s=0.25, features_per_s=1200.123456, speedup=4.0,
                        scores={"f1": 80.0, "exact_match": 70.0}, parity="pass", max_abs_logit_diff=float("nan"))
    failed = BackendResult("eager-fp16", status="not run", error="needs CUDA")
    for r in (ref, ort, failed):
        bundle.add(r)
    return bundle


def test_bench_parent_run_has_the_comparison_table(tmp_path):
    bundle = _bundle(tmp_path)
    tracker = Tracker(tmp_path / "store")
    tracker.start_bench(bundle.meta, tags={})
    for r in bundle.results:
        tracker.log_backend(bundle.meta, r, {})
    tracker.finish_bench(bundle, Verdict("PASS", []))

    client = _client(tracker)
    parent = client.get_run(tracker.parent_id)
    assert COMPARISON_TABLE in [a.path for a in client.list_artifacts(tracker.parent_id)]
    assert {"path": COMPARISON_TABLE, "type": "table"} in json.loads(parent.data.tags["mlflow.loggedArtifacts"])
    table = _table(client, tracker.parent_id)
    assert list(table["backend"]) == ["eager-fp32", "onnxruntime", "eager-fp16"]
    assert list(table.columns[:5]) == ["backend", "features_per_s", "speedup", "predict_s", "f1"]
    assert table.loc[1, "features_per_s"] == pytest.approx(1200.0) and table.loc[1, "f1"] == 80.0
    assert table.loc[2, "status"] == "not run" and "needs CUDA" in table.loc[2, "error"]
    # the children carry the key numbers as metrics (the chart view's bars)
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.parent_id}'")
    ort = next(r for r in children if r.data.params["backend"] == "onnxruntime")
    for key in ("predict_s", "features_per_s", "speedup", "f1"):
        assert key in ort.data.metrics, key
    assert parent.info.status == "FINISHED"


def test_two_benches_have_one_table_each(tmp_path):
    parents = []
    for _ in range(2):
        bundle = _bundle(tmp_path)
        tracker = Tracker(tmp_path / "store")
        tracker.start_bench(bundle.meta, tags={})
        tracker.finish_bench(bundle, Verdict("PASS", []))
        parents.append(tracker.parent_id)
    client = _client(tracker)
    tagged = client.search_runs([tracker.experiment_id], "tags.`mlflow.loggedArtifacts` LIKE '%comparison.json%'")
    assert sorted(r.info.run_id for r in tagged) == sorted(parents)
    for run_id in parents:  # log_table appends to an existing file: each bench's table holds its own rows only
        assert list(_table(client, run_id)["backend"]) == ["eager-fp32", "onnxruntime", "eager-fp16"]
