"""Comparison tables and plots from a result bundle (results.csv)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from .results import atomic_write_text, read_csv


def _num(v) -> Optional[float]:
    try:
        f = float(v)
        return None if math.isnan(f) else f
    except (TypeError, ValueError):
        return None


def _f(v, fmt: str, empty: str = "—") -> str:
    x = _num(v)
    return empty if x is None else format(x, fmt)


def metric_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(column, header) of the accuracy columns: EM/F1 for SQuAD, long/short/micro F1 for NQ."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    if "micro_f1" in keys and any(_num(r.get("micro_f1")) is not None for r in rows):
        return [("long_f1", "Long F1"), ("short_f1", "Short F1"), ("micro_f1", "Micro-F1")]
    return [("exact_match", "EM"), ("f1", "F1")]


def markdown_table(rows: list[dict], reference: str, *, gpu_columns: bool = False) -> str:
    metrics = metric_columns(rows)
    head = ["Backend", "Precision", "Prediction time (s)", "% vs " + reference, "Speedup", "Features/s"]
    if gpu_columns:
        head.append("TFLOP/s")
    head += [h for _, h in metrics] + ["Answer agreement", "Max |Δ logit|", "Parity", "Prepare (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.get("status") != "ok":
            cells = [r["backend"], r.get("precision", ""), f"{r.get('status', '')}: {r.get('error', '')}"]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
            continue
        pct = _num(r.get("pct_change_vs_ref"))
        cells = [r["backend"], r.get("precision", ""), _f(r.get("predict_s"), ".3f"),
                 "—" if pct is None else f"{pct:+.1f}%", _f(r.get("speedup"), ".2f") + "×",
                 _f(r.get("features_per_s"), ",.0f")]
        if gpu_columns:
            cells.append(_f(r.get("achieved_tflops"), ".1f"))
        cells += [_f(r.get(k), ".2f") for k, _ in metrics]
        agr = _num(r.get("answer_agreement"))
        cells += ["—" if agr is None else f"{agr:.2%}", _f(r.get("max_abs_logit_diff"), ".2e"),
                  r.get("parity") or "—", _f(r.get("prepare_s"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(rows: list[dict], meta: dict) -> str:
    reference = meta.get("reference", "eager-fp32")
    gpu = any(r.get("device") == "cuda" for r in rows)
    first_ok = next((r for r in rows if r.get("status") == "ok"), rows[0] if rows else {})
    lines = [f"# {meta.get('suite', '')} — {meta.get('run_id', '')}", ""]
    lines.append(f"- Model: `{meta.get('model', '')}` ({meta.get('model_note', '')})")
    lines.append(f"- Device: {first_ok.get('device_name', meta.get('device', ''))}")
    lines.append(f"- Batch size {first_ok.get('batch_size', '')}, max sequence length {first_ok.get('max_seq_len', '')}"
                 f", padding {first_ok.get('padding', '')}; {first_ok.get('n_features', '')} features, "
                 f"{first_ok.get('n_questions', '')} questions")
    lines.append(f"- Prediction time: every feature, after warm-up, first batch in to last logits on the host. "
                 f"Speedup and % change are against `{reference}` from this same run.")
    if meta.get("command"):
        lines.append(f"- Command: `{meta['command']}`")
    if meta.get("verdict"):
        lines.append(f"- Parity verdict: **{meta['verdict']}**")
    lines += ["", markdown_table(rows, reference, gpu_columns=gpu), ""]
    notes = [r for r in rows if r.get("status") not in ("ok", None)]
    if notes:
        lines.append("Backends not run or failed:")
        lines += [f"- `{r['backend']}`: {r.get('status')} — {r.get('error', '')}" for r in notes]
        lines.append("")
    fails = [r for r in rows if r.get("parity") == "FAIL"]
    if fails:
        lines.append("Parity failures:")
        lines += [f"- `{r['backend']}`: {r.get('parity_failures', '')}" for r in fails]
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """Prediction time and the primary accuracy metric per backend, side by side."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, header = metric_columns(ok)[-1]
    names = [r["backend"] for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(names) + 4), 4))
    a.bar(names, [float(r["predict_s"]) for r in ok], color="#4c72b0")
    a.set_ylabel("full-dataset prediction time (s)")
    a.set_title("Prediction time (lower is better)")
    b.bar(names, [float(r.get(metric) or 0) for r in ok], color="#55a868")
    b.set_ylabel(header)
    b.set_title(f"{header} (parity vs reference)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=35)
        for lbl in ax.get_xticklabels():
            lbl.set_ha("right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: Path, meta: dict) -> str:
    rows = read_csv(Path(run_dir) / "results.csv")
    md = summary_markdown(rows, meta)
    atomic_write_text(Path(run_dir) / "summary.md", md)
    plot(rows, Path(run_dir) / "comparison.png")
    return md


def latest_run(results_root: Path) -> Optional[Path]:
    runs = sorted(p.parent for p in Path(results_root).glob("*/results.csv") if p.parent.name != "reference")
    return runs[-1] if runs else None


def reference_tables(run_dirs: list[Path], out_stem: Path, title: str, notes: str = "") -> str:
    """Merge result bundles (each with its own baseline) into a committed reference table
    ``<out_stem>.md`` + ``.csv`` that states card, driver, versions, commands and dates."""
    import json

    from .results import write_csv

    sections, all_rows = [f"# {title}", ""], []
    if notes:
        sections += [notes.strip(), ""]
    for d in map(Path, run_dirs):
        rows = read_csv(d / "results.csv")
        env = json.loads((d / "env.json").read_text()) if (d / "env.json").exists() else {}
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
        summary = (d / "summary.md").read_text() if (d / "summary.md").exists() else ""
        command = next((ln.split("`")[1] for ln in summary.splitlines() if ln.startswith("- Command:")), "")
        model_line = next((ln[2:] for ln in summary.splitlines() if ln.startswith("- Model:")), "")
        reference = cfg.get("bench", {}).get("reference", rows[0]["backend"] if rows else "")
        first = rows[0] if rows else {}
        sections += [
            f"## {cfg.get('name', d.name)} — run `{d.name}`", "",
            f"- Card: {env.get('gpu', env.get('cpu', '?'))}; driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}, "
            f"torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, onnxruntime-gpu "
            f"{env.get('onnxruntime_gpu', '?')}, tensorrt {env.get('tensorrt', '?')}; commit {env.get('git_commit', '?')}",
            f"- {model_line}" if model_line else "- Model: ?",
            f"- Batch {first.get('batch_size', '?')}, sequence length {first.get('max_seq_len', '?')}, padding "
            f"{first.get('padding', '?')}, {first.get('n_features', '?')} features / {first.get('n_questions', '?')} questions",
            f"- Command: `{command}`", f"- Date: {d.name.split('-')[1] if d.name.startswith('device-') else d.name[:8]}",
            f"- Speedup and % change are against `{reference}` measured in this same run.", "",
            markdown_table(rows, reference, gpu_columns=any(r.get("device") == "cuda" for r in rows)), "",
        ]
        all_rows += [{"run_id": d.name, "suite": cfg.get("name", ""), "card": env.get("gpu", ""),
                      "driver": env.get("driver", ""), **r} for r in rows]
    md = "\n".join(sections)
    atomic_write_text(Path(str(out_stem) + ".md"), md)
    write_csv(Path(str(out_stem) + ".csv"), all_rows)
    return md
