"""``bertqa-bench parity``: the accuracy gate for CI and GPU runs.

Runs the reference and each backend on the same features (through the benchmark itself, so the
gate checks exactly what the speed table reports), checks the reference is deterministic,
applies per-class tolerances and the committed expected scores, prints a pass/fail table and
returns False on any breach.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional

from .bench import run_bench
from .config import SuiteConfig, resolve_path
from .parity import check_expected, determinism
from .results import atomic_write_json, write_csv
from .runner import run_backend
from .tasks import get_task


def expected_path(cfg: SuiteConfig) -> Path:
    return resolve_path(cfg.parity.expected_file or f"benchmarks/expected/{cfg.name}.csv")


def parity_table(rows: list[dict], metric: str) -> str:
    head = ["backend", "class", f"{metric}", f"{metric} ratio (min)", "agreement (min)", "start/end argmax",
            "max |Δ logit|", "verdict"]
    lines = [" | ".join(head)]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(" | ".join([r["backend"], r.get("parity_class", ""), "", "", "", "", "",
                                     f"{r.get('status')}: {r.get('error', '')}"]))
            continue
        f = lambda k, fmt: format(float(r[k]), fmt) if r.get(k) not in (None, "") else "—"  # noqa: E731
        lines.append(" | ".join([
            r["backend"], r.get("parity_class", ""), f(metric, ".2f"),
            f"{f('primary_ratio', '.4f')} (≥{f('min_f1_ratio', '.3f')})",
            f"{f('answer_agreement', '.4f')} (≥{f('min_agreement', '.2f')})",
            f"{f('start_argmax_agreement', '.3f')}/{f('end_argmax_agreement', '.3f')}",
            f("max_abs_logit_diff", ".2e"), r.get("parity", "—")]))
    return "\n".join(lines)


def read_expected(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_parity_check(cfg: SuiteConfig, *, backends: Optional[list[str]] = None, update_expected: bool = False,
                     tracker=None, progress: bool = True, command: str = "", log=print) -> bool:
    task = get_task(cfg.model.task)
    out = run_bench(cfg, backends=backends, tracker=tracker, progress=progress, command=command, log=log,
                    keep_outputs=True)
    rows = out.rows
    problems: list[str] = []

    ref_row = rows[0]
    if ref_row.get("status") != "ok":
        problems.append(f"reference {ref_row['backend']} did not run: {ref_row.get('error')}")
    else:
        # Determinism: a second reference pass must reproduce the first exactly; if it doesn't,
        # backend differences below that noise are not the backend's fault.
        examples, features = out.examples, out.features
        again = run_backend(ref_row["backend"], cfg.model_dir, features, task.output_names, cfg, progress=False)
        first = out.outputs[ref_row["backend"]]
        preds_first = task.postprocess(examples, features, first, cfg)
        preds_again = task.postprocess(examples, features, again.outputs, cfg)
        det = determinism(first, again.outputs, features.attention_mask, preds_first, preds_again)
        atomic_write_json(out.run_dir / "determinism.json", det)
        log(f"determinism of {ref_row['backend']}: max |Δ logit| {det['max_abs_logit_diff']:.2e}, "
            f"identical answers: {det['identical_answers']}")
        if not det["identical_answers"]:
            problems.append(f"reference {ref_row['backend']} is not deterministic (answers changed between two "
                            f"runs, max |Δ logit| {det['max_abs_logit_diff']:.2e}): fix that before judging backends")

    for r in rows:
        if r.get("parity") == "FAIL":
            problems.append(f"{r['backend']}: {r.get('parity_failures')}")
        if r.get("status") == "failed":
            problems.append(f"{r['backend']}: failed to run: {r.get('error')}")

    exp_path = expected_path(cfg)
    if update_expected:
        cols = ["backend", "precision", *task.metric_names]
        keep = [{k: r.get(k, "") for k in cols} for r in rows if r.get("status") == "ok"]
        write_csv(exp_path, keep, columns=cols)
        log(f"expected scores written to {exp_path}")
    else:
        expected = read_expected(exp_path)
        if expected:
            problems += check_expected(rows, expected, task.metric_names, cfg.parity.expected_tolerance)
        else:
            log(f"note: no expected-results file at {exp_path}; create it with --update-expected")

    print()
    print(parity_table(rows, task.primary_metric))
    print()
    if problems:
        print("PARITY CHECK FAILED:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        if any("expected" in p for p in problems):
            print(f"If the change of scores is intended, refresh the expected file with "
                  f"`bertqa-bench parity --suite {cfg.name} --update-expected` and commit {exp_path}.", file=sys.stderr)
        return False
    print(f"PARITY CHECK PASSED ({len([r for r in rows if r.get('status') == 'ok'])} backends; results {out.run_dir})")
    return True
