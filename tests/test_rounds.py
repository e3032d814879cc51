"""Interleaved rounds (measuring/rounds.py, record/rounds.py): the order, the pairing, the interval,
the noise sensor and the recommendation that never names a row not decidedly faster.

The host's drift is simulated: fake sessions advance a shared clock by their pass time times the
host's slowness at that moment, so the tests check the method's logic, not this machine's speed."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from bertqa_bench.measuring.rounds import RoundsLog, RoundsSettings, RowProcesses, run_rounds
from bertqa_bench.measuring.sessions import SessionEnded
from bertqa_bench.record.results import BackendResult, RunMeta
from bertqa_bench.record.rounds import block_speedup, paired_ratios, paired_speedup, round_order, spread_pct
from bertqa_bench.reporting.recommend import recommend
from bertqa_bench.reporting.report import markdown_table, rounds_lines


# --- the order ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_round_order_rotates_every_row_through_every_position(n):
    rounds = [round_order(n, k) for k in range(n)]
    for order in rounds:
        assert sorted(order) == list(range(n))  # each row once a round
    for position in range(n):  # over n rounds each row stands once in each position
        assert sorted(order[position] for order in rounds) == list(range(n))
    assert round_order(n, n) == round_order(n, 0)


# --- the pairing and the interval -------------------------------------------------------------------
def test_paired_ratio_uses_the_same_rounds_passes():
    # the host halves its speed every other round: both sides of each round's ratio move together
    ref = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0]
    row = [5.0, 10.0, 5.0, 10.0, 5.0, 10.0]
    sp = paired_speedup(ref, row)
    assert paired_ratios(ref, row) == [2.0] * 6
    assert sp.speedup == 2.0 and sp.low == pytest.approx(2.0) and sp.high == pytest.approx(2.0)
    assert sp.rounds == 6 and not sp.straddles_one


def test_a_round_without_both_passes_pairs_nothing():
    assert paired_ratios([10.0, None, 12.0], [5.0, 6.0, None]) == [2.0]
    sp = paired_speedup([10.0, None], [5.0, 6.0])
    assert sp.rounds == 1 and sp.low is None and sp.halfwidth_pct is None and sp.straddles_one
    assert paired_speedup([None], [1.0]) is None


def test_interval_is_a_replication_interval_of_log_ratios():
    rng = np.random.default_rng(3)
    ratios = np.exp(rng.normal(math.log(1.5), 0.05, size=8))
    ref = list(10.0 * ratios)
    sp = paired_speedup(ref, [10.0] * 8)
    logs = np.log(ratios)
    from scipy import stats

    half = stats.t.ppf(0.975, 7) * logs.std(ddof=1) * math.sqrt(2 / 8)
    assert sp.low == pytest.approx(math.exp(logs.mean() - half))
    assert sp.high == pytest.approx(math.exp(logs.mean() + half))
    assert sp.speedup == pytest.approx(float(np.median(ratios)))
    assert sp.halfwidth_pct == pytest.approx(100 * math.expm1(half))


def test_spread_pct():
    assert spread_pct([1.0, 1.0, 1.0]) == 0.0
    assert spread_pct([1.0]) is None
    assert spread_pct([1.0, 3.0]) == pytest.approx(100 * math.sqrt(2) / 2)


# --- a host that drifts ------------------------------------------------------------------------------
class Host:
    """A simulated clock and a host whose speed changes over time (``slowness(t)``)."""

    def __init__(self, slowness, jitter=0.02, seed=0):
        self.t, self.slowness = 0.0, slowness
        self.rng = np.random.default_rng(seed)
        self.jitter = jitter

    def work(self, seconds: float) -> float:
        took = seconds * self.slowness(self.t) * (1 + self.jitter * self.rng.standard_normal())
        self.t += took
        return took


class FakeSession:
    def __init__(self, name, base_s, host, fail_at=None):
        self.name, self.base_s, self.host, self.fail_at = name, base_s, host, fail_at
        self.passes = 0
        self.ready = {"event": "ready"}

    def run_pass(self) -> float:
        self.passes += 1
        if self.fail_at is not None and self.passes >= self.fail_at:
            raise SessionEnded(f"{self.name}: crashed")
        return self.host.work(self.base_s)


def _drifting_host(switch_at: float) -> Host:
    # 40 % slower for the second half of the time: what a shared VM does over minutes
    return Host(lambda t: 1.0 if t < switch_at else 1.4)


def test_planted_drift_moves_a_block_ratio_outside_its_interval_but_not_the_interleaved_one():
    true_ratio, rounds = 2.0, 8  # the reference takes 10 s a pass, the row 5 s
    # blocks: every reference pass (80 s), then every row pass, after the host slowed down at 80 s
    host = _drifting_host(switch_at=10.0 * rounds)
    ref_block = [host.work(10.0) for _ in range(rounds)]
    row_block = [host.work(5.0) for _ in range(rounds)]
    block = block_speedup(ref_block, row_block)
    assert not block.low <= true_ratio <= block.high  # the drift is in the ratio and not in its range
    # rounds: the same host, slowing down halfway through the same amount of work
    host = _drifting_host(switch_at=(10.0 + 5.0) * rounds / 2)
    sessions = [FakeSession("ref", 10.0, host), FakeSession("row", 5.0, host)]
    log = run_rounds(sessions, "ref", RoundsSettings(min_rounds=rounds, max_rounds=rounds, budget_s=1e9),
                     calibrate=lambda: host.work(0.1), clock=lambda: host.t, log=lambda _: None)
    sp = log.speedup("row")
    assert log.n_rounds == rounds
    assert sp.low <= true_ratio <= sp.high
    assert sp.speedup == pytest.approx(true_ratio, rel=0.05)


class ScriptedSession:
    """A row whose passes are given in advance, one a round (the host's clock advances by them)."""

    def __init__(self, name, passes, host):
        self.name, self.script, self.host = name, list(passes), host
        self.ready = {"event": "ready"}

    def run_pass(self) -> float:
        took = self.script.pop(0)
        self.host.t += took
        return took


def _needed(sd, target_pct, at_least, at_most):
    # restated: the fewest n with t(0.975, n-1) * sd * sqrt(2 / n) <= log(1 + target)
    from scipy import stats

    for n in range(at_least, at_most + 1):
        if stats.t.ppf(0.975, n - 1) * sd * math.sqrt(2 / n) <= math.log1p(target_pct / 100):
            return n
    return at_most


def test_the_first_rounds_fix_how_many_run_whatever_the_later_ones_show():
    # the pilot's ratios spread ~7 %; afterwards the row repeats one time exactly, so its interval
    # soon looks narrow: the rule that stopped then would end early, this one runs the planned count
    pilot = [5.0, 5.5, 4.6, 5.2]
    host = Host(lambda t: 1.0)
    settings = RoundsSettings(min_rounds=4, max_rounds=40, budget_s=1e9, target_halfwidth_pct=5.0)
    ref = ScriptedSession("ref", [10.0] * 40, host)
    row = ScriptedSession("row", pilot + [5.0] * 36, host)
    log = run_rounds([ref, row], "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t, log=lambda _: None)
    sd = float(np.std(np.log([10.0 / p for p in pilot]), ddof=1))
    planned = _needed(sd, 5.0, 4, 40)
    assert log.planned_rounds == planned == log.n_rounds and planned > 5
    early = [n for n in range(5, planned) if paired_speedup([10.0] * n, log.passes["row"][:n]).halfwidth_pct <= 5.0]
    assert early, "the planted later rounds should narrow the interval before the planned count"
    assert "fixed after the first 4" in log.stop_reason


def test_later_rounds_that_spread_wider_do_not_extend_the_rounds():
    host = Host(lambda t: 1.0)
    settings = RoundsSettings(min_rounds=4, max_rounds=40, budget_s=1e9, target_halfwidth_pct=5.0)
    pilot = [5.0, 5.3, 4.8, 5.1]
    ref = ScriptedSession("ref", [10.0] * 40, host)
    row = ScriptedSession("row", pilot + [3.0, 7.0] * 18, host)
    log = run_rounds([ref, row], "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t, log=lambda _: None)
    sd = float(np.std(np.log([10.0 / p for p in pilot]), ddof=1))
    assert log.n_rounds == _needed(sd, 5.0, 4, 40) == log.planned_rounds and 4 < log.n_rounds < 40
    assert log.speedup("row").halfwidth_pct > 5.0  # wider than the target, and the rounds still ended


def test_the_rerun_spread_widens_the_reported_interval_and_not_the_plan():
    """bench.rerun_spread_pct reaches the intervals the run reports (the log keeps it), while the
    number of rounds is fixed from the rounds' own spread: no count of rounds narrows a run's
    offset, so planning on it would only spend the budget."""
    pilot = [5.0, 5.3, 4.8, 5.1]
    runs = {}
    for spread in (0.0, 3.0):
        host = Host(lambda t: 1.0)
        settings = RoundsSettings(min_rounds=4, max_rounds=40, budget_s=1e9, target_halfwidth_pct=5.0,
                                  rerun_spread_pct=spread)
        ref = ScriptedSession("ref", [10.0] * 40, host)
        row = ScriptedSession("row", pilot + [5.0, 5.2] * 18, host)
        runs[spread] = run_rounds([ref, row], "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t,
                                  log=lambda _: None)
    plain, spread = runs[0.0], runs[3.0]
    assert spread.n_rounds == plain.n_rounds == plain.planned_rounds  # the same plan
    assert spread.rerun_spread_pct == 3.0 and spread.to_dict()["rerun_spread_pct"] == 3.0
    assert spread.speedup("row", within_run=True) == plain.speedup("row")
    wide, narrow = spread.speedup("row"), plain.speedup("row")
    assert wide.speedup == narrow.speedup and wide.low < narrow.low and narrow.high < wide.high
    assert spread.speedup("ref") == plain.speedup("ref")  # the reference is 1.0 in every run


def test_a_pooled_process_spread_reaches_every_row_but_the_reference():
    """bench.pool_process_spread: the rows' process offsets estimated once over the rows against
    the reference; a row whose own two processes happened to differ gets the pool's estimate
    and its degrees of freedom instead of its own, a row whose processes agree gets the pool's
    too, and the reference stays 1.0."""
    runs = {}
    for pool in (False, True):
        host = Host(lambda t: 1.0)
        settings = RoundsSettings(min_rounds=4, max_rounds=4, budget_s=1e9, target_halfwidth_pct=50.0,
                                  pool_process_spread=pool)
        ref = RowProcesses("ref", [ScriptedSession("ref", [10.0] * 4, host), ScriptedSession("ref2", [10.0] * 4, host)])
        wide = RowProcesses("wide", [ScriptedSession("w0", [5.0, 5.1], host), ScriptedSession("w1", [5.5, 5.6], host)])
        calm = RowProcesses("calm", [ScriptedSession("c0", [4.0, 4.05], host), ScriptedSession("c1", [4.02, 4.0], host)])
        runs[pool] = run_rounds([ref, wide, calm], "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t,
                                log=lambda _: None)
    own, pooled = runs[False], runs[True]
    assert pooled.to_dict()["pool_process_spread"] is True and own.pooled_between() is not None
    assert pooled.speedup("wide").speedup == own.speedup("wide").speedup
    assert pooled.speedup("wide").halfwidth_pct < own.speedup("wide").halfwidth_pct  # one df no more
    assert pooled.speedup("calm").halfwidth_pct > own.speedup("calm").halfwidth_pct  # the pool's spread reaches it
    assert pooled.speedup("ref") == own.speedup("ref")


def test_rounds_needed_is_the_fewest_that_reach_the_target():
    from bertqa_bench.record.rounds import rounds_needed

    for sd in (0.01, 0.04, 0.08):
        n = rounds_needed(sd, 5.0, 3, 60)
        assert n == _needed(sd, 5.0, 3, 60)
    assert rounds_needed(10.0, 5.0, 3, 12) == 12  # never reachable: the most allowed
    assert rounds_needed(0.0, 5.0, 4, 12) == 4  # never fewer than the first rounds


def test_rounds_end_within_the_budget_at_the_first_rounds_pace():
    host = Host(lambda t: 1.0, jitter=0.2, seed=1)
    sessions = [FakeSession("ref", 10.0, host), FakeSession("a", 10.0, host)]
    settings = RoundsSettings(min_rounds=2, max_rounds=100, budget_s=100.0, target_halfwidth_pct=0.1)
    log = run_rounds(sessions, "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t, log=lambda _: None)
    assert "budget holds" in log.plan_note and host.t <= 100.0 + 25.0
    assert log.n_rounds >= 2 and log.n_rounds < 100


def test_rounds_of_two_processes_alternate_and_the_pilot_spans_both():
    from bertqa_bench.measuring.rounds import RowProcesses

    host = Host(lambda t: 1.0, jitter=0.01)
    ref = RowProcesses("ref", [FakeSession("ref", 10.0, host), FakeSession("ref", 10.0, host)])
    a = RowProcesses("a", [FakeSession("a", 5.0, host), FakeSession("a", 5.0, host)])
    settings = RoundsSettings(min_rounds=3, max_rounds=8, budget_s=1e9, target_halfwidth_pct=50.0)
    log = run_rounds([ref, a], "ref", settings, calibrate=lambda: 0.0, clock=lambda: host.t, log=lambda _: None)
    assert log.processes["a"] == [k % 2 for k in range(log.n_rounds)] == log.processes["ref"]
    assert [s.passes for s in a.sessions] == [2, 2]  # the pilot: a whole turn of both, rounded up from 3
    assert log.n_rounds == 4 and log.n_processes("a") == 2


def test_a_row_that_fails_mid_rounds_leaves_and_keeps_its_passes():
    host = Host(lambda t: 1.0, jitter=0.0)
    sessions = [FakeSession("ref", 10.0, host), FakeSession("bad", 5.0, host, fail_at=3)]
    log = run_rounds(sessions, "ref", RoundsSettings(min_rounds=4, max_rounds=4), calibrate=lambda: 0.0,
                     clock=lambda: host.t, log=lambda _: None)
    assert log.ended == {"bad": "bad: crashed"}
    assert log.passes["bad"] == [5.0, 5.0, None, None] and len(log.passes["ref"]) == 4
    assert log.speedup("bad").rounds == 2


def test_a_planted_noisy_calibration_marks_the_run():
    host = Host(lambda t: 1.0, jitter=0.0)
    calibrations = iter([0.10, 0.16, 0.09, 0.15, 0.10, 0.17])
    sessions = [FakeSession("ref", 10.0, host), FakeSession("a", 5.0, host)]
    log = run_rounds(sessions, "ref", RoundsSettings(min_rounds=6, max_rounds=6), calibrate=lambda: next(calibrations),
                     clock=lambda: host.t, log=lambda _: None)
    assert log.calibration_cv_pct > 10 and log.noisy(10.0) is True and log.noisy(50.0) is False
    quiet = RoundsLog(["ref"], "ref", {"ref": [1.0] * 3}, calibration_s=[0.1, 0.101, 0.099])
    assert quiet.noisy(10.0) is False
    # and the run's views say so: the table's mark and the timing lines under it
    meta = RunMeta(suite="t", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1", reference="ref",
                   rounds=log.to_dict(), calibration_cv_pct=log.calibration_cv_pct, timing_noisy=True, noise_cv_pct=10.0)
    rows = [_row("ref", 1.0, 1.0, 1.0, noisy=True), _row("a", 2.0, 1.9, 2.1, noisy=True)]
    assert "noisy host" in "\n".join(rounds_lines(rows, meta))
    assert "2.00× [1.90–2.10] ~" in markdown_table(rows, meta)
    assert rows[1].to_row()["timing_noisy"] is True


# --- the recommendation -------------------------------------------------------------------------------
def _row(name, speedup, low, high, precision="fp32", parity="pass", noisy=None):
    return BackendResult(backend=name, precision=precision, parity_class="fp32" if precision == "fp32" else "reduced",
                         speedup=speedup, speedup_low=low, speedup_high=high, speedup_within_noise=low <= 1.0 <= high,
                         parity=parity, parity_within_noise=False, predict_s=1.0 / speedup, n_features=10,
                         features_per_s=10 * speedup, timing_mode="rounds", timing_noisy=noisy, scores={"f1": 90.0})


def test_the_recommendation_refuses_a_row_whose_interval_includes_one():
    ref = _row("eager-fp32", 1.0, 1.0, 1.0)
    rows = [ref, _row("openvino-fp32", 1.05, 0.93, 1.18)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best is None and rec.stay.backend == "openvino-fp32"
    text = rec.text()
    assert "Stay on eager-fp32 here" in text and "openvino-fp32" in text and "[0.93–1.18]" in text
    assert rec.tags()["recommended_backend"] == "eager-fp32"
    assert rec.headline().startswith("stay on eager-fp32")


def test_the_fp32_class_stays_when_only_a_reduced_precision_row_is_decidedly_faster():
    rows = [_row("eager-fp32", 1.0, 1.0, 1.0), _row("openvino-fp32", 0.9, 0.79, 1.04),
            _row("openvino-int8-sorted", 3.2, 3.0, 3.4, precision="int8")]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "openvino-int8-sorted" and rec.fp32 is None
    assert rec.fp32_stay.backend == "openvino-fp32"
    assert "FP32 class (answers unchanged): stay on eager-fp32 here" in rec.text()
    assert rec.tags()["recommended_fp32_backend"] == "eager-fp32"


def test_a_decidedly_faster_fp32_row_is_recommended():
    rows = [_row("eager-fp32", 1.0, 1.0, 1.0), _row("openvino-fp32", 1.3, 1.2, 1.4),
            _row("ort-fp32", 1.25, 1.1, 1.35)]
    rec = recommend(rows, "eager-fp32")
    assert rec.best.backend == "openvino-fp32" and rec.best.ties == ("ort-fp32",)
    assert rec.stay is None and rec.fp32_stay is None


def test_the_table_shows_the_interval_and_the_rounds_line():
    meta = RunMeta(suite="t", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1",
                   reference="eager-fp32", rounds={"calibration_s": [0.1] * 5, "stop_reason": "every interval within ±5%"},
                   calibration_cv_pct=1.0, timing_noisy=False, noise_cv_pct=10.0)
    a = _row("openvino-fp32", 0.95, 0.76, 1.03)
    a.speedup_halfwidth_pct = 15.0
    rows = [_row("eager-fp32", 1.0, 1.0, 1.0), a]
    table = markdown_table(rows, meta)
    assert "0.95× [0.76–1.03] ≈" in table
    text = "\n".join(rounds_lines(rows, meta))
    assert "5 interleaved rounds" in text and "`openvino-fp32` ±15.0%" in text and "within the 10% threshold" in text
    assert "between-run" not in text  # no spread configured: none claimed
    meta.rounds["rerun_spread_pct"] = 3.0  # the rounds' log keeps the spread its intervals hold
    assert "a between-run spread of 3% (bench.rerun_spread_pct" in "\n".join(rounds_lines(rows, meta))


def test_a_block_timed_row_is_marked_and_says_why():
    meta = RunMeta(suite="t", run_id="r", task="squad", metric_names=["f1"], primary_metric="f1", reference="eager-fp32")
    b = _row("big", 2.0, 1.8, 2.2)
    b.timing_mode, b.timing_mode_note = "block", "timed in a block after the rounds: 900 MiB of host memory free"
    rows = [_row("eager-fp32", 1.0, 1.0, 1.0), b]
    assert "2.00× [1.80–2.20] B" in markdown_table(rows, meta)
    assert "900 MiB of host memory free" in "\n".join(rounds_lines(rows, meta))


def test_room_for_another_row_process():
    from bertqa_bench.commands.bench_rows import room_for_another

    assert room_for_another([], 1000.0) == ""
    assert room_for_another([{"host_peak_mib": 900.0}], 10_000.0) == ""
    assert "host memory" in room_for_another([{"host_peak_mib": 900.0}], 1000.0)
    gpu = [{"host_peak_mib": 10.0, "device_free_mib": 3000.0, "device_reserved_mib": 4000.0}]
    assert "GPU" in room_for_another(gpu, None)
    gpu[0]["device_free_mib"] = 80_000.0
    assert room_for_another(gpu, None) == ""


def test_settings_follow_the_suite():
    from bertqa_bench.commands.bench_rows import rounds_settings

    bench = SimpleNamespace(min_passes=4, max_rounds=9, rounds_budget_s=30.0, target_halfwidth_pct=2.5,
                            noise_cv_pct=7.0, rerun_spread_pct=1.5, pool_process_spread=True)
    assert rounds_settings(bench) == RoundsSettings(4, 9, 30.0, 2.5, 7.0, 1.5, True)
