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
the byte widths the row's recipe gives each tensor (``Recipe``, from its FP8 options: which GEMMs
run in FP8, what attention reads and writes, whether the dense GEMMs write e4m3), with a 16-bit
residual stream. A 16-bit input to an FP8 GEMM counts as 16-bit bytes, not the quantize pass it
takes. Pure functions of their arguments; the peaks are the card's published dense figures (no
sparsity).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

ROLES = ("qkv", "attention", "attn_out", "layernorm", "ffn_up", "ffn_down")
GEMM_ROLES = ("qkv", "attn_out", "ffn_up", "ffn_down")
ATTENTION = re.compile(r"attention|attn_fwd|fmha|flash", re.I)
NORM = re.compile(r"layer_?norm", re.I)
GEMM = re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|_mm_|scaled_mm", re.I)
GELU = re.compile(r"gelu", re.I)


@dataclass(frozen=True)
class Recipe:
    """What a row's kernels read and write: the GEMM roles on FP8 tensor cores (their inputs and
    weights in e4m3; the others in 16 bits), and the bytes an element of each tensor between
    kernels. The default is the packed e4m3-dense row (every GEMM in FP8, e4m3 Q, K, V into
    attention, P V in fp16, e4m3 out of every kernel but the 16-bit residual)."""
    fp8_gemms: frozenset = frozenset(GEMM_ROLES)
    qkv_out: int = 1  # Q, K, V as attention reads them
    qk_fp8: bool = True  # Q K^T on FP8 tensor cores
    pv_fp8: bool = False  # P V on FP8 tensor cores (else fp16)
    attention_out: int = 1
    dense_out: int = 1  # the attention-output and FFN-down GEMMs' outputs, read by the LayerNorm
    ffn_hidden: int = 1  # the FFN-up GEMM's (GELU's) output

    def describe(self) -> str:
        gemms = ", ".join(g for g in GEMM_ROLES if g in self.fp8_gemms) or "none"
        return (f"FP8 GEMMs: {gemms}; Q K^T {'e4m3' if self.qk_fp8 else 'fp16'}, P V {'e4m3' if self.pv_fp8 else 'fp16'}; "
                f"bytes an element: Q K V {self.qkv_out}, attention out {self.attention_out}, dense GEMMs out "
                f"{self.dense_out}, FFN hidden {self.ffn_hidden}, residual 2")


FP16 = Recipe(frozenset(), 2, False, False, 2, 2, 2)


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


def name_class(name: str) -> str:
    """attention, layernorm, gemm, gelu (an elementwise GELU of its own) or other, by name alone."""
    if ATTENTION.search(name):
        return "attention"
    if NORM.search(name):
        return "layernorm"
    if GEMM.search(name):
        return "gemm"
    return "gelu" if GELU.search(name) else "other"


def role_of(name: str, prev: Optional[str], next_class: str = "") -> str:
    """The layer role of the kernel ``name``, given the role of the last kernel with a role before
    it on its stream (None at a stream's start; an elementwise GELU counts as ``gelu``) and the
    class of the next kernel that is not ``other`` (``name_class``); ``other`` for everything
    else: the embeddings and their LayerNorm, the QA head's GEMM, copies, quantize passes."""
    cls = name_class(name)
    if cls == "attention":
        return "attention"
    if cls == "layernorm":  # after a layer's dense GEMM; the embeddings' LayerNorm is not one
        return "layernorm" if prev in ("attn_out", "ffn_down") else "other"
    if cls != "gemm":
        return "other"
    if GELU.search(name) or next_class == "gelu":  # the GELU epilogue, or an unfused GELU after
        return "ffn_up"
    if prev == "attention":
        return "attn_out"
    if prev in ("ffn_up", "gelu"):
        return "ffn_down"
    return "qkv" if next_class == "attention" else "other"  # a GEMM before no attention: the QA head


def role_times(kernels: Iterable[Mapping]) -> dict[str, dict]:
    """Total device µs and calls per role, from trace kernel events (``name``, ``ts``, ``dur`` and
    a ``stream``), each stream read in time order."""
    by_stream: dict = {}
    for k in kernels:
        by_stream.setdefault(k.get("stream"), []).append(k)
    out = {r: {"calls": 0, "us": 0.0} for r in (*ROLES, "other")}
    for ks in by_stream.values():
        ks = sorted(ks, key=lambda k: float(k["ts"]))
        classes = [name_class(k["name"]) for k in ks]
        nxt, following = [""] * len(ks), ""
        for i in range(len(ks) - 1, -1, -1):  # the next kernel's class that is not other
            nxt[i] = following
            if classes[i] != "other":
                following = classes[i]
        prev = None
        for i, k in enumerate(ks):
            role = role_of(k["name"], prev, nxt[i])
            out[role]["calls"] += 1
            out[role]["us"] += float(k.get("dur", 0.0))
            if role != "other":  # copies and small kernels between two roles do not hide the order
                prev = role
            elif classes[i] == "gelu":
                prev = "gelu"
    return out


def trace_kernels(events: Iterable[Mapping]) -> list[dict]:
    """The GPU kernels of a Chrome trace's events, as ``role_times`` takes them."""
    return [{"name": e.get("name", "?"), "ts": e["ts"], "dur": e.get("dur", 0.0),
             "stream": (e.get("args") or {}).get("stream", e.get("tid"))}
            for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def role_floors(hidden: int, intermediate: int, layers: int, tokens: float, sum_sq_len: float, *, peak: Peak,
                clock_mhz: float, recipe: Recipe = Recipe(), heads: int = 0,
                attention_tokens: Optional[float] = None) -> dict[str, dict]:
    """Per role over the pass: matrix FLOPs, bytes, and the floor (s) = max(FLOPs at the dense
    peak of their precision scaled to ``clock_mhz``, bytes at HBM bandwidth, and for attention one
    exp2 a score on the special-function units). ``tokens``: tokens the GEMMs and LayerNorms
    compute over the pass (token buckets included); ``attention_tokens``: those attention reads
    (default ``tokens``); ``sum_sq_len``: the sum of every sequence's length squared (attention's
    scores a head); ``heads`` (0: hidden / 64); ``recipe``: what the kernels read and write."""
    h, f, t, n = float(hidden), float(intermediate), float(tokens), float(layers)
    ta = float(tokens if attention_tokens is None else attention_tokens)
    r = recipe
    scale = clock_mhz / peak.boost_mhz
    fp8, fp16 = peak.fp8_tflops * 1e12 * scale, peak.fp16_tflops * 1e12 * scale
    rate = {g: fp8 if g in r.fp8_gemms else fp16 for g in GEMM_ROLES}
    w = {g: 1.0 if g in r.fp8_gemms else 2.0 for g in GEMM_ROLES}  # weights and the GEMM's own input
    qk = pv = 2.0 * sum_sq_len * h  # Q K^T and P V, summed over heads
    ln_copy = (1.0 if "ffn_up" in r.fp8_gemms else 0.0) + (1.0 if "qkv" in r.fp8_gemms else 0.0)
    spec = {  # role: (FLOPs, FLOP time, bytes) for one layer over the pass
        "qkv": (6 * t * h * h, 6 * t * h * h / rate["qkv"], w["qkv"] * (t * h + 3 * h * h) + r.qkv_out * 3 * t * h),
        "attention": (qk + pv, qk / (fp8 if r.qk_fp8 else fp16) + pv / (fp8 if r.pv_fp8 else fp16),
                      r.qkv_out * 3 * ta * h + r.attention_out * ta * h),
        "attn_out": (2 * t * h * h, 2 * t * h * h / rate["attn_out"],
                     max(r.attention_out, w["attn_out"]) * t * h + w["attn_out"] * h * h + r.dense_out * t * h),
        # two a layer, each reading its GEMM's output and the 16-bit residual and writing the
        # residual and, before an FP8 GEMM, its e4m3 copy
        "layernorm": (0.0, 0.0, (2 * (r.dense_out + 2 + 2) + ln_copy) * t * h),
        "ffn_up": (2 * t * h * f, 2 * t * h * f / rate["ffn_up"], w["ffn_up"] * (t * h + f * h) + r.ffn_hidden * t * f),
        "ffn_down": (2 * t * f * h, 2 * t * f * h / rate["ffn_down"],
                     max(r.ffn_hidden, w["ffn_down"]) * t * f + w["ffn_down"] * f * h + r.dense_out * t * h),
    }
    scores = sum_sq_len * float(heads or hidden // 64)
    exp_s = scores / (peak.exp2_per_clk_sm * peak.sms * clock_mhz * 1e6)
    out = {}
    for role, (flops, flop_s, nbytes) in spec.items():
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
