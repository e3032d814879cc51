#!/usr/bin/env python3
"""Reruns of one suite side by side: each row's speedup and interval per run, and whether every
run's interval holds the other runs' medians (what results/reference/cpu-2core-reproducibility.md
shows), and the spread of the runs' medians: the most bench.rerun_spread_pct should say for this
machine (it also holds each run's own sampling error, so it is an upper bound).

    python scripts/rerun_table.py results/RUN1 results/RUN2 results/RUN3 [--process-spread own|pooled]

``--process-spread`` recomputes every row's interval from the rounds each run recorded (their
passes and which process timed each), with the spread between processes each row's own or pooled
over the run's rows (bench.pool_process_spread), so the two rules are compared on the same runs.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bertqa_bench.measuring.rounds import RoundsLog  # noqa: E402
from bertqa_bench.record.judging import apply_speedup  # noqa: E402
from bertqa_bench.record.results import RunBundle  # noqa: E402
from bertqa_bench.reporting.recommend import for_run  # noqa: E402


def _cell(r) -> str:
    if r is None or r.speedup is None:
        return "—"
    ci = f" [{r.speedup_low:.2f}–{r.speedup_high:.2f}]" if r.speedup_low is not None else ""
    return f"{r.speedup:.2f}×{ci}"


def covers(rows: list) -> bool:
    """Every run's interval holds every other run's median."""
    ok = [r for r in rows if r is not None and r.speedup_low is not None]
    return len(ok) == len(rows) and all(a.speedup_low <= b.speedup <= a.speedup_high for a in ok for b in ok)


def checks(rows: list) -> tuple[int, int]:
    """(held, made): each run's interval against each other run's median, one check a pair."""
    made = held = 0
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            if i != j:
                made += 1
                held += bool(a is not None and b is not None and a.speedup_low is not None
                             and a.speedup_low <= b.speedup <= a.speedup_high)
    return held, made


def between_run_sd_pct(rows: list) -> str:
    """The standard deviation of the runs' log speedups, as a percentage ('—' under two runs)."""
    logs = [math.log(r.speedup) for r in rows if r is not None and r.speedup]
    return f"{100 * math.expm1(statistics.stdev(logs)):.1f}%" if len(logs) > 1 else "—"


def recomputed(bundle, pooled: bool):
    """The bundle with every rounds row's speedup and interval recomputed from its recorded rounds,
    the spread between processes pooled over the rows or each row's own."""
    log = bundle.meta.rounds or {}
    if not log.get("passes"):
        return bundle
    rounds = RoundsLog(list(log["names"]), log["reference"], passes=dict(log["passes"]),
                       processes=dict(log.get("processes") or {}), calibration_s=list(log["calibration_s"]),
                       rerun_spread_pct=float(log.get("rerun_spread_pct") or 0.0), pool_process_spread=pooled)
    for r in bundle.results:
        if r.ok and r.timing_mode == "rounds" and r.backend in rounds.passes:
            apply_speedup(r, rounds.speedup(r.backend), "rounds", r.timing_mode_note)
    bundle.meta.rounds = {**log, "pool_process_spread": pooled}
    return bundle


def table(bundles: list) -> str:
    names = list(dict.fromkeys(r.backend for b in bundles for r in b.results))
    ref = bundles[0].meta.reference
    head = ["row"] + [f"run {i + 1}" for i in range(len(bundles))] + ["each interval holds the others' medians", "runs' spread (sd)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_cells = []
    for b in bundles:
        r = next((x for x in b.results if x.backend == ref), None)
        ref_cells.append(f"{r.predict_s:.1f} s a pass" if r is not None and r.ok else "—")
    lines.append(f"| {ref} (reference) | " + " | ".join(ref_cells) + " | | |")
    for n in names:
        if n == ref:
            continue
        rows = [next((x for x in b.results if x.backend == n and x.ok), None) for b in bundles]
        held, made = checks(rows)
        lines.append(f"| {n} | " + " | ".join(_cell(r) for r in rows)
                     + f" | {'yes' if covers(rows) else '**no**'}: {held} of {made} | {between_run_sd_pct(rows)} |")
    recs = [for_run(b.results, b.meta) for b in bundles]
    lines.append("| recommendation | " + " | ".join(r.headline() for r in recs) + " | "
                 + ("same" if len({r.tags()['recommended_backend'] for r in recs}) == 1 else "**differs**") + " | |")
    lines.append("| FP32 class | " + " | ".join(r.tags()["recommended_fp32_backend"] or "—" for r in recs) + " | "
                 + ("same" if len({r.tags()['recommended_fp32_backend'] for r in recs}) == 1 else "**differs**") + " | |")
    timing = []
    for b in bundles:
        m = b.meta
        n = len((m.rounds or {}).get("calibration_s", []))
        timing.append(f"{n} rounds, calibration {m.calibration_cv_pct:.1f}%" + (" (noisy)" if m.timing_noisy else "")
                      if n else "blocks")
    lines.append("| timing | " + " | ".join(timing) + " | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--process-spread", choices=("own", "pooled"), default=None,
                   help="recompute the intervals from the recorded rounds with this rule (default: as recorded)")
    a = p.parse_args(argv)
    bundles = [RunBundle.load(d) for d in a.runs]
    if a.process_spread:
        bundles = [recomputed(b, a.process_spread == "pooled") for b in bundles]
    print(table(bundles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
