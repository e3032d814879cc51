"""What a bench looks like in MLflow, as pure functions of the records: each backend's metrics,
params and tags (the headline metrics first), the runs table's columns, the comparison charts
and the comparison table. tracking.py logs them."""
from __future__ import annotations

import math
from typing import Iterable

from ..record.noise import gpu_clock_text
from ..record.results import BackendResult, RunBundle

PARITY_VALUE = {"pass": 1.0, "FAIL": 0.0}


PARAM_FIELDS = ("backend", "implementation", "precision", "parity_class", "device", "device_name", "batching",
                "batch_size", "max_seq_len", "model", "task", "status")


TAG_FIELDS = ("status", "parity", "parity_failures", "error", "energy_note")


def numeric(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or v is None:
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def _f1(v) -> str:
    return "?" if v is None else f"{v:.1f}"


def headline_keys(primary: str = "f1") -> tuple[str, str, str, str]:
    """The four metrics a comparison leads with: speedup, prediction time, the primary metric's
    change against the reference, parity. Capitalised: MLflow's compare page lists metric keys in
    code-point order (upper case before lower case), so these four come first there, ahead of
    the lower-case rest, where speedup used to be the last of eleven rows."""
    return "Speedup", "Time_s", f"{primary[:1].upper()}{primary[1:]}_delta", "Parity_pass"


def child_metrics(r: BackendResult, metric_names: Iterable[str] = (), primary: str = "") -> dict:
    """The few numbers a child run logs as metrics, in the order the runs view shows them: the
    headline four (``headline_keys``), throughput, the task's scores, latencies, prepare time and
    peak memory. Peak memory is the larger of prepare's and prediction's host peaks (and the
    GPU's used memory on CUDA rows), in MiB; the per-phase values are in result.json."""
    names = list(metric_names) or list(r.scores)
    primary = primary or (names[-1] if names else "f1")
    speedup, time_s, delta, parity = headline_keys(primary)
    host = [v for v in (r.prepare_host_peak_mib, r.predict_host_peak_mib) if v is not None]
    gpu = r.predict_device_used_mib if r.predict_device_used_mib is not None else r.predict_cuda_reserved_peak_mib
    values = {speedup: r.speedup, time_s: r.predict_s, delta: (r.deltas or {}).get(primary),
              # a FAIL within the noise of the questions sorts between decided ones, as the run's
              # INCONCLUSIVE does between PASS and FAIL (verdict_pass)
              parity: 0.5 if r.parity == "FAIL" and r.parity_within_noise else PARITY_VALUE.get(r.parity),
              "features_per_s": r.features_per_s, **{m: r.scores.get(m) for m in names},
              "latency_p50_ms": r.latency_p50_ms, "latency_p99_ms": r.latency_p99_ms, "prepare_s": r.prepare_s,
              "peak_host_mib": max(host) if host else None, "peak_gpu_mib": gpu,
              "energy_j_per_1k_features": r.energy_j_per_1k_features,
              # the interval's ends; the run's calibration spread is the parent's metric (a child
              # metric named below "f1" would push the scores under the compare page's fold)
              "speedup_low": r.speedup_low, "speedup_high": r.speedup_high,
              # GPU rows: the clock and power over its own passes (NVML medians)
              "gpu_sm_clock_mhz": r.gpu_sm_clock_mhz, "gpu_power_w": r.gpu_power_w}
    if getattr(r, "scenario", ""):  # a LoadGen row: its load numbers are the comparison too
        values.update({"achieved_qps": r.achieved_qps, "target_qps": r.target_qps,
                       "sample_latency_p90_ms": r.sample_latency_p90_ms,
                       "sample_latency_p99_ms": r.sample_latency_p99_ms, "qps_vs_bench_pct": r.qps_vs_bench_pct})
    # 4 significant digits: the runs table prints a metric whole (30.30943300674 features/s); the
    # unrounded values stay in result.json and results.csv.
    return {k: float(f"{v:.4g}") for k, v in numeric(values).items()}


def result_view(r: BackendResult, metric_names: Iterable[str] = (), primary: str = "") -> tuple[dict, dict, dict]:
    """(params, metrics, tags) of a backend's child run; the whole record goes to result.json."""
    row = r.to_row()
    params = {k: row[k] for k in PARAM_FIELDS if row.get(k) not in (None, "")}
    params.update({f"prepare.{k}": v for k, v in r.prepare_info.items()})
    tags = {k: row[k] for k in TAG_FIELDS if row.get(k)}
    if r.timing_reliable is not None:  # what the machine was doing while it was timed (machine_state.py)
        tags["timing"] = r.timing_note if r.timing_reliable is False else "reliable"
    if r.timing_noisy:  # a noise sensor that speaks for this row wandered (record/noise.py)
        tags["timing"] = (tags.get("timing", "") + "; " if tags.get("timing") not in (None, "reliable") else "") + (
            f"noisy ({r.timing_noise_note})" if r.timing_noise_note
            else f"noisy host (calibration spread {_f1(r.calibration_cv_pct)}%)")
    if r.timing_mode:
        tags["timing_mode"] = r.timing_mode + (f" ({r.rounds} rounds" + (
            f", {r.processes} processes" if r.processes and r.processes > 1 else "") + ")" if r.rounds else "")
    if gpu_clock_text(r):  # e.g. "power-capped at 1,650 MHz, 692 W": the clock the row ran at
        tags["gpu_clock"] = gpu_clock_text(r)
    if r.parity and r.parity_within_noise:
        # beside the status, not in it: `tags.parity = 'FAIL'` keeps finding every FAIL
        tags["parity_within_noise"] = f"{r.questions_to_decide or '?'} questions would decide it"
    return params, child_metrics(r, metric_names, primary), tags


def view_columns(children_metrics: Iterable[Iterable[str]], metric_names: Iterable[str] = (),
                 primary: str = "f1") -> list[str]:
    """The runs-table columns of a bench's view, in order: the parity tag (each backend's, and the
    bench's verdict on the parent), then the chosen metrics some child has (GPU-only ones stay out
    of a CPU bench), the parent's verdict_pass and its recommendation; keys as the UI writes them
    (``metrics.`f1```, its canonical sort keys)."""
    have = set().union(*map(set, children_metrics)) if children_metrics else set()
    order = ["achieved_qps", "target_qps", "sample_latency_p90_ms", "sample_latency_p99_ms", "qps_vs_bench_pct",
             *headline_keys(primary), "features_per_s", *metric_names, "latency_p50_ms", "latency_p99_ms",
             "prepare_s", "peak_host_mib", "peak_gpu_mib", "energy_j_per_1k_features", "gpu_sm_clock_mhz",
             "gpu_power_w"]
    return (["tags.`parity`"] + [f"metrics.`{m}`" for m in dict.fromkeys(order) if m in have]
            + ["metrics.`verdict_pass`", "tags.`recommendation`"])


# The chart mode's first section: the comparison's bar charts, one a row across the whole width.
# A bar chart names its bars only in its legend, and MLflow gives the legend 32 px (two lines) of
# the card: at one card a row, two lines hold the names of about a dozen backends; at MLflow's
# three a row they held four.
COMPARISON_SECTION = "bertqa-comparison"


def comparison_charts(children_metrics: Iterable[Iterable[str]], primary: str, n_runs: int) -> dict:
    """The saved view's chart mode (MLflow's ``compareRunCharts`` / ``compareRunSections``): a
    "Comparison" section with a bar chart of each headline metric some child has (speedup,
    prediction time, the primary metric's change, parity), then throughput and the primary
    metric, every run of the bench in each; MLflow adds the other metrics' charts below it, in
    its own "Model metrics" section."""
    have = set().union(*map(set, children_metrics)) if children_metrics else set()
    keys = [k for k in dict.fromkeys([*headline_keys(primary), "features_per_s", primary]) if k in have]
    charts = [{"uuid": f"bertqa-{k}", "type": "BAR", "metricKey": k, "displayName": k, "metricSectionId": COMPARISON_SECTION,
               "runsCountToCompare": max(10, n_runs), "deleted": False, "isGenerated": False} for k in keys]
    section = {"uuid": COMPARISON_SECTION, "name": "Comparison (every backend of this bench)", "display": True,
               "isReordered": True, "deleted": False, "isGenerated": False, "columns": 1, "cardHeight": 360}
    return {"compareRunCharts": charts, "compareRunSections": [section], "isAccordionReordered": True}


def comparison_frame(bundle: RunBundle):
    """results.csv as a DataFrame for ``MlflowClient.log_table``: one row per backend, the
    backend first and the headline numbers next (MLflow's artifact view groups by the first
    column and compares the second across the selected runs), then every other column; floats
    to 4 significant digits (results.csv keeps them whole)."""
    import pandas as pd

    primary = bundle.meta.primary_metric
    lead = ["backend", "features_per_s", "speedup", "predict_s", primary, "parity", "status"]
    rows = []
    for r in bundle.results:
        row = r.to_row()
        rows.append({k: _table_value(row.get(k)) for k in [*dict.fromkeys(lead), *row]})
    return pd.DataFrame(rows, columns=list(rows[0]) if rows else lead)


def _table_value(v):
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return float(f"{f:.4g}") if math.isfinite(f) else None
