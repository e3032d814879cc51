"""Views of a run bundle: summary.md, comparison.png and the committed reference tables.

Everything here reads BackendResult / RunMeta records (``RunBundle.load``), never re-parses
its own markdown.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..io import atomic_write_text
from ..record.noise import gpu_clock_text
from ..record.parity import noise_note
from ..record.results import BackendResult, RunBundle, RunMeta, rows_to_csv
from .colors import for_results
from .loadgen_results import loadgen_table
from .recommend import for_run


def _f(v, fmt: str, empty: str = "—") -> str:
    return empty if v is None else format(v, fmt)


def _time(r: BackendResult) -> str:
    if r.n_passes and r.n_passes > 1:
        return f"{r.predict_s:.3f} ({r.predict_min_s:.3f}–{r.predict_max_s:.3f})"
    return _f(r.predict_s, ".3f")


BUSY = "⚠"  # timed while other processes needed the cores (machine_state.py): not the backend's time
NOISY = "~"  # a noise sensor that speaks for the row wandered past bench.noise_cv_pct (record/noise.py)


def busy(r: Optional[BackendResult]) -> bool:
    return r is not None and r.timing_reliable is False


def _speedup(r: BackendResult, ref: Optional[BackendResult] = None) -> str:
    if r.speedup is None:
        return "—"
    # [low–high]: the interval (rounds: what a rerun shows, 95 %; a block: the extremes of passes).
    # "≈": the interval straddles 1.0 — not distinguishable from the reference.
    # ⚠: this row or the reference was timed on a busy machine, so the ratio is not the backends'.
    # ~: a sensor that speaks for this row wandered (the host's for a CPU row, the GPU's for a GPU
    # row); B: timed in a block, not in the rounds.
    ci = f" [{r.speedup_low:.2f}–{r.speedup_high:.2f}]" if r.speedup_low is not None and r is not ref else ""
    return (f"{r.speedup:.2f}×{ci}" + (" ≈" if r.speedup_within_noise and r is not ref else "")
            + (" B" if r.timing_mode == "block" and r is not ref else "")
            + (f" {BUSY}" if busy(r) or busy(ref) else "") + (f" {NOISY}" if r.timing_noisy else ""))


def rounds_lines(results: list[BackendResult], meta: RunMeta) -> list[str]:
    """How the rows were timed: rounds, their processes, the interval each row reached, the two
    noise sensors and the rows each marked, the GPU rows' clocks, the rows timed in blocks and why."""
    log = meta.rounds or {}
    lines = []
    if log.get("calibration_s"):
        n = len(log["calibration_s"])
        widths = ", ".join(f"`{r.backend}` ±{r.speedup_halfwidth_pct:.1f}%" for r in results
                           if r.ok and r.timing_mode == "rounds" and r.speedup_halfwidth_pct is not None
                           and r.backend != meta.reference)
        lines.append(f"Timing: {n} interleaved round{'s' if n != 1 else ''} ({log.get('stop_reason', '')}); "
                     "each speedup is the median over rounds of the reference's pass / the row's pass of the same "
                     "round, its interval [95 %] what a rerun with as many rounds, in new processes, shows"
                     + (f"; intervals reached: {widths}" if widths else "") + ".")
        lines += processes_lines(results, bool(log.get("pool_process_spread")))
        if log.get("rerun_spread_pct"):
            lines.append(f"Between runs: each interval also holds a between-run spread of {log['rerun_spread_pct']:g}% "
                         "(bench.rerun_spread_pct, measured from reruns on this kind of machine): what moves a whole "
                         "run alike, which no spread inside one run shows.")
        lines += sensor_lines(results, meta, n)
    for r in results:
        if r.ok and r.timing_mode == "block" and r.timing_mode_note and r.backend != meta.reference:
            lines.append(f"- `{r.backend}` (B): {r.timing_mode_note}; its ratio is of two blocks timed at different "
                         "times, its range the extremes of the passes.")
    return lines


def processes_lines(results: list[BackendResult], pooled: bool = False) -> list[str]:
    """How many worker processes each row's passes came from, and why fewer where memory said so;
    ``pooled``: the spread between processes was estimated over all rows (bench.pool_process_spread)."""
    rows = [r for r in results if r.ok and r.timing_mode == "rounds" and r.processes]
    if not rows:
        return []
    counts = {r.processes for r in rows}
    head = (f"Processes: every row's passes came from {rows[0].processes} worker process"
            f"{'es' if rows[0].processes != 1 else ''}" if len(counts) == 1
            else "Processes: " + ", ".join(f"`{r.backend}` {r.processes}" for r in rows))
    spread = ("the spread between processes, pooled over the rows (bench.pool_process_spread)" if pooled
              else "the spread between them")
    return [head + (f", taking turns by round; each interval includes {spread}" if max(counts) > 1
                    else "; the spread between processes is not in the intervals") + "."] + [
        f"- `{r.backend}`: {r.processes_note}" for r in rows if r.processes_note]


def sensor_lines(results: list[BackendResult], meta: RunMeta, n: int) -> list[str]:
    """The host calibration and the GPU sensor, which rows each marked (``~``), the GPU clocks."""
    lines, gpu_rows = [], [r for r in results if r.ok and r.device == "cuda"]
    cv = meta.calibration_cv_pct
    if cv is not None:
        marks = "it marks the CPU rows" + (", and a GPU row in proportion to the share of its passes the GPU sat idle"
                                           if gpu_rows else "")
        lines.append(f"Host calibration (a fixed numpy workload on one CPU thread, timed at the start of each round): "
                     f"{cv:.1f}% spread (coefficient of variation) over {n} rounds" + (
                         f" — **noisy host**: above the {meta.noise_cv_pct:g}% threshold; {marks}"
                         if meta.timing_noisy else f", within the {meta.noise_cv_pct:g}% threshold") + ".")
    if meta.gpu_sensor_spread_pct is not None or meta.gpu_sensor_jitter_pct is not None:
        lines.append(f"GPU sensor (fixed GEMMs and a device copy timed by CUDA events each round; it marks the GPU "
                     f"rows): {_f(meta.gpu_sensor_spread_pct, '.1f')}% spread over rounds, "
                     f"{_f(meta.gpu_sensor_jitter_pct, '.1f')}% between repetitions within a round (threshold "
                     f"{meta.noise_cv_pct:g}%).")
    elif gpu_rows:
        lines.append("GPU sensor: not read (no CUDA in the bench's own process); the GPU rows carry no noise mark.")
    lines += [f"- {NOISY} `{r.backend}`: noisy ({r.timing_noise_note}); a ratio whose interval straddles 1.0 cannot "
              "be told here" for r in results if r.ok and r.timing_noisy]
    clocks = [f"`{r.backend}` {gpu_clock_text(r)}" for r in gpu_rows if gpu_clock_text(r)]
    if clocks:
        lines.append("GPU clocks over each row's own passes (NVML, medians): " + "; ".join(clocks) + ".")
    return lines


def timing_lines(results: list[BackendResult], meta: RunMeta) -> list[str]:
    """The rows timed on a busy machine, each with what the machine was doing (the run's summary)."""
    bad = [r for r in results if r.ok and busy(r)]
    if not bad:
        return []
    ref = next((r for r in results if r.backend == meta.reference), None)
    lines = [f"{BUSY} Timing unreliable: {len(bad)} of {sum(r.ok for r in results)} rows were timed while other "
             "processes needed their cores; their times" + (", and every speedup (the reference is one of them)"
                                                             if busy(ref) else " and speedups")
             + " are not the backends'. Rerun on an idle machine (`uptime`, `top`) to compare them:"]
    lines += [f"- `{r.backend}`: timing: {r.timing_note}" for r in bad]
    return lines


def _agreement(r: BackendResult) -> str:
    if r.answer_agreement is None:
        return "—"
    ci = f" [{r.agreement_ci_low:.1%}–{r.agreement_ci_high:.1%}]" if r.agreement_ci_low is not None else ""
    return f"{r.answer_agreement:.2%}{ci}" + (" ≈" if r.agreement_within_noise else "")


def _delta(r: BackendResult, metric: str) -> str:
    """Δ of the primary metric with its paired-bootstrap 95% interval over questions."""
    d = r.deltas.get(metric)
    if d is None:
        return "—"
    ci = r.delta_ci.get(metric)
    return f"{d:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


def _parity(r: BackendResult) -> str:
    if not r.parity:
        return "—"
    note = noise_note(r)
    return r.parity + (f" ({note})" if note else "")


def _memory(r: BackendResult) -> str:
    # Prepare's peak beside prediction's: an export that held 79,514 MiB while preparing was only
    # visible in the CSV while the table showed prediction's 4,9xx MiB. MiB = 2**20 bytes.
    host = f"{_f(r.prepare_host_peak_mib, ',.0f')} / {_f(r.predict_host_peak_mib, ',.0f')}"
    if r.device == "cuda":
        dev = r.predict_device_used_mib if r.predict_device_used_mib is not None else r.predict_cuda_reserved_peak_mib
        return f"{host} / {_f(dev, ',.0f')}"
    return host


def markdown_table(results: list[BackendResult], meta: RunMeta) -> str:
    gpu = any(r.device == "cuda" for r in results)
    metrics = list(meta.metric_names)
    head = ["Backend", "Precision", "Batching", "Prediction time (s)", f"% vs {meta.reference}", "Speedup",
            "Features/s"]
    if gpu:
        head += ["TFLOP/s (real)"]
    primary = meta.primary_metric
    head += [meta.metric_labels.get(m, m) for m in metrics] + [
        f"Δ{meta.metric_labels.get(primary, primary)} [95% CI]", "Answer agreement [95% CI]", "Max |Δ logit|", "Parity",
                                                    "Prepare (s)", ("Peak MiB (host prepare / predict / GPU)" if gpu else "Peak host MiB (prepare / predict)")]
    if gpu:
        head += ["J / 1k features", "GPU clock (median over its passes)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    ref = next((r for r in results if r.backend == meta.reference), None)
    for r in results:
        if not r.ok:
            cells = [r.backend, r.precision, r.batching, f"{r.status}: {r.error}"]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
            continue
        cells = [r.backend, r.precision, r.batching, _time(r) + (f" {BUSY}" if busy(r) else ""),
                 "—" if r.pct_change_vs_ref is None else f"{r.pct_change_vs_ref:+.1f}%", _speedup(r, ref),
                 _f(r.features_per_s, ",.0f")]
        if gpu:
            cells.append(f"{_f(r.achieved_tflops, '.0f')} ({_f(r.real_tflops, '.0f')})")
        cells += [_f(r.scores.get(m), ".2f") for m in metrics]
        cells += [_delta(r, primary), _agreement(r), _f(r.max_abs_logit_diff, ".2e"), _parity(r),
                  _f(r.prepare_s, ".1f"), _memory(r)]
        if gpu:
            cells += [_f(r.energy_j_per_1k_features, ".1f"), gpu_clock_text(r) or "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header_lines(meta: RunMeta, env: dict, results: tuple = ()) -> list[str]:
    card = env.get("gpu") if meta.device_name and not meta.device_name.startswith("cpu") else None
    lines = [f"- Model: `{meta.model}` ({meta.model_note})"
             + (f"; {meta.model_params:,} parameters" if meta.model_params else "")]
    lines.append(f"- Device: {card or meta.device_name}" + (
        f"; driver {env.get('driver')}, CUDA {env.get('cuda')}" if card else "")
        + f"; torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}; commit "
          f"{env.get('git_commit', '?')}"
        + (f" (source {env['source_digest']})" if env.get("source_digest") else ""))
    lines.append(f"- Batching {meta.batching}, batch size {meta.batch_size}, max sequence length {meta.max_seq_len}; "
                 f"{meta.n_features} features per pass, {meta.n_questions} questions")
    lines.append(f"- Prediction time: every feature, after warm-up, first batch in to last logits on the host; the "
                 f"median of the timed passes (min–max in brackets). Speedup and % change are against "
                 f"`{meta.reference}` from this same run, paired round by round [95 % interval]; ≈ marks an "
                 f"interval that straddles 1.0, B a row timed in a block of its own, {BUSY} a time (or a ratio "
                 f"with one) taken while other processes needed the cores, {NOISY} a row whose noise sensor wandered (the "
                 f"host's for a CPU row, the GPU's for a GPU row).")
    if threads_line(list(results)):
        lines.append(threads_line(list(results)))
    if meta.command:
        lines.append(f"- Command: `{meta.command}`")
    lines.append(f"- Date: {meta.date}")
    if meta.verdict:
        lines.append(f"- Parity verdict: **{meta.verdict}**" + (
            f" (of the variants that finished: the run was interrupted by {meta.interrupted_by})"
            if meta.status == "interrupted" else ""))
    lines.append("- Parity: each rule is a point rule (F1 ≥ its share of the reference's, answers agreeing ≥ the "
                 "class's share); Δ intervals are paired bootstraps over questions (2,000 resamples, seeded), "
                 "agreement intervals Wilson's. A verdict whose deciding interval straddles its tolerance is marked "
                 "*within noise*, with the questions that would decide it; a run whose only failures are within noise "
                 "is INCONCLUSIVE.")
    for res in meta.resumes:
        lines.append(f"- Resumed {res.get('date')}: ran {', '.join(res.get('ran') or []) or 'nothing'}"
                     + (f" (`{res['command']}`)" if res.get("command") else ""))
    lines += [f"- {n}" for n in meta.notes]
    return lines


def threads_line(results: list[BackendResult]) -> str:
    """The thread plan the CPU rows ran with, and the cores they had."""
    cpu = [r for r in results if r.ok and r.device == "cpu" and r.threads]
    if not cpu:
        return ""
    threads = sorted({r.threads for r in cpu})
    cores = max((r.usable_cores or 0) for r in cpu)
    same = len(threads) == 1
    return (f"- Threads: {'every CPU backend computed on ' + str(threads[0]) if same else 'CPU backends computed on ' + ', '.join(map(str, threads))}"
            f" thread{'s' if threads[-1] > 1 else ''} of the {cores} core{'s' if cores != 1 else ''} this run may use "
            "(bench.num_threads, else all of them and never more; a variant's own thread option wins); the other "
            "processes' CPU demand while each row was timed is in results.csv (other_cpu_cores, load_avg_1m)")


def results_table(results: list[BackendResult], meta: RunMeta) -> str:
    """The bench table, or for a `bertqa-bench loadgen` bundle its scenario table."""
    if any(r.scenario for r in results):
        return loadgen_table(results, meta)
    return markdown_table(results, meta)


def recommendation(bundle: RunBundle):
    """The run's recommendation (recommend.py) from its records."""
    return for_run(bundle.results, bundle.meta)


def summary_markdown(bundle: RunBundle) -> str:
    """summary.md: the recommendation first, then how the run was made, the table and its notes."""
    meta = bundle.meta
    return "\n".join([f"# {meta.suite} — {meta.run_id}", "", *recommendation(bundle).lines(), "",
                      *header_lines(meta, bundle.env(), bundle.results), "", *_table_and_notes(bundle)])


def console_summary(bundle: RunBundle) -> str:
    """What bench and loadgen print when the run ends: the table, then the recommendation (the
    first thing after it), then the table's notes."""
    meta = bundle.meta
    table, _, *notes = _table_and_notes(bundle)
    return "\n".join([f"# {meta.suite} — {meta.run_id}", "", *header_lines(meta, bundle.env(), bundle.results), "", table, "",
                      *recommendation(bundle).lines(), "", *notes])


def _table_and_notes(bundle: RunBundle) -> list[str]:
    meta, results = bundle.meta, bundle.results
    lines = [results_table(results, meta), ""]
    if rounds_lines(results, meta):
        lines += [*rounds_lines(results, meta), ""]
    if timing_lines(results, meta):  # the rows timed on a busy machine, right under the table
        lines += [*timing_lines(results, meta), ""]
    notes = [r for r in results if not r.ok]
    if notes:
        lines.append("Backends not run or failed:")
        lines += [f"- `{r.backend}`: {r.status} — {r.error}" for r in notes]
        lines.append("")
    fails = [r for r in results if r.parity == "FAIL"]
    if fails:
        lines.append("Parity failures:")
        lines += [f"- `{r.backend}`: {r.parity_failures}" for r in fails]
        lines.append("")
    return lines


def plot(results: list[BackendResult], meta: RunMeta, path: Path) -> Optional[Path]:
    """Throughput and the primary accuracy metric per backend, side by side, each backend in its
    run colour (colors.py: the same as in sweep.png and MLflow's charts). A parity FAIL is drawn
    hatched with a red edge and named in the tick label, so it does not depend on telling colours apart."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = for_results(results, meta.variants)
    metric = meta.primary_metric
    names = [r.backend + ("\n(parity FAIL)" if r.parity == "FAIL" else "") for r in ok]
    colours = [colour(r.backend, r.batching) for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(names) + 4), 4.5))
    label = meta.metric_labels.get(metric, metric)
    for ax, values, ylabel, title in (
            (a, [r.features_per_s for r in ok], "features / s (median pass)", "Throughput (higher is better)"),
            (b, [r.scores.get(metric, 0.0) for r in ok], label, f"{label} (parity vs {meta.reference})")):
        bars = ax.bar(names, values, color=colours, edgecolor="black", linewidth=0.5)
        for bar, r in zip(bars, ok):
            if r.parity == "FAIL":
                bar.set_hatch("xx")
                bar.set_edgecolor("#c00000")
                bar.set_linewidth(1.5)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35)
        for lbl in ax.get_xticklabels():
            lbl.set_ha("right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # bbox_inches="tight": long backend names below the axes are kept whole, never cut at the edge.
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(bundle: RunBundle) -> str:
    md = summary_markdown(bundle)
    atomic_write_text(bundle.dir / "summary.md", md)
    if not any(r.scenario for r in bundle.results):  # LoadGen rows have no full-pass throughput to plot
        plot(bundle.results, bundle.meta, bundle.dir / "comparison.png")
    return md


def latest_run(results_root: Path) -> Optional[Path]:
    runs = sorted(p.parent for p in Path(results_root).glob("*/run.json"))
    return runs[-1] if runs else None


def reference_tables(run_dirs: list[Path], out_stem: Path, title: str, notes: str = "") -> str:
    """Merge result bundles (each with its own baseline) into a committed reference table
    ``<out_stem>.md`` + ``.csv`` that states card, driver, versions, commands and dates."""
    sections, rows = [f"# {title}", ""], []
    if notes:
        sections += [notes.strip(), ""]
    for d in map(Path, run_dirs):
        bundle = RunBundle.load(d)
        meta, env = bundle.meta, bundle.env()
        # Two bundles of one run id (the same plan run twice) stay apart by their folder's name.
        folder = f" (bundle `{d.name}`)" if d.name != meta.run_id else ""
        sections += [f"## {meta.suite} — run `{meta.run_id}`{folder}", "", *header_lines(meta, env), "",
                     results_table(bundle.results, meta), ""]
        rows += [{"run_id": meta.run_id, "bundle": d.name, "suite": meta.suite, "date": meta.date, "card": env.get("gpu") or env.get("cpu"),
                  "driver": env.get("driver", ""), "command": meta.command, **r.to_row()} for r in bundle.results]
    md = "\n".join(sections)
    atomic_write_text(Path(str(out_stem) + ".md"), md)
    atomic_write_text(Path(str(out_stem) + ".csv"), rows_to_csv(rows))
    return md
