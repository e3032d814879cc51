"""A tiny end-to-end run: generate data, train a tiny BERT, benchmark CPU backends, report, MLflow."""
import json

import numpy as np
import pytest

from bertqa_bench import backends as registry
from bertqa_bench.backends.base import Backend
from bertqa_bench.bench import run_bench
from bertqa_bench.config import load_suite
from bertqa_bench.errors import UnknownBackendError
from bertqa_bench.parity_check import run_parity_check
from bertqa_bench.results import read_csv
from bertqa_bench.tracking import Tracker

pytestmark = pytest.mark.slow


class _Wrapping(Backend):
    """Test-only backends that wrap eager-fp32 to break it on purpose."""

    precision = "fp32"
    parity_class = "fp32"

    def prepare(self, ctx):
        self.inner = registry.create("eager-fp32")
        self.inner.prepare(ctx)

    def close(self):
        self.inner.close()


class Exploding(_Wrapping):
    def predict(self, batch):
        raise RuntimeError("kaboom on purpose")


class Perturbed(_Wrapping):
    """Swaps the start logits of each feature around: answers move, the gate must notice."""

    def predict(self, batch):
        out = self.inner.predict(batch)
        rng = np.random.default_rng(0)
        return {k: (v + rng.normal(scale=5.0, size=v.shape).astype(np.float32)) for k, v in out.items()}


@pytest.fixture(scope="module", autouse=True)
def _register_test_backends():
    from bertqa_bench.backends import registry as reg

    reg._ensure_loaded()
    for name, cls in (("test-exploding", Exploding), ("test-perturbed", Perturbed)):
        reg._REGISTRY.pop(name, None)
        reg.register(name, cls)
    yield
    for name in ("test-exploding", "test-perturbed"):
        reg._REGISTRY.pop(name, None)


def test_end_to_end_cpu(tiny_suite, tmp_path):
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32", "onnxruntime", "test-exploding", "eager-fp16"])))
    tracker = Tracker(cfg.results_root)
    out = run_bench(cfg, tracker=tracker, progress=False)

    rows = {r["backend"]: r for r in read_csv(out.run_dir / "results.csv")}
    assert list(rows) == ["eager-fp32", "onnxruntime", "test-exploding", "eager-fp16"]
    ref, ort = rows["eager-fp32"], rows["onnxruntime"]
    assert ref["status"] == "ok" and ort["status"] == "ok"
    # one backend failing is recorded and loses nothing else
    assert rows["test-exploding"]["status"] == "failed" and "kaboom" in rows["test-exploding"]["error"]
    # a CUDA backend on a CPU machine is "not run" with its reason, never faked
    assert rows["eager-fp16"]["status"] == "not run" and rows["eager-fp16"]["error"]
    for col in ("prepare_s", "predict_s", "latency_p50_ms", "latency_p99_ms", "features_per_s", "exact_match",
                "f1", "speedup", "answer_agreement", "max_abs_logit_diff"):
        assert ort[col] != "", col
    assert float(ref["speedup"]) == pytest.approx(1.0)
    assert int(ref["n_features"]) >= int(ref["n_questions"]) > 0
    assert ort["parity"] == "pass", ort.get("parity_failures")
    assert float(ort["max_abs_logit_diff"]) < 1e-3
    # bundle
    assert (out.run_dir / "summary.md").read_text().count("| onnxruntime |") == 1
    assert (out.run_dir / "comparison.png").stat().st_size > 1000
    preds = json.loads((out.run_dir / "predictions" / "onnxruntime.json").read_text())
    assert len(preds) == int(ref["n_questions"])
    # MLflow: a parent run and one child per backend
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name("bertqa-tiny")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "bench-all"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1
    assert sorted(r.data.params["backend"] for r in children) == sorted(rows)
    ort_run = next(r for r in children if r.data.params["backend"] == "onnxruntime")
    assert ort_run.data.metrics["f1"] == pytest.approx(float(ort["f1"]), abs=1e-3)
    assert ort_run.data.tags["parity"] == "pass"
    # a second run reuses the trained model
    logs = []
    run_bench(cfg, backends=["eager-fp32"], progress=False, log=logs.append)
    assert any("reusing" in m for m in logs)


def test_unknown_backend_fails_before_any_work(tiny_suite):
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32", "onnx-runtime"])))
    with pytest.raises(UnknownBackendError) as e:
        run_bench(cfg, progress=False)
    assert "onnxruntime" in str(e.value) and "onnx-runtime" in str(e.value)
    assert not cfg.model_dir.exists()


def test_parity_gate_fails_on_a_broken_backend(tiny_suite, tmp_path, capsys):
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32", "test-perturbed"])),
                     ["parity.expected_file=" + str(tmp_path / "expected.csv")])
    ok = run_parity_check(cfg, progress=False)
    err = capsys.readouterr()
    assert ok is False
    assert "test-perturbed" in err.err and "agreement" in err.err
    assert "test-perturbed" in err.out  # the table names it


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
