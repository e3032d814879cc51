"""The Triton kernels of ``triton_attention`` (see its docstring for the design and numerics).

Imported only through ``triton_attention._kernel()``: this module needs triton at import, and
TRITON_INTERPRET is read when the kernels are decorated, i.e. when this module is first imported.
"""
import os

import triton
import triton.language as tl

# How the e4m3 output is rounded. Compiled for the GPU, Triton's fp32 -> e4m3 cast is Hopper's
# cvt.rn.satfinite (round to nearest, ties to even; the AOT test checks the instruction, the GPU
# test the bits), so the kernel only saturates and casts: the explicit rounding below costs about
# 16 epilogue instructions an element, ~16 us a BERT-large layer on an H200, as much as the fusion
# saves. Triton's interpreter truncates instead, so there the kernel rounds in arithmetic first:
# the same bits either way.
ROUND_IN_ARITHMETIC = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _attend_block(q, k_base, v_base, start_n, seqlen, stride_kt, stride_vt, m_i, l_i, acc, qk_scale,
                  offs_n, offs_d, MASKED: tl.constexpr, PV_DTYPE: tl.constexpr, P_SCALE: tl.constexpr):
    # One K/V block of the online softmax. MASKED only for the sequence's last, partial block:
    # the full blocks before it load without predicates and skip the -inf select.
    rows = start_n + offs_n
    if MASKED:
        n_valid = rows < seqlen
        k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :])
        v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :])
    # exact products, 16-bit x 16-bit or e4m3 x e4m3, accumulated in fp32 (on Hopper's FP8 MMA with
    # fewer bits: varlen_attention's docstring)
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    # The scale (times log2 e, for exp2) is applied to the fp32 scores, fused with the max
    # subtraction into one FMA per score: folding it into Q instead would cost the same
    # per-score subtraction and add a rounding of Q*scale to 16 bits.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf, m_new finite)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # P V: P (in [0, 1], times P_SCALE) and V as PV_DTYPE operands. 16-bit inputs: q's dtype, V as
    # loaded. e4m3 inputs: fp16 (V's e4m3 values are exact in fp16, P rounds to fp16 as in the
    # 16-bit kernel) or e4m3 (P * P_SCALE rounded to e4m3: FP8 tensor-core products both ways)
    if P_SCALE == 1.0:
        p_op = p.to(PV_DTYPE)
    elif ROUND_IN_ARITHMETIC:
        p_op = round_to_e4m3(p * P_SCALE).to(PV_DTYPE)
    else:  # p * P_SCALE <= P_SCALE < 448: the cast rounds, nothing to saturate
        p_op = (p * P_SCALE).to(PV_DTYPE)
    acc = tl.dot(p_op, v.to(PV_DTYPE), acc)
    return m_new, l_i, acc


@triton.jit
def round_to_e4m3(x):
    # x saturated to +-448 and rounded to the e4m3 grid (3 mantissa bits, subnormal spacing 2^-9
    # below 2^-6), to nearest with ties to even, in exact fp32 steps; the cast that follows only
    # changes the format. For Triton's interpreter, whose cast truncates (ROUND_IN_ARITHMETIC).
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    exp = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of |x|
    step_exp = tl.maximum(exp, 127 - 6) - 3  # the grid's spacing at |x|: 2^(step_exp - 127)
    step = (step_exp << 23).to(tl.float32, bitcast=True)
    inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
    # x / step is exact (a power of two); adding and subtracting 1.5 * 2^23 rounds it to an integer,
    # ties to even (|x / step| < 2^4 here, far inside the trick's 2^22); an FMA contraction of the
    # first two steps rounds once too, so it gives the same bits
    r = (x * inv_step + 12582912.0) - 12582912.0
    return tl.where(r == 0.0, x * 0.0, r * step)  # a zero keeps x's sign, as a cast's does


@triton.jit
def varlen_attention_fwd(Q, K, V, O, cu_seqlens, o_inv_scale, qkv_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_ot, stride_oh, qk_scale, seq_bucket, HEAD_DIM: tl.constexpr,
                         E4M3_OUT: tl.constexpr, E4M3_IN: tl.constexpr, PV_DTYPE: tl.constexpr,
                         P_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid (q tiles, heads, sequences), the q tile fastest: the programs of one (sequence,
    # head) are launched next to each other and read the same K/V, which then comes from L2.
    # seq_bucket only keys the autotuner. E4M3_OUT: O is e4m3, written as the output times
    # o_inv_scale (a 1-element fp32 tensor: the consuming GEMM's static input scale, inverted).
    # E4M3_IN: Q, K and V are e4m3 codes of the values divided by qkv_scale (a 1-element fp32
    # tensor: the QKV GEMM's output scale, one for all three), decoded by scaling the fp32 scores
    # (qkv_scale^2) and the output (qkv_scale), never element by element.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_seqlens + seq)
    seqlen = tl.load(cu_seqlens + seq + 1) - start
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen:  # beyond this sequence (the grid is sized for max_seqlen) or empty
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = start.to(tl.int64)  # token offsets times the fused QKV stride pass 2^31 at ~700k tokens
    m_valid = offs_m < seqlen
    # Q loaded once per program; rows past the sequence read as 0 (finite scores, never stored)
    q = tl.load(Q + (row0 + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    k_base = K + row0 * stride_kt + head * stride_kh
    v_base = V + row0 * stride_vt + head * stride_vh
    out_scale = 1.0 / P_SCALE
    if E4M3_IN:
        s_qkv = tl.load(qkv_scale)
        qk_scale = qk_scale * (s_qkv * s_qkv)
        out_scale = out_scale * s_qkv
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = (seqlen // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, start_n, seqlen, stride_kt, stride_vt, m_i, l_i, acc,
                                      qk_scale, offs_n, offs_d, MASKED=False, PV_DTYPE=PV_DTYPE, P_SCALE=P_SCALE)
    if n_full < seqlen:
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n_full, seqlen, stride_kt, stride_vt, m_i, l_i, acc,
                                      qk_scale, offs_n, offs_d, MASKED=True, PV_DTYPE=PV_DTYPE, P_SCALE=P_SCALE)
    # every stored row has >= 1 valid key, so l_i >= 1 (its maximum term is exp2(0))
    out = acc / l_i[:, None]
    if E4M3_IN or P_SCALE != 1.0:
        out = out * out_scale
    if E4M3_OUT:
        out = out * tl.load(o_inv_scale)
        if ROUND_IN_ARITHMETIC:
            out = round_to_e4m3(out)
        else:  # saturated here, not by the cast's satfinite; the cast rounds to nearest-even
            out = tl.minimum(tl.maximum(out, -448.0), 448.0)
    tl.store(O + (row0 + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_valid[:, None])
