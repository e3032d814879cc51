"""MLflow tracking: the experiment's kind, the live training run, the bench's comparison table.
Every test uses a temporary SQLite store (``Tracker(results_root=tmp_path)``)."""
import json
import tempfile
from pathlib import Path

import pytest

from bertqa_bench.record.parity import Verdict
from bertqa_bench.record.results import BackendResult, RunBundle, RunMeta
from bertqa_bench.suite import load_suite
from bertqa_bench.reporting.tracking import Tracker
from bertqa_bench.training.train import train

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
    # MLflow 3.17 reads the URL's workflowType, not the tag: every printed link carries it
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
    # the run's charts are its curves; the final numbers are params (a single-value chart each before)
    assert set(run.data.metrics) == {"train_loss", "samples_per_s", "lr"}
    assert float(run.data.params["final.train_s"]) == pytest.approx(metrics["train_s"])
    assert float(run.data.params["final.dev_f1"]) == pytest.approx(metrics["dev_f1"])
    assert float(run.data.params["final.train_steps"]) == metrics["train_steps"]
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
    # samples/s at every point, the last one included, is samples over the time they took: the
    # intervals it implies tile the training (their sum is the training's own time, give or take
    # the set-up between the plan and the first step), and no point is the ~70 us between two
    # loggings (it read 57,598.7 samples/s against a run average of 10)
    hist = client.get_metric_history(info.run_id, "samples_per_s")
    seen = [0] + [min(s * 8, metrics["train_features"]) for s in [m.step for m in hist]]
    spans = [(b - a) / m.value for a, b, m in zip(seen, seen[1:], hist)]
    assert sum(spans) == pytest.approx(metrics["train_s"], rel=0.5)
    assert max(m.value for m in hist) < 20 * metrics["train_samples_per_s"], [m.value for m in hist]


def test_samples_per_s_is_timed_between_the_points_clock_readings_not_their_logging(tmp_path):
    """Points logged late (the loss read back one log step behind, the last two back to back) keep
    the rate of the steps they stand for."""
    tracker = Tracker(tmp_path)
    with tracker.training("tiny", "m", {"train.seed": 1, "base": "b"}, tmp_path / "m") as run:
        run.plan(4)
        t0 = run._last_t
        # step k done at t0 + 2k seconds, 8 samples a step; step 3's point is logged at step 4's
        # time and step 4's right after it, as the deferred readback does
        for step in range(1, 5):
            run.step(step, loss=1.0, seen=8 * step, total_steps=4, at_time=t0 + 2.0 * step)
    hist = _client(tracker).get_metric_history(run.run_id, "samples_per_s")
    assert [(m.step, m.value) for m in hist] == [(1, 4.0), (2, 4.0), (3, 4.0), (4, 4.0)]


def test_a_long_training_logs_a_few_hundred_points_at_most(tmp_path):
    tracker = Tracker(tmp_path)
    with tracker.training("tiny", "m", {"train.seed": 1, "base": "b"}, tmp_path / "m") as run:
        every = run.plan(10_000)
        for step in range(1, 10_001):
            run.step(step, loss=1.0, seen=step * 8, total_steps=10_000)
    hist = _client(tracker).get_metric_history(run.run_id, "train_loss")
    assert every > 1 and 10 <= len(hist) <= 300 and hist[-1].step == 10_000


def test_a_training_that_raises_ends_failed(tiny_suite, tmp_path, monkeypatch):
    import bertqa_bench.training.train as train_mod

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
    assert not off.training(cfg.name, cfg.model.name, {}, cfg.model_dir).active
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
    ort = BackendResult("onnxruntime", predict_s=0.25, features_per_s=1200.123456, speedup=4.0, speedup_low=3.9,
                        speedup_high=4.1,
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
    assert parent.info.status == "FINISHED"
    # the run's recommendation, as tags the runs table can show (recommend.py decides it)
    assert parent.data.tags["recommended_backend"] == "onnxruntime"
    assert parent.data.tags["recommendation"].startswith("onnxruntime: 4.00× eager-fp32")
    assert parent.data.tags["recommended_fp32_backend"] == ""  # no precision given: not FP32 class
    assert parent.data.metrics["best_speedup_at_parity"] == 4.0


def _bench(tmp_path, verdict="PASS", results=None):
    bundle = _bundle(tmp_path)
    if results is not None:
        bundle.results = results
    tracker = Tracker(tmp_path / "store")
    tracker.start_bench(bundle.meta, tags={})
    for r in bundle.results:
        tracker.log_backend(bundle.meta, r, {})
    tracker.finish_bench(bundle, Verdict(verdict, [] if verdict == "PASS" else ["onnxruntime: F1 ratio"]))
    client = _client(tracker)
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.parent_id}'")
    return tracker, client, client.get_run(tracker.parent_id), {r.data.params["backend"]: r for r in children}


def test_children_log_few_chosen_metrics_and_the_rest_as_one_json(tmp_path):
    """The runs table's columns are the comparison: a handful of metrics per backend, not the ~60
    numbers of the record (which stay in result.json)."""
    slow = BackendResult("onnxruntime", predict_s=0.25, features_per_s=1200.123456, speedup=4.0, parity="FAIL",
                         scores={"f1": 80.0, "exact_match": 70.0}, latency_p50_ms=2.5, latency_p99_ms=9.0,
                         prepare_s=3.0, prepare_host_peak_mib=900.0, predict_host_peak_mib=500.0,
                         max_abs_logit_diff=0.5, n_batches=13, answer_agreement=0.9)
    ref = BackendResult("eager-fp32", predict_s=1.0, features_per_s=300.0, speedup=1.0, parity="pass",
                        scores={"f1": 80.0, "exact_match": 70.0})
    tracker, client, parent, kids = _bench(tmp_path, "FAIL", [ref, slow])
    ort = kids["onnxruntime"]
    assert set(ort.data.metrics) == {"Speedup", "Time_s", "Parity_pass", "features_per_s", "f1", "exact_match",
                                     "latency_p50_ms", "latency_p99_ms", "prepare_s", "peak_host_mib"}
    assert ort.data.metrics["Speedup"] == 4.0 and ort.data.metrics["Time_s"] == 0.25
    assert ort.data.metrics["features_per_s"] == 1200.0  # 4 significant digits for the table
    assert ort.data.metrics["peak_host_mib"] == 900.0  # the larger of prepare's and prediction's peaks
    # parity as a value that sorts, beside the readable tag
    assert ort.data.metrics["Parity_pass"] == 0.0 and kids["eager-fp32"].data.metrics["Parity_pass"] == 1.0
    assert ort.data.tags["parity"] == "FAIL"
    # a FAIL within the noise of the questions: between the two, and said so
    from bertqa_bench.reporting.mlflow_views import child_metrics, result_view

    noisy = BackendResult("x", parity="FAIL", parity_within_noise=True)
    noisy.questions_to_decide = 3
    tags = result_view(noisy)[2]
    assert child_metrics(noisy)["Parity_pass"] == 0.5 and tags["parity"] == "FAIL"
    # the primary metric's change against the reference leads too, named after the metric
    noisy.deltas = {"f1": -0.5, "exact_match": -1.0}
    assert child_metrics(noisy, ["exact_match", "f1"], "f1")["F1_delta"] == -0.5
    assert tags["parity_within_noise"] == "3 questions would decide it"
    # the whole record, unrounded, in one JSON artifact
    path = client.download_artifacts(ort.info.run_id, "result.json", dst_path=str(tmp_path))
    record = json.loads(Path(path).read_text())
    assert record["features_per_s"] == 1200.123456 and record["n_batches"] == 13 and record["answer_agreement"] == 0.9
    # the parent's verdict is a value and the first word of its name, not only the status icon
    assert parent.data.metrics["verdict_pass"] == 0.0 and parent.data.tags["parity"] == "FAIL"
    assert parent.info.run_name == "FAIL 20260101-000000-tiny" and parent.info.status == "FAILED"


def test_each_bench_saves_its_view_and_prints_its_links(tmp_path):
    """MLflow's saved view (experiment tag mlflow.sharedViewState.<key>, opened by
    ?viewStateShareKey=<key>) with the comparison's columns, this bench's runs grouped by kind."""
    tracker, client, parent, kids = _bench(tmp_path)
    exp = client.get_experiment(tracker.experiment_id)
    key = exp.tags["bertqa.latestView"]
    assert key == parent.info.run_id
    envelope = json.loads(exp.tags[f"mlflow.sharedViewState.{key}"])
    assert envelope["name"] == "bench 20260101-000000-tiny (PASS)" and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    assert state["selectedColumns"][:6] == ["tags.`parity`", "metrics.`Speedup`", "metrics.`Time_s`",
                                            "metrics.`Parity_pass`", "metrics.`features_per_s`", "metrics.`exact_match`"]
    assert state["selectedColumns"][-1] == "tags.`recommendation`"
    # the chart mode plots every run of the bench, not MLflow's first 10, and opens on the
    # comparison's bar charts, one a row (MLflow's legend gives each two lines of names)
    assert state["runsHiddenMode"] == "SHOW_ALL"
    assert [c["metricKey"] for c in state["compareRunCharts"]][:3] == ["Speedup", "Time_s", "Parity_pass"]
    assert state["compareRunSections"][0]["columns"] == 1
    assert "metrics.`verdict_pass`" in state["selectedColumns"] and state["columnOrder"] == state["selectedColumns"]
    assert "metrics.`peak_gpu_mib`" not in state["selectedColumns"]  # no CUDA row here: no empty GPU column
    # the filter keeps exactly this bench's runs
    hits = client.search_runs([tracker.experiment_id], state["searchFilter"])
    assert sorted(r.info.run_id for r in hits) == sorted([parent.info.run_id, *(r.info.run_id for r in kids.values())])
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "kind"}]
    view, compare = tracker.links()
    assert f"#/experiments/{tracker.experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning" in view
    assert "#/compare-runs?runs=" in compare and "workflowType=machine_learning" in compare
    from urllib.parse import parse_qs, unquote, urlsplit

    query = parse_qs(urlsplit(unquote(compare).split("#", 1)[1]).query)
    assert json.loads(query["runs"][0]) == [kids[b].info.run_id for b in ("eager-fp32", "onnxruntime", "eager-fp16")]
    assert json.loads(query["experiments"][0]) == [tracker.experiment_id]


def test_backends_have_their_plot_colour_in_mlflow(tmp_path):
    from bertqa_bench.reporting.colors import for_results

    tracker, client, parent, kids = _bench(tmp_path)
    colour = for_results(_bundle(tmp_path / "again").results)
    for name, run in kids.items():
        assert run.data.tags["mlflow.runColor"] == colour(name)


def test_backend_colours_are_distinct_and_shared_by_a_family():
    from bertqa_bench.reporting.colors import BackendColors

    names = ["eager-fp32", "torch-compile", "onnxruntime", "onnxruntime-int8", "eager-bf16-cpu", "eager-fp32-sorted",
             "onnxruntime-sorted"]
    colour = BackendColors(names)
    assert len({colour(n) for n in names}) == len(names)
    # a length-aware row is its padded row's hue, lighter: onnxruntime / -sorted are related, never equal
    assert colour("onnxruntime-sorted") != colour("onnxruntime")
    assert colour("onnxruntime@b64-sorted") == colour("onnxruntime-sorted")
    assert colour("onnxruntime@b64-padded") == colour("onnxruntime", "padded")


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


def test_make_mlflow_ui_prints_the_latest_bench_links(tmp_path):
    from bertqa_bench.reporting.tracking import ui_links

    tracker, client, parent, kids = _bench(tmp_path)
    lines = ui_links(tmp_path / "store")
    assert lines[0].startswith("bertqa-tiny: ") and lines[0].endswith(
        f"#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning")
    assert any(f"viewStateShareKey={parent.info.run_id}&" in line for line in lines)
    assert any("#/compare-runs?runs=" in line and all(r.info.run_id in line for r in kids.values()) for line in lines)
