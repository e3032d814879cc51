"""The noise marks and the process-level interval (record/noise.py, record/rounds.py,
measuring/sessions.merge_records): planted readings, no GPU and no clock needed.

* per-process offsets widen the interval, and a rerun in new processes lands inside it about as
  often as it claims where the interval that ignored processes missed;
* the spread between processes pooled over a run's rows (bench.pool_process_spread) covers a
  rerun as often as each row's own estimate, without its one-degree-of-freedom blow-ups;
* a between-run spread (bench.rerun_spread_pct) widens it at least by what that spread alone
  gives, and covers reruns whose whole run shifts, which no spread inside a run shows;
* the GPU sensor's decision on planted quiet, drifting and contended readings;
* a noisy GPU reading marks only GPU rows, a noisy host only CPU rows (and a GPU row only as far
  as its passes are host-bound);
* NVML samples over a row's passes give its median clock, power and power cap."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bertqa_bench.record.noise import (GpuNoise, gpu_clock_text, gpu_samples_summary, gpu_sensor_noise, host_share,
                                       row_noise, sensor_round)
from bertqa_bench.record.results import BackendResult, RunMeta
from bertqa_bench.record.rounds import (ProcessAnova, log_mean_variance, paired_logs, paired_speedup,
                                        pooled_process_variance, process_anova, with_rerun_spread)


# --- the interval counts the processes ------------------------------------------------------------
def _two_process_logs(offset: float, sd: float, n: int, rng) -> np.ndarray:
    """n rounds' log ratios, rounds alternating between two processes whose offsets differ by
    ``offset`` (log terms), each round with its own noise ``sd``."""
    return np.array([0.4 + (offset if k % 2 else 0.0) + rng.normal(0.0, sd) for k in range(n)])


def test_planted_process_offsets_widen_the_interval():
    rng = np.random.default_rng(7)
    logs = _two_process_logs(0.05, 0.01, 8, rng)
    groups = [(k % 2, k % 2) for k in range(8)]
    ref = list(np.exp(logs))
    alone = paired_speedup(ref, [1.0] * 8)
    counted = paired_speedup(ref, [1.0] * 8, groups=groups)
    assert counted.speedup == alone.speedup  # the point estimate is the same median
    # a 5 % offset between the processes is five times their rounds' noise: the interval that
    # counts them is several times as wide, and holds both processes' own ratios
    assert counted.halfwidth_pct > 3 * alone.halfwidth_pct
    assert counted.low < math.exp(0.4) and math.exp(0.45) < counted.high


def test_processes_that_agree_keep_the_within_process_interval():
    # the two processes' means are equal by construction: no between-process variance to add,
    # and the variance is the within-process mean square over n on n - m degrees of freedom
    logs = [0.40, 0.41, 0.38, 0.40, 0.42, 0.39]  # process 0: .40 .38 .42; process 1: .41 .40 .39
    groups = [0, 1, 0, 1, 0, 1]
    a, b = logs[0::2], logs[1::2]
    assert np.mean(a) == pytest.approx(np.mean(b))
    msw = (np.sum((np.array(a) - np.mean(a)) ** 2) + np.sum((np.array(b) - np.mean(b)) ** 2)) / (6 - 2)
    var, df = log_mean_variance(logs, groups)
    assert var == pytest.approx(msw / 6) and df == 4


def test_a_rerun_in_new_processes_lands_inside_the_interval_as_often_as_claimed():
    """Simulated reruns: every run draws two fresh processes (offset sd 3 %) and 6 rounds (noise
    sd 2 %); does the next run's mean log ratio fall inside this run's interval? The interval over
    rounds alone, as before, holds about three in four (the issue measured 30 of 40); counting the
    processes holds near nine in ten (two processes give the offsets' variance one degree of
    freedom, and Satterthwaite's approximation is short of the 95 % there: more processes close
    the gap, bench.processes)."""
    rng = np.random.default_rng(1)
    trials, n = 600, 6
    groups = [(k % 2, k % 2) for k in range(n)]
    hits_new = hits_old = 0
    for _ in range(trials):
        runs = []
        for _ in range(2):
            offsets = rng.normal(0.0, 0.03, 2)
            runs.append(np.array([0.3 + offsets[k % 2] + rng.normal(0.0, 0.02) for k in range(n)]))
        ref, rerun = list(np.exp(runs[0])), math.exp(runs[1].mean())
        new = paired_speedup(ref, [1.0] * n, groups=groups)
        old = paired_speedup(ref, [1.0] * n)
        hits_new += new.low <= rerun <= new.high
        hits_old += old.low <= rerun <= old.high
    # a share's binomial sd is at most sqrt(0.25 / trials) (2.0 % here); the difference of two
    # is at most sqrt(2) times that: the shares are told apart at 4 of those
    sd_diff = math.sqrt(2 * 0.25 / trials)
    assert hits_new / trials - hits_old / trials > 4 * sd_diff
    assert hits_old / trials < 0.95 - 4 * math.sqrt(0.95 * 0.05 / trials)  # the old interval under-covers


def test_the_pooled_process_spread_weights_rows_by_their_degrees_of_freedom_and_truncates_once():
    two = ProcessAnova(msb=0.010, msw=0.002, n0=2.0, m=2, n=4)      # component (0.010 - 0.002) / 2 = 0.004
    three = ProcessAnova(msb=0.001, msw=0.003, n0=2.0, m=3, n=6)    # component -0.001: below zero alone
    var, df = pooled_process_variance([two, three, None])
    assert df == 3.0  # (2 - 1) + (3 - 1); a row without two processes adds nothing
    assert var == pytest.approx((1 * 0.004 + 2 * -0.001) / 3)  # the negative estimate counts before truncation
    assert pooled_process_variance([three]) == (0.0, 2.0)
    assert pooled_process_variance([None, None]) is None


def test_an_interval_takes_the_pooled_spread_in_place_of_its_own():
    logs, groups = [0.40, 0.47, 0.41, 0.46], [0, 1, 0, 1]  # two processes 6 % apart: a large own estimate
    anova = process_anova(logs, groups)
    again = process_anova(*paired_logs([math.exp(v) for v in logs], [1.0] * 4, groups))
    assert (again.msb, again.msw, again.n0, again.m) == pytest.approx((anova.msb, anova.msw, anova.n0, anova.m))
    own_var, own_df = log_mean_variance(logs, groups)
    pooled_var, pooled_df = log_mean_variance(logs, groups, pooled_between=(0.0001, 5.0))
    assert own_df < 1.5 < pooled_df  # its own: near one degree of freedom; the pool's five lift it
    assert pooled_var == pytest.approx(anova.msw / 4 + 0.0001 / 2)
    assert own_var == pytest.approx(anova.msw / 4 + anova.between_component / 2)
    ref = [math.exp(v) for v in logs]
    own = paired_speedup(ref, [1.0] * 4, groups=groups)
    pooled = paired_speedup(ref, [1.0] * 4, groups=groups, pooled_between=(0.0001, 5.0))
    assert pooled.speedup == own.speedup and pooled.halfwidth_pct < own.halfwidth_pct / 3


def test_a_rerun_lands_inside_the_pooled_interval_as_often_and_without_its_blow_ups():
    """Simulated reruns of the default suite's shape: two rows against one reference, 4 rounds
    alternating between two processes; every run draws new processes for the reference (offset sd
    2 %, shared by both rows' ratios) and for each row (2 %), each round its noise (2 %). Row 0's
    interval from its own processes and from the spread pooled over both rows: a rerun's mean
    lands inside either about 95 % of the time, but the own estimate's single degree of freedom
    makes its widest intervals several times the pooled ones."""
    rng = np.random.default_rng(5)
    trials, n, rows = 600, 4, 2
    groups = [(k % 2, k % 2) for k in range(n)]
    hits, widths = {"own": 0, "pooled": 0}, {"own": [], "pooled": []}
    for _ in range(trials):
        runs = []
        for _ in range(2):
            ref_offsets, row_offsets = rng.normal(0.0, 0.02, 2), rng.normal(0.0, 0.02, (rows, 2))
            runs.append(np.array([[0.3 + ref_offsets[k % 2] - row_offsets[r, k % 2] + rng.normal(0.0, 0.02)
                                   for k in range(n)] for r in range(rows)]))
        refs = [list(np.exp(runs[0][r])) for r in range(rows)]
        pooled = pooled_process_variance([process_anova(*paired_logs(refs[r], [1.0] * n, groups)) for r in range(rows)])
        rerun = math.exp(runs[1][0].mean())
        for key, between in (("own", None), ("pooled", pooled)):
            sp = paired_speedup(refs[0], [1.0] * n, groups=groups, pooled_between=between)
            hits[key] += sp.low <= rerun <= sp.high
            widths[key].append(sp.halfwidth_pct)
    tol = 4 * math.sqrt(0.95 * 0.05 / trials)
    assert hits["pooled"] / trials > 0.95 - tol and hits["own"] / trials > 0.95 - tol
    assert np.percentile(widths["pooled"], 95) < np.percentile(widths["own"], 95) / 2


def test_no_rerun_spread_leaves_the_interval_as_it_was():
    assert with_rerun_spread(0.0004, 3.0, 0.0) == (0.0004, 3.0)
    ref = [1.30, 1.33, 1.29, 1.31, 1.34]
    assert paired_speedup(ref, [1.0] * 5, rerun_spread_pct=0.0) == paired_speedup(ref, [1.0] * 5)


def test_a_rerun_spread_adds_its_variance_and_widens_the_interval_at_least_by_its_own():
    var, df = with_rerun_spread(0.0004, 3.0, 3.0)
    assert var == pytest.approx(0.0004 + math.log1p(0.03) ** 2)
    assert df > 3.0  # a known variance adds no sampling error: the t quantile shrinks towards z
    ref = [1.30, 1.33, 1.29, 1.31, 1.34]
    plain, spread = paired_speedup(ref, [1.0] * 5), paired_speedup(ref, [1.0] * 5, rerun_spread_pct=3.0)
    assert spread.speedup == plain.speedup
    assert spread.low < plain.low and plain.high < spread.high
    # t >= z at any degrees of freedom, and the variance is at least the spread's: the half-width
    # is at least z * sqrt(2) * the spread alone (both this run's offset and the rerun's)
    floor = 100 * math.expm1(1.959 * math.sqrt(2) * math.log1p(0.03))
    assert spread.halfwidth_pct >= floor
    # every rerun spread widens it more: the half-width grows with the spread
    assert paired_speedup(ref, [1.0] * 5, rerun_spread_pct=4.0).halfwidth_pct > spread.halfwidth_pct


def test_a_rerun_whose_whole_run_shifts_lands_inside_the_interval_with_the_rerun_spread():
    """Simulated reruns where every run draws its own offset (sd 3 %, common to all its rounds:
    the host's state over the run), two fresh processes (sd 1 %) and 5 rounds (noise 1.5 %): the
    interval from the rounds and processes alone misses the next run's mean far more often than
    5 %; with the run offset's sd as bench.rerun_spread_pct it holds about 95 %."""
    rng = np.random.default_rng(3)
    trials, n = 600, 5
    groups = [(k % 2, k % 2) for k in range(n)]
    hits = {0.0: 0, 3.0: 0}
    for _ in range(trials):
        runs = []
        for _ in range(2):
            run_offset, procs = rng.normal(0.0, 0.03), rng.normal(0.0, 0.01, 2)
            runs.append(np.array([0.3 + run_offset + procs[k % 2] + rng.normal(0.0, 0.015) for k in range(n)]))
        ref, rerun = list(np.exp(runs[0])), math.exp(float(np.median(runs[1])))
        for spread in hits:
            sp = paired_speedup(ref, [1.0] * n, groups=groups, rerun_spread_pct=spread)
            hits[spread] += sp.low <= rerun <= sp.high
    tol = 4 * math.sqrt(0.95 * 0.05 / trials)  # four binomial sds of a 95 % share over the trials
    assert hits[0.0] / trials < 0.95 - tol
    assert hits[3.0] / trials > 0.95 - tol


def test_a_row_of_two_processes_is_one_record():
    from bertqa_bench.measuring.sessions import merge_records

    def rec(passes, reliable, power, capped, pid):
        p = float(np.median(passes))
        return {"status": "ok", "prepare_s": 3.0, "pass_s": passes, "batch_ms": [10.0] * 4, "outputs": f"{pid}.npz",
                "pid": pid, "timing": {"predict_s": p, "features_per_s": 100.0 / p, "n_passes": len(passes),
                                       "identical_passes": True},
                "measures": {"timing_reliable": reliable, "timing_note": "" if reliable else "unreliable (x)",
                             "gpu_power_w": power, "gpu_power_capped": capped, "predict_host_peak_mib": power,
                             "energy_j": 10.0, "energy_j_per_1k_features": 50.0, "avg_power_w": 5.0}}

    merged = merge_records([rec([1.0, 1.2], True, 600.0, False, 1), rec([2.0, 1.1], False, 700.0, True, 2)])
    assert merged["pass_s"] == [1.0, 1.2, 2.0, 1.1] and merged["outputs"] == "1.npz"  # the first's answers
    t = merged["timing"]
    assert t["predict_s"] == pytest.approx(1.15) and t["n_passes"] == 4
    assert t["features_per_s"] == pytest.approx(100.0 / 1.15)
    m = merged["measures"]
    assert m["timing_reliable"] is False and m["timing_note"] == "unreliable (x)"  # a busy process marks the row
    assert m["gpu_power_capped"] is True and m["gpu_power_w"] == 650.0 and m["predict_host_peak_mib"] == 700.0
    assert m["energy_j"] == 20.0 and m["energy_j_per_1k_features"] == pytest.approx(50.0)
    assert m["avg_power_w"] == pytest.approx(5.0)
    failed = {"status": "failed", "error": "boom"}
    assert merge_records([rec([1.0], True, 1.0, False, 1), failed]) is failed  # a process that failed fails the row


# --- the GPU sensor -------------------------------------------------------------------------------
def _quiet_round(rng, gemm_ms=1.8, copy_ms=0.35):
    return sensor_round(list(gemm_ms * (1 + 0.005 * rng.standard_normal(20))),
                        list(copy_ms * (1 + 0.005 * rng.standard_normal(20))), 0)


def test_a_quiet_gpu_is_not_noisy_whatever_its_clock_sits_at():
    rng = np.random.default_rng(0)
    # power-capped at a steady 1,650 MHz: slower than the card's 1,980, but steady, so not noise
    readings = [_quiet_round(rng, gemm_ms=1.8 * 1980 / 1650) for _ in range(6)]
    g = gpu_sensor_noise(readings)
    assert g.spread_pct < 2 and g.jitter_pct < 2 and g.noisy(10.0) is False and g.why(10.0) == ""


def test_a_gpu_whose_speed_wanders_between_rounds_is_noisy():
    rng = np.random.default_rng(1)
    readings = [_quiet_round(rng, gemm_ms=ms) for ms in (1.8, 2.6, 1.8, 2.7, 1.9, 2.6)]
    g = gpu_sensor_noise(readings)
    assert g.spread_pct > 10 and g.noisy(10.0) is True and "over 6 rounds" in g.why(10.0)


def test_another_process_time_sliced_in_between_the_repetitions_is_noisy():
    # every round equally slowed (the load runs throughout, so the rounds agree) but within each
    # round some repetitions waited for the other process's time slice and others did not
    rng = np.random.default_rng(2)
    readings = [sensor_round([1.8 if i % 3 else 3.8 for i in range(20)], [0.35] * 20, 0) for _ in range(6)]
    g = gpu_sensor_noise(readings)
    assert g.spread_pct == pytest.approx(0.0) and g.jitter_pct > 10 and g.noisy(10.0) is True
    assert "within a round" in g.why(10.0)
    seen = gpu_sensor_noise([_quiet_round(rng) for _ in range(3)] + [{**_quiet_round(rng), "other_processes": 1}])
    assert seen.noisy(10.0) is True and "1 other process" in seen.why(10.0)


def test_a_sensor_round_needs_positive_times():
    with pytest.raises(ValueError, match="positive time"):
        sensor_round([1.0, 0.0], [0.3])
    assert gpu_sensor_noise([None, None]) is None


# --- which sensor marks which row ----------------------------------------------------------------
NOISY_GPU = GpuNoise(spread_pct=25.0, jitter_pct=40.0, other_processes=0, rounds=5)
QUIET_GPU = GpuNoise(spread_pct=0.5, jitter_pct=1.0, other_processes=0, rounds=5)


def test_a_noisy_gpu_reading_marks_only_gpu_rows():
    cpu, why = row_noise("cpu", calibration_cv_pct=2.0, gpu_busy_pct=None, gpu=NOISY_GPU, threshold_pct=10.0)
    assert cpu is False and why == ""
    gpu, why = row_noise("cuda", calibration_cv_pct=2.0, gpu_busy_pct=99.0, gpu=NOISY_GPU, threshold_pct=10.0)
    assert gpu is True and why.startswith("GPU sensor")


def test_a_noisy_host_marks_cpu_rows_and_gpu_rows_only_as_far_as_they_are_host_bound():
    cal = 15.0  # the H200 benches' calibration spread
    assert row_noise("cpu", calibration_cv_pct=cal, gpu_busy_pct=None, gpu=QUIET_GPU, threshold_pct=10.0)[0] is True
    # a GPU busy 99 % of its passes feels 1 % of the host's spread: 0.15 %, far under the threshold
    busy, _ = row_noise("cuda", calibration_cv_pct=cal, gpu_busy_pct=99.0, gpu=QUIET_GPU, threshold_pct=10.0)
    assert busy is False
    # a row whose GPU sat idle 80 % of its passes (host-side packing) feels 12 % of it: marked
    packed, why = row_noise("cuda", calibration_cv_pct=cal, gpu_busy_pct=20.0, gpu=QUIET_GPU, threshold_pct=10.0)
    assert packed is True and "80% of its passes host-bound" in why
    # the boundary is the arithmetic: share x spread against the threshold
    assert host_share("cuda", 100 - 100 * 10.0 / cal + 1) * cal < 10.0
    # nothing read that speaks for the row: no claim either way
    assert row_noise("cuda", calibration_cv_pct=cal, gpu_busy_pct=None, gpu=None, threshold_pct=10.0) == (None, "")
    assert row_noise("cpu", calibration_cv_pct=None, gpu_busy_pct=None, gpu=NOISY_GPU, threshold_pct=10.0) == (None, "")


def test_nvml_samples_over_the_passes_give_the_clock_under_load():
    # 40 samples at the power cap, 1,590-1,845 MHz around a 1,650 median, then 2 at the end when
    # the card idled back up to 1,980 (what the single reading used to report)
    clocks = [1650.0] * 20 + [1590.0] * 10 + [1845.0] * 10
    samples = [(c, 692.0, 0x4, 100.0) for c in clocks] + [(1650.0, 692.0, 0x8, 100.0)] + [(1980.0, 90.0, 0x1, 0.0)] * 2
    s = gpu_samples_summary(samples)
    assert s["gpu_sm_clock_mhz"] == 1650.0 and s["gpu_power_w"] == 692.0 and s["gpu_busy_pct"] == 100.0
    assert s["gpu_power_capped"] is True
    assert s["gpu_throttle"] == ""  # one HW-slowdown sample in 43 is not the row's state
    r = BackendResult("fp16", device="cuda", **{k: v for k, v in s.items() if k != "gpu_throttle"})
    assert gpu_clock_text(r) == "power-capped at 1,650 MHz, 692 W"
    free = gpu_samples_summary([(1980.0, 400.0, 0x0, 97.0)] * 5)
    assert free["gpu_power_capped"] is False and gpu_samples_summary([]) == {}


def test_the_views_carry_the_gpu_clock_and_the_processes():
    from bertqa_bench.reporting.mlflow_views import result_view
    from bertqa_bench.reporting.report import markdown_table, rounds_lines

    meta = RunMeta(suite="t", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1", reference="ref",
                   rounds={"calibration_s": [0.1] * 4, "stop_reason": "4 rounds"}, calibration_cv_pct=15.0,
                   timing_noisy=True, noise_cv_pct=10.0, gpu_sensor_spread_pct=0.4, gpu_sensor_jitter_pct=0.8)
    common = dict(device="cuda", timing_mode="rounds", rounds=4, processes=2, predict_s=1.0, features_per_s=10.0,
                  gpu_sm_clock_mhz=1650.0, gpu_power_w=692.0, gpu_power_capped=True, timing_noisy=False,
                  scores={"f1": 90.0})
    rows = [BackendResult("ref", speedup=1.0, **common),
            BackendResult("fast", speedup=2.0, speedup_low=1.9, speedup_high=2.1, speedup_halfwidth_pct=5.0, **common)]
    table = markdown_table(rows, meta)
    assert "power-capped at 1,650 MHz, 692 W" in table and "2.00× [1.90–2.10] |" in table  # no ~ on a quiet GPU
    text = "\n".join(rounds_lines(rows, meta))
    assert "every row's passes came from 2 worker processes" in text and "GPU sensor" in text
    assert "pooled" not in text  # each row's own spread between its processes
    pooled = RunMeta(**{**meta.__dict__, "rounds": {**meta.rounds, "pool_process_spread": True}})
    assert "the spread between processes, pooled over the rows (bench.pool_process_spread)" in "\n".join(
        rounds_lines(rows, pooled))
    assert "`fast` power-capped at 1,650 MHz" in text
    params, metrics, tags = result_view(rows[1], ["f1"], "f1")
    assert metrics["gpu_sm_clock_mhz"] == 1650.0 and metrics["gpu_power_w"] == 692.0
    assert tags["gpu_clock"] == "power-capped at 1,650 MHz, 692 W" and "2 processes" in tags["timing_mode"]
    assert rows[1].to_row()["gpu_power_capped"] is True and rows[1].to_row()["processes"] == 2


def test_the_sampler_keeps_only_the_rows_own_passes():
    """A fake NVML: idle (1,980 MHz, 0 %) while the row's worker waits for its first turn, under
    load (1,650 MHz, power cap) during its pass; the samples kept are the pass's only."""
    import time
    from types import SimpleNamespace

    from bertqa_bench.measuring.gpu_sensor import GpuSampler

    state = {"clock": 1980.0, "mask": 0x1, "util": 0.0}
    fake = SimpleNamespace(NVML_CLOCK_SM=0, nvmlDeviceGetClockInfo=lambda h, c: state["clock"],
                           nvmlDeviceGetPowerUsage=lambda h: 692_000, nvmlDeviceGetCurrentClocksEventReasons=lambda h: state["mask"],
                           nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=state["util"]))
    sampler = GpuSampler(fake, None, every_s=0.001)
    sampler.start()  # start_timed: the worker then waits, idle, for the parent's first "pass"
    time.sleep(0.02)
    state.update(clock=1650.0, mask=0x4, util=100.0)
    sampler.start()  # the first pass's resume: what came before is dropped
    time.sleep(0.02)
    sampler.stop()
    assert sampler.samples and all(s == (1650.0, 692.0, 0x4, 100.0) for s in sampler.samples)
    kept = len(sampler.samples)
    state.update(clock=1980.0, mask=0x1, util=0.0)  # between passes: not sampled
    time.sleep(0.01)
    assert len(sampler.samples) == kept
    assert gpu_samples_summary(sampler.samples)["gpu_power_capped"] is True


def test_the_rounds_read_the_gpu_sensor_each_round_and_survive_its_failure():
    from bertqa_bench.measuring.rounds import RoundsSettings, run_rounds

    class Row:
        def __init__(self, name, s):
            self.name, self.s, self.ready = name, s, {}

        def run_pass(self):
            return self.s

    rng = np.random.default_rng(3)
    settings = RoundsSettings(min_rounds=3, max_rounds=3, budget_s=1e9)
    log = run_rounds([Row("ref", 2.0), Row("a", 1.0)], "ref", settings, calibrate=lambda: 0.1, clock=lambda: 0.0,
                     log=lambda _: None, gpu_sensor=lambda: _quiet_round(rng))
    assert len(log.gpu_sensor) == 3 and log.gpu_noise.noisy(10.0) is False
    assert log.to_dict()["gpu_sensor"] == log.gpu_sensor

    def broken():
        raise RuntimeError("no CUDA device")

    lines = []
    log = run_rounds([Row("ref", 2.0), Row("a", 1.0)], "ref", settings, calibrate=lambda: 0.1, clock=lambda: 0.0,
                     log=lines.append, gpu_sensor=broken)
    assert log.n_rounds == 3 and log.gpu_noise is None and any("GPU sensor failed" in x for x in lines)
