"""End to end on a tiny model: data -> train -> every variant in its own process -> results,
report and MLflow; crashes, hangs and exceptions cost only their own row."""
import json
import statistics
import os
import sys

import pytest

from bertqa_bench.commands.bench import run_bench
from bertqa_bench.errors import UnknownBackendError
from bertqa_bench.commands.parity_gate import run_parity_check
from bertqa_bench.record.results import RunBundle
from bertqa_bench.suite import load_suite
from bertqa_bench.reporting.tracking import Tracker

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


def test_end_to_end_cpu(tiny_suite, tmp_path, monkeypatch):
    import bertqa_bench.training.train as train_mod

    def evaluated_twice(*a, **kw):
        raise AssertionError("the bench's reference row repeats this evaluation: it must not run")

    monkeypatch.setattr(train_mod, "evaluate_model", evaluated_twice)
    suite = tiny_suite(backends=["eager-fp32", "ort-fp32", "exploding", "eager-fp16", "sorted-eager"],
                       variants={"exploding": {"implementation": f"{PLUGINS}:Exploding", "device": "cpu"},
                                 "sorted-eager": {"base": "eager-fp32", "batching": "sorted"}})
    cfg = load_suite(str(suite))
    tracker = Tracker(cfg.results_root)
    out = run_bench(cfg, tracker=tracker, progress=False)

    bundle = RunBundle.load(out.run_dir)
    rows = {r.backend: r for r in bundle.results}
    assert list(rows) == ["eager-fp32", "ort-fp32", "exploding", "eager-fp16", "sorted-eager"]
    ref, ort = rows["eager-fp32"], rows["ort-fp32"]
    assert ref.ok and ort.ok
    # one backend failing is recorded and loses nothing else
    assert rows["exploding"].status == "failed" and "kaboom" in rows["exploding"].error
    # a CUDA backend on a CPU machine is "not run" with its reason, never faked
    assert rows["eager-fp16"].status == "not run" and "CUDA" in rows["eager-fp16"].error
    for col in ("prepare_s", "predict_s", "latency_p50_ms", "latency_p99_ms", "features_per_s", "questions_per_s",
                "speedup", "answer_agreement", "max_abs_logit_diff", "end_to_end_s", "predict_host_peak_mib"):
        assert getattr(ort, col) is not None, col
    # interleaved rounds: one pass a round, at least min_passes (2), at most max_rounds (4)
    assert ort.timing_mode == "rounds" and 2 <= ort.n_passes == ort.rounds <= 4
    # each row's passes from two worker processes taking turns by round (bench.processes); the
    # row's answers are its first process's, the second's outputs are not kept
    assert ort.processes == 2 and ref.processes == 2 and bundle.meta.rounds["processes"]["ort-fp32"][:2] == [0, 1]
    assert (out.run_dir / "logs" / "ort-fp32-p2.log").exists()
    assert not (out.run_dir / "outputs" / "ort-fp32-p2.npz").exists()
    assert ort.predict_min_s <= ort.predict_s <= ort.predict_max_s
    assert set(ort.scores) == {"exact_match", "f1"} and ort.n_compared == ref.n_questions
    # speedup = the median over rounds of the reference's pass / the backend's pass of the same
    # round, both from this run (not 1.0 by construction); run.json keeps every pass of every round
    passes = bundle.meta.rounds["passes"]
    assert len(passes["ort-fp32"]) == len(passes["eager-fp32"]) == ort.rounds
    assert len(bundle.meta.rounds["calibration_s"]) == ort.rounds and bundle.meta.calibration_cv_pct is not None
    ratios = [a / b for a, b in zip(passes["eager-fp32"], passes["ort-fp32"])]
    assert ort.speedup == pytest.approx(statistics.median(ratios), rel=2e-5)
    assert ort.speedup_low <= ort.speedup <= ort.speedup_high and ref.model_params > 0
    assert ref.n_features >= ref.n_questions > 0
    assert ort.parity == "pass", ort.parity_failures
    assert ort.max_abs_logit_diff < 1e-3
    assert "not measured" in ort.energy_note  # a CPU without a readable RAPL counter says so
    # a length-sorted variant beside padded ones, against the same padded reference: same answers
    srt = rows["sorted-eager"]
    assert srt.batching == "sorted" and ref.batching == "padded" and srt.n_shapes > 1
    assert srt.parity == "pass" and srt.answer_agreement == 1.0 and srt.max_abs_logit_diff < 1e-4
    assert out.verdict.status == "FAIL" and "exploding" in str(out.verdict)
    # the model trained for this run was not evaluated on its own: the reference row's scores are
    # its dev scores, in every row, the run's note and its train_metrics.json (for later runs)
    saved = json.loads((cfg.model_dir / "train_metrics.json").read_text())
    f1 = pytest.approx(ref.scores["f1"], abs=1e-6)  # results.csv keeps 9 decimals
    assert saved["dev_f1"] == f1 and saved["dev_exact_match"] == pytest.approx(ref.scores["exact_match"], abs=1e-6)
    assert saved["dev_source"] == f"the reference row (eager-fp32) of bench run {bundle.meta.run_id}"
    assert all(r.model_dev_f1 == f1 for r in rows.values()) and bundle.meta.model_dev_metric == f1
    assert bundle.meta.model_note.startswith("fine-tuned by bertqa-bench train; dev exact_match=")
    # bundle
    assert (out.run_dir / "summary.md").read_text().count("| ort-fp32 |") == 1
    assert (out.run_dir / "comparison.png").stat().st_size > 1000
    preds = json.loads((out.run_dir / "predictions" / "ort-fp32.json").read_text())
    assert len(preds) == ref.n_questions
    assert (out.run_dir / "outputs" / "eager-fp32.npz").exists()  # the reference's logits stay
    assert not (out.run_dir / "outputs" / "ort-fp32.npz").exists()
    assert "kaboom" in (out.run_dir / "logs" / "exploding.log").read_text()
    # MLflow: a parent run and one child per backend, failed ones included
    parent, children = _children(tracker)
    assert sorted(r.data.params["backend"] for r in children) == sorted(rows)
    ort_run = next(r for r in children if r.data.params["backend"] == "ort-fp32")
    assert ort_run.data.metrics["f1"] == pytest.approx(ort.scores["f1"], abs=1e-3)
    assert ort_run.data.tags["parity"] == "pass"
    assert parent.data.tags["verdict"] == "FAIL" and parent.info.status == "FAILED"
    # a second run reuses the trained model and the cached evaluation set
    logs = []
    again = run_bench(cfg, backends=["eager-fp32"], progress=False, log=logs.append)
    assert any("reusing" in m for m in logs) and again.evalset.cache_hit
    assert again.verdict.status == "PASS"
    assert RunBundle.load(again.run_dir).meta.model_note == bundle.meta.model_note  # read back, not re-derived


def _plugin_dist(site):
    """A made-up installed package that registers backends through the entry-point group."""
    dist = site / "breakers-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: breakers\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[bertqa_bench.backends]\n"
        f"segfault = {PLUGINS}:Segfault\n"
        f"hang = {PLUGINS}:Hang\n")


def test_one_round_starts_one_process_a_row(tiny_suite):
    """bench.max_rounds 1 (the CI gate's): round k's pass comes from process k mod n, so a second
    process would time nothing and end as a failed row. One process a row, the note saying why."""
    suite = tiny_suite(backends=["eager-fp32", "ort-fp32"],
                       bench={"backends": ["eager-fp32", "ort-fp32"], "batch_size": 8, "warmup_batches": 1,
                              "min_passes": 1, "max_rounds": 1, "min_duration_s": 0, "processes": 2})
    out = run_bench(load_suite(str(suite)), tracker=None, progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    for r in rows.values():
        assert r.ok, (r.backend, r.error)
        assert r.processes == 1 and "bench.max_rounds 1 gives the others no round" in r.processes_note, r.backend


def test_a_crash_and_a_hang_between_working_backends_lose_nothing(tiny_suite, tmp_path, monkeypatch):
    site = tmp_path / "site"
    _plugin_dist(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    suite = tiny_suite(backends=["eager-fp32", "segfault", "ort-fp32", "hang", "torch-compile-fp32"],
                       variants={"hang": {"implementation": "hang", "device": "cpu", "timeout_s": 25}})
    cfg = load_suite(str(suite))
    tracker = Tracker(cfg.results_root)
    out = run_bench(cfg, tracker=tracker, progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    assert list(rows) == ["eager-fp32", "segfault", "ort-fp32", "hang", "torch-compile-fp32"]
    assert rows["segfault"].status == "failed" and "SIGSEGV" in rows["segfault"].error
    assert rows["hang"].status == "failed" and "timed out after 25 s" in rows["hang"].error
    for name in ("eager-fp32", "ort-fp32", "torch-compile-fp32"):
        assert rows[name].ok and rows[name].parity == "pass" and rows[name].predict_s > 0, name
    parent, children = _children(tracker)
    assert sorted(r.data.params["backend"] for r in children) == sorted(rows)
    assert {r.data.params["backend"]: r.info.status for r in children}["segfault"] == "FAILED"
    assert parent.info.status == "FAILED" and "segfault" in parent.data.tags["verdict_reasons"]


def test_unknown_backend_fails_before_any_work(tiny_suite):
    with pytest.raises(UnknownBackendError) as e:
        load_suite(str(tiny_suite(backends=["eager-fp32", "onnx-runtime"])))
    assert "ort-fp32" in str(e.value) and "onnx-runtime" in str(e.value)


def test_a_suite_variant_with_a_typo_in_its_options_fails_before_any_work(tiny_suite):
    from bertqa_bench.errors import ConfigError

    suite = tiny_suite(backends=["eager-fp32", "mine"],
                       variants={"mine": {"base": "ort-fp32", "options": {"opt_levle": 2}}})
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
    from bertqa_bench.commands.profile import profile_backend

    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    out = profile_backend(cfg, "eager-fp32", n_batches=2, top=10)
    trace = json.loads(out["trace"].read_text())
    assert trace["traceEvents"], "empty trace"
    assert out["top_csv"].read_text().startswith("name,calls")
    assert any("addmm" in r["name"] or "linear" in r["name"] for r in out["rows"])  # the matmuls are there
    assert out["floors"] is None and not (out["dir"] / "floors.md").exists()  # floors: packed rows on a known card


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


def test_data_parallel_prediction_on_two_processes_gives_the_single_process_answers(tiny_suite):
    import numpy as np

    from bertqa_bench.measuring.worker import load_outputs

    suite = tiny_suite(backends=["eager-fp32", "eager-fp32-x2", "packed-fp32", "perturbed-x2"],
                       variants={"eager-fp32-x2": {"base": "eager-fp32", "devices": 2},
                                 "packed-fp32": {"base": "eager-fp32", "options": {"packed": True},
                                                 "batching": "packed"},
                                 "perturbed-x2": {"implementation": f"{PLUGINS}:Perturbed", "device": "cpu",
                                                  "devices": 2}},
                       bench={"keep_outputs": True})
    cfg = load_suite(str(suite))
    out = run_bench(cfg, progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    # A data-parallel run is judged against the logits the reference wrote: the perturbed row's
    # max |Δ logit| is the one between the two files on disk (over real tokens). Against anything
    # else (its own outputs, a fresh reference pass) this number would differ.
    written = {name: load_outputs(out.run_dir / "outputs" / f"{name}.npz") for name in ("eager-fp32", "perturbed-x2")}
    real = out.evalset.features.attention_mask.astype(bool)
    diff = max(float(np.abs(written["perturbed-x2"][k].astype(np.float64) - written["eager-fp32"][k])[real].max())
               for k in ("start_logits", "end_logits"))
    assert diff > 1.0 and rows["perturbed-x2"].max_abs_logit_diff == pytest.approx(diff, rel=1e-6)
    assert rows["perturbed-x2"].parity == "FAIL"
    dp, ref = rows["eager-fp32-x2"], rows["eager-fp32"]
    assert dp.ok and dp.n_devices == 2 and ref.n_devices == 1
    # every feature predicted once, in dataset order: the answers are the single process's
    assert dp.answer_agreement == 1.0 and dp.parity == "pass" and dp.max_abs_logit_diff < 1e-5
    assert dp.scores == ref.scores and dp.n_features == ref.n_features
    assert dp.prepare_info["data_parallel"].startswith("2 processes")
    assert "torch.distributed (gloo)" in dp.prepare_info["data_parallel"]
    rank_logs = sorted(p.name for p in (out.run_dir / "logs").glob("eager-fp32-x2.rank*.log"))
    assert rank_logs == ["eager-fp32-x2.rank0.log", "eager-fp32-x2.rank1.log"]
    # rank 0 gathered the logits over the process group and wrote the one outputs file and record
    assert sorted(p.name for p in (out.run_dir / "outputs").glob("eager-fp32-x2*")) == ["eager-fp32-x2.npz"]
    assert sorted(p.name for p in (out.run_dir / "workers").glob("eager-fp32-x2*.json")) == [
        "eager-fp32-x2.job.json", "eager-fp32-x2.json", "eager-fp32-x2.rank1.job.json"]
    assert not (out.run_dir / "barriers").exists()
    # the padding-free path through the whole bench (plan file, worker, scatter): no padding
    # tokens computed, the padded run's answers
    packed = rows["packed-fp32"]
    assert packed.ok and packed.batching == "packed" and packed.prepare_info["packed"] is True
    assert packed.answer_agreement == 1.0 and packed.parity == "pass" and packed.max_abs_logit_diff < 1e-4


def test_ddp_training_on_two_cpu_processes_takes_the_same_steps_as_one(tiny_suite, tmp_path):
    """torchrun + DDP on the gloo backend: the global batch is split over the processes, so two
    processes take exactly the optimizer steps one takes, rank 0 alone saves and evaluates."""
    import subprocess

    from bertqa_bench.measuring.launcher import child_env

    suite = tiny_suite(backends=["eager-fp32"])
    cfg = load_suite(str(suite))
    env = child_env({"OMP_NUM_THREADS": "1"})
    one = subprocess.run([sys.executable, "-m", "bertqa_bench.cli", "train", "--suite", str(suite), "--no-mlflow",
                          "--set", "model.name=one", "--set", "train.grad_accum=2"],  # 1 x 2 x 4 rows
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "bertqa_bench.cli", "train", "--suite", str(suite), "--no-mlflow",
                          "--set", "model.name=two"], env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    m1 = json.loads((cfg.model_dir.parent / "one" / "train_metrics.json").read_text())
    m2 = json.loads((cfg.model_dir.parent / "two" / "train_metrics.json").read_text())
    assert m1["world_size"] == 1 and m2["world_size"] == 2
    assert m1["train_steps"] == m2["train_steps"] and m1["global_batch"] == m2["global_batch"] == 8
    assert "dev_f1" in m2  # rank 0 evaluated the saved model
    assert not list(cfg.model_dir.parent.glob(".two.*"))  # one atomic save, no leftovers from rank 1
    # every training figure names its command and machine
    assert m1["command"].startswith("bertqa-bench train --suite") and m1["device_name"].startswith("cpu")
    assert m2["command"].startswith("torchrun --nproc_per_node=2 -m bertqa_bench.cli train")
    # the scaling table is a view of these two runs: one series (same recipe, 4 rows per process
    # per micro-step), efficiency against the 1-process run
    from bertqa_bench.reporting.scaling import load_rows, write_reference

    rows = load_rows([f"cpu:{cfg.model_dir.parent / 'one'}", f"cpu:{cfg.model_dir.parent / 'two'}"])
    assert len({r.series for r in rows}) == 1 and [r.n_gpus for r in rows] == [1, 2]
    assert rows[1].efficiency == pytest.approx(m2["train_samples_per_s"] / (2 * m1["train_samples_per_s"]))
    md = write_reference(rows, tmp_path / "scaling", "two processes")
    assert m2["command"] in md and (tmp_path / "scaling.csv").read_text().startswith("job,n_gpus,card,host")


def test_length_grouped_batches_and_rank_shares():
    import numpy as np

    from bertqa_bench.training.steps import length_grouped_batches, rank_micro_batches

    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 384, size=1000)
    batches = length_grouped_batches(lengths, 32, rng)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(1000))  # an epoch sees every feature once
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    assert spread < 0.25 * np.ptp(lengths)  # features of similar length travel together
    again = length_grouped_batches(lengths, 32, rng)
    assert [b.tolist() for b in again] != [b.tolist() for b in batches]  # a new order every epoch
    shares = [rank_micro_batches(batches[0], lengths, r, 4, 2) for r in range(4)]
    got = np.concatenate([m for s in shares for m in s])
    assert sorted(got.tolist()) == sorted(batches[0].tolist())  # the ranks split the global batch exactly
    work = [sum(int(lengths[m].sum()) for m in s) for s in shares]
    assert max(work) - min(work) <= np.ptp(lengths[batches[0]]) * 2  # and about equally


def test_timing_only_path_builds_random_weights_and_judges_no_parity(tiny_suite):
    """model.timing_only: random weights, no training; every row is timed, logit differences are
    reported, but answer-level parity is 'n/a' and so is the run's verdict."""
    suite = tiny_suite(backends=["eager-fp32", "ort-fp32"],
                       model={"name": "tiny-timing", "timing_only": True},
                       bench={"backends": ["eager-fp32", "ort-fp32"], "batch_size": 8, "warmup_batches": 1,
                              "min_passes": 1, "min_duration_s": 0, "isolation": "inprocess"})
    cfg = load_suite(str(suite))
    logs = []
    out = run_bench(cfg, progress=False, log=logs.append)
    assert any("random weights (timing only)" in m for m in logs)
    assert not any("fine-tuning" in m for m in logs)
    rows = {r.backend: r for r in out.results}
    assert all(r.ok and r.parity == "n/a" and r.predict_s > 0 for r in rows.values())
    assert rows["ort-fp32"].max_abs_logit_diff < 1e-3  # the numbers are still compared
    assert out.verdict.status == "N/A" and out.bundle.meta.timing_only


def test_a_model_is_trained_once_per_recipe(tiny_suite):
    from bertqa_bench.commands.provision import ensure_model

    suite = tiny_suite(backends=["eager-fp32"])
    logs = []
    first = ensure_model(load_suite(str(suite)), logs.append)
    assert any("not found" in m for m in logs)
    logs.clear()
    # a field that only decides the evaluation keeps the model ...
    ensure_model(load_suite(str(suite), ["data.max_eval_examples=5"]), logs.append)
    assert any("reusing" in m for m in logs)
    logs.clear()
    # ... and so does one that decides only how fast the same steps run (a model trained on 4 GPUs
    # with grad_accum 1 serves a bench that declares grad_accum 4)
    ensure_model(load_suite(str(suite), ["train.grad_accum=2", "train.compile=true"]), logs.append)
    assert any("reusing" in m for m in logs)
    logs.clear()
    # ... one that decides the weights retrains it, in place, and the log names the field
    again = ensure_model(load_suite(str(suite), ["train.learning_rate=5e-4"]), logs.append)
    assert any("another recipe" in m and "train.learning_rate" in m for m in logs)
    assert again.metrics["recipe"] != first.metrics["recipe"]
