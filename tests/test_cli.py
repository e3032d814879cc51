import json

import pytest

from bertqa_bench.cli import main
from bertqa_bench.data.types import Answer, QAExample
from bertqa_bench.data.squad import write_squad_json
from bertqa_bench.results import write_csv


def _dataset(tmp_path):
    ex = [QAExample("q1", "Where was Ada born?", "Ada was born in Teluma in 1874.", (Answer("Teluma", 16),), "t"),
          QAExample("q2", "When was Ada born?", "Ada was born in Teluma in 1874.", (Answer("1874", 26),), "t")]
    p = tmp_path / "dev-v1.1.json"
    write_squad_json(ex, p)
    return p


def test_score_prints_official_json(tmp_path, capsys):
    data = _dataset(tmp_path)
    preds = tmp_path / "preds.json"
    preds.write_text(json.dumps({"q1": "Teluma", "q2": "in 1874"}))
    assert main(["score", str(data), str(preds)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact_match"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)


def test_score_rejects_a_bad_predictions_file(tmp_path, capsys):
    data = _dataset(tmp_path)
    preds = tmp_path / "preds.json"
    preds.write_text("[1, 2]")
    assert main(["score", str(data), str(preds)]) == 2
    assert "preds.json" in capsys.readouterr().err


def test_unknown_backend_lists_valid_names(capsys):
    assert main(["bench", "--suite", "default", "--backends", "eager-fp32,tensor-rt", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "tensor-rt" in err and "tensorrt-fp16" in err and "onnxruntime" in err


def test_unknown_suite_is_a_clear_error(capsys):
    assert main(["bench", "--suite", "nope", "--no-mlflow"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_backends_lists_every_registered_name(capsys):
    from bertqa_bench import backends

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in backends.names():
        assert name in out
    assert "tensorrt" in out and "pip install tensorrt" in out  # the missing package is named


def test_report_and_reference_tables(tmp_path, capsys):
    run = tmp_path / "20260101-000000-x"
    rows = [{"backend": "eager-fp32", "status": "ok", "precision": "fp32", "device": "cpu", "predict_s": 2.0,
             "speedup": 1.0, "pct_change_vs_ref": 0.0, "features_per_s": 50, "exact_match": 60, "f1": 70,
             "answer_agreement": 1.0, "max_abs_logit_diff": 0.0, "parity": "pass", "prepare_s": 0.1},
            {"backend": "onnxruntime", "status": "ok", "precision": "fp32", "device": "cpu", "predict_s": 1.0,
             "speedup": 2.0, "pct_change_vs_ref": -50.0, "features_per_s": 100, "exact_match": 60, "f1": 70,
             "answer_agreement": 1.0, "max_abs_logit_diff": 1e-5, "parity": "pass", "prepare_s": 3.0},
            {"backend": "tensorrt-fp16", "status": "not run", "error": "needs tensorrt"}]
    write_csv(run / "results.csv", rows)
    assert main(["report", str(run)]) == 0
    md = (run / "summary.md").read_text()
    assert "| onnxruntime | fp32 | 1.000 | -50.0% | 2.00× |" in md
    assert "tensorrt-fp16" in md and "needs tensorrt" in md
    assert main(["reference", str(run), "--out", str(tmp_path / "ref"), "--title", "T"]) == 0
    assert (tmp_path / "ref.csv").read_text().count("\n") == 4


def test_track_imports_a_bundle_made_without_mlflow(tmp_path, monkeypatch, capsys):
    run = tmp_path / "device-20260101-000000-gpu-timing"
    rows = [{"backend": "eager-fp32-cuda", "status": "ok", "precision": "fp32", "predict_s": 20.0, "f1": 3.0},
            {"backend": "ort-cuda-fp16", "status": "ok", "precision": "fp16", "predict_s": 2.0, "f1": 3.0}]
    write_csv(run / "results.csv", rows)
    (run / "config.json").write_text(json.dumps({"name": "gpu-timing"}))
    (run / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3"}))
    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["track", str(run)]) == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bertqa-gpu-timing")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.data.params["backend"] for r in children) == ["eager-fp32-cuda", "ort-cuda-fp16"]
    assert all(r.data.tags["env.gpu"] == "NVIDIA H100 80GB HBM3" for r in children)
    assert {r.data.metrics["predict_s"] for r in children} == {20.0, 2.0}
