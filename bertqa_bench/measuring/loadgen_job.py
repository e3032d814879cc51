"""A LoadGen job in its worker process (``worker.py`` runs it for a job of kind ``loadgen``):
prepare and warm the backend for every shape the scenario can hand it, time the bench passes in
the same process, then LoadGen's accuracy run and its performance run or peak search, each
writing its ``mlperf_log_*`` files. The system under test itself is loadgen_sut.py's."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..backends.base import BackendContext
from ..config import LoadGenConfig, build
from ..errors import BackendUnavailableError
from ..record.schedule import Batch, batch_inputs, make_plan
from .flops import model_dims, plan_flops
from .job_setup import load_job
from .loadgen_log import find_peak, read_result, test_settings
from .loadgen_sut import SUT, Codec, Shapes, server_window
from .measure import Probe
from .runner import check_contract, materialize, sample_batches, timed_passes, warm_up


def run_test(lg, sut: SUT, qsl, settings, out_dir: Path) -> dict:
    """One LoadGen test (its logs in ``out_dir``), then its parsed result. Called on the backend
    thread: SingleStream's IssueQuery runs right here inside StartTest (no hand-off in the
    latency); for Server and Offline, StartTest runs on a helper thread while this thread
    batches and submits, so every batch of the process is submitted from one thread (a Server
    batch in flight is collected on the SUT's collector thread: its waiter only waits for the
    device and copies the outputs out)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lg.LogSettings()
    log.log_output.outdir = str(out_dir)
    log.log_output.copy_summary_to_stdout = True
    log.enable_trace = False  # the trace is large and not read; summary and detail are kept
    sut._stop = sut._flush = False
    if sut.scenario == "SingleStream":
        lg.StartTestWithLogSettings(sut.handle, qsl, settings, log, "")
    else:
        failed: list = []

        def drive():
            try:
                lg.StartTestWithLogSettings(sut.handle, qsl, settings, log, "")
            except BaseException as e:  # noqa: BLE001
                failed.append(e)
            finally:
                sut.finish()

        t = threading.Thread(target=drive, name="loadgen", daemon=True)
        t.start()
        sut.serve()
        t.join()
        if failed:
            raise failed[0]
    if sut.error:
        raise RuntimeError(f"the backend failed under LoadGen: {sut.error}")
    return read_result(out_dir)


def _allow_recompiles(n_shapes: int) -> None:
    """torch.compile without dynamic shapes compiles once per shape, and dynamo stops at its
    recompile limit (8) and runs the rest eagerly, silently; a Server shape set (batch sizes x
    length buckets) can pass it, so the limit is raised to the shapes prepare will compile."""
    try:
        import torch._dynamo.config as dc
    except Exception:  # noqa: BLE001 - no torch, or no dynamo: nothing compiles
        return
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(int(getattr(dc, name)), n_shapes + 8))


def on_backend_thread(fn, *args):
    """Run ``fn`` on one dedicated thread and return (or raise) what it did. Prepare, warm-up,
    the bench passes and every LoadGen batch's submission then run on the same thread: a thread's CUDA
    stream and its CPU thread pool are its own, and timings compare like with like (on a
    contended 2-core CPU, torch ran 2.5x slower on the main thread than on a fresh one)."""
    box: dict = {}

    def body():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=body, name="backend")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def execute(job) -> tuple[dict, Optional[dict]]:
    """A ``loadgen`` job in this process: (result record, bench-path outputs or None)."""
    return on_backend_thread(_execute, job)


def _import_loadgen():
    try:
        import mlperf_loadgen as lg  # optional: pip install mlcommons-loadgen
    except ImportError:
        raise BackendUnavailableError("LoadGen is not installed: pip install mlcommons-loadgen "
                                      "(module mlperf_loadgen)") from None
    return lg


class _Setup:
    """A LoadGen job's inputs: its settings, the variant, the query sample library's samples
    (in RAM for the whole run), the bench plan, the SUT's shapes and the backend's context."""

    def __init__(self, job, variant, inputs, plan):
        spec = self.spec = dict(job.loadgen)
        self.job, self.variant, self.inputs, self.plan = job, variant, inputs, plan
        self.scenario = spec["scenario"]
        self.cfg = cfg = build(LoadGenConfig, dict(spec["settings"]), "loadgen")
        self.lengths = np.asarray(inputs["attention_mask"]).sum(axis=1).astype(np.int64)
        self.batches = materialize(inputs, plan)
        self.max_batch = int(cfg.server_max_batch or spec["batch_size"])
        tokens = spec.get("tokens_per_batch") or self.max_batch * job.max_seq_len
        self.shapes = Shapes(plan.batching, job.max_seq_len, spec["seq_multiple"], self.max_batch,
                             cfg.server_batch_sizes, token_budget=tokens)
        self.sut_shapes = self.shapes.all(self.lengths, self.scenario)
        all_shapes = tuple(sorted(set(plan.shapes) | self.sut_shapes, key=lambda s: (s[0] * s[1], s), reverse=True))
        self.ctx = BackendContext(model_dir=Path(job.model_dir), task=job.task, artifacts_dir=Path(job.artifacts_dir),
                                  output_names=tuple(job.output_names), sample_batches=sample_batches(plan, self.batches),
                                  shapes=all_shapes, max_batch_size=max(s[0] for s in all_shapes),
                                  max_seq_len=int(job.max_seq_len))
        _allow_recompiles(len(all_shapes))

    def offline_plan(self, lens):
        spec, job = self.spec, self.job
        return make_plan(lens, batching=self.plan.batching, batch_size=spec["batch_size"], max_seq_len=job.max_seq_len,
                         seq_multiple=spec["seq_multiple"], tokens_per_batch=spec.get("tokens_per_batch"),
                         max_batch_rows=spec.get("max_batch_rows"))


def _execute(job) -> tuple[dict, Optional[dict]]:
    lg = _import_loadgen()
    variant, why, inputs, plan = load_job(job, mmap=False)  # the QSL's samples stay in RAM (mmap=False)
    if why:
        return {"status": "not run", "error": why}, None
    st = _Setup(job, variant, inputs, plan)
    probe = Probe(cuda=variant.device == "cuda")
    backend = variant.create()
    record: dict = {"status": "ok", "pid": os.getpid(), "scenario": st.scenario}
    outputs = None
    try:
        t0 = time.perf_counter()
        backend.prepare(st.ctx)
        record["prepare_s"] = time.perf_counter() - t0
        record["prepare_info"] = dict(backend.prepare_info)
        probe.end_phase("prepare")
        record["warmup_batches"] = _warm_every_shape(backend, st)
        probe.end_phase("warmup")
        codec = Codec(job.output_names, job.token_outputs, backend.predict(st.batches[0]))
        record["layout"] = codec.layout
        bench_fps, outputs = None, None
        record["accuracy_only"] = bool(st.spec.get("accuracy_only"))
        if st.cfg.compare_bench and not record["accuracy_only"]:
            outputs, bench_fps = _bench_passes(backend, st, probe, record)
        _run_scenario(lg, backend, st, codec, bench_fps, record)
        # Energy stays the bench passes' (above): a Server run's joules include idle time
        # between arrivals, which says more about the target QPS than about the backend.
        probe.end_phase("predict")
        record["measures"] = dict(probe.values)
    finally:
        backend.close()
    return record, outputs


def _warm_every_shape(backend, st: _Setup) -> int:
    """The bench plan's warm-up (contract checked, as bench does), then every scenario shape once
    more on real features, so LoadGen never meets a cold shape. Returns the batches run."""
    job = st.job
    names, token = tuple(job.output_names), tuple(job.token_outputs)
    n_warm = warm_up(backend, st.plan, st.batches, job.warmup_batches, names, token)
    order = np.argsort(st.lengths, kind="stable")
    for b, s in sorted(st.sut_shapes):
        fits = np.array([st.shapes.seq(int(v)) <= s for v in st.lengths[order]], dtype=bool)
        fit = order[fits] if not st.shapes.packed else order
        rows = np.resize(fit[-b:] if len(fit) else order[:1], b)
        x = batch_inputs(st.inputs, Batch(rows, (b, s)))
        check_contract(backend.name, backend.predict(x), x, names, token)
        n_warm += 1
    return n_warm


def _bench_passes(backend, st: _Setup, probe, record: dict) -> tuple[dict, float]:
    """The bench's timed passes in this process, beside LoadGen's run: (outputs, features/s)."""
    job, ctx = st.job, st.ctx
    probe.start_timed()
    outputs, timing = timed_passes(backend, st.plan, st.batches, ctx.output_names, tuple(job.token_outputs),
                                   ctx.max_seq_len, min_passes=job.min_passes, min_duration_s=job.min_duration_s,
                                   flops=plan_flops(model_dims(ctx.model_dir), st.plan, st.lengths))
    probe.end_timed(sum(timing.pass_s), timing.n_rows * len(timing.pass_s))
    record["bench"] = timing.summary()
    record["pass_s"] = timing.pass_s
    return outputs, record["bench"]["features_per_s"]


def _run_scenario(lg, backend, st: _Setup, codec, bench_fps: Optional[float], record: dict) -> None:
    """LoadGen's accuracy run, then its performance run (or the Server peak search), into ``record``."""
    cfg, scenario, out_root = st.cfg, st.scenario, Path(st.spec["out_dir"])
    n = len(st.lengths)
    qsl = lg.ConstructQSL(n, min(n, cfg.performance_sample_count or n), lambda s: None, lambda s: None)  # in RAM
    sut = SUT(lg, backend, st.inputs, st.lengths, codec, st.shapes, scenario=scenario, max_batch=st.max_batch,
              max_wait_us=cfg.server_max_wait_us, server_window=server_window(cfg.server_in_flight, backend.in_flight()),
              offline_plan=st.offline_plan)
    try:
        # Hints LoadGen sizes its queries by (enough for min_duration): from the bench
        # throughput of this process, times offline_qps_hint (2 by default), since a run that
        # turns out faster than its hint ends before min_duration and is INVALID (LoadGen's
        # own slack is 10%); without a bench timing, a guess.
        fps = bench_fps or 100.0
        hints = {"offline_expected_qps": cfg.offline_qps_hint * fps,
                 "single_stream_expected_latency_ns": 1e9 / (2.0 * fps)}
        target = cfg.server_target_qps or max(1.0, fps * cfg.server_qps_fraction)
        record["accuracy"] = run_test(lg, sut, qsl, test_settings(lg, cfg, scenario, "accuracy", target, **hints),
                                      out_root / "accuracy")
        record["accuracy_log"] = str(out_root / "accuracy" / "mlperf_log_accuracy.json")
        sut.reset_counts()  # from here on: the performance runs only
        if not record["accuracy_only"]:  # else the reference's answers alone (loadgen.reference_performance)
            _performance(lg, sut, qsl, st, target, hints, record)
        record["sut"] = _sut_facts(sut, st)
    finally:
        sut.close()
        lg.DestroyQSL(qsl)


def _performance(lg, sut, qsl, st: _Setup, target: float, hints: dict, record: dict) -> None:
    """LoadGen's performance run (or the Server peak search), into ``record``."""
    cfg, scenario, out_root = st.cfg, st.scenario, Path(st.spec["out_dir"])
    if scenario == "Server" and st.spec.get("find_peak"):
        _peak_search(lg, sut, qsl, cfg, target, hints, out_root, record)
        return
    res = run_test(lg, sut, qsl, test_settings(lg, cfg, scenario, "performance", target, **hints),
                   out_root / "performance")
    record["performance"] = dict(res, target_qps=target if scenario == "Server" else None,
                                 log_dir=str(out_root / "performance"))


def _peak_search(lg, sut, qsl, cfg, target: float, hints: dict, out_root: Path, record: dict) -> None:
    def at(qps: float) -> dict:
        return run_test(lg, sut, qsl, test_settings(lg, cfg, "Server", "performance", qps, **hints),
                        out_root / "peak" / f"qps-{qps:.6g}")

    best, runs = find_peak(at, target, cfg.peak_precision, cfg.peak_max_runs)
    record["peak_runs"] = [{"target_qps": q, **{k: r.get(k) for k in ("validity", "why", "p99_ms", "achieved_qps")}}
                           for q, r in runs]
    chosen = best if best is not None else min(runs, key=lambda x: x[0])
    record["performance"] = dict(chosen[1], target_qps=chosen[0], log_dir=str(out_root / "peak" / f"qps-{chosen[0]:.6g}"))


def _sut_facts(sut, st: _Setup) -> dict:
    """predict's own rate in the performance runs, beside the bench's: equal rates put a LoadGen
    shortfall outside predict (batch formation, inputs, answers, LoadGen itself); a lower one in
    predict (the device ran slower, or other batches)."""
    shapes, lengths = st.shapes, st.lengths
    ladder = ({str(q): shapes.ladder(q) for q in sorted({shapes.seq(int(v)) for v in lengths})}
              if st.scenario == "Server" and shapes.length_aware and not shapes.packed else {})
    return {"batches": sut.batches, "mean_batch_rows": sut.batch_rows / max(1, sut.batches),
            "predict_s": sut.predict_s,
            "predict_features_per_s": sut.batch_rows / sut.predict_s if sut.predict_s else None,
            "token_efficiency": sut.tokens_real / max(1, sut.tokens_computed),
            "bench_token_efficiency": st.plan.token_efficiency(lengths),
            "max_batch": st.max_batch, "max_wait_us": st.cfg.server_max_wait_us, "in_flight": sut.server_window,
            "grouping": "length-aware" if shapes.length_aware else "first come, first served",
            "length_aware": shapes.length_aware, "shapes": len(st.sut_shapes), "ladder": ladder}
