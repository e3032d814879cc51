"""Residual add + LayerNorm + e4m3 quantize in one pass: a BERT layer's "add & norm", FP8 out.

After the attention-output and FFN-down GEMMs, a post-LayerNorm BERT layer computes
``x = LayerNorm(y + residual)``; ``x`` is the next residual and, quantized to e4m3 at the next
FP8 GEMM's static input scale, that GEMM's input. Under torch.compile Inductor fuses the add, the
LayerNorm and the quantize into one kernel already, but on an H200 at 32,768 tokens x 1,024 it
took 91-93 us where its bytes (fp16 y and residual in, fp16 x and e4m3 x out: 7 bytes an element,
235 MB) allow ~49 us (hopper-kernel-levers.csv): twice a layer, ~17 % of a BERT-large layer's
~1,050 us. This kernel is that pass written for its bytes: each program normalizes ``ROWS`` whole
rows held in registers (one read of each input, one write of each output, no second pass), with
vector loads of 16 bytes.

What it reads and writes, each a declared choice of the caller (FasterTransformer's FP8 BERT
reads and writes e4m3 at every one of these places):

* ``y``: the GEMM's output, fp16/bf16, or e4m3 with its scale ``y_scale`` (a GEMM writing e4m3);
* ``dense_bias`` (optional): that GEMM's bias, added here when its epilogue did not;
* ``residual``: the residual stream, fp16/bf16, or e4m3 with ``residual_scale``;
* writes ``x`` (the next residual) in ``residual``'s dtype (e4m3 at ``1 / x_inv_scale``) and
  ``x8``, e4m3 at ``1 / x8_inv_scale``, the next GEMM's input.

Numerics: the sum, mean, variance and normalization run in fp32 from the decoded inputs; ``x`` and
``x8`` are each rounded once from the same fp32 value (``x8`` is not a rounding of the rounded
``x``). The torch reference below does the same in the same order of operations; the two differ
only in fp32 summation order, bounded in the tests.

Registered with ``torch.library.triton_op`` as gelu_fp8.py's kernel (one plain launch, a grid from
the row count, no host work), so Inductor schedules it inside its graph and CUDA graphs capture
it; off CUDA, or without Triton, ``add_layernorm_fp8`` runs the torch reference.
"""
# No ``from __future__ import annotations``: triton_op reads the op's annotations as types.
import functools
from typing import Optional

import torch

from .fp8_math import E4M3_MAX
from .triton_support import op_implementation, runs_triton_op, triton_op, wrap_triton

# Launch shape by hidden size: (rows a program, warps). One row a program with 16 bytes of fp16 a
# thread for 768-1,024 (Triton's LayerNorm tutorial and Apex's choice for these widths); scripts/
# kernel_bench.py --only layernorm times the alternatives on the card (ROW_CHOICES x WARP_CHOICES).
ROW_CHOICES = (1, 2, 4)
WARP_CHOICES = (2, 4, 8)


def default_config(hidden: int) -> tuple[int, int]:
    """(rows a program, warps) for a hidden size: enough threads for 16-byte fp16 accesses of one row."""
    block = triton_block(hidden)
    return 1, max(1, min(8, block // 256))


def triton_block(hidden: int) -> int:
    """The power of two a program's row tile spans (the kernel masks the columns past ``hidden``)."""
    return 1 << max(0, (int(hidden) - 1).bit_length())


def add_layernorm_scaled(y, residual, weight, bias, eps: float, *, y_scale: float = 1.0,
                         dense_bias: Optional[torch.Tensor] = None, residual_scale: float = 1.0,
                         x_inv_scale: float = 1.0, x8_inv_scale: float = 1.0):
    """Everything but the final roundings, in fp32: (x * x_inv_scale, x * x8_inv_scale clamped to
    the e4m3 range), with x = LayerNorm(y * y_scale + dense_bias + residual * residual_scale).
    ``x``'s scaled value is clamped too when ``residual`` is e4m3 (it is written in e4m3)."""
    s = y.float() * y_scale
    if dense_bias is not None:
        s = s + dense_bias.float()
    s = s + residual.float() * residual_scale
    mean = s.mean(dim=-1, keepdim=True)
    d = s - mean
    rstd = torch.rsqrt((d * d).mean(dim=-1, keepdim=True) + eps)
    x = d * rstd * weight.float() + bias.float()
    xs = x * x_inv_scale
    if residual.dtype == torch.float8_e4m3fn:
        xs = xs.clamp(-E4M3_MAX, E4M3_MAX)
    return xs, (x * x8_inv_scale).clamp(-E4M3_MAX, E4M3_MAX)


def add_layernorm_fp8_reference(y, residual, weight, bias, eps: float, **scales):
    """``add_layernorm_scaled`` rounded: x in residual's dtype, x8 in e4m3 (round to nearest even)."""
    xs, x8 = add_layernorm_scaled(y, residual, weight, bias, eps, **scales)
    return xs.to(residual.dtype), x8.to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_layernorm_fp8_kernel(y_ptr, db_ptr, r_ptr, w_ptr, b_ptr, x_ptr, x8_ptr, n_rows, hidden,
                                 y_scale, r_scale, x_inv_scale, x8_inv_scale, eps,
                                 BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_DENSE_BIAS: tl.constexpr,
                                 X_SATURATES: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        cmask = cols < hidden
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        # Inductor passes Python floats as fp64; converted once so that no per-element math runs in fp64
        ys, rs = tl.cast(y_scale, tl.float32), tl.cast(r_scale, tl.float32)
        xs_inv, x8_inv, e = tl.cast(x_inv_scale, tl.float32), tl.cast(x8_inv_scale, tl.float32), tl.cast(eps, tl.float32)
        s = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32) * ys
        if HAS_DENSE_BIAS:
            s += tl.load(db_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        s += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rs
        mean = tl.sum(s, axis=1) / hidden
        d = tl.where(mask, s - mean[:, None], 0.0)  # the columns past hidden count in neither moment
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / hidden + e)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = d * rstd[:, None] * w[None, :] + b[None, :]
        xo = x * xs_inv
        if X_SATURATES:  # an e4m3 residual stream
            xo = tl.minimum(tl.maximum(xo, -448.0), 448.0)
        tl.store(x_ptr + offs, xo.to(x_ptr.dtype.element_ty), mask=mask)
        q = tl.minimum(tl.maximum(x * x8_inv, -448.0), 448.0)
        tl.store(x8_ptr + offs, q.to(x8_ptr.dtype.element_ty), mask=mask)

    return add_layernorm_fp8_kernel


def _check(y, residual, weight, bias, dense_bias) -> None:
    hidden = y.shape[-1]
    if y.dim() != 2 or residual.shape != y.shape:
        raise ValueError(f"add_layernorm_fp8 takes y and residual of one [rows, hidden] shape, got "
                         f"{tuple(y.shape)} and {tuple(residual.shape)}")
    if weight.shape != (hidden,) or bias.shape != (hidden,) or (dense_bias is not None and dense_bias.shape != (hidden,)):
        raise ValueError(f"add_layernorm_fp8: LayerNorm weight, bias and dense_bias must be [{hidden}]")


def launch(y, residual, weight, bias, x, x8, eps: float, *, y_scale: float = 1.0, dense_bias=None,
           residual_scale: float = 1.0, x_inv_scale: float = 1.0, x8_inv_scale: float = 1.0,
           rows: Optional[int] = None, warps: Optional[int] = None, wrap=None) -> None:
    """Run the Triton kernel on contiguous [rows, hidden] ``y`` and ``residual`` into ``x`` and
    ``x8`` (their dtypes say what is written; fp32 keeps the values before the final rounding, for
    tests: Triton's interpreter rounds to e4m3 without carrying a mantissa overflow into the
    exponent). ``rows``/``warps``: the launch shape (default ``default_config``). ``wrap``: torch's
    wrap_triton inside the op; None launches directly."""
    import triton

    _check(y, residual, weight, bias, dense_bias)
    n, hidden = y.shape
    r0, w0 = default_config(hidden)
    rows, warps = rows or r0, warps or w0
    k = _kernel() if wrap is None else wrap(_kernel())
    k[(triton.cdiv(n, rows),)](y, y if dense_bias is None else dense_bias, residual, weight, bias, x, x8, n, hidden,
                               float(y_scale), float(residual_scale), float(x_inv_scale), float(x8_inv_scale),
                               float(eps), BLOCK=triton_block(hidden), ROWS=rows, HAS_DENSE_BIAS=dense_bias is not None,
                               X_SATURATES=residual.dtype == torch.float8_e4m3fn, num_warps=warps)


def _add_layernorm_fp8_op(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          eps: float, y_scale: float, dense_bias: Optional[torch.Tensor], residual_scale: float,
                          x_inv_scale: float, x8_inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel as a torch op: (x in residual's dtype, x8 in e4m3), both [rows, hidden]."""
    y, residual = y.contiguous(), residual.contiguous()
    x = torch.empty_like(residual)
    x8 = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=y.device)
    launch(y, residual, weight, bias, x, x8, eps, y_scale=y_scale, dense_bias=dense_bias,
           residual_scale=residual_scale, x_inv_scale=x_inv_scale, x8_inv_scale=x8_inv_scale, wrap=wrap_triton)
    return x, x8


add_layernorm_fp8_op = (triton_op("bertqa::add_layernorm_fp8", mutates_args=())(_add_layernorm_fp8_op)
                        if triton_op else None)


def _runs_triton(on_cuda: bool) -> bool:
    return runs_triton_op(on_cuda, add_layernorm_fp8_op)


def implementation(on_cuda: bool) -> str:
    """What add_layernorm_fp8 runs for tensors on CUDA (or not), in words."""
    return op_implementation(on_cuda, add_layernorm_fp8_op, "Triton kernel (one pass, fp32 statistics)")


def add_layernorm_fp8(y, residual, weight, bias, eps: float, *, x8_inv_scale: float, y_scale: float = 1.0,
                      dense_bias=None, residual_scale: float = 1.0, x_inv_scale: float = 1.0):
    """(x, x8): x = LayerNorm(y * y_scale + dense_bias + residual * residual_scale) in residual's
    dtype (x * x_inv_scale when that is e4m3) and x * x8_inv_scale in e4m3, for [rows, hidden]
    inputs: the Triton op on CUDA, torch elsewhere."""
    if _runs_triton(y.is_cuda):
        return add_layernorm_fp8_op(y, residual, weight, bias, float(eps), float(y_scale), dense_bias,
                                    float(residual_scale), float(x_inv_scale), float(x8_inv_scale))
    return add_layernorm_fp8_reference(y, residual, weight, bias, eps, y_scale=y_scale, dense_bias=dense_bias,
                                       residual_scale=residual_scale, x_inv_scale=x_inv_scale,
                                       x8_inv_scale=x8_inv_scale)
