"""LoadGen's settings and logs, shared by the worker (loadgen_sut.py) and the command
(commands/loadgen.py): the TestSettings from the suite's ``loadgen:`` section, LoadGen's detail log
read back into a result, the peak search, and the accuracy log decoded to dataset-order outputs.
Pure functions over files (no backend, no process); the scenario table is reporting's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..config import SCENARIOS, LoadGenConfig
from ..errors import ConfigError
from ..record.schedule import PAD_LOGIT

NS_PER_MS = 1e6
PERCENTILES = {"p50": "50.00", "p90": "90.00", "p99": "99.00", "p999": "99.90"}


# --- LoadGen's settings and logs (shared with the worker side) ------------------------------
def test_settings(lg, cfg: LoadGenConfig, scenario: str, mode: str, target_qps: float, *,
                  offline_expected_qps: float, single_stream_expected_latency_ns: float):
    """LoadGen's TestSettings for one run, from the suite's ``loadgen:`` section."""
    if scenario not in SCENARIOS:
        raise ConfigError(f"scenario '{scenario}' is not one of {', '.join(SCENARIOS)}")
    s = lg.TestSettings()
    s.scenario = getattr(lg.TestScenario, scenario)
    s.mode = lg.TestMode.AccuracyOnly if mode == "accuracy" else lg.TestMode.PerformanceOnly
    s.min_duration_ms = int(cfg.min_duration_ms)
    s.max_duration_ms = int(cfg.max_duration_ms)
    s.min_query_count = int(cfg.min_query_count)
    s.max_query_count = int(cfg.max_query_count)
    s.qsl_rng_seed = s.sample_index_rng_seed = s.schedule_rng_seed = int(cfg.seed)
    s.single_stream_expected_latency_ns = max(1, int(single_stream_expected_latency_ns))
    s.single_stream_target_latency_percentile = float(cfg.single_stream_target_latency_percentile)
    s.server_target_qps = float(target_qps)
    s.server_target_latency_ns = int(cfg.server_target_latency_ns)
    s.server_target_latency_percentile = float(cfg.server_target_latency_percentile)
    s.server_coalesce_queries = bool(cfg.server_coalesce_queries)
    s.offline_expected_qps = float(offline_expected_qps)
    return s


def parse_detail(path: Path) -> dict:
    """``mlperf_log_detail.txt``'s ``:::MLLOG {json}`` lines as {key: value} (the last of each)."""
    out: dict = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith(":::MLLOG "):
            try:
                rec = json.loads(line[len(":::MLLOG "):])
            except json.JSONDecodeError:
                continue
            out[rec.get("key")] = rec.get("value")
    return out


def read_result(out_dir: Path) -> dict:
    """LoadGen's verdict and numbers of one run, from its detail log."""
    d = parse_detail(Path(out_dir) / "mlperf_log_detail.txt")
    scenario = d.get("effective_scenario", "")
    res: dict = {"scenario": scenario, "mode": d.get("effective_test_mode", ""),
                 "validity": d.get("result_validity", ""), "query_count": d.get("result_query_count"),
                 "min_duration_ms": d.get("effective_min_duration_ms"),
                 "min_query_count": d.get("effective_min_query_count"),
                 "target_latency_ms": (d["effective_target_latency_ns"] / NS_PER_MS
                                       if d.get("effective_target_latency_ns") else None),
                 "n_errors": d.get("num_errors", 0)}
    for name, p in PERCENTILES.items():
        v = d.get(f"result_{p}_percentile_latency_ns")
        res[f"{name}_ms"] = v / NS_PER_MS if v is not None else None
    res["mean_ms"] = d["result_mean_latency_ns"] / NS_PER_MS if "result_mean_latency_ns" in d else None
    res["achieved_qps"] = (d.get("result_completed_samples_per_sec") if scenario == "Server"
                           else d.get("result_samples_per_second") if scenario == "Offline"
                           else d.get("result_qps_without_loadgen_overhead"))
    res["scheduled_qps"] = d.get("result_scheduled_samples_per_sec")
    why = []
    if d.get("result_perf_constraints_met") is False:
        pct = d.get("effective_target_latency_percentile", 0.99) * 100
        key = f"result_{pct:.2f}_percentile_latency_ns"
        got = f"{d[key] / NS_PER_MS:.1f} ms" if key in d else "over"
        why.append(f"latency p{pct:g} {got} > bound {res['target_latency_ms']:g} ms "
                   f"({d.get('result_overlatency_query_count', '?')} queries over it)")
    if d.get("result_min_duration_met") is False:
        why.append(f"min duration {res['min_duration_ms']} ms not met")
    if d.get("result_min_queries_met") is False:
        why.append(f"min query count {res['min_query_count']} not met")
    if d.get("early_stopping_met") is False:
        why.append("early stopping: " + " ".join(str(d.get("early_stopping_result", "")).split()))
    if d.get("result_invalid_reason"):
        why.append(str(d["result_invalid_reason"]).strip())
    if res["n_errors"]:
        why.append(f"{res['n_errors']} LoadGen errors (see mlperf_log_detail.txt)")
    res["why"] = "; ".join(w for w in why if w)
    return res


def find_peak(run_at: Callable[[float], dict], start_qps: float, precision: float,
              max_runs: int) -> tuple[Optional[tuple[float, dict]], list]:
    """The highest target QPS whose LoadGen run is VALID: from ``start_qps``, double while VALID
    (halve while INVALID) until both a VALID and an INVALID target are known, then bisect until
    they are within ``precision`` of each other (or ``max_runs`` runs). Returns (the best VALID
    (qps, result) or None, every (qps, result) in the order run)."""
    runs: list = []
    lo: Optional[tuple] = None
    hi: Optional[float] = None
    q = float(start_qps)
    while len(runs) < max_runs:
        r = run_at(q)
        runs.append((q, r))
        if r.get("validity") == "VALID":
            if lo is None or q > lo[0]:
                lo = (q, r)
        elif hi is None or q < hi:
            hi = q
        if hi is None:
            q *= 2.0
        elif lo is None:
            q /= 2.0
        elif (hi - lo[0]) <= precision * lo[0]:
            break
        else:
            q = (lo[0] + hi) / 2.0
    return lo, runs


def decode_accuracy_log(path: Path, layout: list, lengths: np.ndarray, max_seq_len: int) -> tuple[dict, np.ndarray]:
    """LoadGen's accuracy log back to dataset-order outputs (PAD_LOGIT where nothing came back),
    and how many times each feature was answered. ``layout`` is the SUT's response layout:
    [[name, "token" | number of values], ...] (loadgen_sut.Codec)."""
    n = len(lengths)
    out: dict = {}
    for name, kind in layout:
        shape = (n, max_seq_len) if kind == "token" else (n, int(kind))
        out[name] = np.full(shape, PAD_LOGIT, dtype=np.float32)
    seen = np.zeros(n, dtype=np.int64)
    for entry in json.loads(Path(path).read_text()):
        i = int(entry["qsl_idx"])
        values = np.frombuffer(bytes.fromhex(entry["data"]), dtype=np.float32)
        length = int(lengths[i])
        want = sum(length if kind == "token" else int(kind) for _, kind in layout)
        if values.size != want:
            raise ValueError(f"accuracy log entry for sample {i}: {values.size} values, expected {want}")
        at = 0
        for name, kind in layout:
            k = length if kind == "token" else int(kind)
            if kind == "token":
                out[name][i, :k] = values[at:at + k]
            else:
                out[name][i] = values[at:at + k]
            at += k
        seen[i] += 1
    # Per-feature heads saved flat come back to their own shape by the task when it needs one;
    # every head the tasks have today is one vector per feature.
    return out, seen


# --- views ----------------------------------------------------------------------------------
