"""scripts/rerun_table.py: reruns side by side, and the intervals recomputed from the rounds a
run recorded under either process-spread rule (bench.pool_process_spread)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import load_script

from bertqa_bench.measuring.rounds import RoundsLog
from bertqa_bench.record.results import BackendResult

@pytest.fixture(scope="module")
def rt():
    return load_script("rerun_table")


def _bundle(pooled: bool):
    """A run of a reference and two rows, 4 rounds from two processes taking turns: row ``wide``'s
    processes 10 % apart, row ``calm``'s alike; the intervals as the bench recorded them."""
    passes = {"ref": [10.0] * 4, "wide": [5.0, 5.5, 5.1, 5.6], "calm": [4.0, 4.02, 4.05, 4.0]}
    processes = {n: [0, 1, 0, 1] for n in passes}
    log = RoundsLog(list(passes), "ref", passes=passes, processes=processes, calibration_s=[0.1] * 4,
                    pool_process_spread=pooled)
    results = []
    for n in passes:
        sp = log.speedup(n)
        results.append(BackendResult(n, timing_mode="rounds", speedup=sp.speedup, speedup_low=sp.low,
                                     speedup_high=sp.high, speedup_halfwidth_pct=sp.halfwidth_pct))
    return SimpleNamespace(meta=SimpleNamespace(rounds=log.to_dict()), results=results)


def test_recomputing_under_the_recorded_rule_gives_the_recorded_intervals(rt):
    for pooled in (False, True):
        recorded = [v for r in _bundle(pooled).results for v in (r.speedup_low, r.speedup_high)]
        again = [v for r in rt.recomputed(_bundle(pooled), pooled).results for v in (r.speedup_low, r.speedup_high)]
        assert again == pytest.approx(recorded)


def test_recomputing_under_the_other_rule_moves_the_rows_intervals_and_says_so(rt):
    own, pooled = rt.recomputed(_bundle(True), False), _bundle(True)
    width = {b: {r.backend: r.speedup_high / r.speedup_low for r in x.results} for b, x in (("own", own), ("pooled", pooled))}
    assert width["own"]["wide"] > width["pooled"]["wide"]  # its own two processes: one degree of freedom
    assert width["own"]["calm"] < width["pooled"]["calm"]  # the pool's spread reaches the calm row
    assert own.meta.rounds["pool_process_spread"] is False
    assert [r.speedup for r in own.results] == [r.speedup for r in pooled.results]  # medians untouched
