#!/usr/bin/env python3
"""Does the GPU noise mark mean something? Quiet card: no row noisy; a planted load: noisy.

Run on a machine with a CUDA GPU (nothing else using it), from the repository root:

    python scripts/gpu_sensor_check.py                     # the sensor alone, ~1 minute
    python scripts/gpu_sensor_check.py --bench gpu-bert-base --set bench.max_rounds=4   # and a bench, twice

First the GPU sensor (measuring/gpu_sensor.GpuSensor, the workload the bench times each round)
is read ``--rounds`` times on the quiet card, then again while a second process, started outside
this one's process tree (as another user's job would be), runs fp16 GEMMs on the same card
without pause. It prints each round's reading, the decision (record/noise.gpu_sensor_noise) and
why. With ``--bench SUITE`` it then runs that suite twice, quiet and with the load running during
the whole bench, and prints each row's noise mark and GPU clock from the run's results.csv.

Exit status 0 when the quiet reading is not noisy and the loaded one is (and, with --bench,
no row of the quiet run is marked and every GPU row of the loaded one is), else 1.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bertqa_bench.measuring.gpu_sensor import NVML_HINT, GpuSensor, nvml  # noqa: E402
from bertqa_bench.record.noise import gpu_sensor_noise  # noqa: E402
from bertqa_bench.record.results import RunBundle  # noqa: E402

LOAD = """
import sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16); b = torch.randn_like(a)
torch.mm(a, b); torch.cuda.synchronize()
open(sys.argv[1], "w").write("ready")
while True:
    for _ in range(50):
        torch.mm(a, b)
    torch.cuda.synchronize()
"""


def start_load(workdir: Path) -> int:
    """A GEMM loop on the GPU in a process of its own session, reparented away from this one
    (``sh -c '... &'`` exits at once), so NVML sees it as another process, not the bench's own."""
    ready, pid_file = workdir / "load.ready", workdir / "load.pid"
    script = workdir / "load.py"
    script.write_text(LOAD)
    subprocess.run(["sh", "-c", f'"{sys.executable}" "{script}" "{ready}" >/dev/null 2>&1 & echo $! > "{pid_file}"'],
                   check=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the planted load did not start on the GPU within 120 s")
        time.sleep(0.2)
    return int(pid_file.read_text())


def stop_load(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def planted_load(folder: Path):
    """The GEMM loop running in a process of its own for the block's duration, stopped after it."""
    pid = start_load(folder)
    try:
        yield pid
    finally:
        stop_load(pid)


def read_sensor(rounds: int, threshold: float, label: str) -> bool:
    sensor = GpuSensor()
    readings = []
    for k in range(rounds):
        r = sensor()
        readings.append(r)
        print(f"  {label} round {k + 1}: total {r['total_ms']:.1f} ms, GEMM {r['gemm_ms']:.3f} ms, copy "
              f"{r['copy_ms']:.3f} ms, spread within the round {r['jitter_pct']:.1f}%, other processes "
              f"{r['other_processes'] if r['other_processes'] is not None else '? (' + NVML_HINT + ')'}", flush=True)
        time.sleep(0.5)  # rounds are seconds apart in a bench
    g = gpu_sensor_noise(readings)
    noisy = bool(g.noisy(threshold))
    print(f"{label}: spread over rounds {g.spread_pct:.2f}%, within a round {g.jitter_pct:.2f}%, other processes "
          f"{g.other_processes} -> {'NOISY (' + g.why(threshold) + ')' if noisy else 'quiet'}\n", flush=True)
    return noisy


def bench_rows(suite: str, sets: list, label: str) -> list:
    cmd = [sys.executable, "-m", "bertqa_bench.cli", "bench", "--suite", suite, "--no-mlflow", "--run-id",
           f"gpu-sensor-check-{label}-{int(time.time())}"] + [a for s in sets for a in ("--set", s)]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)
    run = sorted((ROOT / "results").glob(f"gpu-sensor-check-{label}-*/run.json"))[-1].parent
    rows = RunBundle.load(run).results
    for r in rows:
        print(f"  {label} {r.backend} ({r.device}): {'NOISY: ' + r.timing_noise_note if r.timing_noisy else 'not noisy'}"
              f"; GPU clock {r.gpu_sm_clock_mhz} MHz, {r.gpu_power_w} W, power-capped {r.gpu_power_capped}, busy "
              f"{r.gpu_busy_pct}%; {r.processes} processes", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="sensor readings in each phase (default 8)")
    ap.add_argument("--threshold", type=float, default=10.0, help="bench.noise_cv_pct (default 10)")
    ap.add_argument("--bench", metavar="SUITE", default="", help="also run this GPU suite twice, quiet and loaded")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a --set for those benches")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: run this on a GPU machine", file=sys.stderr)
        return 2
    if nvml() is None:
        print(f"note: no NVML ({NVML_HINT}); the sensor still times its workload", file=sys.stderr)
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-sensor-check-") as d:
        if a.bench:
            # the sensor phases in a child process: a CUDA context left open in this one, the
            # benches' parent, would count as another process on the card (machine_state.same_run
            # counts the bench's own descendants only), and mark the quiet bench's rows
            ok = subprocess.run([sys.executable, __file__, "--rounds", str(a.rounds), "--threshold",
                                 str(a.threshold)], check=False).returncode == 0
        else:
            quiet = read_sensor(a.rounds, a.threshold, "quiet")
            with planted_load(Path(d)):
                loaded = read_sensor(a.rounds, a.threshold, "loaded")
            ok = not quiet and loaded
        if a.bench:
            time.sleep(5)  # the load's context gone from the card
            quiet_rows = bench_rows(a.bench, a.sets, "quiet")
            with planted_load(Path(d)):
                loaded_rows = bench_rows(a.bench, a.sets, "loaded")
            ok = ok and not any(r.timing_noisy for r in quiet_rows if r.ok) and all(
                r.timing_noisy for r in loaded_rows if r.ok and r.device == "cuda")
    print("PASS: quiet not noisy, planted load noisy" if ok else "FAIL: see the readings above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
