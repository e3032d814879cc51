#!/usr/bin/env python3
"""The LoadGen system under test against a simulated device, on any CPU: how much of a backend's
bench throughput the SUT's host path and batch formation keep under MLPerf LoadGen, with the
device taken out of the question.

The device is a stand-in backend whose ``predict`` sleeps for the batch's device time (sleeping
releases the GIL, as a blocking CUDA synchronize does) and returns fixed random logits of the
batch's shape: ``launch_us`` per batch plus its tokens (rows x padded length; real tokens when
packed) at a rate calibrated so that the bench's own plan of the suite's evaluation set runs at
``--bench-fps`` features/s, the bench throughput a GPU row measured. Everything else is the
product's code: the evaluation set (the suite's, tokenized with the embedded MiniLM's
vocabulary), the plan (schedule.make_plan), the SUT and its batcher (loadgen_sut.SUT), LoadGen's
Server peak search and Offline run.

    python scripts/loadgen_sut_model.py --bench-fps 9281 --set loadgen.server_max_wait_us=2000
    python scripts/loadgen_sut_model.py --bench-fps 6646 --batching packed --host-us 2000 --in-flight 4

``--in-flight N`` makes the stand-in keep N batches in flight (as torch's ``pipeline`` does: two
a CUDA stream): its device still runs one batch at a time, in order, on a thread of its own, so
what a window gains here is host work (batch formation, inputs, the backend's own host part)
overlapped with the device, not a second stream's overlap of kernels.

prints the simulated bench features/s, LoadGen Offline samples/s and the Server peak (the highest
VALID target QPS), each as a share of the simulated bench, and the SUT's mean batch. A share well
below 100% here is lost on the host or in batch formation, not on the device. What it cannot
show: a real device's lower efficiency at small batches (the sleep is linear in tokens).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bertqa_bench.measuring.loadgen_job import run_test  # noqa: E402
from bertqa_bench.measuring.loadgen_sut import SUT, Codec, Shapes, server_window  # noqa: E402
from bertqa_bench.measuring.runner import stream  # noqa: E402
from bertqa_bench.record.schedule import batch_inputs, make_plan  # noqa: E402
from bertqa_bench.measuring.loadgen_log import find_peak, test_settings  # noqa: E402


class SimulatedDevice:
    """A backend whose device time is ``launch_s + tokens / tokens_per_s`` per batch (slept)."""

    name = "simulated-device"

    def __init__(self, max_rows: int, max_seq: int, packed: bool, launch_us: float, seed: int = 0,
                 host_us: float = 0.0, in_flight: int = 1):
        rng = np.random.default_rng(seed)
        self.logits = rng.standard_normal((max_rows, max_seq)).astype(np.float32)  # rows >= any batch's
        self.packed, self.launch_s, self.tokens_per_s = packed, launch_us / 1e6, 1e9
        self.host_s = host_us / 1e6
        self.window = int(in_flight)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        if self.window > 1:  # the device: one batch at a time, in submission order
            threading.Thread(target=self._device, daemon=True).start()

    def in_flight(self) -> int:
        return self.window

    def _device(self) -> None:
        while True:
            seconds, done = self._work.get()
            time.sleep(seconds)
            done.set()

    def tokens(self, batch: dict) -> int:
        mask = batch["attention_mask"]
        return int(mask.sum()) if self.packed else int(mask.shape[0] * mask.shape[1])

    def predict(self, batch: dict) -> dict:
        return self.submit(batch)()

    def submit(self, batch: dict):
        b, s = batch["input_ids"].shape
        # a real backend's host side of predict (packing, launches, output copies) holds the GIL:
        # Python work, so the SUT's other threads (the responder) compete with it for the GIL
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        out = {"start_logits": self.logits[:b, :s], "end_logits": self.logits[:b, :s]}
        seconds = self.launch_s + self.tokens(batch) / self.tokens_per_s
        if self.window == 1:
            time.sleep(seconds)
            return lambda: out
        done = threading.Event()
        self._work.put((seconds, done))

        def wait() -> dict:
            done.wait()
            return out

        return wait


def bench(device: SimulatedDevice, inputs: dict, plan) -> float:
    """Features/s of one synchronous pass over the plan, as the bench's loop times it: the host
    batches are built before the clock starts (runner.materialize), as the bench builds them."""
    batches = [batch_inputs(inputs, b) for b in plan.batches]
    t0 = time.perf_counter()
    for _ in stream(device, batches):  # the bench runner's loop: in_flight() batches outstanding
        pass
    return len(next(iter(inputs.values()))) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="gpu-bert-base")
    ap.add_argument("--batching", default="sorted", choices=["padded", "sorted", "packed"])
    ap.add_argument("--bench-fps", type=float, required=True, help="the GPU row's bench features/s to simulate")
    ap.add_argument("--launch-us", type=float, default=100.0, help="device time per batch beside its tokens")
    ap.add_argument("--host-us", type=float, default=0.0,
                    help="host time per batch inside predict that holds the GIL (Python work; part of the bench rate)")
    ap.add_argument("--in-flight", type=int, default=1,
                    help="batches the stand-in keeps in flight (torch's pipeline: two a CUDA stream)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="suite overrides, e.g. loadgen.server_max_wait_us=10000")
    ap.add_argument("--scenarios", default="Offline,Server")
    ap.add_argument("--server-qps", type=float, help="one Server run at this target QPS instead of the peak search "
                                                     "(to profile it: py-spy record -- python scripts/...)")
    ap.add_argument("--json", help="write the numbers here too")
    a = ap.parse_args()

    from bertqa_bench.data.evalset import load_evalset
    from bertqa_bench.model.modeling import resolve_base
    from bertqa_bench.suite import load_suite
    from bertqa_bench.tasks import get_task

    cfg = load_suite(a.suite, ["loadgen.min_duration_ms=5000", "loadgen.peak_max_runs=8",
                               "loadgen.server_max_batch=256", "loadgen.server_batch_sizes=[8,32,128]", *a.overrides])
    ev = load_evalset(cfg.evalset_spec(), get_task(cfg.task.name), resolve_base("embedded:all-MiniLM-L6-v2"))
    f = ev.features
    inputs = {"input_ids": f.input_ids, "attention_mask": f.attention_mask, "token_type_ids": f.token_type_ids}
    lengths = f.attention_mask.sum(axis=1).astype(np.int64)
    b = cfg.bench
    plan = make_plan(lengths, batching=a.batching, batch_size=b.batch_size, max_seq_len=cfg.data.max_seq_len,
                     seq_multiple=b.seq_multiple, tokens_per_batch=b.tokens_per_batch, max_batch_rows=b.max_batch_rows)
    lg_cfg = cfg.loadgen
    max_batch = int(lg_cfg.server_max_batch or b.batch_size)
    tokens = b.tokens_per_batch or max_batch * cfg.data.max_seq_len
    device = SimulatedDevice(max(max_batch, b.max_batch_rows or 0, 256), cfg.data.max_seq_len,
                             a.batching == "packed", a.launch_us, host_us=a.host_us, in_flight=a.in_flight)
    # calibrate: device time over the plan = n / bench_fps, less the host time of the loop itself
    # (with --host-us, predict's own host part included)
    total_tokens = sum(device.tokens(batch_inputs(inputs, x)) for x in plan.batches)
    device.tokens_per_s, device.launch_s = 1e18, 0.0  # the loop's host time alone
    host_s = len(lengths) / bench(device, inputs, plan)
    device.launch_s = a.launch_us / 1e6
    device_s = len(lengths) / a.bench_fps - host_s - device.launch_s * len(plan.batches)
    if device_s <= 0:
        ap.error(f"--bench-fps {a.bench_fps} leaves no device time after {host_s:.3f} s of host time and launches")
    device.tokens_per_s = total_tokens / device_s
    fps = float(np.median([bench(device, inputs, plan) for _ in range(3)]))
    out = {"features": len(lengths), "batching": a.batching, "bench_fps": fps, "target_bench_fps": a.bench_fps,
           "bench_token_efficiency": plan.token_efficiency(lengths),
           "host_s_per_pass": host_s, "launch_us": a.launch_us, "host_us": a.host_us,
           "max_wait_us": lg_cfg.server_max_wait_us, "in_flight": a.in_flight,
           "server_window": server_window(lg_cfg.server_in_flight, device.in_flight()),
           "max_batch": max_batch, "token_budget": tokens}
    print(f"{len(lengths)} features ({a.batching}); simulated bench {fps:,.0f} features/s "
          f"(asked {a.bench_fps:,.0f}; host loop alone {len(lengths) / host_s:,.0f}/s)", flush=True)

    import mlperf_loadgen as lg

    example = device.predict(batch_inputs(inputs, plan.batches[0]))
    codec = Codec(["start_logits", "end_logits"], ("start_logits", "end_logits"), example)
    shapes = Shapes(plan.batching, cfg.data.max_seq_len, b.seq_multiple, max_batch, lg_cfg.server_batch_sizes,
                    token_budget=tokens)
    qsl = lg.ConstructQSL(len(lengths), len(lengths), lambda s: None, lambda s: None)
    hints = {"offline_expected_qps": 2.0 * fps, "single_stream_expected_latency_ns": 1e9 / (2.0 * fps)}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in a.scenarios.split(","):
            sut = SUT(lg, device, inputs, lengths, codec, shapes, scenario=scenario, max_batch=max_batch,
                      max_wait_us=lg_cfg.server_max_wait_us, server_window=out["server_window"],
                      offline_plan=lambda lens: make_plan(lens, batching=a.batching, batch_size=b.batch_size,
                                                          max_seq_len=cfg.data.max_seq_len,
                                                          seq_multiple=b.seq_multiple,
                                                          tokens_per_batch=b.tokens_per_batch,
                                                          max_batch_rows=b.max_batch_rows))
            try:
                def at(qps: float, scenario=scenario, sut=sut) -> dict:
                    return run_test(lg, sut, qsl, test_settings(lg, lg_cfg, scenario, "performance", qps, **hints),
                                    Path(tmp) / scenario / f"{qps:.6g}")

                if scenario == "Server":
                    sut.reset_counts()
                    if a.server_qps:
                        r = at(a.server_qps)
                        best, runs = ((a.server_qps, r) if r.get("validity") == "VALID" else None), [(a.server_qps, r)]
                    else:
                        best, runs = find_peak(at, fps * 0.5, lg_cfg.peak_precision, lg_cfg.peak_max_runs)
                    qps = best[0] if best else 0.0
                    res = best[1] if best else {}
                    out["server_peak_qps"], out["server_share"] = qps, qps / fps
                    out["server_p99_ms"] = res.get("p99_ms")
                    out["server_mean_batch"] = sut.batch_rows / max(1, sut.batches)
                    out["server_token_efficiency"] = sut.tokens_real / max(1, sut.tokens_computed)
                    out["server_runs"] = [(round(q), r.get("validity")) for q, r in runs]
                    print(f"Server peak {qps:,.0f} QPS = {qps / fps:.1%} of bench (p99 {res.get('p99_ms') or 0:.1f} "
                          f"ms; runs {out['server_runs']}; mean batch {out['server_mean_batch']:.1f}; real tokens "
                          f"{out['server_token_efficiency']:.0%} of computed, bench plan {out['bench_token_efficiency']:.0%})",
                          flush=True)
                else:
                    res = at(fps)
                    out["offline_qps"], out["offline_share"] = res.get("achieved_qps"), res.get("achieved_qps", 0) / fps
                    print(f"Offline {res.get('achieved_qps', 0):,.0f} samples/s = {out['offline_share']:.1%} of bench",
                          flush=True)
            finally:
                sut.close()
    lg.DestroyQSL(qsl)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
