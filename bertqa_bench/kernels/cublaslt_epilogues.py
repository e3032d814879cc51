"""The FFN up-projection with its bias and GELU in the GEMM's epilogue, e4m3 in and out, through
cuBLASLt (PyPI ``nvmath-python``, ``nvmath.linalg.advanced.Matmul``).

The fastest FP8 rows compute the FFN's first half in two kernels: the FP8 GEMM writes e4m3 (its
bias added in the epilogue), then a Triton kernel reads it, applies GELU's tanh form and writes
e4m3 again (gelu_fp8.py). On BERT-large that kernel was 7.5% of the GPU's time at ~1.1x its memory
floor (h100-mlperf-bert-large.md): as a separate pass it cannot get faster, only disappear.
cuBLASLt's ``GELU_BIAS`` epilogue adds the bias, applies GELU (the tanh form) and scales into e4m3
in the GEMM's own epilogue, so the [tokens, 4 x hidden] tensor is written once and read once.

Numerics: h8 = e4m3(GELU_tanh(sa * sw * (x8 @ w8^T) + bias) / down_scale), saturated at +-448.
Against the two-kernel path it drops one e4m3 rounding (of GELU's input); the GELU itself is the
same tanh form. ``fp8_gemm_gelu_reference`` is that formula in torch (the CPU path and the tests'
reference).

Layout: cuBLASLt adds a bias per row of its column-major result, and takes FP8 A row-major and B
column-major (K contiguous in both). So the GEMM is computed transposed, D^T [N, M] = W [N, K] @
X^T, with D^T column-major: its memory is X @ W^T row-major, [M, N] contiguous, what the FFN's
down-projection reads.

The module also holds the other FP8 GEMMs planned through nvmath-python: the 16-bit-output GEMM
with its bias (``fp8_gemm_bias``, which can replace ``torch._scaled_mm`` so that its algorithm can be
autotuned), the same with the residual as C (``fp8_gemm_add``), and the bias epilogue writing e4m3
for the add + LayerNorm kernel (``fp8_gemm_bias_e4m3``); see the sections below.

CUDA graphs: planning a cuBLASLt matmul synchronizes the stream, which a CUDA graph capture
forbids; one ``Matmul`` per kind of GEMM is planned per token count (M) outside capture, on the
first call (the token buckets' warm-up runs each shape before capturing it), and reused for every
layer through ``reset_operands`` (the weights and bias differ per layer, the shapes do not). Its
workspace is kept (``release_workspace=False``), so a captured graph replays into memory that
stays allocated.

Saturation: e4m3fn has no infinity, so whether an out-of-range result becomes +-448 or NaN is the
kernel's choice. ``epilogue_saturates`` asks the device once with a GEMM whose every output
overflows; the FP8 builder refuses the epilogue where it does not saturate.
"""
# No ``from __future__ import annotations``: custom_op reads the op's annotations as types.
import contextlib
import contextvars
import threading
from typing import Optional

import torch

from .fp8_math import E4M3_MAX
from .gelu_fp8 import gelu_tanh

BIAS_DTYPE = torch.float16
INSTALL = "pip install nvmath-python (cuBLASLt's epilogues through nvmath.linalg.advanced)"


def nvmath_unavailable_reason() -> str:
    """Why the cuBLASLt epilogue cannot run here ('' when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 9):
        return "FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper)"
    try:
        import nvmath.linalg.advanced  # noqa: F401
    except ImportError as e:
        return f"cuBLASLt's epilogues need the package nvmath-python ({INSTALL}): {e}"
    return ""


def fp8_gemm_gelu_scaled(x8, w8, bias, w_scale, x_scale, out_inv_scale):
    """The epilogue's formula in fp32, everything but the final rounding: an fp32 GEMM of the decoded
    e4m3 values, the bias, GELU's tanh form, the output scale, saturated at +-448 here (not left to
    whatever a cast does past the range: NaN for some, +-448 for others)."""
    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + bias.float()
    return (gelu_tanh(y) * out_inv_scale.float()).clamp(-E4M3_MAX, E4M3_MAX)


def fp8_gemm_gelu_reference(x8, w8, bias, w_scale, x_scale, out_inv_scale):
    """The epilogue's formula in torch: e4m3 [M, K] x8 and [N, K] w8 -> e4m3 [M, N]
    (``fp8_gemm_gelu_scaled`` rounded to nearest even)."""
    return fp8_gemm_gelu_scaled(x8, w8, bias, w_scale, x_scale, out_inv_scale).to(torch.float8_e4m3fn)


# One planned Matmul per (kind: gelu / bias / add, device, M, N, K, accumulation, autotune, graph
# copy): the layers share it (same shapes, other weights).
_PLANS: dict = {}
_LOCK = threading.Lock()

# Which copy of the captured CUDA graphs is being captured (``plan_copy``). A plan keeps one
# workspace, which every graph captured with it writes into on replay: copies of the graphs that
# replay at once on different streams (torch option ``streams``) would race on it, so each copy
# gets its own plans.
_COPY = contextvars.ContextVar("bertqa_gemm_plan_copy", default=0)


@contextlib.contextmanager
def plan_copy(copy: int):
    """The GEMMs called inside plan (or reuse) the Matmuls of graph copy ``copy``."""
    token = _COPY.set(int(copy))
    try:
        yield
    finally:
        _COPY.reset(token)


def _e4m3_type():
    import nvmath

    return nvmath.CudaDataType.CUDA_R_8F_E4M3


def _planned(key, what: str, make, operands: dict, stream, autotune: int = 0):
    """Execute the Matmul planned for ``key`` on this call's operands: planned by
    ``make(stream, algorithms)`` on the shape's first call (outside graph capture), reset to
    ``operands`` on later ones (the layers share a shape, not weights). Returns D [M, N], row-major
    (cuBLASLt's column-major D^T).

    Graph copies after the first (``plan_copy``) plan their own Matmul (its own workspace) with the
    algorithms the first copy's plan chose, autotuned or not: a batch's bits then do not depend on
    the copy (the stream) it runs on. Copies are captured in order, so the first copy's plan of a
    shape exists by then; if it does not, the copy plans (and autotunes) on its own.

    ``autotune`` > 0: when the shape is planned, time cuBLASLt's candidate algorithms that many
    times each (nvmath's ``Matmul.autotune``) and keep the fastest, instead of the heuristic's first
    choice. They are timed on the layer's own weights and random activations (and residual) of the
    call's shapes and layouts, not on the call's own: the first call of a shape can be a CUDA graph
    warm-up on dummy tokens (the packed encoder's buckets), whose activations repeat one row, and a
    tensor core's speed depends on the bits it multiplies."""
    key = (*key, _COPY.get())
    mm = _PLANS.get(key)
    if mm is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} was not planned before CUDA graph capture (planning synchronizes the "
                               "stream): run the shape once first")
        with _LOCK:
            first = _PLANS.get((*key[:-1], 0)) if key[-1] else None
            mm = make(stream, first.algorithms) if first is not None else _choose(make, operands, stream, autotune)
            _PLANS[key] = mm
    else:
        mm.reset_operands(**operands, stream=stream)
    d = mm.execute(release_workspace=False, stream=stream)
    # A plan keeps direct references to its operands until the next reset (nvmath's Matmul drops
    # only its result's), and each token bucket has a plan of its own: captured in a CUDA graph,
    # the last layer's activations (B: e4m3 [T, 1,024] or [T, 4,096]) stayed allocated in the
    # graph pool for the process's life, so a later bucket's capture could not reuse them: 5-6 KB a
    # token of every bucket of every copy (1.2 M tokens at 32k: 34 buckets x 2 copies; 4.9 M at
    # 64k). Fitted on an H200's two 32k rows (7,461 and 7,819 MiB, 2026-12-04) that model predicts
    # the 64k row's 25,784 MiB to 1.1 %. The next call resets every operand anyway.
    mm.release_operands()
    if isinstance(d, tuple):  # (result, auxiliary outputs)
        d = d[0]
    out = d.t()
    if not out.is_contiguous():
        raise RuntimeError(f"{what} wrote a {tuple(d.shape)} result with strides {d.stride()}, not the "
                           "column-major layout the next kernel reads")
    return out


def plans_held() -> dict:
    """The cuBLASLt plans this process holds and the device workspace they keep, for a prepare's
    record: one plan per GEMM kind, token count and graph copy, each workspace kept for the plan's
    life (a plan not yet run has none: nvmath allocates it on the first execute)."""
    sizes = [int(getattr(getattr(mm, "workspace", None), "allocated_size", 0) or 0) for mm in list(_PLANS.values())]
    return {"cublaslt_plans": len(sizes), "cublaslt_workspace_mib": round(sum(sizes) / 2**20, 1)}


def _choose(make, operands: dict, stream, autotune: int):
    """The shape's Matmul, planned with the one algorithm it runs: the heuristic's first choice, or
    with ``autotune`` the fastest of the heuristic's candidates, timed on random activations (and
    residual) of the call's shapes and layouts. nvmath sizes a plan's workspace to the largest that
    any of its candidate algorithms needs and keeps it for the plan's life (execute with
    release_workspace=False, which graph capture needs), and its default memory limit (80 % of the
    device) lets split-K candidates ask for workspaces that grow with M x N. Planned again with the
    chosen algorithm alone, a plan holds that algorithm's workspace only; the same algorithm runs,
    so the same bits (an autotuned split-K winner still keeps its own). (This was built as the
    suspected cause of a BERT-large process's memory growing 3.3x from 32k- to 64k-token batches;
    on the H200 the chosen plans held no workspace at all, ``plans_held``: the cause was the
    operands each plan kept, released in ``_planned``.)"""
    mm = make(stream, None)
    try:
        if autotune > 0:
            mm.reset_operands(**{k: _random_like(operands[k]) for k in ("b", "c") if k in operands}, stream=stream)
            mm.autotune(iterations=int(autotune), stream=stream)
        return make(stream, mm.algorithms[:1])  # copies the algorithm's description into its own plan
    finally:
        mm.free()  # the candidates' plan and workspace (nvmath frees a Matmul's resources only when asked)


# cuBLASLt's FP8 kernels need every dimension a multiple of 16 (torch._scaled_mm only K and N): a
# token count that is not (a padded batch of 3 x 40 tokens) is padded with zero rows for the GEMM,
# and those rows of the result dropped
_FP8_MULTIPLE = 16


def _rows_padded(t, rows: int):
    """``t`` [M, ...] with zero rows appended up to ``rows`` (e4m3 through its bytes: a copy either way)."""
    if t.shape[0] == rows:
        return t
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = torch.cat([raw, raw.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])
    return out.view(t.dtype) if t.dtype == torch.float8_e4m3fn else out


def _padded_to_multiple(x8, *others):
    """(m, x8 and others padded to a multiple of 16 rows); m is the rows to keep of the result."""
    m = x8.shape[0]
    rows = -(-m // _FP8_MULTIPLE) * _FP8_MULTIPLE
    return m, _rows_padded(x8, rows), *(_rows_padded(t, rows) for t in others)


def _random_like(t):
    """Random values in ``t``'s shape, strides and dtype (e4m3: normal x 16, inside +-448)."""
    r = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    v = torch.randn(t.size(), device=t.device, dtype=torch.float16)  # fp16: half the transient memory of fp32
    r.copy_((v * 16).clamp(-E4M3_MAX, E4M3_MAX).to(t.dtype) if t.dtype == torch.float8_e4m3fn else v.to(t.dtype))
    return r


def _preferences(candidates: int):
    """nvmath's plan preferences asking cuBLASLt for up to ``candidates`` algorithms (0: nvmath's
    default, 8): the ones autotuning then times (``_planned``)."""
    if candidates <= 0:
        return None
    from nvmath.linalg.advanced import MatmulPlanPreferences

    return MatmulPlanPreferences(limit=int(candidates))


def _matmul(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum: bool, autotune: int, candidates: int = 0,
            epilog: str = "GELU_BIAS"):
    """D^T = act(W @ X^T * scales + bias) * out_inv_scale in e4m3, column-major, act GELU's tanh form
    (``epilog`` GELU_BIAS) or none (BIAS); returns D [M, N]."""
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    scales = {"a": w_scale, "b": x_scale, "d": out_inv_scale}
    b = x8.t()  # [K, M], column-major: K contiguous

    def make(stream, algorithms=None):
        # fast_accumulation: the same accumulation as the torch._scaled_mm GEMM this replaces
        # (Hopper's FP8 tensor cores without the periodic promotion to fp32), else the two
        # paths would differ in more than the epilogue
        mm = Matmul(w8, b, quantization_scales=scales, stream=stream,
                    options={"result_type": _e4m3_type(), "fast_accumulation": bool(fast_accum)})
        mm.plan(preferences=_preferences(candidates), algorithms=algorithms, epilog=getattr(MatmulEpilog, epilog),
                epilog_inputs={"bias": bias}, stream=stream)
        return mm

    kind, what = _E4M3_EPILOGUES[epilog]
    return _planned((kind, x8.device.index, x8.shape[0], w8.shape[0], w8.shape[1], fast_accum, autotune, candidates),
                    f"{what} for {tuple(x8.shape)} x {tuple(w8.shape)}", make,
                    {"a": w8, "b": b, "quantization_scales": scales, "epilog_inputs": {"bias": bias}},
                    torch.cuda.current_stream(x8.device), autotune)


# the e4m3-output epilogues: the plan cache's kind and what a refusal calls it
_E4M3_EPILOGUES = {"GELU_BIAS": ("gelu", "the GELU epilogue"), "BIAS": ("bias8", "the e4m3-output FP8 GEMM")}


# The GEMM ops are custom_ops with fakes, not triton_ops: their bodies plan (and may autotune)
# a cuBLASLt matmul through nvmath-python on the host at call time, which torch.compile must leave
# opaque; each fake gives the output's shape and dtype.
@torch.library.custom_op("bertqa::fp8_gemm_gelu", mutates_args=())
def fp8_gemm_gelu(x8: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor, w_scale: torch.Tensor,
                  x_scale: torch.Tensor, out_inv_scale: torch.Tensor, fast_accum: bool = False,
                  autotune: int = 0, candidates: int = 0) -> torch.Tensor:
    """e4m3 [M, K] x8, [N, K] w8 -> e4m3 [M, N]: cuBLASLt's GELU_BIAS epilogue on CUDA, the same
    formula in torch elsewhere. Scales are 0-d fp32 tensors (on the device: no host copy).
    ``fast_accum``: Hopper's fast FP8 accumulation (CUDA only; the torch formula accumulates in fp32).
    ``autotune``: see ``_planned``; ``candidates``: how many algorithms it times (``_preferences``;
    CUDA only)."""
    if x8.is_cuda:
        m, x8 = _padded_to_multiple(x8.contiguous())
        return _matmul(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum, autotune, candidates)[:m]
    return fp8_gemm_gelu_reference(x8, w8, bias, w_scale, x_scale, out_inv_scale)


@fp8_gemm_gelu.register_fake
def _(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum=False, autotune=0, candidates=0):
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=torch.float8_e4m3fn)


def gemm_gelu_fp8(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum: bool = False, autotune: int = 0,
                  candidates: int = 0):
    """``fp8_gemm_gelu`` as a plain function: what a module holds (a custom op object does not copy)."""
    return fp8_gemm_gelu(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum, autotune, candidates)


def implementation(on_cuda: bool) -> str:
    """What runs the up-projection + GELU for tensors on CUDA (or not), in words."""
    return ("cuBLASLt GELU_BIAS epilogue (nvmath-python), e4m3 out" if on_cuda
            else "torch (the epilogue's formula; not on CUDA)")


_SATURATES: dict = {}


def epilogue_saturates(device, epilog: str = "GELU_BIAS") -> bool:
    """Whether the e4m3-output epilogue ``epilog`` (GELU_BIAS: ``fp8_gemm_gelu``; BIAS:
    ``fp8_gemm_bias_e4m3``) saturates values past +-448 to +-448 on ``device`` (asked once per
    device and epilogue: a 16 x 16 x 16 GEMM whose every output is 16 * 448 * 448, GELU or not)."""
    if epilog not in _E4M3_EPILOGUES:
        raise ValueError(f"epilog must be one of {', '.join(_E4M3_EPILOGUES)}, not {epilog!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return True  # the torch formula clamps explicitly
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, epilog) not in _SATURATES:
        dev = torch.device("cuda", idx)
        x8 = torch.full((16, 16), E4M3_MAX, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device=dev)
        op = fp8_gemm_gelu if epilog == "GELU_BIAS" else fp8_gemm_bias_e4m3
        y = op(x8, x8, torch.zeros(16, dtype=BIAS_DTYPE, device=dev), one, one, one)
        _SATURATES[idx, epilog] = bool(torch.equal(y.float(), torch.full((16, 16), E4M3_MAX, device=dev)))
    return _SATURATES[idx, epilog]


# --- e4m3 output without an activation: D = e4m3((x8 @ w8^T * scales + bias) * out_inv_scale) -----
# The attention-output and FFN-down GEMMs feed the add + LayerNorm kernel (add_layernorm_fp8.py),
# which reads its y in e4m3 at y's scale as readily as in fp16 (fp8 option dense_output: e4m3).
# Written in e4m3 by the GEMM, y crosses memory as one byte an element instead of two, out of the
# GEMM and into the LayerNorm. cuBLASLt's BIAS epilogue with an e4m3 D does it in the GEMM: the bias
# is added to the fp32 tile, the D scale (out_inv_scale) applied, and the result rounded once. The
# cost is that rounding (relative <= 2^-4) of the sublayer's output before the residual add, where
# the fp16 path rounded it to 2^-11: FasterTransformer's FP8 BERT rounds it to e4m3 too.


def fp8_gemm_bias_e4m3_scaled(x8, w8, bias, w_scale, x_scale, out_inv_scale):
    """The formula in fp32 before the final rounding: the GEMM of the decoded values, the bias,
    the output scale, saturated at +-448."""
    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + bias.float()
    return (y * out_inv_scale.float()).clamp(-E4M3_MAX, E4M3_MAX)


def fp8_gemm_bias_e4m3_reference(x8, w8, bias, w_scale, x_scale, out_inv_scale):
    """``fp8_gemm_bias_e4m3_scaled`` rounded to e4m3 (nearest even): e4m3 [M, N]."""
    return fp8_gemm_bias_e4m3_scaled(x8, w8, bias, w_scale, x_scale, out_inv_scale).to(torch.float8_e4m3fn)


@torch.library.custom_op("bertqa::fp8_gemm_bias_e4m3", mutates_args=())
def fp8_gemm_bias_e4m3(x8: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor, w_scale: torch.Tensor,
                       x_scale: torch.Tensor, out_inv_scale: torch.Tensor, fast_accum: bool = False,
                       autotune: int = 0, candidates: int = 0) -> torch.Tensor:
    """e4m3 [M, K] x8, [N, K] w8 -> e4m3 [M, N], (x8 @ w8^T * scales + bias) * out_inv_scale: cuBLASLt's
    BIAS epilogue with an e4m3 result on CUDA (the bias in fp16, ``bias_for_epilogue``), the formula
    in torch elsewhere. Arguments as ``fp8_gemm_gelu``'s."""
    if x8.is_cuda:
        if bias.dtype != BIAS_DTYPE:
            raise ValueError(f"the e4m3-output GEMM through nvmath takes its bias in C's type, fp16, not {bias.dtype} "
                             "(bias_for_epilogue converts it)")
        m, x8 = _padded_to_multiple(x8.contiguous())
        return _matmul(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum, autotune, candidates, "BIAS")[:m]
    return fp8_gemm_bias_e4m3_reference(x8, w8, bias, w_scale, x_scale, out_inv_scale)


@fp8_gemm_bias_e4m3.register_fake
def _(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum=False, autotune=0, candidates=0):
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=torch.float8_e4m3fn)


def gemm_bias_e4m3_fp8(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum: bool = False, autotune: int = 0,
                       candidates: int = 0):
    """``fp8_gemm_bias_e4m3`` as a plain function (what a module holds)."""
    return fp8_gemm_bias_e4m3(x8, w8, bias, w_scale, x_scale, out_inv_scale, fast_accum, autotune, candidates)


def bias_for_epilogue(bias: Optional[torch.Tensor], n: int, device) -> torch.Tensor:
    """The bias as the epilogue takes it: fp16, zeros when the layer has none. For an e4m3 result
    nvmath declares C as fp16, and cuBLASLt's FP8 kernels take the bias in C's type (a bf16 bias
    was refused: CUBLAS_STATUS_NOT_SUPPORTED on an H200)."""
    if bias is None:
        return torch.zeros(n, dtype=BIAS_DTYPE, device=device)
    return bias.detach().to(BIAS_DTYPE).contiguous()


# --- 16-bit output: D = x8 @ w8^T * scales + bias (+ residual), fp16 ------------------------------
# The FP8 GEMMs with a 16-bit output (QKV, attention output, FFN down; FFN up where the hidden
# activations stay 16-bit) write fp16 with their bias. torch._scaled_mm runs
# them through cuBLASLt at its heuristic's first algorithm; planned here instead, the same GEMM can
# be autotuned (``_planned``): on BERT-large's attention-output shape (32,768 x 1,024 x 1,024) an
# autotuned algorithm took 60.8 us against 71.6 us for the heuristic's (H100, kernel_bench.py).
#
# The residual in the GEMM: a BERT layer adds its residual right after the attention-output and
# FFN-down GEMMs, then runs LayerNorm. Inductor fuses that add into the LayerNorm + e4m3 quantize
# pass, which then reads two [tokens, hidden] fp16 tensors (the GEMM's output and the residual).
# cuBLASLt can add the residual as its C operand (beta 1) in the GEMM's epilogue, where the tile is
# still in registers: the LayerNorm pass then reads one tensor. Numerics: the sum is rounded to fp16
# once, in the GEMM, where the fused pass kept it in fp32 (one fp16 rounding of the LayerNorm's
# input more).


def fp8_gemm_bias_reference(x8, w8, bias, w_scale, x_scale):
    """D = x8 @ w8^T * scales + bias in fp32, rounded once to the bias's dtype (the output's: fp16
    on CUDA, where cuBLASLt takes the bias in the output's type)."""
    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + bias.float()
    return y.to(bias.dtype)


def fp8_gemm_add_reference(x8, w8, bias, w_scale, x_scale, residual):
    """The formula in fp32, rounded once to the residual's dtype."""
    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + residual.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(residual.dtype)


def _matmul_16(x8, w8, bias, w_scale, x_scale, residual, fast_accum: bool, autotune: int, candidates: int = 0):
    """D^T = W @ X^T * scales + bias (+ R^T), fp16 column-major; returns D [M, N] (see _matmul)."""
    import nvmath
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    scales = {"a": w_scale, "b": x_scale}
    b = x8.t()
    c = None if residual is None else residual.t()

    def make(stream, algorithms=None):
        kw = {} if c is None else {"c": c, "beta": 1.0}
        mm = Matmul(w8, b, quantization_scales=scales, stream=stream,
                    options={"result_type": nvmath.CudaDataType.CUDA_R_16F, "fast_accumulation": bool(fast_accum)},
                    **kw)
        mm.plan(preferences=_preferences(candidates), algorithms=algorithms, epilog=MatmulEpilog.BIAS,
                epilog_inputs={"bias": bias}, stream=stream)
        return mm

    operands = {"a": w8, "b": b, "quantization_scales": scales, "epilog_inputs": {"bias": bias}}
    if c is not None:
        operands["c"] = c
    what = "the residual GEMM" if c is not None else "the FP8 GEMM"
    return _planned(("add" if c is not None else "bias", x8.device.index, x8.shape[0], w8.shape[0], w8.shape[1],
                     fast_accum, autotune, candidates),
                    f"{what} for {tuple(x8.shape)} x {tuple(w8.shape)}", make, operands,
                    torch.cuda.current_stream(x8.device), autotune)


@torch.library.custom_op("bertqa::fp8_gemm_bias", mutates_args=())
def fp8_gemm_bias(x8: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor, w_scale: torch.Tensor,
                  x_scale: torch.Tensor, fast_accum: bool = False, autotune: int = 0,
                  candidates: int = 0) -> torch.Tensor:
    """e4m3 [M, K] x8, [N, K] w8 -> [M, N] in the bias's dtype (fp16 on CUDA): cuBLASLt planned through
    nvmath-python with the bias in its epilogue on CUDA (``autotune``: see ``_planned``), the same
    formula in torch elsewhere."""
    if x8.is_cuda:
        if bias.dtype != torch.float16:
            raise ValueError(f"the FP8 GEMM through nvmath writes fp16 and takes its bias in fp16, not {bias.dtype}")
        m, x8 = _padded_to_multiple(x8.contiguous())
        return _matmul_16(x8, w8, bias, w_scale, x_scale, None, fast_accum, autotune, candidates)[:m]
    return fp8_gemm_bias_reference(x8, w8, bias, w_scale, x_scale)


@fp8_gemm_bias.register_fake
def _(x8, w8, bias, w_scale, x_scale, fast_accum=False, autotune=0, candidates=0):
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=bias.dtype)


def gemm_bias_fp8(x8, w8, bias, w_scale, x_scale, fast_accum: bool = False, autotune: int = 0, candidates: int = 0):
    """``fp8_gemm_bias`` as a plain function (what a module holds)."""
    return fp8_gemm_bias(x8, w8, bias, w_scale, x_scale, fast_accum, autotune, candidates)


@torch.library.custom_op("bertqa::fp8_gemm_add", mutates_args=())
def fp8_gemm_add(x8: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor, w_scale: torch.Tensor,
                 x_scale: torch.Tensor, residual: torch.Tensor, fast_accum: bool = False,
                 autotune: int = 0, candidates: int = 0) -> torch.Tensor:
    """e4m3 [M, K] x8, [N, K] w8, fp16 [M, N] residual -> fp16 [M, N]: cuBLASLt with the residual
    as C (beta 1) and the bias in its epilogue on CUDA, the same formula in torch elsewhere."""
    if x8.is_cuda:
        m, x8, residual = _padded_to_multiple(x8.contiguous(), residual.contiguous())
        return _matmul_16(x8, w8, bias, w_scale, x_scale, residual, fast_accum, autotune, candidates)[:m]
    return fp8_gemm_add_reference(x8, w8, bias, w_scale, x_scale, residual)


@fp8_gemm_add.register_fake
def _(x8, w8, bias, w_scale, x_scale, residual, fast_accum=False, autotune=0, candidates=0):
    return residual.new_empty((x8.shape[0], w8.shape[0]))


def gemm_add_fp8(x8, w8, bias, w_scale, x_scale, residual, fast_accum: bool = False, autotune: int = 0,
                 candidates: int = 0):
    """``fp8_gemm_add`` as a plain function (what a module holds)."""
    return fp8_gemm_add(x8, w8, bias, w_scale, x_scale, residual, fast_accum, autotune, candidates)
