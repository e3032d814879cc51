"""INT8 encoder GEMMs (``torch._int_mm``), W8A8 with dynamic per-token activation scales. The
per-layer sensitivity sweep that picks which encoder layers stay in 16 bits, for INT8 and FP8
alike, is layer_sensitivity.py's.

INT8 (W8A8, dynamic): weights quantized once per output channel (absmax / 127), activations
per token at run time (absmax / 127 of each row), the product in int32 through cuBLASLt's
int8 GEMM (``torch._int_mm``), rescaled by both scales with the bias added. Under torch.compile
inductor fuses the per-token quantization into the kernel that produced the activation and
the rescale into the GEMM's consumer. BERT's LayerNorm outputs have a few outlier channels,
which is what per-token activation scales (rather than one per tensor) are for; the layers
that still suffer are found by the sweep and left in 16 bits.
"""
from __future__ import annotations

from typing import Iterable

from .fp8_rules import GEMM_KINDS, parse_gemms
from .fp8_surgery import layer_index, target_linears

INT8_MAX = 127.0
_EPS = 1e-8


def _int8_linear_class():
    import torch
    from torch import nn

    class Int8Linear(nn.Module):
        """y = x @ W^T + b with W int8 per output channel and x int8 per token, int32 accumulation."""

        def __init__(self, weight, bias):
            super().__init__()
            n, k = weight.shape
            if n % 8 or k % 8:
                raise ValueError(f"int8 GEMMs need in/out features that are multiples of 8, got {k} -> {n}")
            self.in_features, self.out_features = int(k), int(n)
            self.act_dtype = weight.dtype
            w = weight.detach().float()
            scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / INT8_MAX)  # [N, 1]
            # stored [K, N] so the GEMM's second operand needs no transpose at run time
            self.register_buffer("weight_int8", (w / scale).round().clamp(-INT8_MAX, INT8_MAX)
                                 .to(torch.int8).t().contiguous())
            self.register_buffer("weight_scale", scale.reshape(1, n))
            self.register_buffer("bias", None if bias is None else bias.detach().float())

        def forward(self, x):
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features).float()
            s = x2.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / INT8_MAX  # [M, 1] per token
            q = (x2 / s).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            if q.shape[0] > 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
                acc = torch._int_mm(q, self.weight_int8).float()
            else:
                acc = q.float() @ self.weight_int8.float()
            y = acc * s * self.weight_scale
            if self.bias is not None:
                y = y + self.bias
            return y.to(self.act_dtype).reshape(*lead, self.out_features)

    return Int8Linear


_INT8_CLASS = None


def int8_linear_class():
    global _INT8_CLASS
    if _INT8_CLASS is None:
        _INT8_CLASS = _int8_linear_class()
    return _INT8_CLASS


def swap_to_int8(model, *, gemms=GEMM_KINDS, keep_layers: Iterable[int] = ()) -> dict:
    """Replace encoder Linears of the kinds in ``gemms`` by Int8Linear, in place, except in
    ``keep_layers``. Returns what was done (swapped names, kept names)."""
    Int8Linear = int8_linear_class()
    keep = {int(i) for i in keep_layers}
    swapped, kept = [], []
    for name in target_linears(model, parse_gemms(gemms)):
        if layer_index(name) in keep:
            kept.append(name)
            continue
        parent, _, child = name.rpartition(".")
        lin = model.get_submodule(name)
        setattr(model.get_submodule(parent), child, Int8Linear(lin.weight, lin.bias))
        swapped.append(name)
    return {"swapped": swapped, "kept": kept}
