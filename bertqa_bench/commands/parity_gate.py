"""``bertqa-bench parity``: the accuracy gate for CI and GPU runs.

Runs the suite through the benchmark itself (so the gate checks exactly what the speed table
reports) with the reference run twice in two processes (it must be deterministic), applies
the per-class tolerances and the committed expected scores, prints a pass/fail table and
returns False on any breach — through the same ``parity.verdict`` the bench uses.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional

from ..backends.variants import VariantTable
from ..config import SuiteConfig, resolve_path
from ..errors import BenchError
from ..io import atomic_write_text
from ..record.parity import check_expected, noise_note, verdict
from ..record.results import BackendResult, rows_to_csv
from ..tasks import get_task
from .bench import run_bench


def expected_path(cfg: SuiteConfig) -> Path:
    return resolve_path(cfg.parity.expected_file or f"benchmarks/expected/{cfg.name}.csv")


def parity_table(results: list[BackendResult], metric: str) -> str:
    head = ["backend", "class", metric, f"{metric} ratio [95% CI] (min)", "agreement [95% CI] (min)",
            "start/end argmax", "max |Δ logit|", "verdict"]
    lines = [" | ".join(head)]
    for r in results:
        if not r.ok:
            lines.append(" | ".join([r.backend, r.parity_class, "", "", "", "", "", f"{r.status}: {r.error}"]))
            continue
        f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
        lines.append(" | ".join([
            r.backend, r.parity_class, f(r.scores.get(metric), ".2f"),
            f"{f(r.primary_ratio, '.4f')}"
            + (f" [{f(r.primary_ratio_low, '.4f')}-{f(r.primary_ratio_high, '.4f')}]" if r.primary_ratio_low is not None else "")
            + f" (≥{f(r.min_f1_ratio, '.3f')})",
            f"{f(r.answer_agreement, '.4f')} [{f(r.agreement_ci_low, '.3f')}-{f(r.agreement_ci_high, '.3f')}] "
            f"(≥{f(r.min_agreement, '.2f')})" + (" within noise" if r.agreement_within_noise else ""),
            f"{f(r.start_argmax_agreement, '.3f')}/{f(r.end_argmax_agreement, '.3f')}",
            f(r.max_abs_logit_diff, ".2e"), (r.parity or "—") + (f" ({noise_note(r)})" if noise_note(r) else "")]))
    return "\n".join(lines)


def expected_tolerance(cfg: SuiteConfig, evalset) -> float:
    """The allowed drift from the expected scores, in points."""
    q = cfg.parity.expected_tolerance_questions
    return 100.0 * q / evalset.n_questions if q is not None else cfg.parity.expected_tolerance


def read_expected(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def canonical_rows(cfg: SuiteConfig, rows: list[dict]) -> list[dict]:
    """Expected rows keyed by old backend names (an expected file written before the catalogue's
    names) under the names the rows of this run get."""
    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    out = []
    for row in rows:
        try:
            out.append({**row, "backend": table.canonical(row["backend"])})
        except BenchError:  # a row of a backend this table cannot name: compared with nothing, as before
            out.append(row)
    return out


def run_parity_check(cfg: SuiteConfig, *, backends: Optional[list[str]] = None, update_expected: bool = False,
                     tracker=None, progress: bool = True, command: str = "", log=print) -> bool:
    task = get_task(cfg.task.name)
    out = run_bench(cfg, backends=backends, tracker=tracker, progress=progress, command=command, log=log,
                    check_determinism=True)
    results = out.results
    problems = list(out.problems)
    exp_path = expected_path(cfg)
    if update_expected:
        cols = ["backend", "precision", *task.metric_names]
        keep = [{"backend": r.backend, "precision": r.precision, **{m: r.scores.get(m) for m in task.metric_names}}
                for r in results if r.ok]
        atomic_write_text(exp_path, rows_to_csv(keep, cols))
        log(f"expected scores written to {exp_path}")
    else:
        expected = canonical_rows(cfg, read_expected(exp_path))
        if expected:
            problems += check_expected(results, expected, task.metric_names, expected_tolerance(cfg, out.evalset))
        else:
            log(f"note: no expected-results file at {exp_path}; create it with --update-expected")

    v = verdict(results, cfg.bench.reference, timing_only=out.bundle.meta.timing_only, problems=problems)
    print()
    print(parity_table(results, task.primary_metric))
    print()
    if not v.ok:
        print(f"PARITY CHECK FAILED ({v.status}):", file=sys.stderr)
        for p in v.reasons:
            print(f"  - {p}", file=sys.stderr)
        if any("expected" in p for p in v.reasons):
            print(f"If the change of scores is intended, refresh the expected file with "
                  f"`bertqa-bench parity --suite {cfg.name} --update-expected` and commit {exp_path}.", file=sys.stderr)
        return False
    print(f"PARITY CHECK PASSED ({sum(r.ok for r in results)} backends; results {out.run_dir})")
    return True
