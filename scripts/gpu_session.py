#!/usr/bin/env python3
"""One GPU session of measurements, run from the repository in place (no install), in the
background, so that it can outlast one device call:

    setsid python3 scripts/gpu_session.py PLAN [PLAN ...] [--out device-out] &   # start (returns at once)
    python3 scripts/gpu_session.py --status [--out device-out]        # progress; copies results to $OUT

Plans run one after another; ``A+B`` runs plans A and B side by side, each on its own GPU of the
host (lane i = GPU i), and ``A,B`` inside a lane runs them in turn there:
``loadgen-rest+families,loadgen-offline predict-scaling`` on two GPUs.

Plans (PLANS), reusable: ``h100`` (one GPU: the CPU gate, the suite's model, every backend, a
sweep, the calibration points, the batching rows), ``tests`` (the GPU tests), ``families`` (issue
20: DistilBERT-base grown from MiniLM and RoBERTa-base on generated SQuAD v2.0, each fine-tuned
then benchmarked as a user's checkpoint), ``loadgen``, ``loadgen-length-aware`` and ``loadgen-rest`` (issue 21:
MLPerf LoadGen SingleStream, Server peak and Offline rows), ``perf`` (issue 22: the GPU tests of the newest FP8
row, then it beside the row it improves on, seven passes each), ``train-speed`` (issue 23: one-GPU training, baseline
and bucketed + compiled, with step profiles), ``scale-out`` (issue 23 on a 4-GPU host: the fastest
training recipe on 1, 2 and 4 GPUs), ``predict-scaling`` and ``train-scaling``
(data-parallel prediction and training on 1, 2 and 4 GPUs of the host). Plans that ran once are
not kept: the reference tables in results/reference/ record the commands they ran.
Poll with back-to-back device calls (``sleep N; --status``): a lent machine goes back after 30 s
idle, taking the background run with it.

Every step is a ``bertqa-bench`` command (MLflow off: bundles are imported later with
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
import threading
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
    def __init__(self, out: Path, lane: str = "", env: dict | None = None, log=None, lock=None):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = log or open(out / "driver.log", "a", buffering=1)
        self.lock = lock or threading.Lock()  # lanes log from several threads
        self.lane, self.env = lane, dict(env or {})

    def on_gpu(self, gpu) -> "Session":
        """The same session for one lane: every step it runs sees only GPU ``gpu`` (or the GPUs
        of a string such as "2,3")."""
        return Session(self.out, f"[gpu{gpu}] ", on(gpu), self.log, self.lock)

    def say(self, msg: str) -> None:
        with self.lock:
            self.log.write(f"{time.strftime('%H:%M:%S')} {self.lane}{msg}\n")

    def run(self, name: str, args: list[str], *, timeout: float = 3600, env: dict | None = None,
            background: bool = False):
        cmd = args if args[0] != "cli" else CLI + args[1:]
        self.say(f"start {name}: {' '.join(cmd[2:] if cmd[:2] == CLI[:2] else cmd)}")
        full_env = {**os.environ, **ENV, **self.env, **(env or {})}
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


A = ["--set", f"data.synthetic.ambiguity={MAIN}"]  # the suite's data setting, passed to every step


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def on(gpu: int) -> dict:
    """The environment of a step that runs on one GPU of the host (a lane)."""
    return {"CUDA_VISIBLE_DEVICES": str(gpu)}


def lanes(*work) -> None:
    """Run the given callables in parallel threads (one lane per GPU) and wait for all."""
    threads = [threading.Thread(target=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def gpu_tests(s: Session, name: str, *args: str, timeout: float = 600, env: dict | None = None) -> None:
    """The GPU-marked tests among ``args`` (test files, ``-k`` expressions), skips with reasons."""
    s.run(name, [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", *args],
          timeout=timeout, env=env)


def step_tests(s: Session, env: dict | None = None) -> None:
    gpu_tests(s, "gpu-tests", "tests/test_backends.py", "tests/test_fp8.py", env=env)


def cpu_gate(s: Session):
    """The CI gate on this machine's CPU (a second machine for the absolute expected scores), on
    its last 8 cores beside the GPU work, with the versions constraints.txt pins when they were
    shipped to /root/gate-site (transformers, tokenizers, CPU onnxruntime)."""
    cores = os.cpu_count() or 16
    return s.run("cpu-parity-gate", ["taskset", "-c", f"{cores - 8}-{cores - 1}", *CLI, "parity", "--suite", "ci",
                                     "--no-mlflow", "--no-progress", "--set", "results_dir=device-out/results-cpu",
                                     "--set", "models_dir=device-out/models-cpu", "--set", "cache_dir=device-out/cache-cpu"],
                 env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "8",
                      "PYTHONPATH": f"/root/gate-site:/root/device-site:{ROOT}"}, background=True)


# Lanes that need the same model (``loadgen-rest+loadgen-offline``): the first trains it, the
# others wait for it, then use it (two lanes writing one model folder at once would race).
_TRAINING: dict[str, threading.Lock] = {}
_TRAINED: set = set()
_TRAINING_LOCK = threading.Lock()


def train(s: Session, a: float, env: dict | None = None) -> dict:
    name = model_name(a)
    with _TRAINING_LOCK:
        lock = _TRAINING.setdefault(name, threading.Lock())
    with lock:
        if name in _TRAINED:
            s.say(f"train-{name}: trained by another lane of this session; using it")
        else:
            code = s.run(f"train-{name}", ["cli", "train", "--suite", SUITE, "--no-mlflow", "--set",
                                           f"model.name={name}", "--set", f"data.synthetic.ambiguity={a}"],
                         timeout=900, env=env)
            if code == 0:
                _TRAINED.add(name)
    m = ROOT / "models" / name / "train_metrics.json"
    metrics = json.loads(m.read_text()) if m.exists() else {}
    s.say(f"calibration ambiguity={a}: dev F1 {metrics.get('dev_f1', float('nan')):.2f} "
          f"EM {metrics.get('dev_exact_match', float('nan')):.2f}, {metrics.get('train_samples_per_s', 0):.0f} samples/s")
    with s.lock:
        cal = s.out / "calibration.json"
        data = json.loads(cal.read_text()) if cal.exists() else {}
        data[str(a)] = metrics
        cal.write_text(json.dumps(data, indent=1))
    return metrics


def train_ddp(s: Session, tag: str, n_gpus: int, sets: list[str], env: dict | None = None) -> None:
    """torchrun + DDP on ``n_gpus`` GPUs of this host (the Makefile's train-ddp)."""
    s.run(f"train-{tag}", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={n_gpus}", "-m", "bertqa_bench.cli", "train", "--suite", SUITE,
                           "--no-mlflow", *sets, *A], timeout=900, env=env)


def train_scaling(s: Session, global_batch: int = 128, rows: int = 32, counts=(1, 2, 4), tag: str = "",
                  sets: tuple = ()) -> None:
    """Training scaling at a fixed global batch: ``rows`` rows per GPU per micro-step at 1, 2 and
    4 GPUs (grad_accum = global_batch / (GPUs x rows)), back to back, nothing else on the host."""
    for c in [c for c in counts if c <= gpus()]:
        accum = max(1, global_batch // (c * rows))
        train_ddp(s, f"{tag}g{global_batch}-r{rows}-gpus{c}", c,
                  ["--set", f"model.name={model_name(MAIN)}-{tag}g{global_batch}-gpus{c}",
                   "--set", f"train.batch_size={global_batch}", "--set", f"train.grad_accum={accum}", *sets])


# SQuAD v1.1's training set is 87,599 questions -> 88,524 features at 384; the suite's generator
# gives ~5.185 features per context, so 17,073 contexts make a SQuAD-sized training set.
SQUAD_SIZED = ("--set", "data.synthetic.n_train_contexts=17073")


def predict_scaling(s: Session, sets: list[str]) -> None:
    """Data-parallel prediction on 1, 2 and 4 GPUs, one run (reference: eager FP16 padded, to
    spare device time). ``sets`` must name the model and its own training overrides, else the
    bench sees another recipe and retrains it."""
    counts = [c for c in (1, 2, 4) if c <= gpus()]
    s.run("predict-scaling", ["cli", "sweep", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id",
                              "gpu-predict-scaling", "--backends", "eager-fp16", "--batch-sizes", "64",
                              "--batchings", "sorted", "--devices", ",".join(map(str, counts)),
                              "--set", "bench.reference=eager-fp16", *sets, *A], timeout=900)


def bench_all(s: Session) -> None:
    s.run("bench", ["cli", "bench", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id", "gpu-bert-base",
                    "--set", f"model.name={model_name(MAIN)}", *A], timeout=2400)


def sweep(s: Session, tag: str, backends: str, env: dict | None = None,
          batch_sizes: str = "16,32,64,128,256") -> None:
    """Batch sizes (16-256), against the eager-fp32-cuda of the same run."""
    s.run(f"sweep-{tag}", ["cli", "sweep", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id",
                           f"gpu-sweep-{tag}", "--backends", backends, "--batch-sizes", batch_sizes,
                           "--set", f"model.name={model_name(MAIN)}", *A, "--set", "bench.warmup_batches=3"],
          timeout=1500, env=env)


def bench_and_profile(s: Session, tag: str, backends: str, profiles: tuple = (), env: dict | None = None,
                      timeout: float = 1200, extra: tuple = ()) -> None:
    """One `bench` of the given backends (run id gpu-TAG, log bench-TAG, ``extra`` arguments
    last), then a 20-batch profile of each of ``profiles`` (GPU idle fraction, top kernels, trace)."""
    s.run(f"bench-{tag}", ["cli", "bench", "--suite", SUITE, "--no-mlflow", "--no-progress", "--run-id", f"gpu-{tag}",
                           "--backends", backends, "--set", f"model.name={model_name(MAIN)}", *A, *extra],
          timeout=timeout, env=env)
    for backend in profiles:
        s.run(f"profile-{backend}", ["cli", "profile", "--suite", SUITE, "--backend", backend, "--batches", "20",
                                     "--set", f"model.name={model_name(MAIN)}", *A], timeout=400, env=env)


def batching_rows(s: Session, env: dict | None = None) -> None:
    """Padded, sorted and packed rows in one run, then their profiles (GPU idle fraction)."""
    bench_and_profile(s, "batching", "eager-fp32-cuda,eager-fp16,eager-fp16-sorted,eager-fp16-packed,"
                      "torch-compile-fp8-sorted,torch-compile-fp16-packed,eager-fp8-packed,torch-compile-fp8-packed",
                      ("eager-fp16-packed", "torch-compile-fp8-packed", "eager-fp16-sorted", "eager-fp16",
                       "torch-compile-fp8"), env)


# A family's table: the reference, the classic FP16 rows, FP8, the length-aware rows and TensorRT
# (reported "not run" where it cannot load); the suite's 26 rows would not fit one device session.
FAMILY_BACKENDS = ("eager-fp32-cuda,eager-fp16,eager-bf16,torch-compile-fp16-graph,ort-cuda-fp16-graph,"
                   "torch-compile-fp8,tensorrt-fp16,eager-fp16-sorted,ort-cuda-fp16-graph-sorted,"
                   "eager-fp16-packed,torch-compile-fp8-packed-graph")


def family(s: Session, suite: str, init: str, make: list[str], model: str) -> None:
    """Issue 20: one encoder family as a user's checkpoint. Make the initial folder (families.py),
    fine-tune it with the suite's recipe, then `bench --model` the trained folder: every GPU
    backend of the suite, speed and parity in one run (the ones that cannot run the family say
    why). The suite's YAML says how its model is obtained."""
    if not (ROOT / "models" / init / "config.json").exists():
        s.run(f"init-{init}", [sys.executable, "-m", "bertqa_bench.model.families", *make, f"models/{init}"], timeout=600)
    s.run(f"train-{model}", ["cli", "train", "--suite", suite, "--no-mlflow"], timeout=1500)
    m = ROOT / "models" / model / "train_metrics.json"
    metrics = json.loads(m.read_text()) if m.exists() else {}
    s.say(f"{model}: dev " + ", ".join(f"{k[4:]} {v:.2f}" for k, v in metrics.items()
                                       if k.startswith("dev_") and isinstance(v, float)))
    s.run(f"bench-{model}", ["cli", "bench", "--suite", suite, "--model", f"models/{model}", "--no-mlflow",
                             "--no-progress", "--run-id", f"gpu-{model}", "--backends", FAMILY_BACKENDS], timeout=2400)


def step_families(s: Session) -> list:
    """DistilBERT-base grown from MiniLM (v1.1, hard), then RoBERTa-base from random init with a
    BPE tokenizer trained on the generated text (v2.0): ~25 device minutes on one H100."""
    family(s, "gpu-distilbert", "distilbert-base-grown-init",
           ["distilbert", "--size", "base", "--grow-from", "embedded:all-MiniLM-L6-v2"], "distilbert-grown-hard")
    family(s, "gpu-roberta-v2", "roberta-base-init",
           ["roberta", "--size", "base", "--corpus-suite", "gpu-roberta-v2", "--vocab-size", "8000"],
           "roberta-base-synth-v2")


# Issue 21's H100 rows: eager FP16, torch.compile + CUDA graphs FP16, ONNX Runtime + CUDA graphs
# FP16 and compiled FP8, padded and length-aware (sorted; FP8 also padding-free), each the SUT of
# MLPerf LoadGen; the suite's reference (eager-fp32-cuda) runs first in every scenario for parity.
LOADGEN_BACKENDS = ("eager-fp16,torch-compile-fp16-graph,ort-cuda-fp16-graph,torch-compile-fp8,eager-fp16-sorted,"
                    "torch-compile-fp16-graph-sorted,ort-cuda-fp16-graph-sorted,torch-compile-fp8-sorted,"
                    "torch-compile-fp8-packed")
# Server: batches up to 128 rows padded to 8, 32 or 128 (x 6 length buckets of 64 tokens: 18
# shapes a compiled variant prepares), 2 ms max wait; each peak-search run lasts >= 5 s (MLPerf:
# 600 s), at most 8 runs from half the bench throughput of the same process.
LOADGEN_SERVER = ["--set", "loadgen.server_max_batch=128", "--set", "loadgen.server_batch_sizes=[8,32,128]",
                  "--set", "loadgen.min_duration_ms=5000", "--set", "loadgen.peak_max_runs=8"]
# Length-aware Server rows: up to 256 rows as the bench's plan (max_batch_rows), each length
# bucket's ladder ending where its length fills the 32,768-token budget (80 rows at 384 tokens,
# 256 at 64-128: 22 shapes for 6 buckets).
LOADGEN_SERVER_LENGTH_AWARE = ["--set", "loadgen.server_max_batch=256", "--set", "loadgen.server_batch_sizes=[8,32,128]",
                               "--set", "loadgen.min_duration_ms=5000", "--set", "loadgen.peak_max_runs=8"]


def loadgen(s: Session, scenario: str, backends: str = LOADGEN_BACKENDS, extra: tuple = (),
            env: dict | None = None, timeout: float = 3000) -> None:
    """One `bertqa-bench loadgen` run (run id gpu-loadgen-SCENARIO); trains the suite's model first
    if it is missing (ensure_model)."""
    s.run(f"loadgen-{scenario.lower()}", ["cli", "loadgen", "--suite", SUITE, "--scenario", scenario, "--no-mlflow",
                                          "--no-progress", "--run-id", f"gpu-loadgen-{scenario.lower()}",
                                          "--backends", backends, "--set", f"model.name={model_name(MAIN)}", *A,
                                          *extra], timeout=timeout, env=env)


LOADGEN_OFFLINE = "ort-cuda-fp16-graph-sorted,torch-compile-fp8-sorted,torch-compile-fp8-packed-graph"
LOADGEN_LENGTH_AWARE = ("eager-fp16-sorted,torch-compile-fp16-graph-sorted,ort-cuda-fp16-graph-sorted,"
                        "torch-compile-fp8-sorted,torch-compile-fp8-packed,torch-compile-fp8-packed-graph")


def step_loadgen_length_aware(s: Session) -> list:
    """What the first LoadGen session left (issue 21), one GPU: the length-aware rows'
    SingleStream p90, their Server peak (with the padded FP8 row the first run did not finish),
    then the Offline cross-check of the best length-aware rows."""
    train(s, MAIN)
    loadgen(s, "SingleStream", LOADGEN_LENGTH_AWARE, timeout=1200)
    loadgen(s, "Server", "torch-compile-fp8,ort-cuda-fp16-graph-sorted,torch-compile-fp8-sorted,"
            "torch-compile-fp8-packed-graph", extra=("--find-peak-qps", *LOADGEN_SERVER), timeout=1500)
    loadgen(s, "Offline", LOADGEN_OFFLINE, timeout=900)
    return []


# Issue 22: the QA head on the packed tokens inside the bucket graphs (head_first). Its first
# measurement (h100-perf.md, commit 36b3b3f) put the head row at 16,044 features/s with one of its
# three passes under 16,000, and its GPU tests ran out of device time. So: the GPU tests of the
# head row first, then the suite's model and one bench of the head row beside the packed tanh row
# it changes and eager FP32, seven timed passes a row (the median and spread of more passes). The
# padded tanh row and both profiles of that run stand (nothing on their path changed).
PERF_BACKENDS = "eager-fp32-cuda,torch-compile-fp8-packed-ffn8-tanh,torch-compile-fp8-packed-ffn8-tanh-head"


def step_perf(s: Session) -> list:
    """Issue 22 on one GPU: the GPU tests of the head row, the suite's model, one bench of
    PERF_BACKENDS at seven passes a row."""
    gpu_tests(s, "gpu-tests-issue22", "tests/test_fp8.py", "tests/test_backends.py", "-k", "head", timeout=600)
    train(s, MAIN)
    bench_and_profile(s, "perf", PERF_BACKENDS, timeout=1500, extra=("--set", "bench.min_passes=7"))
    return []


def step_train_speed(s: Session) -> list:
    """Issue 23, one GPU: the SQuAD-sized recipe (global batch 512 = 4 micro-steps of 128 rows,
    as the 1,933 samples/s baseline) as it was, then with 128-token length buckets compiled once
    each and the padding-masked loss; a 5-step profile in each (results/profiles/*-train-*)."""
    base = ["cli", "train", "--suite", SUITE, "--no-mlflow", *SQUAD_SIZED, "--set", "train.batch_size=512",
            "--set", "train.grad_accum=4", *A, "--profile-steps", "5"]
    s.run("train-speed-base", base + ["--set", "model.name=bb-squad-g512-base"], timeout=900)
    s.run("train-speed-b128c", base + ["--set", "model.name=bb-squad-g512-b128c", "--set", "train.seq_bucket=128",
                                       "--set", "train.compile=true"], timeout=900)
    for m in ("bb-squad-g512-base", "bb-squad-g512-b128c"):
        f = ROOT / "models" / m / "train_metrics.json"
        if f.exists():
            d = json.loads(f.read_text())
            s.say(f"{m}: {d.get('train_samples_per_s', 0):.0f} samples/s, epochs {d.get('train_epoch_s')}, "
                  f"dev F1 {d.get('dev_f1', float('nan')):.2f}")
    return []


SCALE_OUT = [*SQUAD_SIZED, "--set", "train.batch_size=512", "--set", "train.seq_bucket=64", "--set", "train.compile=true"]


def scale_out_run(lane: Session, gpus: int, rows: int, sets: tuple = (), tag: str = "") -> None:
    """One SQuAD-sized training (global batch 512, 64-token buckets, each encoder layer compiled
    once per bucket before the clock) on ``gpus`` GPUs at ``rows`` rows per micro-step, plus
    ``sets`` (model name suffix ``tag``). Inductor's caches off: every run pays its own compile
    (its prepare time), none reuses another's kernels."""
    name = f"bb-squad-r{rows}-gpus{gpus}{tag}"
    train_ddp(lane, f"squad-r{rows}-gpus{gpus}{tag}", gpus,
              [*SCALE_OUT, "--set", f"train.grad_accum={512 // (gpus * rows)}", "--set", f"model.name={name}", *sets],
              env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})


def say_training(s: Session) -> None:
    for f in sorted((ROOT / "models").glob("bb-squad-r*-gpus*/train_metrics.json")):
        d = json.loads(f.read_text())
        s.say(f"{f.parent.name}: {d.get('train_samples_per_s', 0):.0f} samples/s after {d.get('train_prepare_s')} s "
              f"prepare, epochs {d.get('train_epoch_s')}, graphs in loop {d.get('compiled_graphs_in_loop')}, "
              f"optimizer step {d.get('optimizer_step')}, graphed layers {d.get('graph_layers')} "
              f"({d.get('cuda_graphs')} CUDA graphs, {d.get('graphed_micro_steps')} graphed micro-steps), "
              f"hook {d.get('ddp_comm_hook')}, no host sync {d.get('no_host_sync')} (mask prepared {d.get('prepared_mask')}), "
              f"dev F1 {d.get('dev_f1', float('nan')):.2f}")


# The fastest training recipe measured (h100-scaling.md, host M): the layers as CUDA graphs and DDP's
# FP32 all-reduce hook, on top of SCALE_OUT; train.no_host_sync is on by default.
FASTEST = ("--set", "train.graph_layers=true", "--set", "train.ddp_comm_hook=allreduce")


def step_scale_out(s: Session) -> list:
    """Training scaling on a 4-GPU host with the fastest recipe: first the GPU tests of its graphed
    layers and sync-free step; side by side on their own GPUs, one GPU (GPU 0) and 2 GPUs (GPUs
    2-3); then alone on the host 4 GPUs twice and one GPU (the denominator that shares the host
    with nothing, as the 4-GPU runs do). ~20 minutes. (Prediction on 1, 2 and 4 GPUs:
    ``predict-scaling``.)"""
    gpu_tests(s, "gpu-tests-scale-out", "tests/test_train_speed.py", "tests/test_host_sync.py", "-k",
              "cuda_graphed or deferred_loss or never_syncs", timeout=300)
    lanes(lambda: scale_out_run(s.on_gpu(0), 1, 128, FASTEST),
          lambda: scale_out_run(s.on_gpu("2,3"), 2, 128, FASTEST))
    for tag in ("", "-b"):
        scale_out_run(s, 4, 128, FASTEST, tag)
    scale_out_run(s, 1, 128, FASTEST, "-alone")
    say_training(s)
    return []


# Most important first: a machine goes back after 30 minutes, and each --status call packs
# what is done so far.
PLANS = {
    # one GPU: the CPU gate, the suite's model, every backend, a sweep, the calibration points, the batching rows
    "h100": [lambda s: [cpu_gate(s)], lambda s: train(s, MAIN), bench_all,
             lambda s: sweep(s, "all", "eager-fp16,torch-compile-fp16-graph,ort-cuda-fp16-graph"),
             lambda s: [train(s, a) for a in CALIBRATION], batching_rows],
    "tests": [step_tests],
    "families": [step_families],
    "loadgen": [lambda s: loadgen(s, "SingleStream"), lambda s: loadgen(
        s, "Server", extra=("--find-peak-qps", *LOADGEN_SERVER)), lambda s: loadgen(s, "Offline", LOADGEN_OFFLINE)],
    "loadgen-length-aware": [step_loadgen_length_aware],
    # issue 21's Server peak of the two best length-aware rows (highest share of bench, highest
    # QPS) with the budget-filling batch ladder, ~14 minutes on one GPU with the model
    "loadgen-rest": [lambda s: train(s, MAIN), lambda s: loadgen(
        s, "Server", "ort-cuda-fp16-graph-sorted,torch-compile-fp8-packed-graph",
        extra=("--find-peak-qps", *LOADGEN_SERVER_LENGTH_AWARE), timeout=1500)],
    # the Offline cross-check against bench on the GPU, with the suite's model (trained here unless
    # this session or another lane already did)
    "loadgen-offline": [lambda s: train(s, MAIN), lambda s: loadgen(s, "Offline", LOADGEN_OFFLINE, timeout=900)],
    "perf": [step_perf],
    "train-speed": [step_train_speed],
    "predict-scaling": [lambda s: predict_scaling(s, ["--set", f"model.name={model_name(MAIN)}"])],
    "scale-out": [step_scale_out],
    "train-scaling": [lambda s: train_scaling(s, 512, 128, counts=(1, 2, 4), tag="squad-", sets=SQUAD_SIZED)],
}


def run_plan(s: Session, plan: str) -> list:
    background = []
    for step in PLANS[plan]:
        started = step(s)
        background += [p for p in (started or []) if isinstance(p, subprocess.Popen)]
    return background


def main_run(plans: list[str], out: Path) -> int:
    s = Session(out)
    s.say(f"plans {' '.join(plans)} on {subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout.strip()}")
    background: list = []
    for group in plans:
        parts = group.split("+")
        if len(parts) == 1:
            for plan in parts[0].split(","):
                background += run_plan(s, plan)
            continue
        if len(parts) > gpus():  # two lanes on one GPU would time each other
            s.say(f"refused {group}: {len(parts)} lanes, {gpus()} GPU(s)")
            raise SystemExit(f"{group}: {len(parts)} lanes need as many GPUs; this host has {gpus()}")
        found: list = []

        def lane(g: int, plans: str) -> None:
            ls = s.on_gpu(g)
            try:
                for q in plans.split(","):
                    found.extend(run_plan(ls, q))
            except BaseException as e:  # noqa: BLE001 - the other lanes go on; the log says why
                ls.say(f"lane failed: {type(e).__name__}: {e}")

        lanes(*[lambda g=g, p=p: lane(g, p) for g, p in enumerate(parts)])
        background += found
        s.say(f"lanes {group} done")
    for p in background:
        s.say(f"background {p.args[2:6]} exit {p.wait()}")
    s.say("DONE")
    return 0


def pack(out: Path, dest: Path) -> Path:
    """Result bundles (no logits, no predictions), metrics, calibration, profiles and logs."""
    dest.mkdir(parents=True, exist_ok=True)
    tgz = dest / "gpu-session.tgz"

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        # LoadGen's accuracy logs (tens of MB of hex logits) are decoded into the bundle's rows already
        if "outputs" in parts or "predictions" in parts or info.name.endswith(
                (".npz", ".npy", ".safetensors", ".onnx", "mlperf_log_accuracy.json")):
            return None
        return info

    with tarfile.open(tgz, "w:gz") as t:
        for p in [out, *(ROOT / "results").glob("*"), *(ROOT / "models").glob("*/train_metrics.json")]:
            if p.exists() and p.name not in ("mlflow.db", "mlruns", "reference"):
                t.add(p, arcname=str(p.relative_to(ROOT)), filter=keep)
    return tgz


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="*", metavar="PLAN",
                    help=f"one of {', '.join(sorted(PLANS))}; A+B runs A and B side by side, one GPU each")
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
    unknown = [p for g in a.plans for lane in g.split("+") for p in lane.split(",") if p not in PLANS]
    if unknown or not a.plans:
        ap.error(f"unknown plan {unknown[0]!r}; valid: {', '.join(sorted(PLANS))}" if unknown else "name a plan")
    return main_run(a.plans, out)


if __name__ == "__main__":
    sys.exit(main())
