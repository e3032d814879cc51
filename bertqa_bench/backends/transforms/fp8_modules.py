"""The FP8 encoder modules that ``fp8_surgery.swap_to_fp8`` puts in place of a BERT layer's
linear layers: ``Fp8Linear`` (one e4m3 GEMM through ``torch._scaled_mm`` or cuBLASLt),
``Fp8Intermediate`` (the FFN's first half, its GELU fused or in e4m3) and ``Fp8SelfAttention``
(the fused QKV GEMM and attention). The e4m3 arithmetic they use is kernels/fp8_math.py's, the
option vocabularies fp8_rules.py's; this
module imports torch, so ``fp8_surgery`` (and the variant registry above it) loads it only when a
model is swapped."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.add_layernorm_fp8 import add_layernorm_fp8
from ...kernels.cublaslt_epilogues import (bias_for_epilogue, gemm_add_fp8, gemm_bias_e4m3_fp8, gemm_bias_fp8,
                                           gemm_gelu_fp8)
from ...kernels.fp8_math import _EPS, E4M3_MAX, gemm_writes_saturated_e4m3, quantize_e4m3, saturate_to_e4m3, weight_scale
from ...kernels.gelu_fp8 import gelu_tanh_fp8
from .fp8_rules import _QKV, FFN_GELUS, GELU_CLASSES, SCALINGS


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W and x in float8_e4m3fn, fp32 accumulation, 16-bit output."""

    def __init__(self, weight, bias, *, scaling: str = "tensor", act_scale: Optional[float] = None,
                 fast_accum: bool = False, cast_output: bool = True, out_scale: Optional[float] = None):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, not '{scaling}'")
        if scaling != "rowwise" and act_scale is None:
            raise ValueError(f"scaling '{scaling}' needs a calibrated static act_scale")
        if out_scale is not None and scaling != "tensor":
            raise ValueError(f"an FP8 output (out_scale) needs static per-tensor scales, not scaling '{scaling}'")
        n, k = weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"FP8 GEMMs need in/out features that are multiples of 16, got {k} -> {n}")
        self.in_features, self.out_features = int(k), int(n)
        self.scaling = scaling
        self.fast_accum = bool(fast_accum)
        self.cast_output = bool(cast_output)
        self.act_dtype = weight.dtype  # what the rest of the model computes in
        per_channel = scaling != "tensor"
        ws = weight_scale(weight, per_channel)
        # [N, K] row-major; forward passes .t(): the column-major [K, N] operand _scaled_mm needs.
        self.register_buffer("weight_fp8", quantize_e4m3(weight.detach(), ws).contiguous())
        self.register_buffer("weight_scale", ws.reshape(1, n).contiguous() if per_channel else ws.reshape(()))
        # The rowwise kernels write bf16 only; tensorwise writes the model's 16-bit dtype.
        # out_scale: the GEMM writes e4m3 itself (y / out_scale, saturated), so its consumer
        # reads one byte per element instead of two and no separate quantize pass runs.
        if out_scale is not None:
            self.out_dtype = torch.float8_e4m3fn
        elif scaling == "tensor" and self.act_dtype in (torch.float16, torch.bfloat16):
            self.out_dtype = self.act_dtype
        elif self.act_dtype == torch.float32 and scaling == "tensor":
            self.out_dtype = torch.float32  # CPU/fp32 tests; _scaled_mm takes no bias with fp32 output
        else:
            self.out_dtype = torch.bfloat16
        # What the GEMM itself writes. An e4m3 output saturates only where the kernel is
        # known to (gemm_writes_saturated_e4m3); elsewhere the GEMM writes a wide dtype and
        # forward clamps to ±448 before the cast: fp32 on CPU (exact for what follows),
        # bf16 on a GPU (torch's FP8 GEMM takes a bias there; its range has room for any
        # overflow, so the clamp, not the dtype, bounds the result).
        self.gemm_dtype = self.out_dtype
        if out_scale is not None and not gemm_writes_saturated_e4m3(weight.device):
            self.gemm_dtype = torch.float32 if weight.device.type == "cpu" else torch.bfloat16
        b = None if bias is None else bias.detach()
        # the bias before the output scale is folded in: what a GELU epilogue adds before GELU
        # (Fp8Intermediate with gelu "epilogue")
        self.register_buffer("bias_unscaled", None if b is None or out_scale is None else b.float())
        self._bias_in_gemm = b is not None and self.gemm_dtype != torch.float32
        self.out_scale_value = None if out_scale is None else float(out_scale)
        if out_scale is not None:
            # The output scale is folded into scale_a and the bias rather than passed as
            # scale_result, whose direction differs between torch's CPU and cuBLASLt paths
            # (CPU divides by it, cuBLASLt's D scale multiplies); the bias in bf16 when the
            # GEMM adds it (torch takes bf16 for an FP8 output on both paths), else fp32.
            b = None if b is None else b.float() / float(out_scale)
            bias_dtype = torch.bfloat16 if self._bias_in_gemm else torch.float32
        else:
            bias_dtype = self.out_dtype if self._bias_in_gemm else torch.float32
        self.register_buffer("bias", None if b is None else b.to(bias_dtype))
        self.act_scale_value = None if act_scale is None else float(act_scale)
        self.register_buffer("act_scale", None if act_scale is None
                             else torch.tensor(float(act_scale), dtype=torch.float32, device=weight.device))
        self._inv_act_scale = None if act_scale is None else 1.0 / float(act_scale)
        self.register_buffer("gemm_scale_a", None if out_scale is None else torch.tensor(
            float(act_scale) / float(out_scale), dtype=torch.float32, device=weight.device))

    @classmethod
    def from_linear(cls, linear, **kw):
        return cls(linear.weight, linear.bias, **kw)

    residual_in_gemm = False
    # the GEMM runs through cuBLASLt planned by nvmath-python (cublaslt_epilogues.fp8_gemm_bias)
    # instead of torch._scaled_mm (use_cublaslt)
    planned_gemm = False
    # > 0: every GEMM of this layer planned through nvmath-python (this one under use_cublaslt,
    # the residual GEMM, a GELU epilogue reading this layer's weights) has its algorithm
    # autotuned when its shape is planned (cublaslt_epilogues._planned)
    cublaslt_autotune = 0
    # > 0: how many algorithms cuBLASLt is asked for, the ones autotuning times (0: nvmath's 8)
    cublaslt_candidates = 0

    def use_cublaslt(self, autotune: int = 0) -> None:
        """Run this GEMM (fp16 out, bias in the epilogue) through cuBLASLt planned by nvmath-python,
        whose algorithm can be autotuned per shape (``autotune`` > 0), instead of torch._scaled_mm
        at cuBLASLt's heuristic choice."""
        self._check_16bit_gemm("cuBLASLt through nvmath-python")

        self._gemm_bias = gemm_bias_fp8
        self._register_epilogue_bias()
        self.planned_gemm = True
        self.cublaslt_autotune = int(autotune)

    def _check_16bit_gemm(self, what: str) -> None:
        if self.scaling != "tensor" or self.out_scale_value is not None:
            raise ValueError(f"{what} needs per-tensor scales and a 16-bit output "
                             f"(scaling '{self.scaling}', out_scale {self.out_scale_value})")
        if self.act_dtype == torch.bfloat16:
            raise ValueError(f"{what} runs in fp16 (cuBLASLt's FP8 kernels take the bias and C in the "
                             "output's type); this model computes in bf16")

    def _register_epilogue_bias(self) -> None:
        """The bias as the nvmath-planned GEMMs take it: in the output's dtype, zeros when the
        layer has none (the BIAS epilogue always adds one)."""
        if getattr(self, "cublaslt_bias", None) is None:
            bias = self.bias if self.bias is not None else torch.zeros(
                self.out_features, dtype=self.act_dtype, device=self.weight_fp8.device)
            self.register_buffer("cublaslt_bias", bias.to(self.act_dtype))

    # the scale of the e4m3 output ``forward_e4m3`` writes (None: none; fp8 option dense_output: e4m3)
    e4m3_out_scale = None

    def write_e4m3_for_layernorm(self, out_scale: float) -> None:
        """``forward_e4m3`` writes this GEMM's output, bias included, in e4m3 at ``out_scale`` (a
        scale calibrated on it), for the add + LayerNorm kernel after it (Fp8AddLayerNorm reads it
        at that scale), through cuBLASLt's BIAS epilogue planned by nvmath-python. ``forward``
        stays the 16-bit GEMM: the padded model, which adds its residual itself, still calls it."""
        self._check_16bit_gemm("an e4m3 output for the LayerNorm kernel")
        # fp16: cuBLASLt takes an e4m3 result's bias in C's type, which nvmath declares fp16 (a bf16
        # model is refused just above, and by swap_to_fp8 before it swaps anything)
        self.register_buffer("e4m3_out_bias", bias_for_epilogue(self.bias, self.out_features, self.weight_fp8.device))
        self._gemm_bias_e4m3 = gemm_bias_e4m3_fp8
        self.e4m3_out_scale = float(out_scale)
        self.register_buffer("e4m3_out_inv_scale", torch.tensor(1.0 / float(out_scale), dtype=torch.float32,
                                                                device=self.weight_fp8.device))

    def forward_e4m3(self, x):
        """e4m3 [*, out_features], the codes of ``self(x)`` over ``e4m3_out_scale`` (rounded once, from fp32)."""
        if self.e4m3_out_scale is None:
            raise RuntimeError("forward_e4m3 needs write_e4m3_for_layernorm first (fp8 option dense_output: e4m3)")
        lead = x.shape[:-1]
        xq, sa = self.quantize_input(x.reshape(-1, self.in_features))
        y8 = self._gemm_bias_e4m3(xq, self.weight_fp8, self.e4m3_out_bias, self.weight_scale, sa,
                                  self.e4m3_out_inv_scale, self.fast_accum, self.cublaslt_autotune,
                                  self.cublaslt_candidates)
        return y8.reshape(*lead, self.out_features)

    def add_residual_in_gemm(self) -> None:
        """``plus`` adds the residual in the GEMM (cuBLASLt's C operand, cublaslt_epilogues.py)
        instead of leaving it to the next elementwise pass."""
        self._check_16bit_gemm("the residual in the GEMM")

        self._gemm_add = gemm_add_fp8
        self._register_epilogue_bias()
        self.residual_in_gemm = True

    def plus(self, x, residual):
        """self(x) + residual, the add in the GEMM when ``add_residual_in_gemm`` was called."""
        if not self.residual_in_gemm:
            return self(x) + residual
        lead = x.shape[:-1]
        xq, sa = self.quantize_input(x.reshape(-1, self.in_features))
        y = self._gemm_add(xq, self.weight_fp8, self.cublaslt_bias, self.weight_scale, sa,
                           residual.reshape(-1, self.out_features), self.fast_accum, self.cublaslt_autotune,
                           self.cublaslt_candidates)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}, "
                f"act_scale={self.act_scale_value}, fast_accum={self.fast_accum}, out_dtype={self.out_dtype}"
                + ("" if self.gemm_dtype == self.out_dtype else f" (GEMM {self.gemm_dtype}, clamped)")
                + ("" if self.out_scale_value is None else f", out_scale={self.out_scale_value}")
                + (", residual added in the GEMM" if self.residual_in_gemm else "")
                + ("" if self.e4m3_out_scale is None else f", e4m3 out at {self.e4m3_out_scale:g} for the LayerNorm")
                + (", cuBLASLt through nvmath" if self.planned_gemm else "")
                + (f", algorithm autotuned x{self.cublaslt_autotune}"
                   + (f" among up to {self.cublaslt_candidates}" if self.cublaslt_candidates else "")
                   if self.cublaslt_autotune and (self.planned_gemm or self.residual_in_gemm) else ""))

    def quantize_input(self, x2):
        """(fp8 [M, K], scale_a) for a [M, K] activation. An input already in e4m3 is taken as
        quantized with this layer's static act_scale (its producer did it: Fp8Intermediate)."""
        if x2.dtype == torch.float8_e4m3fn:
            if self.scaling != "tensor":
                raise ValueError(f"an e4m3 input needs a static per-tensor act_scale, not scaling '{self.scaling}'")
            return x2, self.act_scale
        if self.scaling == "rowwise":
            amax = x2.abs().amax(dim=1, keepdim=True).float()
            s = amax.clamp(min=_EPS) / E4M3_MAX
            return saturate_to_e4m3(x2, scale=s), s
        q = saturate_to_e4m3(x2, self._inv_act_scale)
        if self.scaling == "static-rowwise":  # rowwise kernel: scale_a must be [M, 1]
            return q, self.act_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        return q, self.act_scale

    def forward(self, x):
        lead = x.shape[:-1]
        xq, sa = self.quantize_input(x.reshape(-1, self.in_features))
        if self.planned_gemm:
            y = self._gemm_bias(xq, self.weight_fp8, self.cublaslt_bias, self.weight_scale, sa, self.fast_accum,
                                self.cublaslt_autotune, self.cublaslt_candidates)
            return y.reshape(*lead, self.out_features)
        if self.gemm_scale_a is not None:
            sa = self.gemm_scale_a
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=sa, scale_b=self.weight_scale,
                             bias=self.bias if self._bias_in_gemm else None, out_dtype=self.gemm_dtype,
                             use_fast_accum=self.fast_accum)
        if self.bias is not None and not self._bias_in_gemm:
            y = y + self.bias
        if self.gemm_dtype != self.out_dtype:  # e4m3 out, saturated here, not by whatever the cast does past ±448
            y = saturate_to_e4m3(y)
        y = y.reshape(*lead, self.out_features)
        if self.out_scale_value is not None:
            return y  # e4m3, y / out_scale: its consumer dequantizes
        return y.to(self.act_dtype) if self.cast_output else y


class Fp8Intermediate(nn.Module):
    """A BERT layer's FFN up-projection and activation with the hidden activations in e4m3.

    Drop-in for transformers' BertIntermediate (``dense`` then ``intermediate_act_fn``): the
    FP8 up-projection writes e4m3 (``out_scale``), the activation reads it, and its result is
    quantized with the FFN down-projection's static input scale, so the down-projection takes
    it as it is. The [tokens, intermediate] tensor crosses memory as one byte per element
    twice instead of two bytes out of the GEMM, two in and one out of GELU + quantize; under
    torch.compile dequantize, GELU and quantize are one elementwise kernel. The cost is one
    more e4m3 rounding, of the GELU's input. Measured on an H100: +2.6% packed, not more,
    because that kernel is bound by erf-GELU's instructions, not by its bytes (``gelu``
    "tanh": gelu_fp8.py).
    """

    def __init__(self, dense, act_fn, down_act_scale: float, gelu: str = "exact"):
        super().__init__()
        if dense.out_scale_value is None:
            raise ValueError("Fp8Intermediate needs an up-projection that writes FP8 (out_scale)")
        if gelu not in FFN_GELUS:
            raise ValueError(f"gelu must be one of {FFN_GELUS}, not '{gelu}'")
        if gelu != "exact" and type(act_fn).__name__ not in GELU_CLASSES:
            raise ValueError(f"gelu '{gelu}' replaces a GELU; this layer's activation is {type(act_fn).__name__}")
        if gelu == "epilogue" and dense.scaling != "tensor":
            raise ValueError(f"gelu 'epilogue' needs per-tensor scales, not scaling '{dense.scaling}'")
        self._tanh_gelu = self._epilogue = None
        if gelu == "tanh":  # bound here, not in forward: nothing is imported inside traced code
            self._tanh_gelu = gelu_tanh_fp8
        if gelu == "epilogue":
            self._epilogue = gemm_gelu_fp8
            self.register_buffer("epilogue_bias", bias_for_epilogue(dense.bias_unscaled, dense.out_features,
                                                                    dense.weight_fp8.device))
            self.register_buffer("down_inv_scale", torch.tensor(1.0 / float(down_act_scale), dtype=torch.float32,
                                                                device=dense.weight_fp8.device))
        self.dense = dense
        self.intermediate_act_fn = act_fn
        self.gelu = gelu
        self.out_scale_value = float(dense.out_scale_value)
        self._inv_down_scale = 1.0 / float(down_act_scale)

    def extra_repr(self) -> str:
        d = self.dense
        tuned = self.gelu == "epilogue" and d.cublaslt_autotune
        among = f" among up to {d.cublaslt_candidates}" if d.cublaslt_candidates else ""
        return (f"hidden=e4m3, gelu={self.gelu}, down_act_scale={1.0 / self._inv_down_scale}"
                + (f", epilogue algorithm autotuned x{d.cublaslt_autotune}{among}" if tuned else ""))

    def forward(self, hidden_states):
        if self._epilogue is not None:  # cublaslt_epilogues: GEMM, bias, GELU and e4m3 out in one cuBLASLt kernel
            d = self.dense
            lead = hidden_states.shape[:-1]
            x8, sa = d.quantize_input(hidden_states.reshape(-1, d.in_features))
            h8 = self._epilogue(x8, d.weight_fp8, self.epilogue_bias, d.weight_scale, sa, self.down_inv_scale,
                                d.fast_accum, d.cublaslt_autotune, d.cublaslt_candidates)
            return h8.reshape(*lead, d.out_features)
        if self._tanh_gelu is not None:  # gelu_fp8: one Triton kernel on CUDA, e4m3 in and out
            return self._tanh_gelu(self.dense(hidden_states), self.out_scale_value, self._inv_down_scale)
        h = self.intermediate_act_fn(self.dense(hidden_states).float() * self.out_scale_value)
        return saturate_to_e4m3(h, self._inv_down_scale)


class Fp8SelfAttention(nn.Module):
    """BERT self-attention with query/key/value as one FP8 GEMM (``qkv``). Its output is 16-bit,
    or e4m3 when swap_to_fp8 gives it an ``out_scale`` (``attention: fp8``): the packed encoder
    then reads Q, K and V in e4m3 for cuDNN's FP8 attention. ``o_inv_scale`` (set by swap_to_fp8)
    is the scale the packed encoder's attention writes its output in, e4m3, for the FP8
    attention-output GEMM: cuDNN's FP8 attention, or the 16-bit Triton kernel with
    ``attention_output: e4m3``. This module's own forward is the padded path: it decodes an e4m3
    QKV back to 16 bits and runs SDPA in 16 bits, with a 16-bit output.

    Drop-in for transformers' BertSelfAttention in an encoder: takes (hidden_states,
    attention_mask, ...), ignores caches/cross-attention kwargs, returns (output, None).
    """

    def __init__(self, attn, *, act_scale: Optional[float], scaling: str, fast_accum: bool,
                 out_scale: Optional[float] = None):
        super().__init__()
        q, k, v = (getattr(attn, n) for n in _QKV)
        self.num_heads = int(attn.num_attention_heads)
        self.head_dim = int(attn.attention_head_size)
        self.scaling_factor = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        w = torch.cat([q.weight, k.weight, v.weight], dim=0)
        b = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias], dim=0)
        # cast_output=False: SDPA runs in the GEMM's output dtype, saving a cast pass over q/k/v.
        # out_scale: Q, K and V in e4m3 (x out_scale), for FP8 attention on the packed path
        # (cudnn_fp8_attention.py, or varlen_attention.py's e4m3 inputs); this padded forward
        # decodes them for SDPA.
        self.qkv = Fp8Linear(w, b, scaling=scaling, act_scale=act_scale, fast_accum=fast_accum,
                              cast_output=False, out_scale=out_scale)
        self.register_buffer("qkv_out_scale", None if out_scale is None else torch.tensor(
            float(out_scale), dtype=torch.float32, device=w.device))
        # 1 / the attention-output GEMM's static input scale: FP8 attention writes its output
        # in that scale (set by swap_to_fp8 once that GEMM is FP8)
        self.register_buffer("o_inv_scale", None)

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        bsz, seq = hidden_states.shape[:2]
        qkv = self.qkv(hidden_states)
        if qkv.dtype == torch.float8_e4m3fn:
            qkv = (qkv.float() * self.qkv_out_scale).to(self.qkv.act_dtype)
        qkv = qkv.view(bsz, seq, 3, self.num_heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling_factor)
        out = out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim)
        return out.to(self.qkv.act_dtype), None  # back to the model dtype (free when fused downstream)


class Fp8AddLayerNorm(nn.Module):
    """A BERT layer's residual add + LayerNorm whose output also feeds an FP8 GEMM: ``add_norm(y,
    residual)`` returns (x, x8), the 16-bit LayerNorm output (the next residual) and x quantized
    at that GEMM's static input scale, from one kernel (kernels/add_layernorm_fp8.py; fp8 option
    ``layernorm: triton``), where Inductor's fused pass wrote x and the GEMM's quantize read it
    again in the same kernel. The consumer takes x8 as it is (``Fp8Linear.quantize_input``).

    Drop-in for the LayerNorm it replaces: its forward is that LayerNorm (the padded path, which
    adds the residual itself); the packed encoder calls ``add_norm``."""

    def __init__(self, norm: nn.LayerNorm, consumer_act_scale: float):
        super().__init__()
        if tuple(norm.normalized_shape) != (norm.weight.shape[0],) or norm.bias is None:
            raise ValueError("Fp8AddLayerNorm replaces a LayerNorm over the last dimension with weight and bias")
        self.normalized_shape = tuple(norm.normalized_shape)
        self.eps = float(norm.eps)
        self.weight, self.bias = norm.weight, norm.bias
        self.consumer_act_scale = float(consumer_act_scale)
        self._x8_inv_scale = 1.0 / self.consumer_act_scale

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, e4m3 out at {self.consumer_act_scale:g} (one kernel)"

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def add_norm(self, y, residual, y_scale: float = 1.0):
        """(LayerNorm(y * y_scale + residual), its e4m3 copy at the consumer's scale), [*, hidden]
        each; ``y`` 16-bit, or e4m3 codes of the values over ``y_scale`` (a GEMM writing e4m3)."""
        if y.dtype != torch.float8_e4m3fn and y_scale != 1.0:
            raise ValueError(f"a y_scale ({y_scale}) decodes an e4m3 y, not a {y.dtype} one")
        lead, h = y.shape[:-1], y.shape[-1]
        x, x8 = add_layernorm_fp8(y.reshape(-1, h), residual.reshape(-1, h), self.weight, self.bias, self.eps,
                                  x8_inv_scale=self._x8_inv_scale, y_scale=y_scale)
        return x.reshape(*lead, h), x8.reshape(*lead, h)
