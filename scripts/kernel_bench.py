#!/usr/bin/env python3
"""Time the packed encoder's kernel choices at one model shape on a CUDA GPU, each beside the path it
would replace, with its numerics checked against a reference on the same inputs:

* attention: FlashAttention-2 varlen (``packed_attention: flash``) against cuDNN's fused attention
  through nvidia-cudnn-frontend (``cudnn``), torch's FlexAttention with a document mask (``flex``)
  and the suite's Triton varlen kernel (``triton``, autotuned on its first call; the chosen
  configuration and every timed one are recorded), on packed [T, 3, heads, head_dim] QKV views of
  random sequence lengths; reference: per-sequence SDPA in fp32; and for the FP8 output GEMM's
  input, the Triton kernel writing e4m3 itself (``triton-e4m3``, ``fp8.attention_output: e4m3``)
  against its fp16 output quantized by a compiled pass of its own (``triton+quantize``, today's);
* the FFN's first half: the FP8 up-projection writing e4m3 then the Triton tanh-GELU kernel
  (``ffn_gelu: tanh``) against cuBLASLt's GELU_BIAS epilogue through nvmath-python
  (``ffn_gelu: epilogue``); reference: the epilogue's formula in fp32 (cublaslt_epilogues.py);
* the layer's other FP8 GEMMs (QKV, attention output, FFN down, fp16 out with their bias): torch's
  ``_scaled_mm`` (cuBLASLt's heuristic choice, today's path) against the same cuBLASLt GEMM through
  nvmath-python, first at the heuristic's choice, then autotuned among its candidates; for the two
  GEMMs a residual follows, also with the residual added in the GEMM (cuBLASLt's C operand, beta 1)
  and the Inductor LayerNorm + e4m3 quantize kernel that then reads one tensor instead of two, and
  writing e4m3 for the add + LayerNorm kernel (``fp8.dense_output: e4m3``, the BIAS epilogue with an
  e4m3 result); reference: the same GEMM in fp32 on the decoded e4m3 values;
* residual add + LayerNorm + e4m3 quantize (``--only layernorm``): Inductor's fused pass against the
  suite's one-pass Triton kernel (``fp8.layernorm: triton``) at each launch shape it may use, with
  fp16 or e4m3 GEMM outputs and an fp16 or bf16 residual; reference: the kernel's torch formula;
* the layer's four GEMMs in INT8 (``--only int8``): cuBLASLt's IMMA GEMM through ``torch._int_mm``
  alone and with its dequantize as Inductor compiles it (by default, and under max-autotune with
  the int8 template's fused epilogue) against the FP8 GEMM of today's path, for the energy an
  INT8 path could save on a power-capped card; reference: the GEMM in fp32 on the fp16 inputs;
* every algorithm cuBLASLt offers for the FFN-up GEMM with its GELU + bias epilogue and e4m3 output
  (``--only ffn_up_candidates``, at each ``--candidates`` limit), each planned alone and timed, and
  the same for all four of the layer's GEMMs with their epilogues beside ``torch._scaled_mm``
  (``--only gemm_candidates``);
* each inside a captured CUDA graph as well, replayed and compared with its eager result;
* with ``--energy-s S``, each graph replayed back to back for about S seconds between two reads of
  NVML's energy counter: joules a call, the card's average power and the sustained time a call
  (``energy_record``). On a power-capped card a pass's time follows its energy (the fused-LayerNorm
  lever was 31 % faster as a kernel and 0.6 % end to end: h200-mlperf-bert-large-fused-layernorm.md),
  so a lever's prediction needs the joules each kernel costs, not only its microseconds.

Times are CUDA-event medians (min-max) over ``--iters`` calls after ``--warmup``; each line of the
output is one JSON record. Random weights and activations: kernel timing and numerics only.

    python scripts/kernel_bench.py --shape bert-large --tokens 32768 --out kernels.jsonl

The attention's cost depends on the sequence lengths it packs, and random lengths of 100-384
tokens are not a run's: ``--from-run`` takes them from a bench run's own packed plan and
evaluation set instead (``plan_lengths``), times the attention kernels on ``--plan-batches`` of its
batches spread over the plan, and adds a record per kernel estimating its time over one whole
pass (per layer: the sampled batches' mean times the plan's batch count).

    python scripts/kernel_bench.py --shape bert-large --only attention --from-run results/h200-large \
        --backend torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-2streams

``--tiles`` also times, on each of those batches, every tile the Triton kernel's autotuner chooses
among (e4m3 output, each checked against its numerics bound), and adds a record comparing the tile
the autotuner picked on the typical batch, as the run's backend does, with the best single tile and
with each batch taking its own best: what choosing a tile per batch could save.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"bert-base": (768, 12, 3072), "bert-large": (1024, 16, 4096)}
# the quack kernel's configurations timed by default (kernels/quack_gemm_gelu.py; each compiles in
# seconds): every ping-pong tile with a cluster of 2 along M, two along N, and the cooperative
# tiles nearest cuBLASLt's choices (256 x 128 and 128 x 256)
QUACK_TILES = ["pingpong-128x128-c2x1", "pingpong-128x160-c2x1", "pingpong-128x192-c2x1", "pingpong-128x208-c2x1",
               "pingpong-192x128-c2x1", "pingpong-128x192-c1x2", "pingpong-128x128-c1x2",
               "coop-256x128-c2x1", "coop-256x128-c1x2", "coop-256x192-c2x1", "coop-128x256-c2x1"]


def timed(fn, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return {"us_median": round(statistics.median(times), 1), "us_min": round(min(times), 1),
            "us_max": round(max(times), 1), "iters": iters}


def graphed(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream): (replay, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g.replay, out


def timed_eager_and_graphed(fn, out, args) -> dict:
    """fn timed eagerly and replayed in a CUDA graph, and whether the replay writes ``out``'s bytes;
    with ``args.energy_s``, the replay's energy a call too (``energy_of_replays``)."""
    rec = timed(fn, args.warmup, args.iters)
    replay, gout = graphed(fn)
    replay()
    torch.cuda.synchronize()
    rec["graph_replay_equals_eager"] = bool(torch.equal(gout.view(torch.uint8), out.view(torch.uint8)))
    rec.update(replay_record(replay, args))
    return rec


def replay_record(replay, args) -> dict:
    """A captured graph's replay timed (``timed``) and, with ``args.energy_s``, its energy a call."""
    rec = {"graph": timed(replay, args.warmup, args.iters)}
    if args.energy_s:
        rec["energy"] = energy_of_replays(replay, rec["graph"]["us_median"], args.energy_s)
    return rec


def replays_for(seconds: float, us_per_call: float) -> int:
    """How many back-to-back calls of ``us_per_call`` fill ``seconds`` (at least 100: NVML's energy
    counter moves in millijoules and updates every few milliseconds, so a window needs many calls)."""
    if not seconds > 0 or not us_per_call > 0:
        raise ValueError(f"replays_for needs positive seconds and a positive time a call, got {seconds}, {us_per_call}")
    return max(100, int(seconds * 1e6 / us_per_call))


def energy_record(mj_before: float, mj_after: float, s_before: float, s_after: float, calls: int,
                  clocks_mhz=()) -> dict:
    """Joules a call and the card's average power over ``calls`` calls between two reads of NVML's
    total-energy counter (millijoules) at two host times (seconds); the sustained time a call; the
    median SM clock sampled over the window."""
    if calls < 1 or s_after <= s_before or mj_after < mj_before:
        raise ValueError(f"energy_record: {calls} calls, {s_after - s_before:.3f} s, {mj_after - mj_before} mJ: "
                         "the counter or the clock went backwards, or nothing was called")
    joules, seconds = (mj_after - mj_before) / 1000.0, s_after - s_before
    return {"mJ_per_call": round(1000.0 * joules / calls, 4), "avg_power_w": round(joules / seconds, 1),
            "us_per_call_sustained": round(1e6 * seconds / calls, 1), "calls": calls, "window_s": round(seconds, 3),
            "sm_clock_mhz_median": statistics.median(clocks_mhz) if clocks_mhz else None}


def energy_of_replays(replay, us_per_call: float, seconds: float) -> dict:
    """Replay a captured graph back to back for about ``seconds`` between two reads of NVML's energy
    counter (``energy_record``); the SM clock read every ~10 % of the window on the host."""
    from bertqa_bench.measuring.gpu_sensor import NVML_HINT, nvml, nvml_handle

    mod = nvml()
    if mod is None:
        return {"error": f"no NVML here: {NVML_HINT}"}
    h = nvml_handle(mod, torch.cuda.current_device())
    calls = replays_for(seconds, us_per_call)
    chunk = max(1, calls // 10)
    torch.cuda.synchronize()
    e0, t0, clocks = mod.nvmlDeviceGetTotalEnergyConsumption(h), time.perf_counter(), []
    for done in range(0, calls, chunk):
        for _ in range(min(chunk, calls - done)):
            replay()
        torch.cuda.synchronize()  # the queue stays short, so the clock read is of this window
        clocks.append(mod.nvmlDeviceGetClockInfo(h, mod.NVML_CLOCK_SM))
    e1, t1 = mod.nvmlDeviceGetTotalEnergyConsumption(h), time.perf_counter()
    return energy_record(e0, e1, t0, t1, calls, clocks)


def epilogue_support(emit) -> None:
    """Which cuBLASLt epilogues nvmath plans for an e4m3 x e4m3 GEMM with an e4m3 result here."""
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    from bertqa_bench.kernels.cublaslt_epilogues import _e4m3_type

    w8 = torch.randn(256, 128, device="cuda").to(torch.float8_e4m3fn)
    x8 = torch.randn(64, 128, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for epi in ("DEFAULT", "BIAS", "GELU", "GELU_BIAS"):
        for bias_dtype in ((torch.float16, torch.bfloat16) if "BIAS" in epi else (None,)):
            rec = {"what": "epilogue_support", "epilog": epi, "bias": str(bias_dtype)}
            try:
                mm = Matmul(w8, x8.t(), quantization_scales={"a": one, "b": one, "d": one},
                            options={"result_type": _e4m3_type()})
                kw = {} if epi == "DEFAULT" else {"epilog": getattr(MatmulEpilog, epi)}
                if bias_dtype is not None:
                    kw["epilog_inputs"] = {"bias": torch.zeros(256, dtype=bias_dtype, device="cuda")}
                mm.plan(**kw)
                d = mm.execute()
                d = d[0] if isinstance(d, tuple) else d
                rec.update(ok=True, result_shape=list(d.shape), result_stride=list(d.stride()))
            except Exception as e:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            emit(rec)


ATTENTION_KERNELS = ("flash", "cudnn", "cudnn-fp8", "triton", "triton-e4m3", "triton+quantize", "triton-fp8",
                     "triton-fp8-pv16", "flex")
# the kernels that read e4m3 Q, K, V (the QKV GEMM's e4m3 output): their error is also measured
# against attention of the decoded e4m3 inputs, which leaves the inputs' own rounding out
E4M3_INPUT_KERNELS = ("cudnn-fp8", "triton-fp8", "triton-fp8-pv16")


def lengths_for(tokens: int, lo: int, hi: int, gen) -> list[int]:
    out, total = [], 0
    while True:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        if total + n > tokens:
            return out
        out.append(n)
        total += n


def plan_lengths(run_dir, backend: str | None = None, evalset: str | None = None) -> tuple[list[list[int]], int]:
    """The real sequence lengths of every batch of a bench run's packed plan, in the plan's order,
    and the run's maximum sequence length (the attention kernel's ``max_seqlen`` there).

    The plan is the run's own (``plans/`` of the run folder, as its worker's job names it); the
    lengths are its evaluation set's (``attention_mask.npy`` in the cached set the job names, or in
    ``evalset``). ``backend``: whose job to read; by default the first job of a packed row."""
    import numpy as np

    from bertqa_bench.record.schedule import Plan

    run = Path(run_dir)
    jobs = sorted((run / "workers").glob("*.job.json"))
    if not jobs:
        raise SystemExit(f"kernel_bench: {run} has no workers/*.job.json (is it a bench run folder?)")
    specs = {j.name[: -len(".job.json")]: json.loads(j.read_text()) for j in jobs}
    for name, spec in specs.items():
        missing = [k for k in ("variant", "plan", "evalset", "max_seq_len") if k not in spec]
        if missing:
            raise SystemExit(f"kernel_bench: {run}/workers/{name}.job.json has no {', '.join(missing)}: "
                             "not a job this version of the runner wrote")
    if backend is not None:
        if backend not in specs:
            raise SystemExit(f"kernel_bench: {run} has no job for {backend}; it has: {', '.join(sorted(specs))}")
        spec = specs[backend]
    else:
        packed = [v for v in specs.values() if v["variant"].get("batching") == "packed"]
        if not packed:
            raise SystemExit(f"kernel_bench: {run} ran no packed row; its rows: {', '.join(sorted(specs))}")
        spec = packed[0]
    plan_file = run / "plans" / Path(spec["plan"]).name  # the job names it where the run was made
    mask_file = Path(evalset or spec["evalset"]) / "attention_mask.npy"
    for f, what in ((plan_file, "plan"), (mask_file, "evaluation set (give --evalset DIR)")):
        if not f.exists():
            raise SystemExit(f"kernel_bench: the run's {what} is not at {f}")
    plan = Plan.load(plan_file)
    if plan.batching != "packed":
        raise SystemExit(f"kernel_bench: {plan_file} is a {plan.batching} plan; the attention packs only packed ones")
    lengths = np.load(mask_file, mmap_mode="r").sum(axis=1)
    if len(lengths) != plan.n_features:
        raise SystemExit(f"kernel_bench: {mask_file} has {len(lengths)} features, the plan {plan.n_features}: "
                         "not this run's evaluation set")
    return [[int(n) for n in lengths[b.rows]] for b in plan.batches], int(spec["max_seq_len"])


def typical_first(batches: list[list[int]], chosen: list[int]) -> list[int]:
    """``chosen`` with the batch of median mean length (the lower median) first: the Triton
    kernel's autotuner times its tiles on its first call for a key and every later batch reuses
    that tile, as the bench's backend tunes on its typical sample batch (``typical_batch``)."""
    from bertqa_bench.backends.torch_backend import median_index

    first = chosen[median_index([sum(batches[i]) / max(1, len(batches[i])) for i in chosen])]
    return [first] + [i for i in chosen if i != first]


def attention_over_plan(args, plan: tuple[list[list[int]], int], hidden, heads, emit) -> None:
    """The attention kernels on batches of a bench run's own plan (``plan_lengths``), then one
    record per kernel estimating its time over a whole pass, per layer (``pass_records``), and with
    ``--tiles`` one comparing the tuned tile with each batch's best (``tiles_summary``)."""
    batches, max_seq_len = plan
    args.seq_max = max_seq_len  # the kernels' max_seqlen as the run's (it sizes the launch grid)
    from bertqa_bench.record.schedule import spread

    chosen = typical_first(batches, spread(len(batches), args.plan_batches))
    seen: list[dict] = []

    def collect(rec):
        emit(rec)
        seen.append(rec)

    for k, i in enumerate(chosen):
        attention(args, hidden, heads, collect, lens=batches[i],
                  tag={"plan_batch": i, "plan_batches": len(batches)}, tuning_call=k == 0)
    if args.tiles:
        # the tile the kernel bench's own autotuner chose on the typical batch, as the run's backend
        # does (the run's own tile where Triton's cache holds it: see triton_attention.tuning_source)
        tuned = next((r["triton_config"] for r in seen if r.get("what") == "attention"
                      and r.get("kernel") == "triton-e4m3" and r.get("triton_config")), None)
        from bertqa_bench.kernels import varlen_attention as triton_attention

        emit({**tiles_summary(seen, tuned, len(batches)), "tuning_source": triton_attention.tuning_source()})
    for rec in pass_records(seen, len(batches)):
        emit({**rec, "run": str(args.from_run), "tuned_on_plan_batch": chosen[0]})


def pass_estimate(times: list[float], n_batches: int) -> float:
    """A kernel's time over one pass, per layer: the sampled batches' mean times the plan's batch count."""
    return round(sum(times) / len(times) * n_batches, 1)


def pass_records(records: list[dict], n_batches: int) -> list[dict]:
    """Per kernel, from its ``attention`` records (the tile sweep's ``attention-tile`` records and
    failed ones left out): the sampled batches' mean CUDA-graph time, as the bench replays it,
    times the plan's batch count: its estimated time over one pass, per layer."""
    times: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("what") == "attention" and "error" not in rec and "us_median" in rec.get("graph", {}):
            times.setdefault(rec["kernel"], []).append(rec["graph"]["us_median"])
    return [{"what": "attention-pass", "kernel": name, "plan_batches": n_batches, "sampled": len(ts),
             "mean_batch_us": round(sum(ts) / len(ts), 1), "pass_estimate_us": pass_estimate(ts, n_batches),
             "note": "per layer: the sampled batches' mean median (CUDA graph replay) times the plan's batch "
                     "count; the run's kernel also sees its token buckets' dummy sequences, left out here"}
            for name, ts in times.items()]


def sdpa_reference(q, k, v, cu, scale: float):
    """Per-sequence SDPA in fp32 of packed [T, heads, d] q, k, v (decoded to fp32 first)."""
    ref = torch.empty(q.shape, device=q.device)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[s:e].float().transpose(0, 1) for x in (q, k, v))
        ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    return ref


def qkv_gemm_outputs(args, hidden, emit) -> None:
    """The fused QKV GEMM (torch._scaled_mm, e4m3 x e4m3, bias, fast accumulation) at the batch's
    token count writing fp16 (what 16-bit attention reads) or e4m3 at an output scale (what FP8
    attention reads): the other half of moving attention's inputs to e4m3."""
    from bertqa_bench.kernels.fp8_math import gemm_writes_saturated_e4m3

    m, n = args.tokens, 3 * hidden
    x8 = torch.randn(m, hidden, device="cuda").to(torch.float8_e4m3fn)
    w8 = (torch.randn(n, hidden, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    sa = torch.tensor(1.0 / 16, device="cuda")  # the output scale folded into scale_a, as Fp8Linear does
    bias16, bias_bf = torch.randn(n, device="cuda").half(), torch.randn(n, device="cuda").bfloat16()
    outs = {"fp16": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, bias=bias16,
                                             out_dtype=torch.float16, use_fast_accum=True),
            "e4m3": lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=one, bias=bias_bf,
                                             out_dtype=torch.float8_e4m3fn, use_fast_accum=True)}
    for name, fn in outs.items():
        rec = {"what": "qkv-gemm", "out": name, "M": m, "N": n, "K": hidden,
               "out_MB": m * n * (2 if name == "fp16" else 1) / 1e6,
               "saturates_e4m3": gemm_writes_saturated_e4m3(torch.device("cuda"))}
        try:
            out = fn()
            rec.update(timed_eager_and_graphed(fn, out, args))
        except Exception as e:  # noqa: BLE001 - a result too
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        emit(rec)


def attention(args, hidden, heads, emit, lens=None, tag=None, tuning_call: bool = True) -> None:
    from bertqa_bench.backends.transforms.packed_encoder import _cudnn_kernel, _varlen_kernel

    d = hidden // heads
    if lens is None:
        gen = torch.Generator().manual_seed(0)
        lens = lengths_for(args.tokens, args.seq_min, args.seq_max, gen)
    # the kernels' max_seqlen: the bench's (384 by default), never below a sequence it is given
    max_len = max(args.seq_max, max(lens))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    t = int(cu[-1])
    qkv = torch.randn(t, 3, heads, d, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    scale = d ** -0.5

    def wanted(name):  # cuDNN's kernels are set up only when timed: they need nvidia-cudnn-frontend
        return not args.kernels or name in args.kernels

    kernels = {}
    flash = _varlen_kernel()
    kernels["flash"] = lambda: flash(q, k, v, cu, cu, max_len, max_len, scale=scale)
    if wanted("cudnn"):
        cudnn_op = _cudnn_kernel()
        kernels["cudnn"] = lambda: cudnn_op(q, k, v, scale, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                                            max_seqlen_kv=max_len, return_lse=False)[0]
    # cuDNN's FP8 attention on the same values in e4m3 (unit scales: the inputs are ~N(0, 1)), its
    # output in e4m3 at scale 1/16 (|O| <= max |V|)
    one, o_inv = torch.ones((), device="cuda"), torch.tensor(16.0, device="cuda")
    q8, k8, v8 = qkv.to(torch.float8_e4m3fn).unbind(1)  # the e4m3-input kernels' inputs (E4M3_INPUT_KERNELS)
    if wanted("cudnn-fp8"):
        from bertqa_bench.kernels.cudnn_fp8_attention import fp8_varlen_attention

        kernels["cudnn-fp8"] = lambda: fp8_varlen_attention(q8, k8, v8, cu, max_len, scale, one, o_inv)
    # the hand-written Triton varlen kernel; its first (eager) call below autotunes, before any
    # timing or graph capture
    from bertqa_bench.kernels import varlen_attention as triton_attention

    kernels["triton"] = lambda: triton_attention.varlen_attention(q, k, v, cu, max_len, scale)
    # the e4m3 output at the scale cuDNN's FP8 row uses (1/16), fused or as a pass of its own (what
    # Inductor generates for the output GEMM's quantize of a 16-bit input)
    from bertqa_bench.kernels.fp8_math import saturate_to_e4m3

    quantize = torch.compile(lambda x: saturate_to_e4m3(x, o_inv))
    o_inv1 = o_inv.reshape(1)
    kernels["triton-e4m3"] = lambda: triton_attention.varlen_attention(q, k, v, cu, max_len, scale, o_inv1)
    kernels["triton+quantize"] = lambda: quantize(triton_attention.varlen_attention(q, k, v, cu, max_len, scale))
    # the Triton kernel on the same values in e4m3 (unit scale, as cuDNN's FP8 row), e4m3 out at 1/16:
    # both products on FP8 tensor cores (P rounded to e4m3), or P V in fp16 on V's exact values
    one1 = one.reshape(1)
    kernels["triton-fp8"] = lambda: triton_attention.varlen_attention(q8, k8, v8, cu, max_len, scale, o_inv1,
                                                                      qkv_scale=one1, pv_e4m3=True)
    kernels["triton-fp8-pv16"] = lambda: triton_attention.varlen_attention(q8, k8, v8, cu, max_len, scale, o_inv1,
                                                                           qkv_scale=one1)
    # torch's own FlexAttention (compiled Triton templates) with a document mask over the packed
    # tokens: the maintained library for exactly this masking, beside the hand-written kernel
    # (compiled for each batch's shape: leave it out of --kernels on many batches)
    if wanted("flex"):
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
            block_mask = create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], B=None, H=None, Q_LEN=t, KV_LEN=t,
                                           device="cuda")
            flex = torch.compile(flex_attention, dynamic=False)
            q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, T, d] views
            kernels["flex"] = lambda: flex(q4, k4, v4, block_mask=block_mask, scale=scale)[0].transpose(0, 1)
        except Exception as e:  # noqa: BLE001 - recorded as this kernel's result
            emit({"what": "attention", "kernel": "flex", "error": f"{type(e).__name__}: {e}"[:2000]})
    if args.kernels:
        kernels = {n: f for n, f in kernels.items() if n in args.kernels}
    ref = sdpa_reference(q, k, v, cu, scale)
    ref8 = sdpa_reference(q8, k8, v8, cu, scale) if set(kernels) & set(E4M3_INPUT_KERNELS) else None
    # bytes of Q, K, V read and O written once: the kernel's memory floor
    floor_bytes = 4 * t * hidden * 2
    seq_range = [args.seq_min, args.seq_max] if tag is None else [min(lens), max(lens)]  # drawn from / real
    for name, fn in kernels.items():
        rec = {"what": "attention", "kernel": name, "tokens": t, "sequences": len(lens), "heads": heads,
               "head_dim": d, "seq_range": seq_range, "dtype": "fp16", "floor_MB": floor_bytes / 1e6, **(tag or {})}
        try:
            out = fn()
            if name.startswith("triton"):
                rec["triton_config"] = triton_attention.best_config()
                if tuning_call:  # later calls of the key reuse the first call's tile and timings
                    rec["triton_autotune_us"] = triton_attention.autotune_timings()
            decoded = out.float() / 16.0 if out.dtype == torch.float8_e4m3fn else out.float()
            rec["max_abs_err_vs_fp32_sdpa"] = float((decoded - ref).abs().max())
            if name in E4M3_INPUT_KERNELS:
                rec["max_abs_err_vs_fp32_sdpa_of_the_e4m3_inputs"] = float((decoded - ref8).abs().max())
                rec["input_MB"] = 3 * t * hidden / 1e6  # e4m3 Q, K, V: half the 16-bit kernels' reads
                rec["floor_MB"] = (3 * t * hidden + t * hidden) / 1e6  # e4m3 in, e4m3 out
            rec["dtype"] = str(out.dtype)
            rec.update(timed_eager_and_graphed(fn, out, args))
        except Exception as e:  # noqa: BLE001 - one kernel's failure is a result, the others still run
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        emit(rec)
    if args.tiles:
        # every tile the autotuner chooses among, each timed on this batch with the e4m3 output:
        # how far the one tuned tile is from each batch's best
        vmax = float(v.abs().max())
        for cfg in triton_attention.candidate_configs(d, max_len):
            rec = {"what": "attention-tile", "kernel": "triton-e4m3", "config": str(cfg), "tokens": t,
                   "sequences": len(lens), "seq_range": seq_range, **(tag or {})}
            fn = (lambda c: lambda: triton_attention.launch(q, k, v, cu, max_len, scale, out_inv_scale=o_inv1,
                                                            config=c))(cfg)
            try:
                out = fn()
                rec["max_abs_err_vs_fp32_sdpa"] = err = float((out.float() / 16.0 - ref).abs().max())
                # e4m3's rounding of the output (relative 2^-4, 2^-10 absolute among subnormals, at
                # scale 1/16) and P's and the fp32 reference's (2^-11 relative each) of |O| <= max|V|
                rec["within_bound"] = err <= (2.0 ** -4 + 2 * 2.0 ** -11) * vmax + 2.0 ** -10 / 16.0
                rec.update(timed_eager_and_graphed(fn, out, args))
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile or launch is a result
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            emit(rec)


def tiles_summary(records: list[dict], tuned: str | None, n_batches: int) -> dict:
    """From the tile sweep's ``attention-tile`` records (one per tile and sampled plan batch): the
    pass estimate (per layer, the sampled mean CUDA-graph time times the plan's batch count) of each
    tile, of the tuned one, of the best single tile, and of each batch taking its own best tile (the
    bound a choice of tile per batch could reach).

    A tile counts only if it ran on every sampled batch within its numerics bound and its graph
    replay wrote the eager call's bytes; the others are listed under ``failed`` with their batches,
    so the counted and the failed tiles together are every tile timed. Without the tuned tile among
    the counted ones there is nothing to compare: the record says so in ``error``."""
    tiles = [r for r in records if r.get("what") == "attention-tile"]
    sampled = sorted({r["plan_batch"] for r in tiles})
    ok: dict[str, dict[int, float]] = {}
    failed: dict[str, list[int]] = {}
    for r in tiles:
        good = ("error" not in r and r.get("within_bound") is True and r.get("graph_replay_equals_eager") is True
                and "us_median" in r.get("graph", {}))
        if good:
            ok.setdefault(r["config"], {})[r["plan_batch"]] = r["graph"]["us_median"]
        else:
            failed.setdefault(r["config"], []).append(r["plan_batch"])
    for c in list(ok):  # a tile that could not run everywhere is no single choice
        if c in failed or set(ok[c]) != set(sampled):
            ran = ok.pop(c)
            failed.setdefault(c, sorted(set(sampled) - set(ran)))
    out = {"what": "attention-tiles-pass", "kernel": "triton-e4m3", "plan_batches": n_batches, "sampled": sampled,
           "tuned": tuned, "failed": failed}
    if not ok:
        return {**out, "error": "no tile ran within its bound on every sampled batch"}

    each = {c: pass_estimate(list(t.values()), n_batches) for c, t in ok.items()}
    best = min(each, key=each.get)
    out.update(tuned_pass_us=each.get(tuned), best_single=best, best_single_pass_us=each[best],
               per_batch_best_pass_us=pass_estimate([min(t[b] for t in ok.values()) for b in sampled], n_batches),
               best_by_batch={b: min(ok, key=lambda c: ok[c][b]) for b in sampled}, pass_us_by_tile=each)
    if tuned not in each:
        out["error"] = f"the tuned tile ({tuned}) is not among the tiles counted: no comparison with it"
    return out


def ffn_up(args, hidden, ffn, emit) -> None:
    from transformers.activations import GELUActivation

    from bertqa_bench.kernels import cublaslt_epilogues
    from bertqa_bench.backends.transforms.fp8_surgery import fp8_classes
    from bertqa_bench.kernels.fp8_math import e4m3_codes_apart, static_act_scale

    Fp8Linear, _, Fp8Intermediate = fp8_classes()[:3]
    torch.manual_seed(0)
    w = (torch.randn(ffn, hidden, device="cuda") * hidden ** -0.5).half()
    b = (torch.randn(ffn, device="cuda") * 0.1).half()
    x = torch.randn(args.tokens, hidden, device="cuda").half()
    y = x.float() @ w.float().t() + b.float()
    out_scale = static_act_scale(float(y.abs().amax()))
    down_scale = static_act_scale(float(cublaslt_epilogues.gelu_tanh(y).abs().amax()))
    act = static_act_scale(float(x.abs().amax()))
    rec0 = {"what": "ffn_up", "tokens": args.tokens, "hidden": hidden, "ffn": ffn,
            "epilogue_saturates": None, "nvmath": None}
    try:
        import nvmath

        rec0["nvmath"] = nvmath.__version__
        rec0["epilogue_saturates"] = cublaslt_epilogues.epilogue_saturates("cuda")
    except Exception as e:  # noqa: BLE001
        rec0["error"] = f"{type(e).__name__}: {e}"[:2000]
    emit(rec0)
    up = Fp8Linear(w, b, scaling="tensor", act_scale=act, fast_accum=True, out_scale=out_scale)
    paths = {}
    for gelu in ("tanh", "epilogue"):
        try:
            paths[gelu] = Fp8Intermediate(up, GELUActivation(), down_scale, gelu=gelu)
        except Exception as e:  # noqa: BLE001
            emit({"what": "ffn_up", "gelu": gelu, "error": f"{type(e).__name__}: {e}"[:2000]})
    x8, sa = up.quantize_input(x)
    # the kernels alone, on the e4m3 input the LayerNorm kernel writes in the model (each module
    # takes an e4m3 input as quantized with its static scale)
    h8 = up(x8)
    alone = {"gemm_e4m3_out (torch._scaled_mm)": lambda: up(x8)}
    if "tanh" in paths:
        alone["gelu_tanh_kernel (Triton)"] = lambda: paths["tanh"]._tanh_gelu(h8, up.out_scale_value,
                                                                              1 / down_scale)
        alone["gemm + gelu (two kernels)"] = lambda: paths["tanh"](x8)
    if "epilogue" in paths:
        alone["gemm_gelu_bias_epilogue (nvmath, heuristic, fast accumulation)"] = lambda: paths["epilogue"](x8)
        ep = paths["epilogue"]
        alone["gemm_gelu_bias_epilogue (nvmath, heuristic, fp32 promotion: no fast accumulation)"] = \
            lambda: cublaslt_epilogues.gemm_gelu_fp8(x8, up.weight_fp8, ep.epilogue_bias, up.weight_scale, sa,
                                                ep.down_inv_scale, False)
    alone.update(inductor_gelu_paths(x8, up, sa, down_scale))
    alone.update(quack_gelu_paths(x8, up, sa, down_scale, args.quack_tiles))
    for label, fn in alone.items():
        rec = {"what": "ffn_up_kernels", "kernel": label, "tokens": args.tokens, "hidden": hidden, "ffn": ffn}
        try:
            replay, out = graphed(fn)
            rec.update(replay_record(replay, args))
            if "Inductor" in label or ", quack (" in label:  # a new path: its codes against the epilogue's formula
                diff = e4m3_codes_apart(out, cublaslt_epilogues.fp8_gemm_gelu_reference(
                    x8, up.weight_fp8, up.bias_unscaled.to(cublaslt_epilogues.BIAS_DTYPE), up.weight_scale, sa,
                    torch.tensor(1 / down_scale, device="cuda")))
                rec.update(share_within_one_code=float((diff <= 1).float().mean()), max_codes_apart=int(diff.max()))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        emit(rec)
    if "epilogue" in paths and args.autotune:
        ep = paths["epilogue"]
        rec = {"what": "ffn_up_kernels", "kernel": f"gemm_gelu_bias_epilogue (nvmath, autotuned x{args.autotune}, fast accumulation)",
               "tokens": args.tokens}
        try:
            replay, _ = graphed(lambda: cublaslt_epilogues.gemm_gelu_fp8(x8, up.weight_fp8, ep.epilogue_bias, up.weight_scale,
                                                                     sa, ep.down_inv_scale, True, args.autotune))
            rec.update(replay_record(replay, args))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        emit(rec)
    ref = cublaslt_epilogues.fp8_gemm_gelu_reference(x8, up.weight_fp8, up.bias_unscaled.to(cublaslt_epilogues.BIAS_DTYPE),
                                                up.weight_scale, sa, torch.tensor(1 / down_scale, device="cuda"))
    for gelu, mod in paths.items():
        rec = {"what": "ffn_up", "gelu": gelu, "tokens": args.tokens, "hidden": hidden, "ffn": ffn}
        try:
            fn = lambda m=mod: m(x)  # noqa: E731
            out = fn()
            diff = e4m3_codes_apart(out, ref)
            rec.update(dtype=str(out.dtype), shape=list(out.shape), contiguous=out.is_contiguous(),
                       share_equal_code=float((diff == 0).float().mean()),
                       share_within_one_code=float((diff <= 1).float().mean()),
                       max_codes_apart=int(diff.max()), nan=int(out.float().isnan().sum()),
                       max_abs_err=float((out.float() - ref.float()).abs().max()))
            rec.update(timed_eager_and_graphed(fn, out, args))
            rec["floor_MB"] = (args.tokens * hidden + args.tokens * ffn) / 1e6
        except Exception as e:  # noqa: BLE001
            import traceback

            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
        emit(rec)


def inductor_gelu_paths(x8, up, sa, down_scale) -> dict:
    """FFN-up's GEMM + bias + tanh-GELU + e4m3 quantize as one function compiled by Inductor under
    max-autotune: with the GELU fused into a Triton GEMM template's epilogue where Inductor chooses
    one (``TRITON`` only: the template always), or cuBLASLt's GEMM and a pointwise kernel after it
    (``ATEN,TRITON``: whichever Inductor times faster). Labels -> zero-argument callables."""
    from bertqa_bench.kernels.cublaslt_epilogues import gelu_tanh

    w8, sw, bias, inv = up.weight_fp8, up.weight_scale, up.bias_unscaled, 1.0 / down_scale

    def f(a8):
        y = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
        return (gelu_tanh(y.float() + bias) * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    out = {}
    for backends in ("TRITON", "ATEN,TRITON"):
        # max-autotune without Inductor's own CUDA graphs (``graphed`` captures): options, not mode,
        # since torch.compile takes one or the other
        fn = torch.compile(f, dynamic=False, options={"max_autotune": True, "triton.cudagraphs": False,
                                                      "max_autotune_gemm_backends": backends})
        out[f"gemm + bias + gelu + e4m3, Inductor max-autotune ({backends})"] = lambda fn=fn: fn(x8)
    return out


def quack_gelu_paths(x8, up, sa, down_scale, tiles) -> dict:
    """FFN-up's GEMM + bias + tanh-GELU + e4m3 output as one quack (CuTe DSL) kernel
    (kernels/quack_gemm_gelu.py) at each of ``tiles``; none where quack cannot run here (the reason
    is printed). Labels -> zero-argument callables; each tile compiles on its first call."""
    from bertqa_bench.kernels import quack_gemm_gelu

    why = quack_gemm_gelu.quack_unavailable_reason()
    if why:
        print(f"kernel_bench: no quack paths: {why}", file=sys.stderr)
        return {}
    alpha = (sa.float() * up.weight_scale.float()).reshape(1)
    inv = torch.tensor([1.0 / down_scale], dtype=torch.float32, device=x8.device)
    from quack.gemm_interface import gemm, gemm_act

    out = {f"gemm + bias + gelu + e4m3, quack ({tile})":
           lambda tile=tile: quack_gemm_gelu.gemm_gelu_quack(x8, up.weight_fp8, up.bias_unscaled, alpha, inv, tile)
           for tile in tiles}
    # quack's own entry points on the same operands, to tell its main loop from the suite's epilogue:
    # the plain GEMM (bf16 out, the library's default configuration and its autotuner's choice) and
    # its own GELU epilogue (bf16 out, no e4m3 scale)
    w_t, a = up.weight_fp8.t(), float(alpha)
    out["quack library gemm, bf16 out (default configuration)"] = lambda: gemm(x8, w_t, out_dtype=torch.bfloat16,
                                                                               tuned=False)
    out["quack library gemm, bf16 out (autotuned)"] = lambda: gemm(x8, w_t, out_dtype=torch.bfloat16, tuned=True)
    for tile in tiles:
        out[f"quack library gemm_act gelu_tanh_approx, bf16 out, no pre-activation ({tile})"] = (
            lambda tile=tile: gemm_act(x8, w_t, bias=up.bias_unscaled.bfloat16(), activation="gelu_tanh_approx",
                                       alpha=a, postact_dtype=torch.bfloat16, store_preact=False, tuned=False,
                                       config=quack_gemm_gelu._config(tile))[1])
    return out


def algorithm_fields(alg) -> dict:
    """What an nvmath ``Algorithm`` (a cuBLASLt algorithm) says of itself, where it says it."""
    out = {}
    for k in ("algorithm_id", "tile", "stages", "split_k", "cta_swizzling", "cluster_shape", "inner_shape"):
        try:
            v = getattr(alg, k)
        except Exception:  # noqa: BLE001 - a field this nvmath or this algorithm lacks
            continue
        out[k] = v if isinstance(v, (int, float, str, type(None))) else str(v)
    return out


# The layer's four GEMMs as the packed FP8 rows run them: (N, K) from (hidden, ffn), the epilogue,
# and whether the output is e4m3 (read by the next FP8 kernel) or fp16 (read by the LayerNorm).
GEMM_EPILOGUES = {
    "qkv": (lambda h, f: (3 * h, h), "BIAS", True),
    "attn_out": (lambda h, f: (h, h), "BIAS", False),
    "ffn_up": (lambda h, f: (f, h), "GELU_BIAS", True),
    "ffn_down": (lambda h, f: (h, f), "BIAS", False),
}


def gemm_candidates(args, hidden, ffn, emit, names=tuple(GEMM_EPILOGUES)) -> None:
    """Every algorithm cuBLASLt offers for each of the layer's GEMMs with the epilogue and output
    type the packed FP8 rows use (nvmath-python), at each ``--candidates`` limit, each planned alone
    and timed in a CUDA graph, beside ``torch._scaled_mm`` on the same operands (cuBLASLt's heuristic
    choice, the path QKV and FFN-down take today): whether any algorithm past the 8 the backend's
    autotuning compares (nvmath's default limit) hides the epilogue or beats the heuristic."""
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    from bertqa_bench.kernels.cublaslt_epilogues import _e4m3_type, _preferences
    import nvmath

    torch.manual_seed(0)
    one = torch.ones((), device="cuda")
    x8 = (torch.randn(args.tokens, max(hidden, ffn), device="cuda") * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
    for name in names:
        dims, epilog, e4m3_out = GEMM_EPILOGUES[name]
        n, k = dims(hidden, ffn)
        a8 = x8[:, :k].contiguous()
        w8 = (torch.randn(n, k, device="cuda") * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
        bias = (torch.randn(n, device="cuda") * 0.1).half()
        scales = {"a": one / 256, "b": one / 256, **({"d": one / 4} if e4m3_out else {})}
        result = _e4m3_type() if e4m3_out else nvmath.CudaDataType.CUDA_R_16F
        base = {"what": "gemm_candidates", "gemm": name, "M": args.tokens, "N": n, "K": k, "epilog": epilog,
                "out": "e4m3" if e4m3_out else "fp16", "tflop": round(2 * args.tokens * n * k / 1e12, 4)}

        def planned(limit=0, algorithms=None, a8=a8, w8=w8, bias=bias, scales=scales, result=result, epilog=epilog):
            mm = Matmul(w8, a8.t(), quantization_scales=scales,
                        options={"result_type": result, "fast_accumulation": True})
            found = mm.plan(preferences=_preferences(limit), algorithms=algorithms,
                            epilog=getattr(MatmulEpilog, epilog), epilog_inputs={"bias": bias})
            return mm, found

        if epilog == "BIAS":  # torch's path on the same operands: the heuristic's first choice
            # as Fp8Linear runs it: an e4m3 output's scale folded into scale_a, its bias in bf16
            b16, out_dtype = (bias.bfloat16(), torch.float8_e4m3fn) if e4m3_out else (bias, torch.float16)
            rec = {**base, "kernel": "torch._scaled_mm (heuristic)"}
            try:
                replay, _ = graphed(lambda: torch._scaled_mm(a8, w8.t(), one / 64, one / 256, bias=b16,
                                                              out_dtype=out_dtype, use_fast_accum=True))
                rec.update(replay_record(replay, args))
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            emit(rec)
        for limit in args.candidates:
            try:
                _, found = planned(limit)
            except Exception as e:  # noqa: BLE001
                emit({**base, "limit": limit, "error": f"{type(e).__name__}: {e}"[:1000]})
                continue
            emit({**base, "limit": limit, "found": len(found)})
            for rank, alg in enumerate(found):
                rec = {**base, "kernel": "nvmath", "limit": limit, "rank": rank, **algorithm_fields(alg)}
                try:
                    mm, _ = planned(algorithms=[alg])

                    def call(mm=mm):
                        d = mm.execute(release_workspace=False, stream=torch.cuda.current_stream())
                        return d[0] if isinstance(d, tuple) else d
                    replay, _ = graphed(call)
                    rec.update(replay_record(replay, args))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"[:500]
                emit(rec)


def ffn_up_candidates(args, hidden, ffn, emit) -> None:
    """``gemm_candidates`` for the FFN-up GEMM alone (its GELU + bias epilogue, e4m3 out)."""
    gemm_candidates(args, hidden, ffn, emit, ("ffn_up",))


def gemms(args, hidden, ffn, emit) -> None:
    """The FP8 GEMMs with a 16-bit output, torch's path against nvmath's, with and without the residual."""
    from bertqa_bench.kernels import cublaslt_epilogues
    from bertqa_bench.backends.transforms.fp8_surgery import fp8_classes
    from bertqa_bench.kernels.fp8_math import static_act_scale

    Fp8Linear = fp8_classes()[0]
    torch.manual_seed(0)
    m = args.tokens
    for name, n, k, residual in (("qkv", 3 * hidden, hidden, False), ("attn_out", hidden, hidden, True),
                                 ("ffn_down", hidden, ffn, True)):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).half()
        b = (torch.randn(n, device="cuda") * 0.1).half()
        x = torch.randn(m, k, device="cuda").half()
        lin = Fp8Linear(w, b, scaling="tensor", act_scale=static_act_scale(float(x.abs().amax())), fast_accum=True)
        x8, sx = lin.quantize_input(x)
        ref = (x8.float() @ lin.weight_fp8.float().t()) * (sx * lin.weight_scale) + b.float()
        r = torch.randn(m, n, device="cuda").half()
        base = {"what": "gemm", "gemm": name, "M": m, "N": n, "K": k, "tflop": round(2 * m * n * k / 1e12, 4)}
        # (call, adds the residual, what decodes its output: 1, or an e4m3 output's scale)
        paths = {"torch._scaled_mm (fast accum)": (lambda: lin(x8), False, 1.0)}
        # the e4m3 output the LayerNorm kernel reads (fp8 dense_output: e4m3), at the scale of
        # its calibrated amax as the surgery sets it
        y_scale = static_act_scale(float(ref.abs().amax()))
        y_inv = torch.tensor(1.0 / y_scale, device="cuda")
        # the backend's own ops (cublaslt_epilogues.py): cuBLASLt planned through nvmath-python, one plan
        # per shape and autotune setting, so the heuristic's and the autotuned plans stand side by side
        for tune in sorted({0, args.autotune}):
            how = f"autotuned x{tune}" if tune else "heuristic"
            paths[f"nvmath BIAS, {how}"] = (
                lambda t=tune: cublaslt_epilogues.gemm_bias_fp8(x8, lin.weight_fp8, b, lin.weight_scale, sx, True, t),
                False, 1.0)
            if residual:
                paths[f"nvmath BIAS + residual (C, beta 1), {how}"] = (
                    lambda t=tune: cublaslt_epilogues.gemm_add_fp8(x8, lin.weight_fp8, b, lin.weight_scale, sx, r, True, t),
                    True, 1.0)
                paths[f"nvmath BIAS, e4m3 out (dense_output: e4m3), {how}"] = (
                    lambda t=tune: cublaslt_epilogues.gemm_bias_e4m3_fp8(x8, lin.weight_fp8, b, lin.weight_scale, sx,
                                                                          y_inv, True, t), False, y_scale)
        for label, (fn, adds_residual, decode) in paths.items():
            rec = {**base, "kernel": label}
            try:
                out = fn()
                want = ref + r.float() if adds_residual else ref
                rec["max_rel_err"] = float(((out.float() * decode - want).abs() / (want.abs() + 1)).max())
                rec.update(timed_eager_and_graphed(fn, out, args))
                rec["pflops_graph"] = round(rec["tflop"] / (rec["graph"]["us_median"] * 1e-6) / 1e3, 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            emit(rec)
        if residual:
            _layernorm_after(args, x.new_empty(m, n).copy_(ref), r, emit, base)


def int8_gemm_paths(x8, w8, sx: float, sw, b) -> dict:
    """The ways an INT8 GEMM with a per-tensor input scale ``sx`` and per-row weight scales ``sw``
    can produce the layer's fp16 output (y = x8 w8^T sx sw + b): cuBLASLt's IMMA GEMM alone (int32
    out, no epilogue), then with the dequantize as Inductor compiles it by default (a pointwise
    kernel after the GEMM) and under max-autotune with ``force_fuse_int_mm_with_mul`` (Inductor's
    Triton int8 template, the dequantize fused into its epilogue where it chooses that template)."""
    import torch._inductor.config as inductor_config

    w8t, scale = w8.t(), (sw * sx).float()

    def dequant(x, w, s, bias):
        return (torch._int_mm(x, w).float() * s + bias).half()

    default = torch.compile(dequant, dynamic=False)
    with inductor_config.patch(force_fuse_int_mm_with_mul=True):
        tuned = torch.compile(dequant, dynamic=False, mode="max-autotune-no-cudagraphs")
        tuned(x8, w8t, scale, b)  # compiled (and autotuned) here, under the patched config
    return {"torch._int_mm (cuBLASLt IMMA, int32 out, no epilogue)": (lambda: torch._int_mm(x8, w8t), False),
            "int8 GEMM + dequantize + bias, Inductor default": (lambda: default(x8, w8t, scale, b), True),
            "int8 GEMM + dequantize + bias, Inductor max-autotune (fused int_mm x mul)": (
                lambda: tuned(x8, w8t, scale, b), True)}


def int8_gemms(args, hidden, ffn, emit) -> None:
    """The layer's four GEMMs in INT8 against the same GEMM in FP8 (today's ``torch._scaled_mm``,
    fp16 out + bias), on the same Gaussian activations: time and, with ``--energy-s``, joules a call.
    Hopper's dense INT8 and FP8 tensor-core peaks are equal; what an INT8 path could save on a
    power-capped card is the energy of its integer products (MLPerf's bert-99 H200 results run INT8)."""
    from bertqa_bench.backends.transforms.fp8_surgery import fp8_classes
    from bertqa_bench.kernels.fp8_math import static_act_scale

    Fp8Linear = fp8_classes()[0]
    torch.manual_seed(0)
    m = args.tokens
    for name, n, k in (("qkv", 3 * hidden, hidden), ("attn_out", hidden, hidden), ("ffn_up", ffn, hidden),
                       ("ffn_down", hidden, ffn)):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).half()
        b = (torch.randn(n, device="cuda") * 0.1).half()
        x = torch.randn(m, k, device="cuda").half()
        ref = x.float() @ w.float().t() + b.float()
        sx = float(x.abs().amax()) / 127.0
        sw = w.float().abs().amax(dim=1) / 127.0
        x8 = (x.float() / sx).round().clamp(-127, 127).to(torch.int8)
        w8 = (w.float() / sw[:, None]).round().clamp(-127, 127).to(torch.int8)
        lin = Fp8Linear(w, b, scaling="tensor", act_scale=static_act_scale(float(x.abs().amax())), fast_accum=True)
        xf8, _ = lin.quantize_input(x)
        base = {"what": "int8_gemm", "gemm": name, "M": m, "N": n, "K": k, "tflop": round(2 * m * n * k / 1e12, 4)}
        paths = {"fp8 torch._scaled_mm (fast accum), fp16 out + bias": (lambda: lin(xf8), True)}
        try:
            paths.update(int8_gemm_paths(x8, w8, sx, sw, b))
        except Exception as e:  # noqa: BLE001
            emit({**base, "kernel": "int8 compiled paths", "error": f"{type(e).__name__}: {e}"[:1500]})
            paths["torch._int_mm (cuBLASLt IMMA, int32 out, no epilogue)"] = (lambda: torch._int_mm(x8, w8.t()), False)
        for label, (fn, dequantized) in paths.items():
            rec = {**base, "kernel": label}
            try:
                out = fn()
                got = out.float() if dequantized else out.float() * (sw * sx) + b.float()
                rec["max_rel_err"] = float(((got - ref).abs() / (ref.abs() + 1)).max())
                rec.update(timed_eager_and_graphed(fn, out, args))
                rec["pflops_graph"] = round(rec["tflop"] / (rec["graph"]["us_median"] * 1e-6) / 1e3, 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            emit(rec)


def _layernorm_after(args, y, r, emit, base) -> None:
    """Residual + LayerNorm + e4m3 quantize (the packed encoder's pass after this GEMM), compiled by
    Inductor, reading the GEMM's output and the residual, against LayerNorm + quantize reading one
    tensor (the residual already added in the GEMM)."""
    from bertqa_bench.kernels.fp8_math import static_act_scale

    ln = torch.nn.LayerNorm(y.shape[1], device="cuda", dtype=torch.float16)
    s = y + r
    inv = 1.0 / static_act_scale(float(s.abs().amax()))

    def ln_quantize(t):
        h = ln(t)
        return h, (h.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)

    two = torch.compile(lambda y, r: ln_quantize(y + r), dynamic=False)
    one = torch.compile(ln_quantize, dynamic=False)
    for label, reads, call in (("residual + LayerNorm + quantize (reads 2 tensors)", 2, lambda: two(y, r)[1]),
                               ("LayerNorm + quantize (reads 1 tensor)", 1, lambda: one(s)[1])):
        # bytes: the fp16 inputs read, the fp16 hidden state and its e4m3 copy written
        rec = {**base, "what": "layernorm", "kernel": label, "floor_MB": y.numel() * (2 * reads + 2 + 1) / 1e6}
        try:
            out = call()
            rec.update(timed_eager_and_graphed(call, out, args))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
        emit(rec)


def add_layernorm(args, hidden, emit) -> None:
    """Residual add + LayerNorm + e4m3 quantize, [tokens, hidden]: Inductor's fused pass (today's
    path) against the suite's Triton kernel (kernels/add_layernorm_fp8.py, fp8 layernorm: triton)
    at every launch shape it may use, on fp16 inputs, and on an e4m3 GEMM output (what a GEMM
    writing e4m3 would hand it) and a bf16 residual; each checked against the torch reference
    (e4m3 codes apart) and set against its bytes floor."""
    from bertqa_bench.kernels import add_layernorm_fp8 as aln
    from bertqa_bench.kernels.fp8_math import e4m3_codes_apart

    torch.manual_seed(0)
    m = args.tokens
    y = torch.randn(m, hidden, device="cuda").half()
    r = (torch.randn(m, hidden, device="cuda") * 2).half()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).half()
    b = (0.1 * torch.randn(hidden, device="cuda")).half()
    inv = 40.0
    base = {"what": "add_layernorm", "M": m, "hidden": hidden}
    ln = torch.nn.LayerNorm(hidden, device="cuda", dtype=torch.float16, eps=1e-12)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    inductor = torch.compile(lambda y, r: (lambda h: (h, (h.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)))(
        ln(y + r)), dynamic=False)
    cases = [("fp16 y, fp16 residual", y, r, {}), ("e4m3 y, fp16 residual", (y.float() / 0.01).clamp(-448, 448).to(
        torch.float8_e4m3fn), r, {"y_scale": 0.01}), ("fp16 y, bf16 residual", y, r.bfloat16(), {})]
    for label, yy, rr, kw in cases:
        floor = m * hidden * (yy.element_size() + 2 * rr.element_size() + 1)
        ref_x, ref8 = aln.add_layernorm_fp8_reference(yy, rr, w, b, 1e-12, x8_inv_scale=inv, **kw)
        paths = {}
        if not kw and rr.dtype == torch.float16:
            paths["Inductor (LayerNorm + quantize, fused)"] = lambda: inductor(yy, rr)
        for rows in aln.ROW_CHOICES:
            for warps in aln.WARP_CHOICES:
                x, x8 = torch.empty_like(rr), torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device="cuda")

                def call(rows=rows, warps=warps, x=x, x8=x8):
                    aln.launch(yy, rr, w, b, x, x8, 1e-12, x8_inv_scale=inv, rows=rows, warps=warps, **kw)
                    return x, x8
                tag = " (default)" if (rows, warps) == aln.default_config(hidden) else ""
                paths[f"Triton, {rows} row(s) x {warps} warps{tag}"] = call
        for kernel, fn in paths.items():
            rec = {**base, "inputs": label, "kernel": kernel, "floor_MB": round(floor / 1e6, 1)}
            try:
                out_x, out8 = fn()
                apart = e4m3_codes_apart(out8, ref8)
                rec["e4m3_codes_apart_max"] = int(apart.max())
                rec["e4m3_codes_equal_pct"] = round(100 * float((apart == 0).float().mean()), 3)
                rec["x_max_abs_err"] = float((out_x.float() - ref_x.float()).abs().max())
                rec.update(timed_eager_and_graphed(lambda: fn()[1], out8, args))
                us = rec["graph"]["us_median"]
                rec["TB_s"] = round(floor / (us * 1e-6) / 1e12, 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            emit(rec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bert-large")
    p.add_argument("--tokens", type=int, default=32768, help="packed tokens per batch (default 32768)")
    p.add_argument("--seq-min", type=int, default=100)
    p.add_argument("--seq-max", type=int, default=384)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", choices=("attention", "ffn_up", "gemms", "layernorm", "int8", "ffn_up_candidates", "gemm_candidates"),
                   default=None)
    p.add_argument("--candidates", default=[8, 64], metavar="N,N",
                   type=lambda v: [int(k) for k in v.split(",") if k],
                   help="with --only ffn_up_candidates or gemm_candidates: the algorithm limits asked of cuBLASLt (default 8,64)")
    p.add_argument("--quack-tiles", default=QUACK_TILES, metavar="T,T",
                   type=lambda v: [k for k in v.split(",") if k],
                   help="with ffn_up: the quack GEMM + GELU kernel's configurations to time (KIND-MxN-cAxB; "
                        "empty: none)")
    p.add_argument("--autotune", type=int, default=5, help="also time the epilogue autotuned (iterations; 0: not)")
    p.add_argument("--out", default="-", help="JSON lines file (default stdout)")
    p.add_argument("--energy-s", type=float, default=0.0, metavar="S",
                   help="also replay each graph ~S seconds between two reads of NVML's energy counter: joules a "
                        "call, average power, sustained time a call (0: not; 1-2 s gives ~1 %% resolution)")
    p.add_argument("--from-run", default=None, metavar="RUN_DIR",
                   help="attention on the sequence lengths of this bench run's packed plan instead of random ones")
    p.add_argument("--backend", default=None, help="with --from-run: whose plan (default: the run's first packed row)")
    p.add_argument("--evalset", default=None, metavar="DIR",
                   help="with --from-run: the cached evaluation set, where it is not where the run's job says")
    p.add_argument("--plan-batches", type=int, default=8,
                   help="with --from-run: how many of the plan's batches to time, spread over it (0: all)")
    p.add_argument("--kernels", default=None, type=lambda v: [k for k in v.split(",") if k],
                   help=f"attention kernels to time, comma-separated (default all: {','.join(ATTENTION_KERNELS)}; "
                        "with --from-run all but flex)")
    p.add_argument("--tiles", action="store_true",
                   help="also time every tile the Triton kernel's autotuner chooses among (e4m3 output) on each "
                        "batch; with --from-run, a record comparing the tuned tile with each batch's best")
    args = p.parse_args(argv)
    unknown = sorted(set(args.kernels or ()) - set(ATTENTION_KERNELS))
    if unknown:
        p.error(f"unknown --kernels {','.join(unknown)}; valid: {','.join(ATTENTION_KERNELS)}")
    if not args.candidates or min(args.candidates) < 1:
        p.error(f"--candidates are how many algorithms to ask cuBLASLt for, each >= 1, not {args.candidates}")
    try:
        from bertqa_bench.kernels.quack_gemm_gelu import parse_tile

        for tile in args.quack_tiles:
            parse_tile(tile)
    except ValueError as e:
        p.error(f"--quack-tiles: {e}")
    if args.energy_s < 0:
        p.error(f"--energy-s is seconds of replays a kernel (0: none), not {args.energy_s:g}")
    if args.tiles and args.only not in (None, "attention"):
        p.error(f"--tiles times the attention kernel's tiles: not with --only {args.only}")
    if args.tiles and args.kernels and "triton-e4m3" not in args.kernels:
        p.error("--tiles compares each tile with triton-e4m3's tuned one: add triton-e4m3 to --kernels")
    # the run's plan and evaluation set are read first: a wrong path fails before any GPU work
    plan_batches = plan_lengths(args.from_run, args.backend, args.evalset) if args.from_run else None
    if plan_batches is not None and args.kernels is None:
        # FlexAttention compiles for each batch's token count, past torch.compile's recompile
        # limit over a plan's batches: on a plan it runs only when named
        args.kernels = [k for k in ATTENTION_KERNELS if k != "flex"]
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device", file=sys.stderr)
        return 2
    hidden, heads, ffn = SHAPES[args.shape]
    sink = sys.stdout if args.out == "-" else open(args.out, "w")
    dev = {"what": "device", "name": torch.cuda.get_device_name(), "torch": torch.__version__,
           "capability": list(torch.cuda.get_device_capability()), "shape": args.shape}
    try:
        import cudnn

        dev["cudnn_frontend"] = cudnn.__version__
        dev["cudnn_backend"] = cudnn.backend_version()
    except Exception as e:  # noqa: BLE001
        dev["cudnn_frontend_error"] = f"{type(e).__name__}: {e}"[:500]

    def emit(rec):
        print(json.dumps(rec), file=sink, flush=True)
        if sink is not sys.stdout:
            print(json.dumps(rec)[:600], flush=True)

    emit(dev)
    if args.only in (None, "attention"):
        if plan_batches is not None:
            attention_over_plan(args, plan_batches, hidden, heads, emit)
        else:
            attention(args, hidden, heads, emit)
            qkv_gemm_outputs(args, hidden, emit)
    if args.only in (None, "ffn_up"):
        try:
            epilogue_support(emit)
        except Exception as e:  # noqa: BLE001
            emit({"what": "epilogue_support", "error": f"{type(e).__name__}: {e}"[:500]})
        ffn_up(args, hidden, ffn, emit)
    if args.only in (None, "gemms"):
        gemms(args, hidden, ffn, emit)
    if args.only in (None, "layernorm"):
        add_layernorm(args, hidden, emit)
    if args.only in (None, "int8"):
        int8_gemms(args, hidden, ffn, emit)
    if args.only == "ffn_up_candidates":  # every algorithm timed alone: only when asked
        ffn_up_candidates(args, hidden, ffn, emit)
    if args.only == "gemm_candidates":
        gemm_candidates(args, hidden, ffn, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
