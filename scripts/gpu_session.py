#!/usr/bin/env python3
"""One GPU session of measurements, run from the repository in place (no install), in the
background, so that it can outlast one device call:

    setsid python3 scripts/gpu_session.py PLAN [--out device-out] &   # start (returns at once)
    python3 scripts/gpu_session.py --status [--out device-out]        # progress; copies results to $OUT

PLAN names the steps (see STEPS): e.g. ``h100`` = GPU tests, the difficulty calibration of the
trained BERT-base, the benchmark of every GPU backend on it, a batch-size sweep, profiles, and
the CPU parity gate on this machine's CPU; ``scaling`` = training and prediction on 1, 2 and 4
GPUs. Every step is a ``bertqa-bench`` command (MLflow off: bundles are imported later with
``bertqa-bench track``); each writes its log under ``--out``. ``--status`` packs the result
bundles (without logits and predictions), training metrics, profiles and logs into
``$OUT/gpu-session.tgz`` and prints the driver's log tail.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": f"/root/device-site:{ROOT}", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       # NVLink multicast stays off in every process (shared multi-GPU hosts)
       "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CLI = [sys.executable, "-m", "bertqa_bench.cli"]
SUITE = "gpu-bert-base"
MAIN = 0.2  # the suite's ambiguity setting (benchmarks/gpu-bert-base.yaml)
CALIBRATION = (0.0, 0.3)  # more settings of the hard preset, trained and scored after the main table


def model_name(ambiguity: float) -> str:
    return f"bert-base-grown-hard-a{int(round(ambiguity * 100)):02d}"


class Session:
    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "driver.log", "a", buffering=1)

    def say(self, msg: str) -> None:
        self.log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    def run(self, name: str, args: list[str], *, timeout: float = 3600, env: dict | None = None,
            background: bool = False):
        cmd = args if args[0] != "cli" else CLI + args[1:]
        self.say(f"start {name}: {' '.join(cmd[2:] if cmd[:2] == CLI[:2] else cmd)}")
        full_env = {**os.environ, **ENV, **(env or {})}
        f = open(self.out / f"{name}.log", "w")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        if background:
            return p
        t0 = time.time()
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            code = "timeout"
        self.say(f"end {name}: exit {code} after {time.time() - t0:.0f}s")
        return code


def step_tests(s: Session) -> None:
    s.run("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests/test_backends.py", "tests/test_fp8.py"], timeout=420)


def step_cpu_gate(s: Session):
    # The CI gate on this machine's CPU (a second machine for the absolute expected scores),
    # on 8 of the 16 cores, beside the GPU work.
    return s.run("cpu-parity-gate", ["taskset", "-c", "8-15", *CLI, "parity", "--suite", "ci", "--no-mlflow",
                                     "--no-progress", "--set", "results_dir=device-out/results-cpu",
                                     "--set", "models_dir=device-out/models-cpu", "--set", "cache_dir=device-out/cache-cpu"],
                 env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "8"}, background=True)


def train(s: Session, a: float) -> dict:
    name = model_name(a)
    s.run(f"train-{name}", ["cli", "train", "--suite", SUITE, "--no-mlflow", "--set", f"model.name={name}",
                            "--set", f"data.synthetic.ambiguity={a}"], timeout=900)
    m = ROOT / "models" / name / "train_metrics.json"
    metrics = json.loads(m.read_text()) if m.exists() else {}
    s.say(f"calibration ambiguity={a}: dev F1 {metrics.get('dev_f1', float('nan')):.2f} "
          f"EM {metrics.get('dev_exact_match', float('nan')):.2f}, {metrics.get('train_samples_per_s', 0):.0f} samples/s")
    cal = s.out / "calibration.json"
    data = json.loads(cal.read_text()) if cal.exists() else {}
    data[str(a)] = metrics
    cal.write_text(json.dumps(data, indent=1))
    return metrics


def step_bench(s: Session, a: float) -> None:
    s.run("bench", ["cli", "bench", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id", "gpu-bert-base",
                    "--set", f"model.name={model_name(a)}", "--set", f"data.synthetic.ambiguity={a}"], timeout=2400)


def step_sweep(s: Session, a: float) -> None:
    s.run("sweep", ["cli", "sweep", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id", "gpu-sweep",
                    "--backends", "eager-fp16,torch-compile-fp16-graph,ort-cuda-fp16-graph",
                    "--batch-sizes", "16,64,256", "--set", f"model.name={model_name(a)}",
                    "--set", f"data.synthetic.ambiguity={a}", "--set", "bench.warmup_batches=3"], timeout=1800)


def step_profiles(s: Session, a: float) -> None:
    for backend in ("torch-compile-fp8", "torch-compile-fp16-graph-sorted", "eager-fp16-packed"):
        s.run(f"profile-{backend}", ["cli", "profile", "--suite", SUITE, "--backend", backend, "--batches", "20",
                                     "--set", f"model.name={model_name(a)}",
                                     "--set", f"data.synthetic.ambiguity={a}"], timeout=600)


def step_scaling(s: Session) -> None:
    """Training and prediction on 1, 2 and 4 GPUs of this host, back to back."""
    import torch

    n = torch.cuda.device_count()
    counts = [c for c in (1, 2, 4) if c <= n]
    a = MAIN
    for c in counts:
        name = f"{model_name(a)}-ddp{c}"
        s.run(f"train-gpus{c}", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={c}", "-m", "bertqa_bench.cli", "train", "--suite", SUITE,
                                 "--no-mlflow", "--set", f"model.name={name}", "--set", f"data.synthetic.ambiguity={a}"],
              timeout=1200)
    s.run("predict-scaling", ["cli", "sweep", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id",
                              "gpu-predict-scaling", "--backends", "torch-compile-fp16-graph", "--batch-sizes", "64",
                              "--batchings", "sorted", "--devices", ",".join(map(str, counts)),
                              "--set", f"model.name={model_name(a)}-ddp1", "--set", f"data.synthetic.ambiguity={a}",
                              "--set", "bench.backends=[eager-fp32-cuda]"], timeout=1800)


# Most important first: a machine goes back after 30 minutes, and each --status call packs
# what is done so far.
PLANS = {
    "h100": ["gate", "train", "bench", "sweep", "calibrate", "profiles"],
    "scaling": ["scaling"],
    "tests": ["tests"],
}


def main_run(plan: str, out: Path) -> int:
    s = Session(out)
    s.say(f"plan {plan} on {subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout.strip()}")
    gate = None
    a = MAIN
    for step in PLANS[plan]:
        if step == "tests":
            step_tests(s)
        elif step == "gate":
            gate = step_cpu_gate(s)
        elif step == "train":
            train(s, MAIN)
        elif step == "calibrate":
            for other in CALIBRATION:
                train(s, other)
        elif step == "bench":
            step_bench(s, a)
        elif step == "sweep":
            step_sweep(s, a)
        elif step == "profiles":
            step_profiles(s, a)
        elif step == "scaling":
            step_scaling(s)
    if gate is not None:
        s.say(f"cpu gate exit {gate.wait()}")
    s.say("DONE")
    return 0


def pack(out: Path, dest: Path) -> Path:
    """Result bundles (no logits, no predictions), metrics, calibration, profiles and logs."""
    dest.mkdir(parents=True, exist_ok=True)
    tgz = dest / "gpu-session.tgz"

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if "outputs" in parts or "predictions" in parts or info.name.endswith((".npz", ".npy", ".safetensors", ".onnx")):
            return None
        return info

    with tarfile.open(tgz, "w:gz") as t:
        for p in [out, *(ROOT / "results").glob("*"), *(ROOT / "models").glob("*/train_metrics.json")]:
            if p.exists() and p.name not in ("mlflow.db", "mlruns", "reference"):
                t.add(p, arcname=str(p.relative_to(ROOT)), filter=keep)
    return tgz


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan", nargs="?", choices=sorted(PLANS))
    ap.add_argument("--out", default="device-out")
    ap.add_argument("--status", action="store_true")
    a = ap.parse_args()
    out = ROOT / a.out
    if a.status:
        log = out / "driver.log"
        print(log.read_text()[-6000:] if log.exists() else "no driver log yet")
        if os.environ.get("OUT"):
            print("packed", pack(out, Path(os.environ["OUT"])))
        return 0
    return main_run(a.plan, out)


if __name__ == "__main__":
    sys.exit(main())
