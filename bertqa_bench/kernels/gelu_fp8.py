"""GELU between the FFN's two FP8 GEMMs, e4m3 in and out, with the tanh approximation.

The profile of the packed FP8 row with e4m3 hidden activations (h100-perf.md, 2026-11-27) put
Inductor's fused dequantize + erf-GELU + quantize kernel at 185 us per layer per 32k-token batch:
18% of the GPU's time, about three times what it moves through memory allows (one byte in, one
out per element: ~60 us). Halving its input bytes had not made it faster, so it is bound by
instructions, not memory: the erf polynomial in fp32 for 100M elements. GELU's tanh form with the
GPU's one-instruction ``tanh.approx.f32`` takes a handful of instructions per element.

Numerics: the tanh form differs from erf-GELU by at most ~5e-4 (absolute), ``tanh.approx.f32``
by ~2^-11 relative; the result is rounded to e4m3 (3 mantissa bits) right after, so ~90% of the
elements round to the same code as erf-GELU's, and none is more than one code from it in torch's
tanh (CPU test) or two with the GPU's (GPU test). Whether the answers still match is the parity
gate's call, as for every reduced-precision row.

On CUDA ``gelu_tanh_fp8`` calls a torch custom op (``torch.library.triton_op``, registered when
this module is imported, outside any traced code) around the Triton kernel, so torch.compile keeps
it in its graph (fullgraph compiles, tested) and the bucket CUDA graphs capture it; elsewhere (CPU
tests) the same formula in torch (``gelu_tanh_fp8_reference``), with torch's tanh.

Why ``triton_op`` here and ``custom_op`` + ``register_fake`` for the attention kernel
(varlen_attention.py): this op's body is one plain Triton launch (a grid from the element count,
no host work), which ``triton_op`` lets Inductor trace into and schedule as its own kernel, with
no fake to keep in step. The attention's body must run at call time, outside tracing (its
autotuner times configurations, its checks read the inputs), which only an opaque ``custom_op``
guarantees.
"""
# No ``from __future__ import annotations``: triton_op reads the op's annotations as types.
import functools

import torch

from .fp8_math import E4M3_MAX
from .triton_support import op_implementation, runs_triton_op, triton_op, wrap_triton
from .triton_support import triton_unavailable_reason  # noqa: F401 - this kernel's availability

_C = 0.7978845608028654  # sqrt(2 / pi)
_K = 0.044715
BLOCK = 4096  # elements per program: 16 per thread at 8 warps, one 16-byte load of e4m3 each


def gelu_tanh(h):
    """GELU's tanh form in torch (also the cuBLASLt epilogue's reference, cublaslt_epilogues.py)."""
    return 0.5 * h * (1.0 + torch.tanh(_C * (h + _K * h * h * h)))


def gelu_tanh_scaled(x8, in_scale: float, out_inv_scale: float):
    """e4m3 ``x8`` (values x8 * in_scale) -> GELU_tanh(x) * out_inv_scale in fp32, clamped to the
    e4m3 range: everything but the final rounding to e4m3."""
    return (gelu_tanh(x8.float() * in_scale) * out_inv_scale).clamp(-E4M3_MAX, E4M3_MAX)


def gelu_tanh_fp8_reference(x8, in_scale: float, out_inv_scale: float):
    """``gelu_tanh_scaled`` rounded to e4m3 (round to nearest even, as the GPU's conversion)."""
    return gelu_tanh_scaled(x8, in_scale, out_inv_scale).to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_tanh_fp8_kernel(x_ptr, y_ptr, n, in_scale, out_inv_scale, BLOCK: tl.constexpr,
                             FAST_TANH: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # The scales arrive as fp32 when launched directly but as fp64 from Inductor (it types
        # Python floats fp64), which would carry the math, and the tanh asm's operand, into fp64:
        # Triton then fails to lower the kernel (seen on the H100). Converted once per program.
        s_in = tl.cast(in_scale, tl.float32)
        s_out = tl.cast(out_inv_scale, tl.float32)
        h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * s_in
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        if FAST_TANH:  # the SFU's tanh, one instruction (sm_75 and newer)
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                          pack=1)
        else:  # Triton's interpreter runs no PTX: the same function through exp (|u| <= 15: tanh is +-1 there)
            t = 2.0 / (1.0 + tl.exp(-2.0 * tl.minimum(tl.maximum(u, -15.0), 15.0))) - 1.0
        g = 0.5 * h * (1.0 + t) * s_out
        g = tl.minimum(tl.maximum(g, -448.0), 448.0)
        tl.store(y_ptr + offs, g.to(y_ptr.dtype.element_ty), mask=mask)

    return gelu_tanh_fp8_kernel


def launch(x8, y8, in_scale: float, out_inv_scale: float, *, fast_tanh: bool = True, wrap=None) -> None:
    """Run the Triton kernel over contiguous e4m3 ``x8`` into ``y8`` (e4m3; fp32 keeps the value
    before the final rounding, for tests: Triton's interpreter rounds to e4m3 without carrying a
    mantissa overflow into the exponent, 7.94 -> 4.0). ``wrap``: torch's wrap_triton inside the
    custom op; None launches directly."""
    import triton

    n = x8.numel()
    k = _kernel() if wrap is None else wrap(_kernel())
    k[(triton.cdiv(n, BLOCK),)](x8, y8, n, float(in_scale), float(out_inv_scale), BLOCK=BLOCK,
                                FAST_TANH=fast_tanh, num_warps=8)


def _gelu_tanh_fp8_op(x8: torch.Tensor, in_scale: float, out_inv_scale: float) -> torch.Tensor:
    """The Triton kernel as a torch op (e4m3 in, e4m3 out, same shape)."""
    x8 = x8.contiguous()
    y8 = torch.empty_like(x8)
    launch(x8, y8, in_scale, out_inv_scale, wrap=wrap_triton)
    return y8


gelu_tanh_fp8_op = triton_op("bertqa::gelu_tanh_fp8", mutates_args=())(_gelu_tanh_fp8_op) if triton_op else None


def _runs_triton(on_cuda: bool) -> bool:
    return runs_triton_op(on_cuda, gelu_tanh_fp8_op)


def implementation(on_cuda: bool) -> str:
    """What gelu_tanh_fp8 runs for tensors on CUDA (or not), in words."""
    return op_implementation(on_cuda, gelu_tanh_fp8_op, "Triton kernel (tanh.approx.f32)")


def gelu_tanh_fp8(x8, in_scale: float, out_inv_scale: float):
    """GELU (tanh form) of e4m3 activations into e4m3: the Triton op on CUDA, torch elsewhere."""
    if _runs_triton(x8.is_cuda):
        return gelu_tanh_fp8_op(x8, float(in_scale), float(out_inv_scale))
    return gelu_tanh_fp8_reference(x8, in_scale, out_inv_scale)
