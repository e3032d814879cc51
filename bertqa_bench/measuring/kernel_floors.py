"""Each encoder kernel of a profiled packed pass beside its floor: the time its matrix FLOPs take
at the tensor cores' dense peak (scaled to the clock the card ran at), or the time its bytes take
at HBM bandwidth, whichever is longer. This is the table issue 61 asks of the H200 reference ("the
per-kernel profile against each kernel's floor"), made from a ``bertqa-bench profile`` trace
instead of by hand.

A kernel's role in the layer (QKV, attention, attention output, LayerNorm, FFN-up, FFN-down) is
read from its name where the name says it (attention, LayerNorm, a GEMM with a GELU epilogue),
and for the other GEMMs from the kernel before it on its CUDA stream: after attention comes the
attention-output GEMM, after FFN-up the FFN-down GEMM, and any other GEMM is the next layer's
QKV. cuBLASLt's kernel names (``nvjet_sm90_qqhsh_256x128_...``) tell tiles and types, not which
product they compute, and the same kernel serves two roles at some shapes. Attention's floor
also counts its softmax: one exp2 a score on the special-function units, which at head dim 64
takes longer than its bytes or its products.

Floors count one read of each input and one write of each output (the weights once a call), in
the byte widths of the row's precision: e4m3 activations for FP8 rows, with a 16-bit residual
stream (the LayerNorm reads the GEMM's output and the residual and writes both the residual and
its e4m3 copy). Pure functions of their arguments; the peaks are the card's published dense
figures (no sparsity).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

ROLES = ("qkv", "attention", "attn_out", "layernorm", "ffn_up", "ffn_down")
ATTENTION = re.compile(r"attention|attn_fwd|fmha|flash", re.I)
NORM = re.compile(r"layer_?norm", re.I)
GEMM = re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|_mm_|scaled_mm", re.I)
GELU = re.compile(r"gelu", re.I)


@dataclass(frozen=True)
class Peak:
    """A card's dense peaks at its boost clock (TFLOP/s; TB/s of HBM), its SMs and their
    special-function units' exp2 results a clock each."""
    name: str
    boost_mhz: float
    fp8_tflops: float
    fp16_tflops: float
    hbm_tb_s: float
    sms: int
    exp2_per_clk_sm: float


# NVIDIA H200 SXM (datasheet): FP8 1,979 and FP16/BF16 989.5 dense TFLOP/s at 1,980 MHz, 4.8 TB/s,
# 132 SMs; exp2 16 results a clock an SM at compute capability 9.0 (CUDA C++ Programming Guide,
# arithmetic instruction throughput). Attention's softmax takes one exp2 a score: at head dim 64
# that unit, not HBM or the tensor cores, sets its floor (a BERT-large layer's ~115 M scores at
# 32k tokens: ~32 us at 1,688 MHz, against ~28 us for its e4m3 bytes)
PEAKS = {"NVIDIA H200": Peak("NVIDIA H200", 1980.0, 1979.0, 989.5, 4.8, 132, 16.0)}


def role_of(name: str, prev: Optional[str], next_name: str = "") -> str:
    """The layer role of the kernel ``name``, given the role of the kernel before it on its stream
    (None at a stream's start) and the next kernel's name; ``other`` for everything else."""
    if ATTENTION.search(name):
        return "attention"
    if NORM.search(name):
        return "layernorm"
    if not GEMM.search(name):
        return "other"
    if GELU.search(name) or GELU.search(next_name):  # the GELU epilogue, or an unfused GELU after
        return "ffn_up"
    return {"attention": "attn_out", "ffn_up": "ffn_down"}.get(prev or "", "qkv")


def role_times(kernels: Iterable[Mapping]) -> dict[str, dict]:
    """Total device µs and calls per role, from trace kernel events (``name``, ``ts``, ``dur`` and
    a ``stream``), each stream read in time order."""
    by_stream: dict = {}
    for k in kernels:
        by_stream.setdefault(k.get("stream"), []).append(k)
    out = {r: {"calls": 0, "us": 0.0} for r in (*ROLES, "other")}
    for ks in by_stream.values():
        ks = sorted(ks, key=lambda k: float(k["ts"]))
        prev = None
        for i, k in enumerate(ks):
            role = role_of(k["name"], prev, ks[i + 1]["name"] if i + 1 < len(ks) else "")
            out[role]["calls"] += 1
            out[role]["us"] += float(k.get("dur", 0.0))
            if role != "other":  # copies and small kernels between two roles do not hide the order
                prev = role
    return out


def trace_kernels(events: Iterable[Mapping]) -> list[dict]:
    """The GPU kernels of a Chrome trace's events, as ``role_times`` takes them."""
    return [{"name": e.get("name", "?"), "ts": e["ts"], "dur": e.get("dur", 0.0),
             "stream": (e.get("args") or {}).get("stream", e.get("tid"))}
            for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def role_floors(hidden: int, intermediate: int, layers: int, tokens: float, sum_sq_len: float, *, peak: Peak,
                clock_mhz: float, precision: str = "fp8", pv16: bool = True, heads: int = 0) -> dict[str, dict]:
    """Per role over the pass: matrix FLOPs, bytes, and the floor (s) = max(FLOPs at the dense
    peak scaled to ``clock_mhz``, bytes at HBM bandwidth, and for attention one exp2 a score on
    the special-function units). ``tokens``: tokens computed over the pass; ``sum_sq_len``: the sum
    of every sequence's length squared (attention's scores a head); ``heads`` (0: hidden / 64)."""
    if precision not in ("fp8", "fp16"):
        raise ValueError(f"precision must be fp8 or fp16, got {precision!r}")
    h, f, t, n = float(hidden), float(intermediate), float(tokens), float(layers)
    a = 1.0 if precision == "fp8" else 2.0  # activation and weight bytes an element
    scale = clock_mhz / peak.boost_mhz
    mm = (peak.fp8_tflops if precision == "fp8" else peak.fp16_tflops) * 1e12 * scale
    fp16 = peak.fp16_tflops * 1e12 * scale
    qk, pv = 2.0 * sum_sq_len * h, 2.0 * sum_sq_len * h  # QK^T and P V, summed over heads
    spec = {  # role: (FLOPs, FLOP time, bytes) for one layer over the pass
        "qkv": (2 * t * h * 3 * h, None, a * (t * h + 3 * h * h + 3 * t * h)),
        "attention": (qk + pv, qk / mm + pv / (fp16 if pv16 and precision == "fp8" else mm), a * 4 * t * h),
        "attn_out": (2 * t * h * h, None, a * (2 * t * h + h * h)),
        "layernorm": (0.0, 0.0, (a + 2 + 2 + a) * t * h * 2),  # two a layer
        "ffn_up": (2 * t * h * f, None, a * (t * h + f * h + t * f)),
        "ffn_down": (2 * t * f * h, None, a * (t * f + f * h + t * h)),
    }
    scores = sum_sq_len * float(heads or hidden // 64)
    exp_s = scores / (peak.exp2_per_clk_sm * peak.sms * clock_mhz * 1e6)
    out = {}
    for role, (flops, flop_s, nbytes) in spec.items():
        flop_s = flops / mm if flop_s is None else flop_s
        bounds = {"FLOPs": flop_s, "bytes": nbytes / (peak.hbm_tb_s * 1e12), "exp2": exp_s if role == "attention" else 0.0}
        bound = max(bounds, key=bounds.get)
        out[role] = {"flops": n * flops, "bytes": n * nbytes, "flop_floor_s": n * flop_s,
                     "byte_floor_s": n * bounds["bytes"], "exp2_floor_s": n * bounds["exp2"],
                     "floor_s": n * bounds[bound], "bound": bound}
    return out


def floors_table(times: Mapping[str, Mapping], floors: Mapping[str, Mapping]) -> list[dict]:
    """One row per role: measured ms over the pass, its calls, the floor (ms, and which bound) and
    measured / floor; then the kernels of no role."""
    rows = []
    for role in ROLES:
        m, fl = times.get(role, {"calls": 0, "us": 0.0}), floors[role]
        ms = m["us"] / 1e3
        rows.append({"role": role, "calls": m["calls"], "measured_ms": round(ms, 2),
                     "us_per_call": round(m["us"] / m["calls"], 1) if m["calls"] else None,
                     "floor_ms": round(fl["floor_s"] * 1e3, 2), "bound": fl["bound"],
                     "x_floor": round(ms / (fl["floor_s"] * 1e3), 2) if fl["floor_s"] and m["calls"] else None})
    other = times.get("other", {"calls": 0, "us": 0.0})
    rows.append({"role": "other", "calls": other["calls"], "measured_ms": round(other["us"] / 1e3, 2),
                 "us_per_call": None, "floor_ms": None, "bound": "", "x_floor": None})
    return rows
