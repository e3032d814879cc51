"""The FP8 (e4m3) arithmetic every FP8 piece shares (the kernels beside this module, the FP8
modules and the model surgery in backends/transforms/): the e4m3 range, scales, saturating casts,
and whether a GPU's FP8 GEMM saturates its own output. The option vocabularies (scalings, GELU
forms, ...) are the surgery's, in backends/transforms/fp8_rules.py. torch is imported in the
functions, so that importing this module (the variant registry does, through fp8_rules' users)
does not import torch."""
from __future__ import annotations

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-12  # the smallest amax a scale is taken from (an all-zero tensor still gets a finite scale)


# --------------------------------------------------------------------------- quantization math

def weight_scale(w, per_channel: bool):
    """fp32 scale so that w / scale fits ±448: [N, 1] per output channel, or a 0-d tensor."""
    import torch

    a = w.detach().float().abs()
    amax = a.amax(dim=1, keepdim=True) if per_channel else a.amax()
    return (amax.clamp(min=_EPS) / E4M3_MAX).to(torch.float32)


def static_act_scale(amax: float, margin: float = 2.0) -> float:
    """Static per-tensor activation scale from a calibrated amax (headroom ``margin``)."""
    return max(float(amax) * float(margin), _EPS) / E4M3_MAX


def saturate_to_e4m3(x, inv_scale=None, *, scale=None):
    """x * inv_scale, or x / scale, or x itself, in fp32, clamped to ±448 and cast to float8_e4m3fn.

    The clamp is explicit because e4m3fn has no infinity and what a bare cast does past ±448
    depends on torch's version and the path: eager casts before torch 2.12 round |x| > 464 to
    e4m3fn's NaN code; 2.12 made the eager casts saturate (pytorch/pytorch#178817; the torch 2.13
    installed here gives ±448 on the CPU, up to ±inf); Triton's conversion saturates. With the
    clamp first every path gives ±448 (a NaN input stays NaN).

    ``scale`` divides, ``inv_scale`` multiplies: x / s and x * (1 / s) differ in fp32's last bit
    for some x, which moves a value at an e4m3 rounding tie to the other neighbour, so each caller
    keeps the arithmetic its numbers were checked with."""
    import torch

    if inv_scale is not None and scale is not None:
        raise ValueError("saturate_to_e4m3 takes inv_scale or scale, not both")
    y = x.float()
    if scale is not None:
        y = y / scale
    elif inv_scale is not None:
        y = y * inv_scale
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_e4m3(x, scale):
    """The tensor x / scale, saturated to the e4m3 range (``saturate_to_e4m3``), as float8_e4m3fn
    (not to be confused with the model-level FP8 swap: torch_builder.calibrate_and_swap_fp8)."""
    return saturate_to_e4m3(x, scale=scale)


def dequantize_e4m3(q, scale):
    """e4m3 ``q`` back to fp32 values: q * scale (``quantize_e4m3``'s inverse, up to its rounding)."""
    return q.float() * scale


def e4m3_codes_apart(a, b):
    """How many e4m3 codes lie between float8_e4m3fn tensors a and b, elementwise (magnitude codes
    are ordered; through zero the two magnitudes add)."""
    import torch

    ua, ub = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    ma, mb = ua & 0x7F, ub & 0x7F
    return torch.where((ua >> 7) == (ub >> 7), (ma - mb).abs(), ma + mb)


_GEMM_SATURATES: dict = {}


def gemm_writes_saturated_e4m3(device) -> bool:
    """Whether ``torch._scaled_mm`` writing ``float8_e4m3fn`` on this device saturates a value past
    ±448 to ±448. e4m3fn has no infinity, so an unsaturated conversion gives NaN, and kernels
    differ: the CPU path through oneDNN writes NaN on Xeons with AMX and ±448 on AMD EPYC. Only
    CUDA (cuBLASLt) is asked, with a GEMM whose every output overflows, once per device; a CPU
    or a device whose kernel fails the probe gets the explicit path (wide GEMM output, clamp,
    cast), so no result depends on an unchecked kernel property."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _GEMM_SATURATES:
        _GEMM_SATURATES[key] = _probe_saturation(torch.device("cuda", key[1]))
    return _GEMM_SATURATES[key]


def _probe_saturation(device) -> bool:
    """One 16x16x16 e4m3 GEMM with outputs of ±16*448*448, far past ±448: saturated means every
    output is exactly ±448 with its sign (rows of -448 give -448), never NaN."""
    import torch

    a = torch.full((16, 16), E4M3_MAX, device=device)
    a[8:] = -E4M3_MAX
    one = torch.ones((), dtype=torch.float32, device=device)
    try:
        y = torch._scaled_mm(a.to(torch.float8_e4m3fn), torch.full((16, 16), E4M3_MAX, device=device)
                             .to(torch.float8_e4m3fn).t(), scale_a=one, scale_b=one,
                             out_dtype=torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError):
        return False
    want = torch.full_like(y, E4M3_MAX)
    want[8:] = -E4M3_MAX
    return bool(torch.equal(y, want))
