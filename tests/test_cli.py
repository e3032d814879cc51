import csv
import json
import shutil
from pathlib import Path

import pytest

from bertqa_bench.cli import main
from bertqa_bench.tasks.squad.types import Answer, QAExample
from bertqa_bench.tasks.squad.reader import write_squad_json
from bertqa_bench.record.results import BackendResult, RunBundle, RunMeta


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


def test_score_accepts_what_the_official_script_accepts(tmp_path, capsys):
    # misaligned answer_start, empty answer text, a duplicate id, no question/answer_start: the
    # official evaluate-v1.1.py reads only ids and answer texts, so it scores this file.
    qas = [{"id": "q1", "question": "Where?", "answers": [{"text": "Teluma", "answer_start": 0}]},
           {"id": "q2", "answers": [{"text": ""}, {"text": "1874", "answer_start": 26}]},
           {"id": "q1", "question": "Again?", "answers": [{"text": "Teluma", "answer_start": 16}]},
           {"id": "q3", "question": "Who?", "answers": [{"text": "Ada", "answer_start": 0}]}]
    data = tmp_path / "dev.json"
    data.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "Ada was born in Teluma in 1874.", "qas": qas}]}]}))
    preds = tmp_path / "preds.json"
    preds.write_text(json.dumps({"q1": "Teluma", "q2": "1874"}))
    assert main(["score", str(data), str(preds)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # q1 twice (both right), q2 right, q3 unanswered: 3 of 4
    assert out["exact_match"] == pytest.approx(75.0) and out["f1"] == pytest.approx(75.0)
    assert (out["n_questions"], out["n_answered"], out["n_unknown_ids"]) == (4, 3, 0)
    assert "Unanswered question q3 will receive score 0." in captured.err
    warning = next(line for line in captured.err.splitlines() if line.startswith("warning:"))
    for part in ("dev.json", "1 answer(s) whose answer_start does not match the context", "1 empty answer text(s)",
                 "1 duplicate question id(s)", "1 question(s) without a string 'question'",
                 "1 answer(s) without an integer 'answer_start'"):
        assert part in warning


def test_score_rejects_a_dataset_without_questions(tmp_path, capsys):
    data = tmp_path / "dev.json"
    data.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": []}]}))
    preds = tmp_path / "preds.json"
    preds.write_text("{}")
    assert main(["score", str(data), str(preds)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "dev.json" in captured.err and "no questions" in captured.err


def test_unknown_backend_lists_valid_names(capsys):
    assert main(["bench", "--suite", "default", "--backends", "eager-fp32,tensor-rt", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "tensor-rt" in err and "tensorrt-fp16" in err and "ort-fp32" in err


def test_unknown_suite_is_a_clear_error(capsys):
    assert main(["bench", "--suite", "nope", "--no-mlflow"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_backends_lists_the_catalogue_by_device_and_all_with_all(capsys):
    from bertqa_bench.backends import default_table
    from bertqa_bench.backends.variants import CATALOGUE

    table = default_table()
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    cpu, cuda = out.index("\nCPU\n"), out.index("\nCUDA GPU")
    for d in CATALOGUE:  # each under its device's heading, with its one line of when to use it
        line = next(x for x in out[cpu if d["device"] == "cpu" else cuda:].splitlines()
                    if x.split()[:1] == [d["name"]])
        assert line.rstrip().endswith(d["when"]) or f"{d['when']} [not here:" in line, line
        assert line.split()[3] in ("yes", "no"), line  # whether it can run here
    research = [d["name"] for d in table.declarations("experiments")]
    assert research and f"+ {len(research)} research and superseded variants" in out
    assert not any(f"\n  {n} " in out for n in research)
    assert "onnxruntime -> ort-fp32" in out  # the old names that still resolve
    assert "tensorrt" in out and "pip install tensorrt" in out  # the missing package is named
    assert main(["backends", "--all"]) == 0
    out = capsys.readouterr().out
    for name in table.names():
        assert f"\n  {name} " in out, name


def _bundle(run_dir, suite="x", results=()):
    meta = RunMeta(suite=suite, run_id=run_dir.name, task="squad", metric_names=["exact_match", "f1"],
                   metric_labels={"exact_match": "EM", "f1": "F1"},
                   primary_metric="f1", reference=results[0].backend, command="bertqa-bench bench --suite x",
                   date="2026-01-01", model="m", batching="padded", batch_size=16, max_seq_len=192)
    b = RunBundle.create(run_dir.parent, meta, {"name": suite}, {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11"})
    for r in results:
        b.add(r)
    return b


def _ok(name, predict_s, speedup, pct, **kw):
    return BackendResult(name, precision="fp32", device="cpu", batching="padded", predict_s=predict_s,
                         speedup=speedup, pct_change_vs_ref=pct, features_per_s=100 / predict_s,
                         scores={"exact_match": 60.0, "f1": 70.0}, answer_agreement=1.0, max_abs_logit_diff=0.0,
                         parity="pass", prepare_s=0.1, **kw)


def test_report_and_reference_tables_are_views_of_the_records(tmp_path, capsys):
    run = tmp_path / "20260101-000000-x"
    b = _bundle(run, results=[_ok("eager-fp32", 2.0, 1.0, 0.0),
                              _ok("onnxruntime", 1.0, 2.0, -50.0, prepare_host_peak_mib=7962.0, predict_host_peak_mib=4721.4),
                              BackendResult("tensorrt-fp16", status="not run", error="needs tensorrt")])
    # the bundle loads back into the same records
    back = RunBundle.load(run)
    assert [r.backend for r in back.results] == ["eager-fp32", "onnxruntime", "tensorrt-fp16"]
    assert back.results[1].scores == {"exact_match": 60.0, "f1": 70.0} and back.results[1].speedup == 2.0
    assert back.results[2].status == "not run" and back.meta.command == b.meta.command
    assert main(["report", str(run)]) == 0
    md = (run / "summary.md").read_text()
    assert "| onnxruntime | fp32 | padded | 1.000 | -50.0% | 2.00× |" in md
    assert "tensorrt-fp16" in md and "needs tensorrt" in md
    # host memory: prepare's peak beside prediction's
    assert "Peak host MiB (prepare / predict)" in md and "| 7,962 / 4,721 |" in md
    assert "Command: `bertqa-bench bench --suite x`" in md  # from run.json, not parsed out of markdown
    assert main(["reference", str(run), "--out", str(tmp_path / "ref"), "--title", "T"]) == 0
    assert (tmp_path / "ref.csv").read_text().count("\n") == 4
    assert "Date: 2026-01-01" in (tmp_path / "ref.md").read_text()
    # the same run id twice (one plan run on two machines): each section names its bundle
    again = tmp_path / "x-again"
    shutil.copytree(run, again)
    assert main(["reference", str(run), str(again), "--out", str(tmp_path / "ref2"), "--title", "T"]) == 0
    ref2 = (tmp_path / "ref2.md").read_text()
    assert f"run `{run.name}`\n" in ref2 and f"run `{run.name}` (bundle `x-again`)\n" in ref2
    assert {r["bundle"] for r in csv.DictReader(open(tmp_path / "ref2.csv"))} == {run.name, "x-again"}


def test_source_digest_names_the_code_and_follows_its_content(tmp_path, monkeypatch):
    from bertqa_bench import envinfo

    pkg = tmp_path / "bertqa_bench"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "backends" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(envinfo, "PROJECT_ROOT", tmp_path)
    first = envinfo.source_digest()
    assert len(first) == 12 and first == envinfo.source_digest()
    (pkg / "backends" / "b.py").write_text("y = 3\n")
    assert envinfo.source_digest() != first


def test_track_imports_a_bundle_made_without_mlflow(tmp_path, monkeypatch, capsys):
    run = tmp_path / "device-20260101-000000-gpu-timing"
    _bundle(run, "gpu-timing", [BackendResult("eager-fp32-cuda", precision="fp32", predict_s=20.0, scores={"f1": 3.0}),
                                BackendResult("ort-cuda-fp16", precision="fp16", predict_s=2.0, scores={"f1": 3.0})])
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
    # the whole record is each child's result.json (its metrics are the table's few columns)
    records = [json.loads(Path(client.download_artifacts(r.info.run_id, "result.json", str(tmp_path))).read_text())
               for r in children]
    assert {rec["predict_s"] for rec in records} == {20.0, 2.0}


@pytest.mark.slow
def test_sweep_runs_a_grid_against_one_reference_and_picks_the_best_point_at_parity(tiny_suite, capsys):
    suite = tiny_suite(backends=["eager-fp32"], bench={"backends": ["eager-fp32"], "batch_size": 8,
                                                         "warmup_batches": 1, "min_passes": 1, "min_duration_s": 0,
                                                         "isolation": "inprocess"})
    assert main(["sweep", "--suite", str(suite), "--backends", "eager-fp32", "--batch-sizes", "4,16",
                 "--batchings", "padded,sorted", "--no-mlflow", "--no-progress"]) == 0
    out = capsys.readouterr().out
    run = Path(out.split("results: ")[-1].strip())
    bundle = RunBundle.load(run)
    names = [r.backend for r in bundle.results]
    assert names == ["eager-fp32", "eager-fp32@b4-padded", "eager-fp32@b16-padded", "eager-fp32@b4-sorted",
                     "eager-fp32@b16-sorted"]
    point = {r.backend: r for r in bundle.results}["eager-fp32@b16-sorted"]
    assert point.batch_size == 16 and point.batching == "sorted" and point.parity == "pass"
    assert "| eager-fp32 |" in (run / "sweep.md").read_text() and (run / "sweep.png").stat().st_size > 1000
    # the recommendation: printed after the tables, first in sweep.md; 18 questions decide no
    # verdict (every pass lies within their noise), and it says so, point by point
    assert out.index("Best configuration per backend") < out.index("Recommendation (from this run")
    assert "- None: no backend passed parity decidedly." in out
    assert "  - eager-fp32@b16-sorted: parity pass, not decided (within noise: ~" in out
    assert (run / "sweep.md").read_text().split("\n")[2].startswith("Recommendation (from this run")


def test_memory_columns_are_mib_and_old_mb_columns_load_back():
    """The memory fields hold MiB (2**20 bytes) and say so; bundles and reference CSVs written
    before the rename (``*_mb`` columns, which held MiB too) load into the same fields unchanged."""
    from bertqa_bench.record.results import BackendResult

    names = {f.name for f in __import__("dataclasses").fields(BackendResult)}
    assert "predict_host_peak_mib" in names and not any(n.endswith("_mb") for n in names)
    old = BackendResult.from_row({"backend": "x", "predict_host_peak_mb": "4721.4", "predict_device_used_mb": "7300"})
    assert old.predict_host_peak_mib == 4721.4 and old.predict_device_used_mib == 7300.0
    new = BackendResult.from_row({"backend": "x", "predict_host_peak_mib": "12.5", "predict_host_peak_mb": "99"})
    assert new.predict_host_peak_mib == 12.5  # a new column wins over a stale old one
