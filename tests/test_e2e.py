"""End to end on a tiny model: data -> train -> every variant in its own process -> results,
report and MLflow; crashes, hangs and exceptions cost only their own row."""
import json
import os
import sys

import pytest

from bertqa_bench.bench import run_bench
from bertqa_bench.errors import UnknownBackendError
from bertqa_bench.parity_check import run_parity_check
from bertqa_bench.results import RunBundle
from bertqa_bench.suite import load_suite
from bertqa_bench.tracking import Tracker

pytestmark = pytest.mark.slow

PLUGINS = "tests.backend_plugins"


def _children(tracker, suite="tiny"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name(f"bertqa-{suite}")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "bench"]
    assert len(parents) == 1
    return parents[0], [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]


def test_end_to_end_cpu(tiny_suite, tmp_path):
    suite = tiny_suite(backends=["eager-fp32", "onnxruntime", "exploding", "eager-fp16", "sorted-eager"],
                       variants={"exploding": {"implementation": f"{PLUGINS}:Exploding", "device": "cpu"},
                                 "sorted-eager": {"base": "eager-fp32", "options": {"num_threads": 1}}})
    cfg = load_suite(str(suite))
    tracker = Tracker(cfg.results_root)
    out = run_bench(cfg, tracker=tracker, progress=False)

    bundle = RunBundle.load(out.run_dir)
    rows = {r.backend: r for r in bundle.results}
    assert list(rows) == ["eager-fp32", "onnxruntime", "exploding", "eager-fp16", "sorted-eager"]
    ref, ort = rows["eager-fp32"], rows["onnxruntime"]
    assert ref.ok and ort.ok
    # one backend failing is recorded and loses nothing else
    assert rows["exploding"].status == "failed" and "kaboom" in rows["exploding"].error
    # a CUDA backend on a CPU machine is "not run" with its reason, never faked
    assert rows["eager-fp16"].status == "not run" and "CUDA" in rows["eager-fp16"].error
    for col in ("prepare_s", "predict_s", "latency_p50_ms", "latency_p99_ms", "features_per_s", "questions_per_s",
                "speedup", "answer_agreement", "max_abs_logit_diff", "end_to_end_s", "predict_host_peak_mb"):
        assert getattr(ort, col) is not None, col
    assert ort.n_passes == 2 and ort.predict_min_s <= ort.predict_s <= ort.predict_max_s
    assert set(ort.scores) == {"exact_match", "f1"} and ort.n_compared == ref.n_questions
    assert ref.speedup == pytest.approx(1.0) and ref.model_params > 0
    assert ref.n_features >= ref.n_questions > 0
    assert ort.parity == "pass", ort.parity_failures
    assert ort.max_abs_logit_diff < 1e-3
    assert "not measured" in ort.energy_note  # a CPU without a readable RAPL counter says so
    assert rows["sorted-eager"].parity == "pass" and rows["sorted-eager"].max_abs_logit_diff == 0.0
    assert out.verdict.status == "FAIL" and "exploding" in str(out.verdict)
    # bundle
    assert (out.run_dir / "summary.md").read_text().count("| onnxruntime |") == 1
    assert (out.run_dir / "comparison.png").stat().st_size > 1000
    preds = json.loads((out.run_dir / "predictions" / "onnxruntime.json").read_text())
    assert len(preds) == ref.n_questions
    assert (out.run_dir / "outputs" / "eager-fp32.npz").exists()  # the reference's logits stay
    assert not (out.run_dir / "outputs" / "onnxruntime.npz").exists()
    assert "kaboom" in (out.run_dir / "logs" / "exploding.log").read_text()
    # MLflow: a parent run and one child per backend, failed ones included
    parent, children = _children(tracker)
    assert sorted(r.data.params["backend"] for r in children) == sorted(rows)
    ort_run = next(r for r in children if r.data.params["backend"] == "onnxruntime")
    assert ort_run.data.metrics["f1"] == pytest.approx(ort.scores["f1"], abs=1e-3)
    assert ort_run.data.tags["parity"] == "pass"
    assert parent.data.tags["verdict"] == "FAIL" and parent.info.status == "FAILED"
    # a second run reuses the trained model and the cached evaluation set
    logs = []
    again = run_bench(cfg, backends=["eager-fp32"], progress=False, log=logs.append)
    assert any("reusing" in m for m in logs) and again.evalset.cache_hit
    assert again.verdict.status == "PASS"


def _plugin_dist(site):
    """A made-up installed package that registers backends through the entry-point group."""
    dist = site / "breakers-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: breakers\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[bertqa_bench.backends]\n"
        f"segfault = {PLUGINS}:Segfault\n"
        f"hang = {PLUGINS}:Hang\n")


def test_a_crash_and_a_hang_between_working_backends_lose_nothing(tiny_suite, tmp_path, monkeypatch):
    site = tmp_path / "site"
    _plugin_dist(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    suite = tiny_suite(backends=["eager-fp32", "segfault", "onnxruntime", "hang", "torch-compile"],
                       variants={"hang": {"implementation": "hang", "device": "cpu", "timeout_s": 25}})
    cfg = load_suite(str(suite))
    tracker = Tracker(cfg.results_root)
    out = run_bench(cfg, tracker=tracker, progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    assert list(rows) == ["eager-fp32", "segfault", "onnxruntime", "hang", "torch-compile"]
    assert rows["segfault"].status == "failed" and "SIGSEGV" in rows["segfault"].error
    assert rows["hang"].status == "failed" and "timed out after 25 s" in rows["hang"].error
    for name in ("eager-fp32", "onnxruntime", "torch-compile"):
        assert rows[name].ok and rows[name].parity == "pass" and rows[name].predict_s > 0, name
    parent, children = _children(tracker)
    assert sorted(r.data.params["backend"] for r in children) == sorted(rows)
    assert {r.data.params["backend"]: r.info.status for r in children}["segfault"] == "FAILED"
    assert parent.info.status == "FAILED" and "segfault" in parent.data.tags["verdict_reasons"]


def test_unknown_backend_fails_before_any_work(tiny_suite):
    with pytest.raises(UnknownBackendError) as e:
        load_suite(str(tiny_suite(backends=["eager-fp32", "onnx-runtime"])))
    assert "onnxruntime" in str(e.value) and "onnx-runtime" in str(e.value)


def test_a_suite_variant_with_a_typo_in_its_options_fails_before_any_work(tiny_suite):
    from bertqa_bench.errors import ConfigError

    suite = tiny_suite(backends=["eager-fp32", "mine"],
                       variants={"mine": {"base": "onnxruntime", "options": {"opt_levle": 2}}})
    with pytest.raises(ConfigError, match="opt_levle.*valid: .*opt_level"):
        load_suite(str(suite))


def test_parity_gate_fails_on_a_broken_backend(tiny_suite, tmp_path, capsys):
    suite = tiny_suite(backends=["eager-fp32", "perturbed"],
                       variants={"perturbed": {"implementation": f"{PLUGINS}:Perturbed", "device": "cpu"}},
                       bench={"backends": ["eager-fp32", "perturbed"], "batch_size": 8, "warmup_batches": 1,
                              "min_passes": 1, "min_duration_s": 0, "isolation": "inprocess"})
    cfg = load_suite(str(suite), ["parity.expected_file=" + str(tmp_path / "expected.csv")])
    ok = run_parity_check(cfg, progress=False)
    err = capsys.readouterr()
    assert ok is False
    assert "perturbed" in err.err and "agreement" in err.err
    assert "perturbed" in err.out  # the table names it
    assert "determinism of eager-fp32 (two processes)" in err.out and "identical answers: True" in err.out


def test_profile_writes_a_trace_and_top_table(tiny_suite):
    from bertqa_bench.profile import profile_backend

    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    out = profile_backend(cfg, "eager-fp32", n_batches=2, top=10)
    trace = json.loads(out["trace"].read_text())
    assert trace["traceEvents"], "empty trace"
    assert out["top_csv"].read_text().startswith("name,calls")
    assert any("addmm" in r["name"] or "linear" in r["name"] for r in out["rows"])  # the matmuls are there


def test_malformed_dataset_fails_clearly_and_writes_nothing(tiny_suite, tmp_path, capsys):
    from bertqa_bench.cli import main

    bad = tmp_path / "dev-v1.1.json"
    bad.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "Ada was born in Teluma.", "qas": [{"id": "q1", "question": "Where?",
                                                        "answers": [{"text": "Paris", "answer_start": 16}]}]}]}]}))
    suite = tiny_suite(backends=["eager-fp32"], data={"source": "squad-json", "train_file": str(bad),
                                                       "dev_file": str(bad)})
    assert main(["bench", "--suite", str(suite), "--no-mlflow", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "answer_start" in err and "q1" in err
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").glob("*/results.csv"))
