"""The run's recommendation (reporting/recommend.py) on constructed records: ties, rows within
noise, nothing passing, a single backend, LoadGen and sweeps."""
import pytest

from bertqa_bench.reporting.recommend import for_run, recommend
from bertqa_bench.record.results import BackendResult, RunMeta

REF_S = 40.0  # the reference's median pass, seconds


def row(name, speedup=1.0, *, spread=0.01, parity="pass", noise=False, cls=None, precision="int8", status="ok",
        error="", batching="padded", host=500.0, **kw):
    """A bench row whose timed passes are REF_S / speedup, +- spread (relative)."""
    s = REF_S / speedup
    fp32 = precision in ("fp32", "tf32")
    r = BackendResult(name, status=status, error=error, precision=precision, batching=batching,
                      parity_class=cls or ("fp32" if fp32 else "reduced"), n_features=1588,
                      predict_s=s, predict_min_s=s * (1 - spread), predict_max_s=s * (1 + spread),
                      features_per_s=1588 / s, prepare_s=5.0, prepare_host_peak_mib=host, predict_host_peak_mib=host / 2,
                      parity=parity if status == "ok" else "", parity_within_noise=noise, answer_agreement=0.994,
                      agreement_ci_low=0.987, agreement_ci_high=0.997, deltas={"f1": 0.12},
                      delta_ci={"f1": (-0.24, 0.52)}, **kw)
    if status == "ok":
        r.speedup = REF_S / s
        r.speedup_low = REF_S * (1 - spread) / r.predict_max_s
        r.speedup_high = REF_S * (1 + spread) / r.predict_min_s
        r.speedup_within_noise = r.speedup_low <= 1.0 <= r.speedup_high
    return r


def ref():
    return row("eager-fp32", 1.0, precision="fp32")


def test_the_fastest_decided_pass_with_its_interval_prepare_and_memory_and_the_fastest_fp32_row():
    rows = [ref(), row("openvino-fp32", 1.47, precision="fp32", host=729.0), row("ort-int8", 2.72),
            row("openvino-int8-sorted", 4.62, host=1156.0)]
    rec = recommend(rows, "eager-fp32", metric_label="F1")
    assert rec.best.backend == "openvino-int8-sorted" and rec.fp32.backend == "openvino-fp32"
    assert rec.best.ties == () and rec.why_none == ()
    text = rec.text()
    assert text.splitlines()[1].startswith(
        "- Fastest: openvino-int8-sorted (int8, padded batching): 4.62× eager-fp32 [4.53–4.71]; 183 features/s")
    assert "prepare 5.0 s" in text and "peak 1,156 MiB host" in text and "ΔF1 +0.12 [-0.24, +0.52]" in text
    assert "answers 99.4% identical [98.7%–99.7%]" in text
    assert "- FP32 class (answers unchanged): openvino-fp32" in text and "1.47×" in text
    assert rec.tags() == {"recommendation": "openvino-int8-sorted: 4.62× eager-fp32 [4.53–4.71], int8, parity pass",
                          "recommended_backend": "openvino-int8-sorted", "recommended_fp32_backend": "openvino-fp32"}


def test_rows_whose_passes_overlap_the_fastest_are_named_as_tied():
    # 3.00x and 2.97x with 2% spreads overlap; 2.50x does not
    rows = [ref(), row("a", 2.97, spread=0.02), row("b", 3.00, spread=0.02), row("c", 2.50, spread=0.02)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "b" and rec.best.ties == ("a",)
    assert "within noise of it (speedup intervals overlap): a" in rec.text()
    # tight passes: not tied any more
    rows = [ref(), row("a", 2.97, spread=0.001), row("b", 3.00, spread=0.001)]
    assert recommend(rows, "eager-fp32").best.ties == ()


def test_equal_speedups_prefer_fp32_class_then_lower_memory_then_run_order():
    rows = [ref(), row("int8", 2.0, host=100.0), row("fp32", 2.0, precision="fp32", host=900.0)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "fp32" and rec.best.ties == ("int8",)
    assert rec.fp32 is None and "Its answers are unchanged: it is FP32 class." in rec.text()
    rows = [ref(), row("big", 2.0, host=900.0), row("small", 2.0, host=100.0)]
    assert recommend(rows, "eager-fp32").best.backend == "small"
    rows = [ref(), row("first", 2.0), row("second", 2.0)]
    assert recommend(rows, "eager-fp32").best.backend == "first"


def test_a_faster_row_within_noise_is_not_recommended_and_is_named_with_why():
    noisy = row("noisy", 5.0, noise=True)
    noisy.questions_to_decide = 2400
    failed = row("broken", 6.0, parity="FAIL", parity_failures="answer agreement 90.00% < 97.0%")
    rows = [ref(), noisy, failed, row("solid", 3.0)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "solid"
    assert dict(rec.passed_over) == {
        "noisy": "parity pass, not decided (within noise: ~2,400 questions would decide it)",
        "broken": "parity FAIL: answer agreement 90.00% < 97.0%"}
    assert "- Faster but not recommended: noisy: parity pass, not decided" in rec.text()


def test_nothing_passing_decidedly_says_so_row_by_row():
    noisy = row("noisy", 2.0, parity="FAIL", noise=True, parity_failures="f1 is 98.9% of reference")
    noisy.questions_to_decide = 3000
    rows = [ref(), noisy, row("crashed", status="failed", error="killed by SIGSEGV"),
            row("gpu", status="not run", error="needs a CUDA GPU"),
            row("fail", 3.0, parity="FAIL", parity_failures="non-finite logits")]
    rec = recommend(rows, "eager-fp32")
    assert rec.best is None and rec.fp32 is None
    assert rec.why_none == ("noisy: parity FAIL (within noise: ~3,000 questions would decide it): f1 is 98.9% of reference",
                            "crashed: failed: killed by SIGSEGV", "gpu: not run: needs a CUDA GPU",
                            "fail: parity FAIL: non-finite logits")
    lines = rec.lines()
    assert lines[1] == "- None: no backend passed parity decidedly." and lines[2] == "  - " + rec.why_none[0]
    assert rec.tags()["recommended_backend"] == "" and rec.headline().startswith("none: noisy: parity FAIL")


def test_a_single_backend_and_a_missing_reference():
    rec = recommend([ref()], "eager-fp32")
    assert rec.best is None and rec.why_none == ("only the reference eager-fp32 ran: there is nothing to compare it with",)
    rec = recommend([row("eager-fp32", status="failed", error="out of memory"), row("x", 2.0)], "eager-fp32")
    assert rec.best is None and rec.why_none == ("the reference eager-fp32 did not run (failed: out of memory)",)


def test_timing_only_rows_and_a_run_problem_recommend_nothing():
    rows = [ref(), row("x", 3.0, parity="n/a")]
    assert recommend(rows, "eager-fp32").why_none == (
        "x: no parity verdict (random weights: timing only; parity is judged on a trained model)",)
    meta = RunMeta(suite="s", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1", reference="eager-fp32",
                   metric_labels={"f1": "F1"},
                   problems=["reference eager-fp32 is not deterministic (answers changed between two runs)"])
    rec = for_run([ref(), row("x", 3.0)], meta)
    assert rec.best is None and "not deterministic" in rec.why_none[0]


def test_a_row_not_decidedly_faster_is_not_recommended_stay_on_the_reference():
    rows = [ref(), row("slow", 0.98, spread=0.05)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best is None and rec.stay.backend == "slow" and rec.stay.speedup_within_noise
    assert rec.text().splitlines()[1].startswith("- Stay on eager-fp32 here: no row that keeps parity is decidedly faster")
    assert "(its interval straddles 1.0: not distinguishable)" in rec.text()
    # a faster median whose interval still reaches 1.0 is named, with why it is not recommended
    rows = [ref(), row("maybe", 1.04, spread=0.05), row("int8", 3.0)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "int8"
    rows = [ref(), row("maybe", 1.04, spread=0.05)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best is None and rec.stay.backend == "maybe"


def test_data_parallel_rows_are_left_out_of_a_one_device_comparison():
    rows = [ref(), row("x", 2.0), row("x-x2", 3.8, n_devices=2)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "x" and rec.left_out == ("x-x2",)


def lg(name, qps, valid=True, parity="pass", scenario="Server", p90=None, **kw):
    r = BackendResult(name, precision="int8", parity_class="reduced", batching="padded", parity=parity, scenario=scenario,
                      loadgen_result="VALID" if valid else "INVALID", achieved_qps=qps, target_qps=qps,
                      sample_latency_p90_ms=p90, sample_latency_p99_ms=50.0, target_latency_ms=130.0,
                      loadgen_invalid_reason="" if valid else "latency p99 190.0 ms > bound 130 ms", **kw)
    return r


def test_loadgen_server_recommends_the_highest_qps_within_the_bound():
    rows = [lg("eager-fp32", 100.0), lg("fast-but-late", 900.0, valid=False), lg("ok", 400.0), lg("ok2", 300.0)]
    rec = recommend(rows, "eager-fp32")
    assert rec.kind == "loadgen" and rec.best.backend == "ok"
    assert rec.lines()[1].startswith("- Highest Server QPS within the 130 ms bound: ok (int8, padded batching): 400.0 QPS")
    assert dict(rec.passed_over) == {"fast-but-late": "LoadGen INVALID: latency p99 190.0 ms > bound 130 ms"}
    # the run's problem of that row ("<backend>: LoadGen ...") is the row's, not the run's
    meta = RunMeta(suite="s", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1",
                   reference="eager-fp32", problems=["fast-but-late: LoadGen Server INVALID: latency p99 190.0 ms"])
    assert for_run(rows, meta).best.backend == "ok"


def test_loadgen_single_stream_recommends_the_lowest_p90_latency():
    rows = [lg("eager-fp32", None, scenario="SingleStream", p90=9.0), lg("a", None, scenario="SingleStream", p90=3.0),
            lg("b", None, scenario="SingleStream", p90=2.0, parity="FAIL")]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "a" and rec.lines()[1].startswith("- Lowest SingleStream p90 latency: a")
    assert [n for n, _ in rec.passed_over] == ["b"]


def test_a_sweep_recommends_its_best_configuration():
    rows = [ref(), row("eager-fp16@b16-padded", 2.0, batch_size=16), row("eager-fp16@b64-sorted", 3.0, batching="sorted",
                                                                          batch_size=64)]
    rec = recommend(rows, "eager-fp32")
    assert rec.kind == "sweep"
    assert rec.lines()[1].startswith("- Best configuration: eager-fp16@b64-sorted (int8, sorted batching, batch 64)")


@pytest.mark.parametrize("reference", ["eager-fp32", "missing"])
def test_the_reference_is_never_recommended(reference):
    rows = [row("eager-fp32", 1.0, precision="fp32")]
    rec = recommend(rows, reference)
    assert rec.best is None


def test_the_rows_estimate_is_the_mean_of_the_rows_after_the_reference():
    from bertqa_bench.measuring.progress import clock, rows_eta, rows_line

    assert rows_eta([], 3) is None
    assert rows_eta([90.0], 2) == 180.0  # only the reference so far: each row at its time
    assert rows_eta([90.0, 40.0, 60.0], 2) == 100.0  # then the mean of the others
    assert clock(65) == "1:05" and clock(3725) == "1:02:05"
    assert rows_line(0, 3, "eager-fp32", [], 0.0) == (
        "rows: 1 of 3 (eager-fp32) after 0:00; an estimate of what is left follows the first row")
    assert rows_line(1, 3, "openvino-fp32", [100.0], 100.0) == "rows: 2 of 3 (openvino-fp32) after 1:40; about 3:20 left"
