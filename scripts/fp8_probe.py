"""Device probe for the FP8 backend: GEMM micro-benchmarks, then BERT-base QA (random weights)
through the registry backends at batch 32 x seq 384, timed like the runner (predict() per batch,
host arrays in, host logits out), with accuracy against eager fp32 on CUDA (TF32 off).

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python scripts/fp8_probe.py [--variants a,b,...] [--budget-s 240]

Prints a compact table at the end; JSON lines and compile logs go to $OUT (or ./fp8-probe-out).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

T_START = time.perf_counter()
OUT = Path(os.environ.get("OUT") or "fp8-probe-out")
OUT.mkdir(parents=True, exist_ok=True)
B, S = 32, 384
N_TIMED = 340
NAMES = ("start_logits", "end_logits")

# name -> (registry name, overrides)
VARIANTS = {
    "fp16-cudagraphs": ("torch-compile-fp16-cudagraphs", {}),
    "fp8": ("torch-compile-fp8", {}),
    "fp8-all": ("torch-compile-fp8-all", {}),
    "fp8-trees": ("torch-compile-fp8", {"cuda_graph": "trees"}),
    "fp16-manualgraph": ("torch-compile-fp8", {"scaling": "none"}),
    "fp8-ffn-only": ("torch-compile-fp8", {"fp8_gemms": "ffn_in,ffn_out"}),
    "fp8-noacc": ("torch-compile-fp8", {"fast_accum": False}),
    "fp8-rowwise": ("torch-compile-fp8-rowwise", {}),
    "fp8-static-rowwise": ("torch-compile-fp8", {"scaling": "static-rowwise"}),
    "fp8-autotune": ("torch-compile-fp8", {"mode": "max-autotune"}),
    "fp8-all-autotune": ("torch-compile-fp8-all", {"mode": "max-autotune"}),
    "fp8-cdt": ("torch-compile-fp8", {"inductor_config": {"coordinate_descent_tuning": True}}),
    "fp16-manualgraph-cdt": ("torch-compile-fp8", {"scaling": "none",
                                                   "inductor_config": {"coordinate_descent_tuning": True}}),
    "fp16-cudagraphs-cudnn": ("torch-compile-fp16-cudagraphs", {"sdpa_backend": "cudnn"}),
}


def elapsed() -> float:
    return time.perf_counter() - T_START


def log_json(rec: dict) -> None:
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


@contextlib.contextmanager
def quiet(path: Path):
    """Send fd 1/2 (compile warnings, autotune tables) to a file for the duration."""
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1); os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])


def make_batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(1000, 30000, (B, S)).astype(np.int64)
        mask = np.ones((B, S), np.int64)
        types = np.zeros((B, S), np.int64)
        types[:, 20:] = 1
        ids[:, 0] = 101
        for r in rng.choice(B, B // 2, replace=False):
            L = int(rng.integers(min(150, S // 2), S + 1))
            mask[r, L:] = 0
            ids[r, L:] = 0
            types[r, L:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
    return out


# --------------------------------------------------------------------------- GEMM micro-benchmark

def gemm_bench() -> list[str]:
    import torch
    import torch.nn.functional as F

    lines = []
    M = B * S
    shapes = [("qkv", 768, 2304), ("attn_out", 768, 768), ("ffn_in", 768, 3072), ("ffn_out", 3072, 768)]
    f8 = torch.float8_e4m3fn

    def bench(fn, iters=40):
        for _ in range(5):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record(); fn(); b.record()
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) for a, b in ev]))

    totals: dict[str, float] = {}
    lines.append(f"GEMM M={M}: ms (TFLOP/s) [rel.err vs fp32]")
    for tag, K, N in shapes:
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda")
        w = torch.randn(N, K, device="cuda") * 0.05
        bias = torch.randn(N, device="cuda") * 0.1
        ref = x @ w.t() + bias
        xh, wh, bh = x.half(), w.half(), bias.half()
        xs = x.abs().amax() / 448
        ws = w.abs().amax() / 448
        xq = (x / xs).clamp(-448, 448).to(f8)
        wq = (w / ws).clamp(-448, 448).to(f8)
        xrs = x.abs().amax(1, keepdim=True) / 448
        wrs = w.abs().amax(1, keepdim=True) / 448
        xrq = (x / xrs).clamp(-448, 448).to(f8)
        wrq = (w / wrs).clamp(-448, 448).to(f8)
        cfgs = {
            "fp16": lambda: F.linear(xh, wh, bh),
            "fp8-t": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bh, out_dtype=torch.float16),
            "fp8-t-fa": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bh, out_dtype=torch.float16,
                                                 use_fast_accum=True),
            "fp8-r": lambda: torch._scaled_mm(xrq, wrq.t(), scale_a=xrs, scale_b=wrs.t().contiguous(),
                                              bias=bias.bfloat16(), out_dtype=torch.bfloat16),
            "fp8-r-fa": lambda: torch._scaled_mm(xrq, wrq.t(), scale_a=xrs, scale_b=wrs.t().contiguous(),
                                                 bias=bias.bfloat16(), out_dtype=torch.bfloat16, use_fast_accum=True),
        }
        parts = []
        for name, fn in cfgs.items():
            try:
                y = fn().float()
                err = float((y - ref).norm() / ref.norm())
                ms = bench(fn)
                totals[name] = totals.get(name, 0.0) + ms
                parts.append(f"{name} {ms:.3f} ({2 * M * K * N / ms / 1e9:.0f}) [{err:.1e}]")
            except Exception as e:  # noqa: BLE001
                parts.append(f"{name} ERR {type(e).__name__}: {str(e)[:80]}")
        lines.append(f"  {tag:8s} K={K:4d} N={N:4d}: " + "; ".join(parts))
    lines.append("  per-batch GEMM time x12 layers: " + ", ".join(f"{k} {v * 12:.2f} ms" for k, v in totals.items()))
    return lines


# --------------------------------------------------------------------------- accuracy

def accuracy(outs: list[dict], refs: list[dict], batches: list[dict]) -> dict:
    maxd, num, den, agree_s, agree_e, agree_both, rows = 0.0, 0.0, 0.0, 0, 0, 0, 0
    for o, r, b in zip(outs, refs, batches):
        valid = b["attention_mask"].astype(bool)
        am = {}
        for n in NAMES:
            d = o[n] - r[n]
            maxd = max(maxd, float(np.abs(d[valid]).max()))
            num += float((d[valid] ** 2).sum()); den += float((r[n][valid] ** 2).sum())
            am[n] = (np.where(valid, o[n], -np.inf).argmax(1) == np.where(valid, r[n], -np.inf).argmax(1))
        agree_s += int(am["start_logits"].sum()); agree_e += int(am["end_logits"].sum())
        agree_both += int((am["start_logits"] & am["end_logits"]).sum()); rows += len(valid)
    return {"max_abs_diff": maxd, "rel_l2": (num / den) ** 0.5, "argmax_start": agree_s / rows,
            "argmax_end": agree_e / rows, "argmax_both": agree_both / rows}


# --------------------------------------------------------------------------- kernel profile

def kernel_profile(backend, batch, n=5) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        backend.predict(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            backend.predict(batch)
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    top = []
    for evt in prof.key_averages():
        t = float(getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0) or 0.0) / n / 1e3
        if t <= 0:
            continue
        k = evt.key.lower()
        if any(s in k for s in ("fmha", "attention", "flash", "attn")):
            c = "attention"
        elif any(s in k for s in ("gemm", "xmma", "cutlass", "nvjet", "f8f8", "scaled_mm", "gmma", "matmul", "sm90")):
            c = "gemm"
        elif "triton" in k:
            c = "triton-fused"
        elif "memcpy" in k or "memset" in k:
            c = "memcpy"
        else:
            c = "other"
        cats[c] = cats.get(c, 0.0) + t
        top.append((t, c, evt.key[:90]))
    top.sort(reverse=True)
    lines = ["  ms/batch by class: " + ", ".join(f"{c} {v:.3f}" for c, v in sorted(cats.items(), key=lambda x: -x[1]))
             + f" | sum {sum(cats.values()):.3f}"]
    lines += [f"    {t:.3f} {c:12s} {k}" for t, c, k in top[:8]]
    return lines


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="fp16-cudagraphs,fp8,fp16-manualgraph,fp8-all,fp8-trees,fp8-rowwise")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no new variant after this")
    ap.add_argument("--variant-cost-s", type=float, default=30.0)
    ap.add_argument("--detail", default="fp16-cudagraphs,fp8",
                    help="variants whose top kernels are printed")
    ap.add_argument("--profile", default="",
                    help="variants to profile (kernel classes), compiled without CUDA graphs")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--n-acc", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run on a tiny model (checks the script itself)")
    args = ap.parse_args()
    global B, S, N_TIMED
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        B, S, N_TIMED = 4, 64, 6
        args.no_gemm, args.profile = True, ""

    import torch
    import transformers

    torch._dynamo.config.cache_size_limit = 64
    sync = (lambda: None) if args.smoke else torch.cuda.synchronize
    from bertqa_bench import backends as reg
    from bertqa_bench.backends.base import BackendContext
    from bertqa_bench.modeling import build_model

    if args.smoke:
        head = [f"torch {torch.__version__} transformers {transformers.__version__} CPU smoke run"]
    else:
        p = torch.cuda.get_device_properties(0)
        head = [f"torch {torch.__version__} transformers {transformers.__version__} GPU {p.name} "
                f"sm_{p.major}{p.minor} SMs {p.multi_processor_count}"]
    print(head[0], flush=True)
    gemm_lines = [] if args.no_gemm else gemm_bench()
    print("\n".join(gemm_lines), flush=True)

    tmp = Path(tempfile.mkdtemp())
    model_dir = tmp / "bert-base-random"
    with quiet(OUT / "compile.log"):
        over = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) \
            if args.smoke else None
        m = build_model("squad", "benchmarks/assets/bert-base-uncased-shape", random_init=True, config_overrides=over)
        m.save_pretrained(model_dir)
    del m
    batches = make_batches(args.n_acc)

    def ctx_for(name):
        return BackendContext(model_dir=model_dir, artifacts_dir=tmp / "art" / name, output_names=NAMES,
                              sample_batch=batches[0], max_batch_size=B, max_seq_len=S, device=dev, options={})

    ref_b = reg.create("eager-fp32-cuda", **({"device": "cpu"} if args.smoke else {}))
    with quiet(OUT / "compile.log"):
        ref_b.prepare(ctx_for("eager-fp32-cuda"))
    refs = [ref_b.predict(b) for b in batches]
    ref_b.close()
    print(f"[{elapsed():.0f}s] fp32 reference done", flush=True)

    rows = []
    wanted = [v for v in args.variants.split(",") if v]
    for v in wanted:
        if elapsed() + args.variant_cost_s > args.budget_s:
            rows.append({"variant": v, "status": "skipped (time budget)"})
            continue
        reg_name, over = VARIANTS[v]
        rec = {"variant": v, "backend": reg_name, "options": over}
        backend = None
        try:
            over = dict(over)
            guard = contextlib.nullcontext()
            if "sdpa_backend" in over and "fp8" not in reg_name:  # fp16 backends take no such option
                from torch.nn.attention import SDPBackend, sdpa_kernel

                guard = sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION}[over.pop("sdpa_backend")]])
            backend = reg.create(reg_name, **{**over, **({"device": "cpu", "mode": "default"} if args.smoke else {})})
            t0 = time.perf_counter()
            with quiet(OUT / "compile.log"), guard:
                backend.prepare(ctx_for(reg_name))
            rec["prepare_s"] = time.perf_counter() - t0
            for b in batches[:5]:
                backend.predict(b)
            outs = [backend.predict(b) for b in batches]
            rec.update(accuracy(outs, refs, batches))
            sync()
            t0 = time.perf_counter()
            for i in range(N_TIMED):
                backend.predict(batches[i % len(batches)])
            sync()
            dt = time.perf_counter() - t0
            rec.update(features_per_s=N_TIMED * B / dt, ms_per_batch=dt / N_TIMED * 1e3, status="ok")
            # Repeat to see the spread.
            t0 = time.perf_counter()
            for i in range(N_TIMED):
                backend.predict(batches[i % len(batches)])
            sync()
            rec["features_per_s_rep"] = N_TIMED * B / (time.perf_counter() - t0)
            if not args.smoke:
                rec["profile"] = kernel_profile(backend, batches[1])
            info = backend.prepare_info
            rec["info"] = {k: info.get(k) for k in info if k.startswith(("fp8", "calib", "act_", "compile"))}
        except Exception as e:  # noqa: BLE001
            rec["status"] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
            with open(OUT / "errors.log", "a") as f:
                f.write(f"=== {v}\n{traceback.format_exc()}\n")
        finally:
            if backend is not None:
                try:
                    backend.close()
                except Exception:  # noqa: BLE001
                    pass
            torch._dynamo.reset()
            if not args.smoke:
                torch.cuda.empty_cache()
        rows.append(rec)
        log_json(rec)
        print(f"[{elapsed():.0f}s] {v}: {rec.get('status')} {rec.get('features_per_s', 0):.0f}/s "
              f"prep {rec.get('prepare_s', 0):.0f}s maxd {rec.get('max_abs_diff', float('nan')):.2e} "
              f"relL2 {rec.get('rel_l2', float('nan')):.2e} am_both {rec.get('argmax_both', float('nan')):.3f}",
              flush=True)
        for line in (rec.get("profile") or [])[:1]:
            print(line, flush=True)

    prof_lines = []
    for v in [v for v in args.profile.split(",") if v]:
        if elapsed() + args.variant_cost_s > args.budget_s + 20:
            prof_lines.append(f"profile {v}: skipped (time budget)")
            continue
        reg_name, over = VARIANTS[v]
        backend = None
        try:
            backend = reg.create(reg_name, **{**over, "mode": "default"})
            with quiet(OUT / "compile.log"):
                backend.prepare(ctx_for(reg_name))
            prof_lines.append(f"profile {v} (compiled, no CUDA graphs):")
            prof_lines += kernel_profile(backend, batches[1])
        except Exception as e:  # noqa: BLE001
            prof_lines.append(f"profile {v}: FAILED {type(e).__name__}: {str(e)[:200]}")
        finally:
            if backend is not None:
                backend.close()
            torch._dynamo.reset()

    detail = [v for v in args.detail.split(",") if v]
    for r in rows:
        if r.get("profile"):
            prof_lines.append(f"kernels {r['variant']} (CUDA graphs, per batch):")
            prof_lines += r["profile"] if r["variant"] in detail else r["profile"][:1]
    print("\n".join(["", "=" * 100] + head + gemm_lines + prof_lines), flush=True)
    print(f"\nBERT-base random QA, B={B} S={S}, {N_TIMED} batches timed (predict(): host in, host logits out); "
          "accuracy vs eager fp32 CUDA (TF32 off) on", len(batches), "batches, valid positions only")
    print(f"{'variant':34s} {'feat/s':>7s} {'rep':>7s} {'ms/b':>6s} {'prep_s':>6s} {'max|d|':>8s} {'relL2':>8s} "
          f"{'am_s':>6s} {'am_e':>6s} {'am_both':>7s}")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['variant']:34s} {r.get('status')}")
            continue
        print(f"{r['variant']:34s} {r['features_per_s']:7.0f} {r['features_per_s_rep']:7.0f} {r['ms_per_batch']:6.2f} "
              f"{r['prepare_s']:6.1f} {r['max_abs_diff']:8.2e} {r['rel_l2']:8.2e} {r['argmax_start']:6.3f} "
              f"{r['argmax_end']:6.3f} {r['argmax_both']:7.3f}")
    print(f"total {elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
