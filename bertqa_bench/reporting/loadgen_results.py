"""The scenario table of a LoadGen bundle (``bertqa-bench loadgen``'s report)."""
from __future__ import annotations


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def loadgen_table(results: list, meta) -> str:
    """The scenario rows of a bundle (summary.md, reference tables)."""
    metrics = list(meta.metric_names)
    head = ["Backend", "Precision", "Batching", "Scenario", "LoadGen", "Target QPS", "Achieved QPS",
            "Latency p50 / p90 / p99 / p99.9 (ms)", "Queries", "Bench features/s (same process)", "QPS / bench",
            *[meta.metric_labels.get(m, m) for m in metrics], "Answer agreement [95% CI]", "Parity",
            "Accuracy run", "= bench answers", "Prepare (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        if not r.ok:
            cells = [r.backend, r.precision, r.batching, r.scenario or "—", f"{r.status}: {r.error}"]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
            continue
        lat = " / ".join(_f(getattr(r, f"sample_latency_{k}_ms"), ".2f") for k in ("p50", "p90", "p99", "p999"))
        agree = "—" if r.answer_agreement is None else (
            f"{r.answer_agreement:.2%} [{r.agreement_ci_low:.1%}–{r.agreement_ci_high:.1%}]")
        cells = [r.backend, r.precision, r.batching, r.scenario, f"**{r.loadgen_result}**",
                 _f(r.target_qps, ",.1f"), _f(r.achieved_qps, ",.1f"), lat, _f(r.loadgen_query_count, ","),
                 _f(r.bench_features_per_s, ",.1f"), "—" if r.qps_vs_bench_pct is None else f"{r.qps_vs_bench_pct:.1f}%",
                 *[_f(r.scores.get(m), ".2f") for m in metrics], agree, r.parity or "—", r.accuracy_run or "missing",
                 _f(r.bench_answer_agreement, ".2%"), _f(r.prepare_s, ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for r in results:
        if r.ok and r.loadgen_result != "VALID":
            notes.append(f"- `{r.backend}`: LoadGen {r.loadgen_result}: {r.loadgen_invalid_reason}")
        if r.ok and r.peak_search:
            notes.append(f"- `{r.backend}` peak search (target QPS: V valid, I invalid): {r.peak_search}")
        if r.ok and r.sut_batcher:
            notes.append(f"- `{r.backend}` SUT: {r.sut_batcher}")
    return "\n".join(lines + ([""] + notes if notes else []))
