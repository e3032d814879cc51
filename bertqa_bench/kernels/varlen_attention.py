"""Variable-length ("packed", padding-free) attention forward in Triton, non-causal, for BERT.

What: ``varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)`` takes the packed encoder's
[T, heads, head_dim] Q, K, V (fp16 or bf16; strided views of one fused [T, 3, heads, head_dim]
QKV tensor are read in place through their strides, no copies) and the int32 sequence offsets
``cu_seqlens`` [B + 1] on the device, and returns softmax(Q K^T * scale) V per sequence and head
as a new contiguous [T, heads, head_dim] tensor of q's dtype.

Why: on the kernel bench's BERT-large case on an H200 (32,754 tokens in 133 sequences of 100-384
tokens, 16 heads, head_dim 64, fp16) cuDNN's fused attention takes ~225 us per layer and
FlashAttention-2 varlen ~287 us, against a memory floor (Q, K, V read and O written once) of
~56 us: ~4x the floor. 36.6 GFLOP at ~162 TFLOP/s is far from Hopper's dense fp16 peak too, so
on sequences this short the per-program fixed costs (launching a tile, loading Q, the epilogue)
weigh as much as the loop over K/V. This kernel is written for that regime: one program per
(q tile, head, sequence), a loop of only 1-6 K/V blocks, masks only in the last block.

Numerics: Q K^T is accumulated in fp32 from the fp16/bf16 inputs (exact products), scaled in
fp32, and the softmax runs online in fp32 with exp2 (the row maximum subtracted first, so no
overflow); the row sum is accumulated in fp32 from the unrounded probabilities. P is rounded to
q's dtype for the second matmul (the tensor cores take 16-bit operands), whose accumulation is
fp32 again; the output is divided by the fp32 row sum and rounded to q's dtype. The error against
an exact (fp64) attention is therefore the rounding of P (relative <= 2^-11 per element in fp16)
plus the output's rounding (relative <= 2^-11): |error| <= 2 * 2^-11 * max|V| per element in
fp16 (2^-8 in bf16), the bound the tests check.

An e4m3 output (``out_inv_scale``, for an FP8 GEMM that consumes it at a static input scale): the
fp32 output times ``out_inv_scale``, saturated to +-448 by the kernel and rounded to nearest-even,
i.e. exactly the GEMM's own quantization of the fp32 output. Compiled, the cast rounds (Hopper's
cvt.rn.satfinite from fp32, which the ahead-of-time test checks); under Triton's interpreter, whose
cast truncates, the kernel rounds in arithmetic first (``round_to_e4m3``). It replaces the 16-bit
output and the separate quantize pass over it: half the bytes written and one pass fewer. The
16-bit output's rounding is gone; e4m3's (relative <= 2^-4, absolute <= 2^-10 / out_inv_scale
among its subnormals) takes its place.

e4m3 inputs (``qkv_scale``, a 1-element fp32 tensor: the fused QKV GEMM's output scale, so that Q,
K, V are e4m3 codes of the values over it): half the bytes read, and Q K^T on Hopper's FP8 tensor
cores. Each e4m3 x e4m3 product is exact, but Hopper's FP8 MMA adds them with fewer bits than fp32
(Triton leaves its imprecise accumulation on at sm_90; about 2^-13 of the products' magnitudes,
by published measurements of the H100/H800 MMA), so each score carries an error of that order
that the 16-bit kernel's scores do not; the scores are decoded by one fp32 multiply (qkv_scale^2
folded into the softmax scale) and the output by another (qkv_scale). P V then runs in fp16 (V's
e4m3 values are exact in fp16; P rounds as above) or, with ``pv_e4m3``, on FP8 tensor cores too,
P times ``P_SCALE_E4M3`` rounded to e4m3 (relative <= 2^-4 per probability, absolute 2^-10 / 256
below e4m3's normals: cuDNN's FP8 attention's bound). On the H200 the e4m3 P V is the slower one:
the FP8 MMA takes its B operand only K-major, and V is stored head-dim-contiguous, so Triton
transposes every V tile through registers (results/reference/h200-mlperf-bert-large-fp8-attention.md).
The head size must be at least 32 (the FP8 MMA's K step).

Contract (as FlashAttention's varlen API): ``max_seqlen`` must be at least every sequence's
length (it sizes the grid; it is not checked against the device values, which would need a host
sync); trailing repeated entries of ``cu_seqlens`` are empty sequences; output rows outside
[0, cu_seqlens[-1]) are not written. The launch grid depends only on host values (shapes,
``max_seqlen``), never on device values, so a call can be captured in a CUDA graph, once the
autotuner has picked its configuration for that key in an eager call (the first call per
head_dim, dtypes, sequence-length bucket and P_SCALE compiles and times up to 22 configurations: seconds).
The tuning is kept in Triton's cache (``cache_results``), so later processes on the machine take the
same tile from it instead of re-timing: the processes of one run agree to the bit, where tiles
within noise of each other would otherwise be chosen apart (``tuning_source`` says which).

Triton is imported lazily (``_kernel()``), so importing this module needs neither Triton nor a
GPU; ``launch`` runs the kernel on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1),
which is how the tests check it without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

# whether Triton is here, decided once for the suite's Triton kernels (gelu_fp8.py's and this one)
from .triton_support import HAS_TRITON, triton_unavailable_reason  # noqa: F401 - torch_backend asks this module

LOG2E = 1.4426950408889634
# powers of two tl.dot takes (K >= 16); the configurations are sized (and checked against ptxas's
# register use) up to 128
HEAD_DIMS = (16, 32, 64, 128)
# with e4m3 inputs: Hopper's FP8 MMA takes K in steps of 32, so Q K^T needs head_dim >= 32
E4M3_HEAD_DIMS = (32, 64, 128)
# e4m3 P for the FP8 P V product: the probabilities (in [0, 1]) times 256, a power of two below
# 448 (so the scale is exact and nothing saturates), put e4m3's normal range (>= 2^-6) over
# p >= 2^-14 (cuDNN's FP8 attention scales them the same way, cudnn_fp8_attention.SCALE_S)
P_SCALE_E4M3 = 256.0
# Under Triton's interpreter (numpy, one program at a time) a single small configuration: tuning
# there measures nothing, and small tiles let the tests cross tile boundaries with short sequences.
# BLOCK_N differs from BLOCK_M so that a q tile spans several K/V blocks.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def seq_bucket(max_seqlen: int) -> int:
    """The autotuner's key for the sequence length: the next power of two (at least 16), so that
    nearby maximum lengths share one tuning run instead of tuning again for each value."""
    return max(16, 1 << (int(max_seqlen) - 1).bit_length())


def keep_config(block_m: int, block_n: int, num_warps: int, head_dim: int, bucket: int) -> bool:
    """Whether a configuration is worth timing for this head_dim and sequence-length bucket.

    * a tile longer than the sequence-length bucket (max_seqlen rounded up to a power of two)
      only adds masked rows/columns: dropped, unless it is the smallest tile (64), which stays;
    * the fp32 score tile S [BLOCK_M, BLOCK_N] and accumulator [BLOCK_M, head_dim] live in
      registers, spread over num_warps * 32 threads; beyond 128 such fp32 values per thread (of
      the 255 registers, with P, the Q fragments and the softmax state besides) ptxas spills to
      local memory, and a spilling configuration only costs compile time to rule out. The limit
      is ptxas's (sm_90a, Triton 3.5's) verdict on each of the 36 tile and warp choices for head_dim
      32/64/128: those over it spill, the others do not (checked by the ahead-of-time test).
    """
    if block_m > max(64, bucket) or block_n > max(64, bucket):
        return False
    return block_m * (block_n + head_dim) <= 128 * 32 * num_warps


def _kept(configs, head_dim: int, bucket: int) -> list:
    """``configs`` after ``keep_config``'s pruning; the first of them when none is kept."""
    kept = [c for c in configs if keep_config(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, head_dim, bucket)]
    return kept or configs[:1]


def candidate_configs(head_dim: int, max_seqlen: int) -> list:
    """The configurations the autotuner times for this head_dim and ``max_seqlen``."""
    return _kept(autotune_configs(), head_dim, seq_bucket(max_seqlen))


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    return _kept(configs, args["HEAD_DIM"], args["seq_bucket"])


@functools.lru_cache(maxsize=None)
def _kernel():
    """The bare @triton.jit kernel (no autotuning): what the ahead-of-time compile test builds.
    It lives in a module of its own, imported here on first use: the kernel and its helper must be
    module globals (Triton's interpreter re-executes a kernel's source against its module's
    globals, so a helper in a closure is not found), and importing it needs triton."""
    from bertqa_bench.kernels import _varlen_attention_triton

    return _varlen_attention_triton.varlen_attention_fwd


def autotune_configs():
    """The configurations the GPU autotuner chooses among (before ``keep_config``'s pruning)."""
    import triton

    if _interpreting():
        return [triton.Config(dict(INTERPRETER_CONFIG), num_warps=4, num_stages=1)]
    # BLOCK_N 32 as well: on the H200's first measurement the smallest tiles timed (64 x 64) won
    # on sequences of 100-384 tokens, ahead of every larger one
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


@functools.lru_cache(maxsize=None)
def _tuned():
    """The kernel wrapped in triton.autotune, keyed on head_dim, the sequence-length bucket and
    P_SCALE (e4m3 inputs with P V in e4m3 or in fp16 are different kernels on the same tensors;
    the autotuner adds the tensors' dtypes to the key itself). Built on first use, after the
    interpreter setting is final (TRITON_INTERPRET is read when the kernel is decorated)."""
    import triton

    return triton.autotune(configs=autotune_configs(), key=["HEAD_DIM", "seq_bucket", "P_SCALE"],
                           prune_configs_by={"early_config_prune": _prune}, cache_results=True)(_kernel())


def best_config() -> str | None:
    """The configuration the autotuner chose in the latest call (None before any call)."""
    if not HAS_TRITON or _tuned.cache_info().currsize == 0:
        return None
    cfg = getattr(_tuned(), "best_config", None)
    return None if cfg is None else str(cfg)


def tuning_source() -> str | None:
    """Where this process's configurations came from: "timed" (it timed them itself, for at least
    one key) or "cache" (every one from an earlier process's timings in Triton's cache); None
    before any call. The autotuner sets its bench_time only when it times configurations."""
    if not HAS_TRITON or _tuned.cache_info().currsize == 0 or getattr(_tuned(), "best_config", None) is None:
        return None
    return "timed" if getattr(_tuned(), "bench_time", None) is not None else "cache"


def autotune_timings() -> dict[str, float] | None:
    """The autotuner's latest tuning run: each configuration it timed -> its median time in us
    (None: it did not compile or launch, e.g. too much shared memory). None before any tuning."""
    if not HAS_TRITON or _tuned.cache_info().currsize == 0:
        return None
    timings = getattr(_tuned(), "configs_timings", None)
    if not timings:
        return None
    out = {}
    for c, t in timings.items():
        ms = t[0] if isinstance(t, (list, tuple)) else t
        out[str(c)] = round(1000.0 * ms, 1) if ms != float("inf") else None  # None: strict JSON has no inf
    return out


def _check(q, k, v, cu_seqlens, max_seqlen, scale, out_inv_scale=None, qkv_scale=None) -> None:
    e4m3_in = qkv_scale is not None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"varlen_attention: {name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
        if e4m3_in and x.dtype != torch.float8_e4m3fn:
            raise ValueError(f"varlen_attention: with qkv_scale, {name} must be float8_e4m3fn, got {x.dtype}")
        if not e4m3_in and x.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"varlen_attention: {name} must be float16 or bfloat16 (float8_e4m3fn with qkv_scale), "
                             f"got {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"varlen_attention: {name}'s head_dim must be contiguous (stride 1), "
                             f"got strides {x.stride()}")
        if x.shape != q.shape or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"varlen_attention: {name} is {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"q is {tuple(q.shape)} {q.dtype} on {q.device}: they must match")
    head_dims = E4M3_HEAD_DIMS if e4m3_in else HEAD_DIMS
    if q.shape[2] not in head_dims:
        raise ValueError(f"varlen_attention: head_dim {q.shape[2]} is not supported"
                         f"{' with e4m3 inputs' if e4m3_in else ''}; valid: {list(head_dims)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"varlen_attention: cu_seqlens must be int32 [batch + 1] (>= 2 entries), "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.stride(0) != 1:  # the kernel reads entry i at cu_seqlens + i
        raise ValueError(f"varlen_attention: cu_seqlens must be contiguous, got stride {cu_seqlens.stride(0)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"varlen_attention: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    if int(max_seqlen) < 1:
        raise ValueError(f"varlen_attention: max_seqlen must be >= 1, got {max_seqlen}")
    if not scale > 0:  # the kernel takes the row maximum of the unscaled scores
        raise ValueError(f"varlen_attention: scale must be > 0, got {scale}")
    for name, x in (("out_inv_scale", out_inv_scale), ("qkv_scale", qkv_scale)):
        if x is not None and (x.numel() != 1 or x.dtype != torch.float32 or x.device != q.device):
            raise ValueError(f"varlen_attention: {name} must be a 1-element float32 tensor on {q.device}, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")


def output_dtype(q_dtype, out_inv_scale=None):
    """What the kernel writes: e4m3 at ``out_inv_scale``, else q's 16-bit dtype (fp16 for e4m3
    inputs)."""
    if out_inv_scale is not None:
        return torch.float8_e4m3fn
    return torch.float16 if q_dtype == torch.float8_e4m3fn else q_dtype


def _pv_operands(q_dtype, pv_e4m3: bool):
    """(PV_DTYPE, P_SCALE): the second product's operand type and the probabilities' scale."""
    import triton.language as tl

    if pv_e4m3:
        return tl.float8e4nv, P_SCALE_E4M3
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float8_e4m3fn: tl.float16}[q_dtype], 1.0


def launch(q, k, v, cu_seqlens, max_seqlen: int, scale: float, out=None, out_inv_scale=None,
           config=None, qkv_scale=None, pv_e4m3: bool = False) -> torch.Tensor:
    """Run the (autotuned) kernel; on CPU tensors under TRITON_INTERPRET=1 as well as on CUDA.
    ``out``: a [T, heads, head_dim] tensor to write (a new one when None), of ``output_dtype``:
    float8_e4m3fn when ``out_inv_scale`` (a 1-element fp32 tensor) is given. ``qkv_scale`` (a
    1-element fp32 tensor): q, k and v are e4m3 codes of the values divided by it, and both
    products run on e4m3 operands where the GPU has FP8 tensor cores (QK^T always; P V with
    ``pv_e4m3``, P then rounded to e4m3 at ``P_SCALE_E4M3``, else in fp16 with V's values exact).
    ``config``: a ``triton.Config`` with BLOCK_M and BLOCK_N (and its warps and stages) to run
    instead of the autotuner's choice, as the kernel bench times each of ``candidate_configs()``
    on a run's own batches; it neither tunes nor changes the autotuner's cache."""
    import triton

    _check(q, k, v, cu_seqlens, max_seqlen, scale, out_inv_scale, qkv_scale)
    if pv_e4m3 and qkv_scale is None:
        raise ValueError("varlen_attention: pv_e4m3 rounds P to e4m3 for an e4m3 V: it needs e4m3 inputs (qkv_scale)")
    if config is not None and not {"BLOCK_M", "BLOCK_N"} <= set(getattr(config, "kwargs", None) or ()):
        raise ValueError(f"varlen_attention: config must be a triton.Config with BLOCK_M and BLOCK_N, got {config!r}")
    t, heads, d = q.shape
    out_dtype = output_dtype(q.dtype, out_inv_scale)
    if out is None:
        out = torch.empty((t, heads, d), dtype=out_dtype, device=q.device)
    elif out.dtype != out_dtype or out.shape != q.shape:
        raise ValueError(f"varlen_attention: out must be {tuple(q.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    batch = cu_seqlens.numel() - 1
    pv_dtype, p_scale = _pv_operands(q.dtype, pv_e4m3)

    def grid(meta):
        return (triton.cdiv(int(max_seqlen), meta["BLOCK_M"]), heads, batch)

    kernel, tile = (_tuned(), {}) if config is None else (_kernel(), config.all_kwargs())
    kernel[grid](q, k, v, out, cu_seqlens, out_inv_scale, qkv_scale, q.stride(0), q.stride(1), k.stride(0),
                 k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), float(scale) * LOG2E,
                 seq_bucket(max_seqlen), HEAD_DIM=d, E4M3_OUT=out_inv_scale is not None,
                 E4M3_IN=qkv_scale is not None, PV_DTYPE=pv_dtype, P_SCALE=p_scale, **tile)
    return out


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                     out_inv_scale=None, qkv_scale=None, pv_e4m3: bool = False) -> torch.Tensor:
    """softmax(Q K^T * scale) V per sequence of the packed batch, per head (non-causal): a new
    contiguous [T, heads, head_dim] tensor of ``output_dtype`` (e4m3 at ``out_inv_scale``, a
    1-element fp32 tensor: the e4m3 codes of the output times it). ``qkv_scale``: q, k, v are e4m3
    codes of the values over it (``launch``). ``scale`` defaults to head_dim ** -0.5."""
    if not HAS_TRITON:
        raise RuntimeError("varlen_attention needs triton (it comes with CUDA builds of torch: pip install triton)")
    if not q.is_cuda and not _interpreting():
        raise ValueError(f"varlen_attention: q is on {q.device}; the Triton kernel runs on CUDA "
                         "(or on the CPU under TRITON_INTERPRET=1)")
    return launch(q, k, v, cu_seqlens, max_seqlen, q.shape[-1] ** -0.5 if scale is None else scale,
                  out_inv_scale=out_inv_scale, qkv_scale=qkv_scale, pv_e4m3=pv_e4m3)


# The packed encoder's entry point: a torch custom op, so torch.compile keeps the call in its graph
# as one opaque kernel (the autotuner and its host-side checks run at call time, not while
# tracing) and the token buckets' CUDA graphs capture it. The schema is spelled out because this
# module's annotations are strings (``from __future__ import annotations``). Registered on import,
# which needs neither Triton nor a GPU; the fake implementation gives the output's shape to the
# compiler: a new contiguous [T, heads, head_dim] tensor of q's dtype (e4m3 with out_inv_scale),
# whatever q's strides. Not a ``triton_op`` as gelu_fp8.py's kernel is: Inductor would trace into
# the body and run the launch from its own generated code, skipping the autotuner's timing and
# these checks at call time (and there is no GPU here to show that it would not).
@torch.library.custom_op("bertqa::varlen_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float scale, "
                                "Tensor? out_inv_scale=None, Tensor? qkv_scale=None, bool pv_e4m3=False) -> Tensor")
def varlen_attention_op(q, k, v, cu_seqlens, max_seqlen, scale, out_inv_scale=None, qkv_scale=None, pv_e4m3=False):
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, out_inv_scale, qkv_scale, pv_e4m3)


@varlen_attention_op.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, scale, out_inv_scale=None, qkv_scale=None,
                           pv_e4m3=False):
    return torch.empty(q.shape, dtype=output_dtype(q.dtype, out_inv_scale), device=q.device)
