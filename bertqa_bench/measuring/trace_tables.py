"""Tables from a finished torch.profiler run or its Chrome trace: top kernels (or operators on a
CPU), time per marked phase, GPU busy time and idle fraction. Pure reading of the profiler's
output, shared by ``bertqa-bench profile`` (profile.py) and the training step profile
(train.py, ``train.profile_steps``); apart from both so that neither imports the other.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path


def write_profile(prof, out: Path, cuda: bool, top: int = 25) -> dict:
    """A finished torch.profiler's trace.json, top_kernels.txt/.csv (operators ranked by device
    time on CUDA, by self CPU time on CPU) and, on CUDA, gpu_idle.json, into ``out``. Shared by
    ``bertqa-bench profile`` and the training profile (train.py, ``train.profile_steps``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))  # open in chrome://tracing or ui.perfetto.dev

    sort_key = "device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    table = events.table(sort_by=sort_key, row_limit=top)
    rows = []
    for e in events:
        dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        rows.append({"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                     "cpu_total_us": e.cpu_time_total, "device_total_us": dev})
    rows.sort(key=lambda r: r["device_total_us"] if cuda else r["self_cpu_us"], reverse=True)
    top_csv = out / "top_kernels.csv"
    with open(top_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["name"])
        w.writeheader()
        w.writerows(rows[:top])
    idle = gpu_idle_fraction(trace) if cuda else None
    if idle is not None:
        table += (f"\nGPU busy {idle['busy_ms']:.1f} ms of {idle['window_ms']:.1f} ms profiled: idle fraction "
                  f"{idle['idle_fraction']:.1%} (time between kernels: host work, copies waited on, launch gaps)\n")
        (out / "gpu_idle.json").write_text(json.dumps(idle, indent=1))
    (out / "top_kernels.txt").write_text(table)
    return {"dir": out, "trace": trace, "top_csv": top_csv, "table": table, "rows": rows[:top], "all_rows": rows,
            "gpu_idle": idle}


def _trace_events(trace_path: Path) -> list:
    return json.loads(Path(trace_path).read_text()).get("traceEvents", [])


def top_kernels(trace_path: Path, top: int = 25) -> list[dict]:
    """GPU kernels (and copies/memsets) of a Chrome trace by total device time: name, calls,
    total_ms and pct (of all their time). Empty when the trace has no GPU activity (CPU runs)."""
    agg: dict = {}
    for e in _trace_events(trace_path):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = agg.setdefault(e.get("name", "?"), [0, 0.0])
            a[0] += 1
            a[1] += float(e.get("dur", 0))
    total = sum(v[1] for v in agg.values()) or 1.0
    rows = [{"name": k, "calls": c, "total_ms": us / 1e3, "pct": 100.0 * us / total} for k, (c, us) in agg.items()]
    return sorted(rows, key=lambda r: r["total_ms"], reverse=True)[:top]


def phase_times(trace_path: Path, prefix: str) -> dict[str, float]:
    """Host time (ms) in each ``record_function`` range whose name starts with ``prefix``, summed."""
    out: dict = {}
    for e in _trace_events(trace_path):
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and name.startswith(prefix):
            key = name[len(prefix):]
            out[key] = out.get(key, 0.0) + float(e.get("dur", 0)) / 1e3
    return out


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def gpu_idle_fraction(trace_path: Path) -> dict | None:
    """From a Chrome trace: the share of the profiled window in which no GPU kernel or copy ran."""
    events = _trace_events(trace_path)
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return None
    host = [float(e["ts"]) for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    start = min(min(host, default=gpu[0][0]), min(s for s, _ in gpu))
    end = max(e for _, e in gpu)
    window = end - start
    busy = busy_time(gpu)
    return {"window_ms": window / 1e3, "busy_ms": busy / 1e3, "idle_fraction": 1.0 - busy / window if window else 0.0}
