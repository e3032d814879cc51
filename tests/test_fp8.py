"""FP8 (bertqa_bench/backends/transforms/fp8_surgery.py + the torch backend's fp8 option): availability reasons, quantization math,
module surgery on a tiny BERT (all on CPU: float8 dtypes and torch._scaled_mm exist in CPU
torch), and GPU end-to-end checks marked ``gpu`` (skipped without CUDA)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bertqa_bench.backends import BackendContext, default_table, make_variant
from bertqa_bench.backends import torch_backend, torch_builder, torch_options
from bertqa_bench.backends.transforms import fp8_rules
from bertqa_bench.backends.transforms import fp8_surgery as fp8
from bertqa_bench.kernels import fp8_math

TABLE = default_table()

OUTPUTS = ("start_logits", "end_logits")
FP8_NAMES = ("torch-compile-fp8", "torch-compile-fp8-all", "torch-compile-fp8-rowwise")
E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa: the largest relative rounding error


def tiny_bert(seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=128, attn_implementation="sdpa")
    model = BertForQuestionAnswering(config).eval()
    with torch.no_grad():
        model.qa_outputs.weight.normal_(0, 1.0)  # logits O(1), so differences mean something
    return model


def qa(model):
    from bertqa_bench.model.modeling import QAModule

    return QAModule(model, OUTPUTS).eval()


def inputs(b: int = 3, s: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (b, s), generator=g)
    ids[:, 0] = 101
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, s // 2:] = 0
    ids[-1, s // 2:] = 0
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, s // 3:] = 1
    return ids, mask, types


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def _cpu_scaled_mm_works(scaling: str = "tensor") -> bool:
    """CPU torch._scaled_mm for float8: tensorwise exists in recent CPU torch, rowwise scales only
    in newer releases (torch 2.11 raises for them; 2.13 runs them)."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        if scaling == "tensor":
            sa = sb = torch.tensor(1.0)
        else:
            sa, sb = torch.ones(16, 1), torch.ones(1, 16)
        torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm_works(),
                                         reason="this torch has no CPU torch._scaled_mm for float8")


def skip_without_cpu_scaling(scaling: str) -> None:
    if not _cpu_scaled_mm_works("tensor" if scaling == "tensor" else "rowwise"):
        pytest.skip(f"this torch's CPU torch._scaled_mm does not take {scaling} scales")


# --------------------------------------------------------------------------- registry / availability

def test_fp8_variants_are_reduced_precision_cuda_backends():
    for name in FP8_NAMES:
        v = TABLE.get(name)
        assert v.device == "cuda", name
        assert (v.precision, v.parity_class) == ("fp8", "reduced"), name
        assert v.description, name
        backend = v.create()  # constructing needs no GPU
        assert backend.name == v.name and backend.device == "cuda"  # a measured name: its row's name now
    assert TABLE.get("torch-compile-fp8").options.fp8.scaling == "tensor"
    assert TABLE.get("torch-compile-fp8-rowwise").options.fp8.scaling == "rowwise"
    assert fp8_rules.parse_gemms(TABLE.get("torch-compile-fp8").options.fp8.gemms) == fp8_rules.DEFAULT_GEMMS
    assert fp8_rules.parse_gemms(TABLE.get("torch-compile-fp8-all").options.fp8.gemms) == fp8_rules.GEMM_KINDS


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_unavailable_without_cuda_names_the_reason():
    for name in FP8_NAMES:
        reason = TABLE.get(name).unavailable_reason()
        assert reason and "fp8" in reason and "CUDA" in reason, reason


def test_unavailable_on_a_gpu_older_than_sm89(monkeypatch):
    monkeypatch.setattr(torch_backend, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    reason = TABLE.get("torch-compile-fp8").unavailable_reason()
    assert reason and "sm_89" in reason and "Hopper" in reason and "A100" in reason and "sm_80" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert TABLE.get("torch-compile-fp8").unavailable_reason() is None


def test_unavailable_without_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch_backend, "cuda_unavailable_reason", lambda: None)
    monkeypatch.delattr(torch, "_scaled_mm")
    reason = TABLE.get("torch-compile-fp8").unavailable_reason()
    assert reason and "_scaled_mm" in reason


def test_fp8_options_are_checked_when_a_variant_is_declared():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="scaling 'per-block'"):
        make_variant("x", "torch", "cuda", {"weights": "fp16", "fp8": {"scaling": "per-block"}})
    with pytest.raises(ConfigError, match="unknown field.*act_marign"):
        make_variant("x", "torch", "cuda", {"weights": "fp16", "fp8": {"act_marign": 3}})
    with pytest.raises(ConfigError, match="16-bit weights"):
        make_variant("x", "torch", "cuda", {"fp8": {}})
    v = make_variant("x", "torch", "cuda", {"weights": "fp16", "fp8": {"keep_layers": "0, 11"}})
    assert v.options.fp8.layers_kept() == (0, 11)


# --------------------------------------------------------------------------- quantization math

def test_static_activation_scale_from_amax():
    assert fp8_math.static_act_scale(10.0, margin=2.0) == pytest.approx(20.0 / 448.0)
    assert fp8_math.static_act_scale(7.0, margin=1.0) == pytest.approx(7.0 / 448.0)
    assert fp8_math.static_act_scale(0.0) > 0  # never a zero scale (division)


def test_weight_scales_per_channel_and_per_tensor():
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.linspace(0.1, 3.0, 48)[:, None]
    per_ch = fp8_math.weight_scale(w, per_channel=True)
    per_t = fp8_math.weight_scale(w, per_channel=False)
    assert per_ch.shape == (48, 1) and per_ch.dtype == torch.float32
    assert per_t.dim() == 0 and per_t.dtype == torch.float32
    torch.testing.assert_close(per_ch[:, 0], w.abs().amax(1) / 448.0)
    torch.testing.assert_close(per_t, w.abs().amax() / 448.0)
    # Each row's largest magnitude lands exactly on the e4m3 maximum.
    q = fp8_math.quantize_e4m3(w, per_ch)
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(q.float().abs().amax(1), torch.full((48,), 448.0))


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantize_dequantize_round_trip_within_fp8_error(per_channel):
    torch.manual_seed(1)
    x = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]
    scale = fp8_math.weight_scale(x, per_channel)
    deq = fp8_math.dequantize_e4m3(fp8_math.quantize_e4m3(x, scale), scale)
    # Normal e4m3 numbers: relative error <= 2^-4; subnormals (below 2^-6 * scale): absolute <= 2^-10 * scale.
    bound = E4M3_REL * x.abs() + (2.0 ** -10) * scale.expand_as(x) * (1 + 1e-6)
    assert bool(((deq - x).abs() <= bound).all())
    assert rel_l2(deq, x) < 0.04  # ~2-3% rms for a normal-ish distribution


def test_quantize_clamps_to_e4m3_range_instead_of_nan():
    scale = torch.tensor(fp8_math.static_act_scale(1.0, margin=1.0))  # calibrated for |x| <= 1
    x = torch.tensor([-1e6, -5.0, -1.0, 0.0, 0.25, 1.0, 3.0, 1e6])
    q = fp8_math.quantize_e4m3(x, scale)
    assert not torch.isnan(q.float()).any()
    deq = fp8_math.dequantize_e4m3(q, scale)
    assert deq[0] == pytest.approx(-1.0) and deq[-1] == pytest.approx(1.0)  # clamped to ±448 * scale
    assert deq[1] == pytest.approx(-1.0) and deq[6] == pytest.approx(1.0)
    assert deq[3] == 0.0 and deq[5] == pytest.approx(1.0)



def test_saturate_to_e4m3_saturates_and_keeps_division_apart_from_multiplication():
    """Past ±448 the helper gives ±448 (its own clamp; older torch casts give NaN there), NaN stays
    NaN, and ``scale=`` divides: at an e4m3 rounding tie x / s and x * (1 / s) round to different
    codes, so the callers that divide must not be turned into multiplications. From torch 2.12 the
    cast saturates by itself, so a missing clamp fails the first part only on older torch (such as
    the GPU machine's 2.11)."""
    q = fp8_math.saturate_to_e4m3(torch.tensor([-1e6, -449.0, 465.0, float("inf"), float("nan"), 3.0]), 2.0)
    assert q.dtype == torch.float8_e4m3fn
    assert q.float()[:4].tolist() == [-448.0, -448.0, 448.0, 448.0] and q.float()[5] == 6.0
    assert torch.isnan(q.float()[4])
    s = torch.tensor(1.1)
    x = torch.tensor(1.1875) * s  # 1.1875: halfway between the e4m3 codes 1.125 and 1.25
    assert x / s == 1.1875 and x * (1 / s) < 1.1875  # the tie, and multiplying's last-bit miss
    assert float(fp8_math.saturate_to_e4m3(x, scale=s).float()) == 1.25  # tie to even
    assert float(fp8_math.saturate_to_e4m3(x, 1 / s).float()) == 1.125
    assert torch.equal(fp8_math.quantize_e4m3(x, s).view(torch.uint8), fp8_math.saturate_to_e4m3(x, scale=s).view(torch.uint8))
    with pytest.raises(ValueError, match="inv_scale or scale"):
        fp8_math.saturate_to_e4m3(x, 1 / s, scale=s)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("scaling", fp8_rules.SCALINGS)
def test_fp8_linear_matches_linear_on_cpu(scaling):
    skip_without_cpu_scaling(scaling)
    torch.manual_seed(2)
    lin = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    amax = float(x.abs().amax())
    act_scale = None if scaling == "rowwise" else fp8_math.static_act_scale(amax, 1.0)
    f = fp8.fp8_classes()[0].from_linear(lin, scaling=scaling, act_scale=act_scale)
    assert f.weight_fp8.dtype == torch.float8_e4m3fn and f.weight_fp8.shape == (48, 64)
    assert f.weight_fp8.t().stride() == (1, 64)  # the column-major operand _scaled_mm wants
    with torch.no_grad():
        y, ref = f(x), lin(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_l2(y, ref) < 0.06  # ~3.7e-2 measured for a random 64-deep dot product


def test_fp8_linear_rejects_bad_shapes_and_missing_scale():
    cls = fp8.fp8_classes()[0]
    with pytest.raises(ValueError, match="multiples of 16"):
        cls.from_linear(nn.Linear(30, 32), scaling="tensor", act_scale=1.0)
    with pytest.raises(ValueError, match="act_scale"):
        cls.from_linear(nn.Linear(32, 32), scaling="tensor")
    with pytest.raises(ValueError, match="scaling"):
        cls.from_linear(nn.Linear(32, 32), scaling="blockwise", act_scale=1.0)


@needs_cpu_scaled_mm
def test_fp8_linear_with_an_output_scale_writes_e4m3_and_saturates():
    """out_scale: the GEMM's own output is e4m3 (y / out_scale, bias included), and a value past
    the calibrated range saturates at +-448 instead of becoming NaN."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    ref = lin(x).detach()
    act = fp8_math.static_act_scale(float(x.abs().amax()), 1.0)
    out_scale = fp8_math.static_act_scale(float(ref.abs().amax()), 2.0)
    f = fp8.fp8_classes()[0].from_linear(lin, scaling="tensor", act_scale=act, out_scale=out_scale)
    # a tenth of the output's range: most outputs overflow e4m3
    tight = fp8.fp8_classes()[0].from_linear(lin, scaling="tensor", act_scale=act,
                                             out_scale=fp8_math.static_act_scale(float(ref.abs().amax()), 0.1))
    with torch.no_grad():
        y = f(x)
        big = tight(x)
    assert y.dtype == torch.float8_e4m3fn and y.shape == ref.shape
    assert rel_l2(y.float() * out_scale, ref) < 0.08
    assert torch.isfinite(big.float()).all() and float(big.float().abs().max()) == fp8_math.E4M3_MAX
    with pytest.raises(ValueError, match="static per-tensor"):
        fp8.fp8_classes()[0].from_linear(lin, scaling="static-rowwise", act_scale=act, out_scale=out_scale)


def _nan_on_overflow_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False, **_):
    """A stand-in for a _scaled_mm whose e4m3 output turns overflow into NaN (the CPU kernel on
    Xeons with AMX): the product in fp32, then NaN wherever an e4m3 output would pass ±448."""
    y = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        y = y + bias.float()
    if out_dtype == torch.float8_e4m3fn:
        y = torch.where(y.abs() > fp8_math.E4M3_MAX, torch.full_like(y, float("nan")), y)
    return y.to(out_dtype)


def _saturating_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False, **_):
    y = (a.float() * scale_a) @ (b.float() * scale_b) + (0 if bias is None else bias.float())
    return (y.clamp(-fp8_math.E4M3_MAX, fp8_math.E4M3_MAX) if out_dtype == torch.float8_e4m3fn else y).to(out_dtype)


def test_an_fp8_output_saturates_even_where_the_gemm_kernel_writes_nan(monkeypatch):
    """The saturation is the layer's own clamp, not the kernel's: with a _scaled_mm that writes NaN
    past the e4m3 range, an FP8-output layer still gives ±448 (and the same values as a kernel
    that saturates)."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    ref = lin(x).detach()
    act = fp8_math.static_act_scale(float(x.abs().amax()), 1.0)
    tight = fp8.fp8_classes()[0].from_linear(lin, scaling="tensor", act_scale=act,
                                             out_scale=fp8_math.static_act_scale(float(ref.abs().amax()), 0.1))
    assert tight.gemm_dtype == torch.float32 and tight.out_dtype == torch.float8_e4m3fn  # CPU: explicit path
    outs = []
    for kernel in (_nan_on_overflow_scaled_mm, _saturating_scaled_mm):
        monkeypatch.setattr(torch, "_scaled_mm", kernel)
        with torch.no_grad():
            outs.append(tight(x).float())
    assert torch.isfinite(outs[0]).all() and float(outs[0].abs().max()) == fp8_math.E4M3_MAX
    assert int((outs[0].abs() == fp8_math.E4M3_MAX).sum()) > outs[0].numel() // 2  # most outputs overflowed
    assert torch.equal(outs[0], outs[1])


def test_the_saturation_probe_tells_a_nan_writing_kernel_from_a_saturating_one(monkeypatch):
    """gemm_writes_saturated_e4m3's probe (asked on CUDA only; run here on the CPU with stand-in
    kernels): a kernel that writes NaN, or loses the sign, or raises, is not trusted to saturate."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_mm", _nan_on_overflow_scaled_mm)
    assert fp8_math._probe_saturation(cpu) is False
    monkeypatch.setattr(torch, "_scaled_mm", _saturating_scaled_mm)
    assert fp8_math._probe_saturation(cpu) is True
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: _saturating_scaled_mm(*a, **k).abs())
    assert fp8_math._probe_saturation(cpu) is False

    def raises(*a, **k):
        raise RuntimeError("no FP8 output on this device")

    monkeypatch.setattr(torch, "_scaled_mm", raises)
    assert fp8_math._probe_saturation(cpu) is False
    assert fp8_math.gemm_writes_saturated_e4m3("cpu") is False  # the CPU always clamps itself


def _ffn8_model(hidden: int = 64):
    """A tiny BERT with FP8 GEMMs, the FFN hidden activations in e4m3; and the same model with
    them in 16 bits, on the same calibration."""
    model = qa(tiny_bert(hidden=hidden))
    x = inputs()
    targets = fp8.target_linears(model, fp8_rules.DEFAULT_GEMMS)
    amax = fp8.calibrate_amax(model, [x], targets, fp8.ffn_up_names(targets))
    plain = copy.deepcopy(model)
    fp8.swap_to_fp8(plain, amax)
    done = fp8.swap_to_fp8(model, amax, ffn_hidden_fp8=True)
    return model, plain, done, amax, x


@needs_cpu_scaled_mm
def test_ffn_hidden_fp8_is_the_16bit_hidden_path_with_one_more_rounding():
    model, plain, done, amax, x = _ffn8_model()
    Fp8Linear, _, Fp8Intermediate = fp8.fp8_classes()[:3]
    assert done["ffn_hidden_fp8"] == [f"model.bert.encoder.layer.{i}.intermediate" for i in range(2)]
    layer, ref_layer = model.model.bert.encoder.layer[0], plain.model.bert.encoder.layer[0]
    assert isinstance(layer.intermediate, Fp8Intermediate) and isinstance(layer.output.dense, Fp8Linear)
    # the fused module against the unfused computation it replaces, on this layer's real input
    h = torch.randn(3, 40, 64)
    with torch.no_grad():
        got = layer.intermediate(h)
        up = layer.intermediate.dense
        hidden = ref_layer.intermediate.intermediate_act_fn(up(h).float() * up.out_scale_value)
        want = fp8_math.quantize_e4m3(hidden, layer.output.dense.act_scale_value)
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # the down-projection takes the e4m3 input as it is: what it gives for its dequantized self
        np.testing.assert_allclose(layer.output.dense(got).numpy(),
                                   layer.output.dense(got.float() * layer.output.dense.act_scale_value).numpy(),
                                   rtol=1e-5, atol=1e-5)
        out, ref = model(*x), plain(*x)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all() and rel_l2(o, r) < 0.05, rel_l2(o, r)


def test_ffn_hidden_fp8_needs_per_tensor_scales_both_ffn_gemms_and_the_output_range():
    model = qa(tiny_bert())
    targets = fp8.target_linears(model, fp8_rules.DEFAULT_GEMMS)
    amax = fp8.calibrate_amax(model, [inputs()], targets)  # inputs only
    with pytest.raises(ValueError, match="output amax of model.bert.encoder.layer.0.intermediate.dense"):
        fp8.swap_to_fp8(copy.deepcopy(model), amax, ffn_hidden_fp8=True)
    with pytest.raises(ValueError, match="both FFN GEMMs"):
        fp8.swap_to_fp8(copy.deepcopy(model), amax, gemms="qkv,ffn_in", ffn_hidden_fp8=True)
    with pytest.raises(ValueError, match="scaling 'tensor'"):
        fp8.swap_to_fp8(copy.deepcopy(model), amax, scaling="static-rowwise", ffn_hidden_fp8=True)
    for bad in ({"ffn_hidden_fp8": True, "scaling": "rowwise"}, {"ffn_hidden_fp8": True, "gemms": "qkv,ffn_out"}):
        with pytest.raises(torch_options.ConfigError, match="ffn_hidden_fp8"):
            torch_options.Fp8Options(**bad)
    # a kept layer keeps its 16-bit FFN; the others get e4m3 hidden activations
    amax = fp8.calibrate_amax(model, [inputs()], targets, fp8.ffn_up_names(targets))
    done = fp8.swap_to_fp8(model, amax, ffn_hidden_fp8=True, keep_layers=[0])
    assert done["ffn_hidden_fp8"] == ["model.bert.encoder.layer.1.intermediate"]
    assert type(model.model.bert.encoder.layer[0].intermediate.dense) is nn.Linear


e4m3_codes_apart = fp8_math.e4m3_codes_apart


def _hidden_e4m3(n: int = 3 * 4099, seed: int = 0):
    """e4m3 FFN hidden activations as the up-projection writes them (a size no block divides)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(3, -1)


def test_tanh_gelu_on_e4m3_is_erf_gelu_up_to_one_e4m3_step():
    """The tanh form's error (< 1e-3 before rounding) moves an element by at most one e4m3 code,
    and most not at all; values past the range saturate."""
    from bertqa_bench.kernels import gelu_fp8

    x8, s_in, s_out = _hidden_e4m3(), 0.05, 0.06  # GELU up to 22.4: inside 448 x s_out
    h = x8.float() * s_in
    tanh_pre = gelu_fp8.gelu_tanh_scaled(x8, s_in, 1 / s_out) * s_out
    assert (tanh_pre - nn.functional.gelu(h)).abs().max() < 1e-3
    got = gelu_fp8.gelu_tanh_fp8_reference(x8, s_in, 1 / s_out)
    exact = fp8_math.quantize_e4m3(nn.functional.gelu(h), s_out)
    apart = e4m3_codes_apart(got, exact)
    assert float((apart == 0).float().mean()) > 0.8 and int(apart.max()) == 1
    big = gelu_fp8.gelu_tanh_fp8_reference(x8, s_in, 1 / (s_out / 50))
    assert torch.isfinite(big.float()).all() and float(big.float().max()) == fp8_math.E4M3_MAX
    # A finer output scale resolves GELU's negative tail (h ~ -3.5, GELU ~ -1e-3), where the tanh
    # form is relatively farthest from erf: more than one code apart there (measured: up to 4 at
    # 0.02), but never where |GELU| / s_out >= 1, and within 0.0625 (in e4m3 units) in the tail.
    fine = 0.02
    got, exact = gelu_fp8.gelu_tanh_fp8_reference(x8, s_in, 1 / fine), fp8_math.quantize_e4m3(nn.functional.gelu(h), fine)
    apart, large = e4m3_codes_apart(got, exact), exact.float().abs() >= 1
    assert int(apart[large].max()) <= 1 and int(apart[~large].max()) > 1
    assert float((got.float() - exact.float())[~large].abs().max()) <= 0.0625


_INTERPRETED = """
import torch
from bertqa_bench.kernels import gelu_fp8
g = torch.Generator().manual_seed(0)
x8 = (torch.randn(3 * 4099, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(3, -1)
for s_out in (0.02, 0.02 / 50):  # in range; mostly saturated
    y = torch.empty(x8.shape)
    gelu_fp8.launch(x8, y, 0.05, 1 / s_out, fast_tanh=False)
    torch.testing.assert_close(y, gelu_fp8.gelu_tanh_scaled(x8, 0.05, 1 / s_out), rtol=1e-5, atol=1e-5)
print("interpreted kernel matches")
"""


def test_tanh_gelu_triton_kernel_in_the_interpreter_matches_torch(tmp_path):
    """The Triton kernel's indexing, masking, scales and clamp, run by Triton's interpreter on the
    CPU with tanh through exp (the interpreter runs no PTX; tanh.approx.f32 is the GPU test's),
    writing fp32 (the interpreter's own e4m3 rounding drops mantissa carries). In a process of its
    own: the interpreter patches triton.language for good, and a kernel compiled later in the same
    process (the sm_90 test below, with a cold Triton cache) fails to lower."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    from bertqa_bench.kernels import gelu_fp8

    root = str(Path(gelu_fp8.__file__).resolve().parents[2])  # the same package as this process's
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "interpreted kernel matches" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("scale_type", ["fp32", "fp64"])
def test_tanh_gelu_kernel_compiles_for_hopper_with_the_hardware_tanh_and_16_byte_accesses(scale_type, tmp_path,
                                                                                           monkeypatch):
    """What the interpreter cannot run: the kernel compiled ahead of time for sm_90 (Triton's own
    ptxas, no GPU needed), with the element count and pointers 16-divisible as a [T, 3072] tensor
    makes them: tanh.approx.f32 per element, packed e4m3 conversions, one 16-byte load and store
    per thread. The scales typed fp32 (a direct launch) and fp64 (as Inductor passes Python floats
    to a triton_op's kernel: before the kernel converted them, that failed to lower on the H100)
    give the same fp32 math."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bertqa_bench.kernels import gelu_fp8

    sig = {"x_ptr": "*fp8e4nv", "y_ptr": "*fp8e4nv", "n": "i32", "in_scale": scale_type, "out_inv_scale": scale_type,
           "BLOCK": "constexpr", "FAST_TANH": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    src = ASTSource(fn=gelu_fp8._kernel(), signature=sig, constexprs={"BLOCK": gelu_fp8.BLOCK, "FAST_TANH": True},
                    attrs=attrs)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold cache: compiled here, not read back
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    per_thread = gelu_fp8.BLOCK // (8 * 32)
    assert ptx.count("tanh.approx.f32") == per_thread
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == per_thread // 2  # two elements per conversion
    assert ptx.count("ld.global.v4.b32") == 1 and ptx.count("st.global.v4.b32") == 1
    assert "ld.global.b8" not in ptx and "st.global.b8" not in ptx
    assert "mul.f64" not in ptx and "mul.rn.f64" not in ptx and "fma.rn.f64" not in ptx  # no per-element fp64


def test_tanh_gelu_op_is_registered_and_its_dispatch_traces_without_graph_breaks():
    """The custom op exists once the module is imported (registered outside traced code), and
    gelu_tanh_fp8's choice between it and torch's formula breaks no torch.compile graph."""
    from bertqa_bench.kernels import gelu_fp8

    schema = str(torch.ops.bertqa.gelu_tanh_fp8.default._schema)
    assert schema.startswith("bertqa::gelu_tanh_fp8(Tensor x8, float in_scale, float out_inv_scale) -> Tensor"), schema
    x8 = _hidden_e4m3()
    explained = torch._dynamo.explain(lambda t: gelu_fp8.gelu_tanh_fp8(t, 0.05, 50.0))(x8)
    assert explained.graph_break_count == 0, explained.break_reasons


@needs_cpu_scaled_mm
def test_ffn_tanh_gelu_tracks_the_exact_e4m3_path_and_needs_a_gelu():
    model, _, _, amax, x = _ffn8_model()
    tanh = copy.deepcopy(qa(tiny_bert(hidden=64)))
    done = fp8.swap_to_fp8(tanh, amax, ffn_hidden_fp8=True, ffn_gelu="tanh")
    layer = tanh.model.bert.encoder.layer[1]
    assert len(done["ffn_hidden_fp8"]) == 2 and layer.intermediate.gelu == "tanh"
    with torch.no_grad():
        out, ref = tanh(*x), model(*x)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all() and rel_l2(o, r) < 0.05, rel_l2(o, r)
    from transformers.activations import QuickGELUActivation

    for act in (nn.ReLU(), QuickGELUActivation()):
        with pytest.raises(ValueError, match=f"replaces a GELU; this layer's activation is {type(act).__name__}"):
            fp8.fp8_classes()[2](layer.intermediate.dense, act, 0.1, "tanh")
    with pytest.raises(ValueError, match="needs ffn_hidden_fp8"):
        fp8.swap_to_fp8(qa(tiny_bert()), amax, ffn_gelu="tanh")
    for bad, match in (({"ffn_gelu": "tanh"}, "needs ffn_hidden_fp8: true"),
                       ({"ffn_hidden_fp8": True, "ffn_gelu": "fast"}, "not one of exact, tanh")):
        with pytest.raises(torch_options.ConfigError, match=match):
            torch_options.Fp8Options(**bad)


# --------------------------------------------------------------------------- module surgery

def test_gemm_kinds_and_targets_of_a_tiny_bert():
    model = qa(tiny_bert())
    assert fp8.gemm_kind("model.bert.encoder.layer.0.attention.self.query") == "qkv"
    assert fp8.gemm_kind("model.bert.encoder.layer.1.attention.output.dense") == "attn_out"
    assert fp8.gemm_kind("model.bert.encoder.layer.0.intermediate.dense") == "ffn_in"
    assert fp8.gemm_kind("model.bert.encoder.layer.0.output.dense") == "ffn_out"
    assert fp8.gemm_kind("model.qa_outputs") is None
    assert fp8.gemm_kind("model.bert.pooler.dense") is None
    all_targets = fp8.target_linears(model)
    assert len(all_targets) == 2 * 6
    assert all(".encoder.layer." in n for n in all_targets)
    assert len(fp8.target_linears(model, fp8_rules.DEFAULT_GEMMS)) == 2 * 5
    with pytest.raises(ValueError):
        fp8_rules.parse_gemms("qkv,conv")
    assert fp8_rules.parse_gemms("all") == fp8_rules.GEMM_KINDS
    assert fp8_rules.parse_gemms("ffn_out, qkv") == ("qkv", "ffn_out")


def _linears(model):
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def test_swap_default_replaces_exactly_qkv_and_ffn_and_leaves_the_rest():
    model = qa(tiny_bert())
    before = _linears(model)
    amax = fp8.calibrate_amax(model, [inputs()], fp8.target_linears(model))
    assert all(v > 0 for v in amax.values())
    done = fp8.swap_to_fp8(model, amax)  # defaults: tensor scaling, fused QKV, qkv + ffn GEMMs
    Fp8Linear, Fp8SelfAttention = fp8.fp8_classes()[:2]
    after = _linears(model)
    assert after == {"model.qa_outputs"} | {f"model.bert.encoder.layer.{i}.attention.output.dense" for i in range(2)}
    assert set(done["swapped"]) == before - after
    assert done["gemms"] == 2 * 3 and len(done["fused_qkv"]) == 2 and not done["kept"]
    for i in range(2):
        layer = model.model.bert.encoder.layer[i]
        assert isinstance(layer.attention.self, Fp8SelfAttention)
        assert layer.attention.self.qkv.out_features == 3 * 32
        assert isinstance(layer.intermediate.dense, Fp8Linear)
        assert isinstance(layer.output.dense, Fp8Linear)
        assert type(layer.attention.output.dense) is nn.Linear
    # Embeddings and LayerNorms untouched.
    assert type(model.model.bert.embeddings.word_embeddings) is nn.Embedding
    assert all(type(m) is nn.LayerNorm for n, m in model.named_modules() if n.endswith("LayerNorm"))


def test_swap_all_unfused_replaces_every_encoder_linear_and_no_other():
    model = qa(tiny_bert())
    targets = fp8.target_linears(model)
    amax = fp8.calibrate_amax(model, [inputs()], targets)
    done = fp8.swap_to_fp8(model, amax, gemms="all", fuse_qkv=False)
    Fp8Linear = fp8.fp8_classes()[0]
    assert sorted(done["swapped"]) == sorted(targets) and done["gemms"] == 12 and not done["fused_qkv"]
    assert _linears(model) == {"model.qa_outputs"}
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear)) == sorted(targets)


def test_static_scaling_needs_calibration_but_rowwise_does_not():
    with pytest.raises(ValueError, match="amax"):
        fp8.swap_to_fp8(qa(tiny_bert()), None, scaling="tensor")
    done = fp8.swap_to_fp8(qa(tiny_bert()), None, scaling="rowwise")
    assert done["gemms"] == 6


@needs_cpu_scaled_mm
@pytest.mark.parametrize("scaling,fuse_qkv,gemms", [("tensor", True, "qkv,ffn_in,ffn_out"), ("tensor", False, "all"),
                                                    ("rowwise", True, "all"), ("static-rowwise", True, "all")])
def test_swapped_tiny_bert_tracks_fp32_on_cpu(scaling, fuse_qkv, gemms):
    skip_without_cpu_scaling(scaling)
    ref_model = qa(tiny_bert(hidden=64))
    x = inputs()
    with torch.no_grad():
        ref = ref_model(*x)
    model = copy.deepcopy(ref_model)
    amax = fp8.calibrate_amax(model, [x], fp8.target_linears(model))
    fp8.swap_to_fp8(model, amax, scaling=scaling, fuse_qkv=fuse_qkv, gemms=gemms)
    with torch.no_grad():
        out = model(*x)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and torch.isfinite(o).all()
        assert rel_l2(o, r) < 0.05, (scaling, rel_l2(o, r))


@needs_cpu_scaled_mm
@pytest.mark.parametrize("fuse_qkv,ffn8,gelu", [(True, False, "exact"), (False, False, "exact"), (True, True, "exact"),
                                                (True, True, "tanh"), (True, True, "epilogue")])
def test_fp8_swapped_model_packed_padding_free_matches_its_padded_self(fuse_qkv, ffn8, gelu):
    """FP8 on the padding-free path: quantize on the padded model, then pack; the packed encoder
    calls the same FP8 GEMMs (the fused QKV one and the e4m3 FFN hidden path included), so on
    every real token it computes what the padded FP8 model does."""
    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    model = qa(tiny_bert(hidden=64))
    ids, mask, types = inputs()
    mask = mask.clone()
    mask[-1, mask.shape[1] // 2:] = 0  # a padded row: packing must drop its tail
    x = (ids, mask, types)
    targets = fp8.target_linears(model)
    amax = fp8.calibrate_amax(model, [x], targets, fp8.ffn_up_names(targets))
    done = fp8.swap_to_fp8(model, amax, scaling="tensor", fuse_qkv=fuse_qkv, ffn_hidden_fp8=ffn8, ffn_gelu=gelu)
    assert bool(done["fused_qkv"]) == fuse_qkv and len(done["ffn_hidden_fp8"]) == (2 if ffn8 else 0)
    packed_model = copy.deepcopy(model)
    pack_model(packed_model.model)  # the QA wrapper's BertForQuestionAnswering, as the backend does
    layers = packed_model.model.bert.bert.encoder.layer  # PackedEncoder -> the BertModel it wraps
    assert sum(hasattr(layer.attention.self, "qkv") for layer in layers) == (2 if fuse_qkv else 0)
    with torch.no_grad():
        padded = model(*x)
        packed = packed_model(*x)
    real = mask.bool()
    for p, r in zip(packed, padded):
        assert (p - r)[real].abs().max() < 1e-4


# --------------------------------------------------------------------------- the GELU epilogue (cublaslt_epilogues.py)

def _epilogue_operands(m=64, k=96, n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x8 = (torch.randn(m, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w8 = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    bias = torch.randn(n, generator=g).to(torch.float16)
    return x8, w8, bias, torch.tensor(0.002), torch.tensor(0.01)


def test_gelu_epilogue_formula_rounds_the_exact_value_once_and_saturates():
    """The epilogue's formula (the op's CPU path): an fp32 GEMM of the decoded e4m3 values, the bias,
    GELU's tanh form, the output scale, one rounding to e4m3. Against the same in fp64, fp32
    accumulation moves a value by far less than an e4m3 step, so every element is the exact
    value's nearest code or, at a rounding boundary, its neighbour; past +-448 it saturates."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    x8, w8, bias, sw, sx = _epilogue_operands()
    inv = torch.tensor(1 / 0.05)
    got = ge.fp8_gemm_gelu(x8, w8, bias, sw, sx, inv)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (64, 128)
    y = (x8.double() @ w8.double().t()) * (float(sw) * float(sx)) + bias.double()
    exact = (0.5 * y * (1 + torch.tanh(0.7978845608028654 * (y + 0.044715 * y ** 3))) * float(inv)).clamp(-448, 448)
    assert int(e4m3_codes_apart(got, exact.float().to(torch.float8_e4m3fn)).max()) <= 1
    big = ge.fp8_gemm_gelu(x8, w8, bias, sw, sx, torch.tensor(1e4))
    assert not big.float().isnan().any() and float(big.float().max()) == fp8_math.E4M3_MAX
    # saturated before the cast, so the result does not hang on what a cast does past the range
    assert float(ge.fp8_gemm_gelu_scaled(x8, w8, bias, sw, sx, torch.tensor(1e4)).max()) == fp8_math.E4M3_MAX


def test_gelu_epilogue_op_traces_without_graph_breaks():
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    schema = str(torch.ops.bertqa.fp8_gemm_gelu.default._schema)
    assert schema.startswith("bertqa::fp8_gemm_gelu(Tensor x8, Tensor w8, Tensor bias, Tensor w_scale"), schema
    ops = _epilogue_operands()
    explained = torch._dynamo.explain(lambda *a: ge.fp8_gemm_gelu(*a))(*ops, torch.tensor(20.0))
    assert explained.graph_break_count == 0, explained.break_reasons


def test_ffn_epilogue_path_is_the_epilogue_formula_on_the_layers_own_operands():
    """Fp8Intermediate with gelu 'epilogue' quantizes its input with the up-projection's static
    scale and hands the layer's e4m3 weight, unscaled bias and the down-projection's input scale
    to the op: bit for bit the formula on those operands, and within one e4m3 step of the two-kernel
    path (which rounds GELU's input to e4m3 once more) for nearly every element."""
    from transformers.activations import GELUActivation

    from bertqa_bench.kernels import cublaslt_epilogues as ge

    Fp8Linear, _, Fp8Intermediate = fp8.fp8_classes()[:3]
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(128, 64, generator=g) * 0.1, torch.randn(128, generator=g) * 0.1
    x = torch.randn(5, 7, 64, generator=g)
    y = x.reshape(-1, 64) @ w.t() + b
    up = Fp8Linear(w, b, scaling="tensor", act_scale=fp8_math.static_act_scale(float(x.abs().max())),
                   out_scale=fp8_math.static_act_scale(float(y.abs().max())))
    down_scale = fp8_math.static_act_scale(float(ge.gelu_tanh(y).abs().max()))
    epi = Fp8Intermediate(up, GELUActivation(), down_scale, gelu="epilogue")
    got = epi(x)
    assert got.shape == (5, 7, 128) and got.dtype == torch.float8_e4m3fn
    x8 = fp8_math.quantize_e4m3(x.reshape(-1, 64), up.act_scale)
    want = ge.fp8_gemm_gelu_reference(x8, up.weight_fp8, b.to(ge.BIAS_DTYPE), up.weight_scale, up.act_scale,
                                      torch.tensor(1 / down_scale))
    assert torch.equal(got.reshape(-1, 128).view(torch.uint8), want.view(torch.uint8))
    if _cpu_scaled_mm_works():
        two = Fp8Intermediate(up, GELUActivation(), down_scale, gelu="tanh")(x)
        apart = e4m3_codes_apart(got, two)
        assert float((apart <= 1).float().mean()) > 0.95
    with pytest.raises(ValueError, match="gelu 'epilogue' replaces a GELU"):
        Fp8Intermediate(up, nn.ReLU(), down_scale, gelu="epilogue")
    # the op is told the up-projection's accumulation mode: the GEMM it replaces runs with Hopper's
    # fast FP8 accumulation, and cuBLASLt's default (fp32 promotion) made the epilogue as slow as
    # the two kernels on an H100
    # and the up-projection's autotune setting (cublaslt_autotune)
    for fast, tune in ((True, 0), (False, 3)):
        up.fast_accum, up.cublaslt_autotune = fast, tune
        seen = []
        epi._epilogue = lambda *a: seen.append(a[-3:]) or ge.gemm_gelu_fp8(*a)
        epi(x)
        assert seen == [(fast, tune, 0)]  # and the candidates (fp8.cublaslt_candidates, default 0)


def test_packed_attention_option_is_checked_and_cudnn_needs_a_gpu():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="packed_attention 'flashy' is not one of flash, cudnn"):
        torch_options.TorchOptions(packed=True, packed_attention="flashy")
    with pytest.raises(ConfigError, match="packed_attention: cudnn .* needs packed: true"):
        torch_options.TorchOptions(packed_attention="cudnn")
    with pytest.raises(ConfigError, match="packed_attention: triton tunes its tile .* needs token_bucket"):
        torch_options.TorchOptions(packed=True, packed_attention="triton")
    torch_options.TorchOptions(packed=True, token_bucket=1024, packed_attention="triton")
    for kernel in ("cudnn", "triton"):
        cpu = make_variant("x", "torch", "cpu", {"packed": True, "token_bucket": 1024, "packed_attention": kernel})
        assert f"packed_attention: {kernel} is a CUDA kernel: it needs device: cuda" in cpu.unavailable_reason()
    epilogue = {"ffn_hidden_fp8": True, "ffn_gelu": "epilogue"}
    with pytest.raises(ConfigError, match="epilogue plans one cuBLASLt GEMM per token count.*token_bucket"):
        torch_options.TorchOptions(weights="fp16", packed=True, fp8=torch_options.Fp8Options(**epilogue))
    torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=1024, fp8=torch_options.Fp8Options(**epilogue))
    with pytest.raises(ConfigError, match="ffn_gelu 'gelu' is not one of exact, tanh, epilogue"):
        torch_options.Fp8Options(ffn_hidden_fp8=True, ffn_gelu="gelu")


def test_missing_cudnn_frontend_or_nvmath_names_the_package(monkeypatch):
    """With a GPU but without the packages, the reasons say what to install (checked before any
    work: unavailable_reason runs before prepare)."""
    from bertqa_bench.backends import torch_backend
    from bertqa_bench.backends.transforms import packed_encoder
    from bertqa_bench.kernels import cublaslt_epilogues

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    monkeypatch.setitem(sys.modules, "nvmath", None)
    monkeypatch.setitem(sys.modules, "nvmath.linalg", None)
    monkeypatch.setitem(sys.modules, "nvmath.linalg.advanced", None)
    assert "pip install nvidia-cudnn-frontend" in packed_encoder.cudnn_unavailable_reason()
    assert "pip install nvmath-python" in cublaslt_epilogues.nvmath_unavailable_reason()
    # with nvmath-python but without the cuDNN frontend: the row with the suite's own Triton
    # attention runs, the same row with cuDNN's names the frontend
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    monkeypatch.setattr(cublaslt_epilogues, "nvmath_unavailable_reason", lambda: "")
    monkeypatch.setattr(torch_backend, "cuda_unavailable_reason", lambda: "")  # this CPU-only torch
    cudnn_row = TABLE.get("torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune-2streams")
    triton_row = TABLE.get("torch-compile-fp8all-graph-packed-triton-epilogue-autotune-2streams")
    assert "pip install nvidia-cudnn-frontend" in cudnn_row.unavailable_reason()
    assert not triton_row.unavailable_reason()


@pytest.mark.gpu
def test_gelu_epilogue_on_gpu_matches_its_formula_saturates_and_captures():
    """cuBLASLt's GELU_BIAS epilogue (nvmath-python) against the formula: within one e4m3 code
    (fast accumulation order, the GPU's tanh), e4m3 [M, N] row-major out; it saturates; a CUDA
    graph captured after the shape was planned replays the same bytes."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    if ge.nvmath_unavailable_reason():
        pytest.skip(ge.nvmath_unavailable_reason())
    x8, w8, bias, sw, sx = (t.cuda() for t in _epilogue_operands(m=256, k=256, n=512))
    inv = torch.tensor(1 / 0.05, device="cuda")
    got = ge.fp8_gemm_gelu(x8, w8, bias, sw, sx, inv)
    assert got.shape == (256, 512) and got.is_contiguous() and got.dtype == torch.float8_e4m3fn
    ref = ge.fp8_gemm_gelu_reference(x8, w8, bias, sw, sx, inv)
    # Where |GELU| in e4m3 units is >= 1, one code (accumulation order, the GPU's tanh); in GELU's
    # negative tail the GPU's formula is relatively farther from torch's tanh (two codes seen at
    # this shape, eight at BERT-large's), as with the Triton kernel's tanh.approx: a bound in value there
    apart, large = e4m3_codes_apart(got, ref), ref.float().abs() >= 1
    assert int(apart[large].max()) <= 1
    assert float((got.float() - ref.float())[~large].abs().max()) <= 0.125
    assert ge.epilogue_saturates("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ge.fp8_gemm_gelu(x8, w8, bias, sw, sx, inv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), got.view(torch.uint8))


@pytest.mark.gpu
def test_cudnn_varlen_attention_matches_per_sequence_sdpa_on_gpu():
    """cuDNN's fused attention on packed QKV views (strides of the fused [T, 3, heads, d] tensor)
    against the per-sequence SDPA loop in fp32, on sequences of uneven lengths."""
    from bertqa_bench.backends.transforms.packed_encoder import PackedEncoder, cudnn_unavailable_reason

    if cudnn_unavailable_reason():
        pytest.skip(cudnn_unavailable_reason())
    bert = tiny_bert(hidden=64).bert.cuda().half()
    enc = PackedEncoder(bert, attention="cudnn")
    lens = [37, 5, 64, 1, 50]
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lens), 3, enc.heads, enc.head_dim, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    got = enc._attention(q, k, v, cu, 64)
    ref = PackedEncoder(bert, use_kernel=False)._attention(q.float(), k.float(), v.float(), cu, 64)
    assert enc.kernel_name.startswith("cuDNN")
    assert float((got.float() - ref).abs().max()) < 2e-3  # fp16 inputs and output, fp32 softmax


# --------------------------------------------------------------------------- FP8 attention (cudnn_fp8_attention.py)

def _fp8_qkv(lens=(37, 5, 64, 1, 50), heads=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv8 = (torch.randn(t, 3, heads, d, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    return qkv8, cu


def _fp8_attention_bound(q8, k8, v8, cu, scale, qkv_scale, o_inv, got8):
    """|decoded output - fp32 attention of the decoded inputs|, and what e4m3 allows there: each
    probability rounded once (relative 2^-4, or below e4m3's normal range an absolute 2^-10 / 256,
    summed over the sequence's n keys), times |v| <= the head's max |v|; the output rounded once
    (relative 2^-4 of the value it rounds, or half its smallest step, 2^-10, in output units)."""
    out = torch.zeros(q8.shape)
    allowed = torch.zeros(q8.shape)
    b = cu.tolist()
    for a, e in zip(b[:-1], b[1:]):
        if e <= a:
            continue
        q, k, v = (x[a:e].float().transpose(0, 1) * qkv_scale for x in (q8, k8, v8))
        p = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
        o = (p @ v).transpose(0, 1)  # [n, heads, d]
        vmax = v.abs().amax(dim=(1, 2))[None, :, None]  # per head
        p_err = (2.0 ** -4 + 2.0 ** -10 / 256 * (e - a)) * vmax
        out[a:e] = o
        allowed[a:e] = p_err + 2.0 ** -4 * (o.abs() + p_err) + 2.0 ** -10 / o_inv
    got = got8.float() / o_inv
    return (got - out).abs(), allowed


def test_fp8_attention_reference_is_attention_up_to_two_e4m3_roundings():
    from bertqa_bench.kernels import cudnn_fp8_attention as fa

    qkv8, cu = _fp8_qkv()
    q8, k8, v8 = qkv8.unbind(1)
    qkv_scale, o_inv, scale = 0.01, 100.0, 16 ** -0.5
    got = fa.fp8_varlen_attention(q8, k8, v8, cu, 64, scale, torch.tensor(qkv_scale), torch.tensor(o_inv))
    assert got.dtype == torch.float8_e4m3fn and got.shape == q8.shape
    err, allowed = _fp8_attention_bound(q8, k8, v8, cu, scale, qkv_scale, o_inv, got)
    assert bool((err <= allowed).all()), float((err - allowed).max())
    # the bound is not vacuous: the output is not zero and rounding moved it
    assert float(got.float().abs().max()) > 10 and float(err.max()) > 0
    big = fa.fp8_varlen_attention_reference(q8, k8, v8, cu, scale, qkv_scale, 1e6)
    assert float(big.float().abs().max()) == fp8_math.E4M3_MAX and not big.float().isnan().any()


def test_fp8_attention_swaps_qkv_to_e4m3_and_the_packed_model_tracks_the_padded_one():
    """attention_fp8: the fused QKV GEMM writes e4m3 (its output scale from the calibrated q/k/v
    amax), the layer knows 1 / the output GEMM's input scale, the padded forward decodes Q, K, V
    for SDPA, and the packed encoder runs the FP8 pipeline (the op's torch path on the CPU): its
    logits stay within the FP8 rows' bound of the padded model's."""
    from bertqa_bench.backends.transforms.packed_encoder import encoder_of, pack_model

    model = qa(tiny_bert(hidden=64))
    ids, mask, types = inputs()
    x = (ids, mask, types)
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    with pytest.raises(ValueError, match="attention_fp8 needs the calibrated output amax"):
        fp8.swap_to_fp8(copy.deepcopy(model), fp8.calibrate_amax(model, [x], targets), gemms="all",
                        attention_fp8=True)
    amax = fp8.calibrate_amax(model, [x], targets, fp8.qkv_names(targets))
    done = fp8.swap_to_fp8(model, amax, gemms="all", attention_fp8=True)
    assert len(done["attention_fp8"]) == 2
    sa = model.get_submodule(done["attention_fp8"][0])
    out_dense = model.get_submodule(done["attention_fp8"][0][: -len("self")] + "output.dense")
    assert sa.qkv.out_dtype == torch.float8_e4m3fn
    assert float(sa.o_inv_scale) == pytest.approx(1.0 / out_dense.act_scale_value)
    packed_model = copy.deepcopy(model)
    pack_model(packed_model.model)
    assert encoder_of(packed_model.model).kernel_name.startswith("cuDNN FP8 attention") and "in 2 layers" in \
        encoder_of(packed_model.model).kernel_name
    with torch.no_grad():
        padded = model(*x)
        packed = packed_model(*x)
    real = mask.bool()
    for p, r in zip(packed, padded):
        assert torch.isfinite(p[real]).all()
        assert rel_l2(p[real], r[real]) < 0.08
    with pytest.raises(ValueError, match="attention: fp8 needs .* both attention GEMMs"):
        fp8.swap_to_fp8(copy.deepcopy(model), amax, gemms="qkv,ffn_in,ffn_out", attention_fp8=True)
    # the Triton kernel's form, P V in fp16 (on the CPU the reference pipeline without P's e4m3
    # rounding): named so, within the same bound, and not the e4m3-P pipeline under another name
    pv16_model = copy.deepcopy(model)
    pack_model(pv16_model.model, attention="triton", fp8_pv="fp16")
    assert encoder_of(pv16_model.model).fp8_pv == "fp16"
    with torch.no_grad():
        pv16 = pv16_model(*x)
    for p, q, r in zip(pv16, packed, padded):
        assert torch.isfinite(p[real]).all() and rel_l2(p[real], r[real]) < 0.08
        assert not torch.equal(p[real], q[real])
    with pytest.raises(ValueError, match="fp8_pv 'fp16' is the Triton kernel's choice"):
        pack_model(copy.deepcopy(model).model, attention="cudnn", fp8_pv="fp16")


def test_triton_fp8_attention_refuses_a_head_size_the_fp8_mma_cannot_take_before_any_work():
    """Head size 16: the 16-bit Triton kernel takes it, the e4m3-input one does not (the FP8 MMA's
    K step is 32): refused when the encoder is packed, naming the sizes, not at the first forward."""
    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    model = qa(tiny_bert(hidden=32))  # 2 heads of 16
    ids, mask, types = inputs()
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    amax = fp8.calibrate_amax(model, [(ids, mask, types)], targets, fp8.qkv_names(targets))
    pack_model(copy.deepcopy(model).model, attention="triton")  # 16-bit Q, K, V: taken
    fp8.swap_to_fp8(model, amax, gemms="all", attention_fp8=True)
    with pytest.raises(ValueError, match="takes head sizes 32, 64, 128 on e4m3 Q, K, V; this model's is 16"):
        pack_model(model.model, attention="triton")


def _tiny_qa_and_its_fp8_all_copy():
    """A tiny QA model, its inputs (ids, mask, types), the calibrated input amax of its encoder
    GEMMs, and a copy with every one of them in FP8 (per-tensor scales): the baseline an FP8
    option is compared with."""
    model = qa(tiny_bert(hidden=64))
    ids, mask, types = inputs()
    x = (ids, mask, types)
    amax = fp8.calibrate_amax(model, [x], fp8.target_linears(model, fp8_rules.GEMM_KINDS))
    plain = copy.deepcopy(model)
    fp8.swap_to_fp8(plain, amax, gemms="all")
    return model, x, mask, amax, plain


def test_attention_output_e4m3_options_are_checked_before_any_work():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="attention_output 'fp8' is not one of fp16, e4m3"):
        torch_options.Fp8Options(gemms="all", attention_output="fp8")
    with pytest.raises(ConfigError, match="attention_output: e4m3 needs scaling 'tensor'.*attn_out"):
        torch_options.Fp8Options(attention_output="e4m3")  # the default gemms leave attn_out in 16 bits
    with pytest.raises(ConfigError, match="attention_output: e4m3 needs scaling 'tensor'"):
        torch_options.Fp8Options(gemms="all", scaling="rowwise", attention_output="e4m3")
    with pytest.raises(ConfigError, match="attention: fp8 writes its output in e4m3 already"):
        torch_options.Fp8Options(gemms="all", attention="fp8", attention_output="e4m3")
    e4m3 = torch_options.Fp8Options(gemms="all", attention_output="e4m3")
    with pytest.raises(ConfigError, match="attention_output: e4m3 is written by .* Triton attention kernel: it needs "
                                          "packed: true and packed_attention: triton"):
        torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=1024, packed_attention="cudnn", fp8=e4m3)
    torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=1024, packed_attention="triton", fp8=e4m3)


@needs_cpu_scaled_mm
def test_attention_output_e4m3_hands_the_output_gemm_what_it_would_quantize_itself():
    """attention_output: e4m3: every layer's attention knows 1 / its output GEMM's input scale,
    that GEMM is called with an e4m3 input, and the packed model's logits are the fp16-output
    model's bit for bit: on the CPU the encoder quantizes the 16-bit attention output exactly as
    the GEMM's own quantize did (the GPU's Triton kernel rounds its fp32 output once instead:
    test_triton_attention)."""
    from bertqa_bench.backends.transforms.packed_encoder import encoder_of, pack_model

    model, x, mask, amax, plain = _tiny_qa_and_its_fp8_all_copy()
    with pytest.raises(ValueError, match="attention_output: e4m3 needs .*attn_out"):
        fp8.swap_to_fp8(copy.deepcopy(model), amax, gemms="qkv,ffn_in,ffn_out", attention_output="e4m3")
    done = fp8.swap_to_fp8(model, amax, gemms="all", attention_output="e4m3")
    assert len(done["attention_output_e4m3"]) == 2 and not done["attention_fp8"]
    seen = []
    for name in done["attention_output_e4m3"]:
        sa = model.get_submodule(name)
        dense = model.get_submodule(name[: -len("self")] + "output.dense")
        assert sa.qkv_out_scale is None and sa.o_inv_scale.dtype == torch.float32
        assert float(sa.o_inv_scale) == np.float32(1.0 / dense.act_scale_value)
        dense.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    pack_model(model.model, attention="triton")
    pack_model(plain.model, attention="triton")
    assert "e4m3" not in encoder_of(model.model).kernel_name  # no Triton kernel on the CPU: SDPA, quantized after
    with torch.no_grad():
        got = model(*x)
        want = plain(*x)
    assert seen == [torch.float8_e4m3fn] * 2
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# --------------------------------------------------------------------------- the residual in the GEMM

@needs_cpu_scaled_mm
def test_residual_in_gemm_calls_the_gemm_with_the_residual_and_the_packed_model_keeps_its_answers():
    """residual: gemm on the padding-free encoder: the attention-output and FFN-down FP8 GEMMs add
    the residual themselves (cublaslt_epilogues's op, its torch formula on the CPU), every one of them
    is called with it, and the logits are the LayerNorm-path model's up to fp32 summation order."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge
    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    model, x, mask, amax, plain = _tiny_qa_and_its_fp8_all_copy()
    done = fp8.swap_to_fp8(model, amax, gemms="all", residual="gemm")
    assert sorted(fp8.gemm_kind(n) for n in done["residual_in_gemm"]) == ["attn_out"] * 2 + ["ffn_out"] * 2
    calls = []
    for name in done["residual_in_gemm"]:
        lin = model.get_submodule(name)
        assert lin.residual_in_gemm and "residual added in the GEMM" in lin.extra_repr()
        lin._gemm_add = lambda *a, _f=lin._gemm_add, _n=name: calls.append(_n) or _f(*a)
    pack_model(model.model)
    pack_model(plain.model)
    with torch.no_grad():
        got = model(*x)
        want = plain(*x)
    assert sorted(calls) == sorted(done["residual_in_gemm"])
    real = mask.bool()
    for g, w in zip(got, want):
        assert (g - w)[real].abs().max() < 1e-4
    # the op is the formula: one GEMM of the decoded values, the bias and the residual
    x8, w8, bias, sw, sx = _epilogue_operands()
    r = torch.randn(x8.shape[0], w8.shape[0]).to(torch.float16)
    y = ge.fp8_gemm_add(x8, w8, bias, sw, sx, r)
    want = ((x8.float() @ w8.float().t()) * (sx * sw) + bias.float() + r.float()).to(torch.float16)
    assert y.dtype == torch.float16 and torch.equal(y, want)


def test_residual_in_gemm_options_are_checked():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8.residual 'ffn' is not one of layernorm, gemm"):
        torch_options.Fp8Options(residual="ffn")
    with pytest.raises(ConfigError, match="residual: gemm .* needs scaling 'tensor' and attn_out or ffn_out"):
        torch_options.Fp8Options(residual="gemm", gemms="qkv,ffn_in")
    with pytest.raises(ConfigError, match="residual: gemm .* needs scaling 'tensor'"):
        torch_options.Fp8Options(residual="gemm", scaling="rowwise")
    f = torch_options.Fp8Options(residual="gemm")
    with pytest.raises(ConfigError, match="fp8.residual: gemm .* needs packed: true and token_bucket"):
        torch_options.TorchOptions(weights="fp16", fp8=f)
    with pytest.raises(ConfigError, match="needs packed: true and token_bucket"):
        torch_options.TorchOptions(weights="fp16", packed=True, fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=256, fp8=f)
    with pytest.raises(ValueError, match="residual 'x' is not one of"):
        fp8.swap_to_fp8(qa(tiny_bert()), None, scaling="rowwise", residual="x")


# --------------------------------------------------------------------------- add + LayerNorm + quantize in one kernel

class _ReferenceLayerNorm(nn.Module):
    """A LayerNorm computed by the fused kernel's torch reference on an already-added input: what
    the plain path's LayerNorm module would be if it used the kernel's arithmetic."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, s):
        from bertqa_bench.kernels.add_layernorm_fp8 import add_layernorm_scaled

        h = s.shape[-1]
        x = add_layernorm_scaled(s.reshape(-1, h), torch.zeros_like(s.reshape(-1, h)), self.norm.weight,
                                 self.norm.bias, self.norm.eps)[0]
        return x.reshape(s.shape).to(s.dtype)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("ffn8", [False, True])
def test_fused_layernorm_feeds_each_fp8_gemm_its_e4m3_input_at_that_gemms_scale(ffn8):
    """layernorm: triton on the padding-free encoder: every LayerNorm an FP8 GEMM reads (each
    layer's attention one feeds its FFN-up, the FFN one the next layer's fused QKV; not the last,
    which the QA head reads) becomes one add + norm kernel, and the logits are bit for bit those of
    the LayerNorm path computing the same LayerNorm arithmetic: the e4m3 copy is the one the GEMM
    would have made, at that GEMM's own scale (a scale taken from another GEMM changes them)."""
    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    model, x, mask, _, _ = _tiny_qa_and_its_fp8_all_copy()
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    amax = fp8.calibrate_amax(model, [x], targets, fp8.ffn_up_names(targets))
    plain = copy.deepcopy(model)
    kw = {"gemms": "all", "ffn_hidden_fp8": ffn8}
    fp8.swap_to_fp8(plain, amax, **kw)
    done = fp8.swap_to_fp8(model, amax, **kw, layernorm="triton")
    assert done["fused_layernorms"] == ["model.bert.encoder.layer.0.attention.output.LayerNorm",
                                        "model.bert.encoder.layer.0.output.LayerNorm",
                                        "model.bert.encoder.layer.1.attention.output.LayerNorm"]
    Fp8AddLayerNorm = fp8.fp8_classes()[3]
    seen = []
    for name in done["fused_layernorms"]:
        norm = model.get_submodule(name)
        consumer = name.replace("attention.output.LayerNorm", "intermediate.dense").replace(
            "layer.0.output.LayerNorm", "layer.1.attention.self.qkv")
        assert isinstance(norm, Fp8AddLayerNorm)
        lin = model.get_submodule(consumer)
        assert norm.consumer_act_scale == lin.act_scale_value
        # what the consumer is handed: the kernel's e4m3 copy, never x to quantize again
        lin.quantize_input = lambda x2, _f=lin.quantize_input, _n=consumer: seen.append((_n, x2.dtype)) or _f(x2)
        _set = name.rsplit(".", 1)[0]
        plain.get_submodule(_set).LayerNorm = _ReferenceLayerNorm(plain.get_submodule(name))
    assert type(model.get_submodule("model.bert.encoder.layer.1.output.LayerNorm")) is nn.LayerNorm
    ffn_norm = model.get_submodule(done["fused_layernorms"][1])
    pack_model(model.model)
    pack_model(plain.model)
    with torch.no_grad():
        got, want = model(*x), plain(*x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert len(seen) == 3 and {dtype for _, dtype in seen} == {torch.float8_e4m3fn}, seen
    # the same model with one consumer's scale off by a step: the kernel's output is what that GEMM reads
    ffn_norm._x8_inv_scale *= 1.5
    with torch.no_grad():
        assert not torch.equal(model(*x)[0], want[0])


def test_fused_layernorm_options_are_checked_before_any_work():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8.layernorm 'apex' is not one of inductor, triton"):
        torch_options.Fp8Options(layernorm="apex")
    with pytest.raises(ConfigError, match="layernorm: triton adds the residual in its own kernel; residual: gemm"):
        torch_options.Fp8Options(layernorm="triton", residual="gemm")
    with pytest.raises(ConfigError, match="layernorm: triton .* needs scaling 'tensor'"):
        torch_options.Fp8Options(layernorm="triton", scaling="rowwise")
    with pytest.raises(ConfigError, match="needs scaling 'tensor' and qkv or ffn_in in FP8"):
        torch_options.Fp8Options(layernorm="triton", gemms="attn_out,ffn_out")
    f = torch_options.Fp8Options(layernorm="triton")
    with pytest.raises(ConfigError, match="fp8.layernorm: triton .* needs packed: true"):
        torch_options.TorchOptions(weights="fp16", fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, fp8=f)
    with pytest.raises(ValueError, match="layernorm 'x' is not one of"):
        fp8.swap_to_fp8(qa(tiny_bert()), None, scaling="rowwise", layernorm="x")


@pytest.mark.gpu
def test_residual_gemm_on_gpu_is_its_formula_and_captures():
    """cuBLASLt with the residual as C (nvmath-python) against the formula in fp32: within what
    its arithmetic allows (one fp16 rounding of the result, and fast FP8 accumulation, bounded
    relative to the sum of the products' magnitudes); fp16 [M, N] row-major; a CUDA graph
    captured after the shape was planned replays the same bytes."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    if ge.nvmath_unavailable_reason():
        pytest.skip(ge.nvmath_unavailable_reason())
    x8, w8, bias, sw, sx = (t.cuda() for t in _epilogue_operands(m=256, k=256, n=512))
    r = torch.randn(256, 512, device="cuda").half()
    exact = (x8.float() @ w8.float().t()) * (sx * sw) + bias.float() + r.float()
    magnitude = (x8.float().abs() @ w8.float().abs().t()) * (sx * sw) + bias.float().abs() + r.float().abs()
    for fast in (False, True):
        _fp16_gemm_is_its_formula_and_captures(lambda: ge.fp8_gemm_add(x8, w8, bias, sw, sx, r, fast), exact,
                                               magnitude, fast)


def _fp16_gemm_is_its_formula_and_captures(run, exact, magnitude, label):
    """``run()``'s fp16 [M, N] row-major result within one fp16 rounding (half a unit in the last
    place, 2^-11 relative) and fast FP8 accumulation's bound (2^-10 of the products' magnitude) of
    ``exact``; a CUDA graph captured after the shape was planned replays the same bytes."""
    got = run()
    assert got.shape == exact.shape and got.is_contiguous() and got.dtype == torch.float16, label
    assert bool(((got.float() - exact).abs() <= exact.abs() * 2.0 ** -11 + magnitude * 2.0 ** -10).all()), label
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got), label


# --------------------------------------------------------------------------- GEMMs planned through nvmath

def _recorded(model, done, calls):
    """Wrap the nvmath-planned ops of ``model`` to record (module name, (autotune, candidates)) per call."""
    for name in done["cublaslt"] + done["residual_in_gemm"]:
        lin = model.get_submodule(name)
        if lin.planned_gemm:
            lin._gemm_bias = lambda *a, _f=lin._gemm_bias, _n=name: calls.append((_n, a[-2:])) or _f(*a)
        if lin.residual_in_gemm:
            lin._gemm_add = lambda *a, _f=lin._gemm_add, _n=name: calls.append((_n + "+r", a[-2:])) or _f(*a)
    for inter in done["ffn_hidden_fp8"]:
        m = model.get_submodule(inter)
        m._epilogue = lambda *a, _f=m._epilogue, _n=inter: calls.append((_n, a[-2:])) or _f(*a)


@needs_cpu_scaled_mm
def test_cublaslt_gemms_run_the_planned_op_with_the_autotune_setting_and_keep_the_answers():
    """cublaslt_gemms: the named FP8 GEMMs (fused QKV, attention output, FFN down) run through
    cublaslt_epilogues's planned op (its torch formula on the CPU) instead of torch._scaled_mm; every
    GEMM planned through nvmath (those, the GELU epilogue, the residual GEMMs) is handed
    cublaslt_autotune, and only those say they are autotuned; the logits are the torch._scaled_mm
    model's up to fp32 summation order, padded and packed."""
    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    model = qa(tiny_bert(hidden=64))
    ids, mask, types = inputs()
    x = (ids, mask, types)
    real = mask.bool()
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    amax = fp8.calibrate_amax(model, [x], targets, fp8.ffn_up_names(targets))
    plain = copy.deepcopy(model)
    fp8.swap_to_fp8(plain, amax, gemms="all", ffn_hidden_fp8=True, ffn_gelu="epilogue")
    with torch.no_grad():
        want = plain(*x)
    planned = copy.deepcopy(model)
    done = fp8.swap_to_fp8(planned, amax, gemms="all", ffn_hidden_fp8=True, ffn_gelu="epilogue",
                           cublaslt_gemms="qkv,attn_out,ffn_out", cublaslt_autotune=4)
    assert sorted(fp8.gemm_kind(n.replace(".qkv", ".query")) for n in done["cublaslt"]) == \
        ["attn_out"] * 2 + ["ffn_out"] * 2 + ["qkv"] * 2
    for name in done["cublaslt"]:
        assert planned.get_submodule(name).planned_gemm and "autotuned x4" in planned.get_submodule(name).extra_repr()
    for inter in done["ffn_hidden_fp8"]:  # the up-projection runs in the epilogue, not on its own
        assert "epilogue algorithm autotuned x4" in planned.get_submodule(inter).extra_repr()
        assert "autotuned" not in planned.get_submodule(inter).dense.extra_repr()
    calls = []
    _recorded(planned, done, calls)
    for packed in (False, True):
        if packed:
            pack_model(planned.model)
        calls.clear()
        with torch.no_grad():
            got = planned(*x)
        # the plain op for every named GEMM, the GELU epilogue per layer, all told 4
        assert sorted(n for n, _ in calls) == sorted(done["cublaslt"] + done["ffn_hidden_fp8"]), packed
        assert {t for _, t in calls} == {(4, 0)}
        for g, w in zip(got, want):
            assert (g - w)[real].abs().max() < 1e-4, packed
    # residual: gemm takes over the attention-output and FFN-down GEMMs on the packed encoder: the
    # residual GEMMs and the QKV named here are handed the setting too
    resid = copy.deepcopy(model)
    done = fp8.swap_to_fp8(resid, amax, gemms="all", ffn_hidden_fp8=True, ffn_gelu="epilogue", residual="gemm",
                           cublaslt_gemms="qkv", cublaslt_autotune=4)
    calls.clear()
    _recorded(resid, done, calls)
    pack_model(resid.model)
    with torch.no_grad():
        got = resid(*x)
    assert sorted(n for n, _ in calls) == sorted(done["cublaslt"] + done["ffn_hidden_fp8"]
                                                 + [n + "+r" for n in done["residual_in_gemm"]])
    assert {t for _, t in calls} == {(4, 0)}
    for g, w in zip(got, want):
        assert (g - w)[real].abs().max() < 1e-4
    # cublaslt_candidates: every planned GEMM asks cuBLASLt for that many algorithms to time
    wide = copy.deepcopy(model)
    done = fp8.swap_to_fp8(wide, amax, gemms="all", ffn_hidden_fp8=True, ffn_gelu="epilogue",
                           cublaslt_gemms="qkv", cublaslt_autotune=4, cublaslt_candidates=64)
    calls.clear()
    _recorded(wide, done, calls)
    with torch.no_grad():
        got = wide(*x)
    assert calls and {t for _, t in calls} == {(4, 64)}
    assert "autotuned x4 among up to 64" in wide.get_submodule(done["ffn_hidden_fp8"][0]).extra_repr()
    for g, w in zip(got, want):
        assert (g - w)[real].abs().max() < 1e-4
    # a GEMM not planned through nvmath does not claim an autotuned algorithm
    other = copy.deepcopy(model)
    done = fp8.swap_to_fp8(other, amax, gemms="all", cublaslt_gemms="qkv", cublaslt_autotune=4)
    out = [n for n in done["swapped"] if fp8.gemm_kind(n) == "attn_out"][0]
    assert "autotuned" not in other.get_submodule(out).extra_repr()
    # the op is the formula: one GEMM of the decoded values and the bias, rounded once
    x8, w8, bias, sw, sx = _epilogue_operands()
    y = torch.ops.bertqa.fp8_gemm_bias(x8, w8, bias, sw, sx)
    assert y.dtype == torch.float16 and torch.equal(
        y, ((x8.float() @ w8.float().t()) * (sx * sw) + bias.float()).to(torch.float16))


class _FakeMatmul:
    """Stands in for nvmath's Matmul in _planned: records what it is given, in order. As nvmath's,
    it holds its operands until released, and after release_operands a reset must give them all."""

    def __init__(self, operands, log, algorithms=None):
        self.operands, self.log = dict(operands), log
        self.given = algorithms  # what plan() was handed (None: the heuristic's)
        self.algorithms = tuple(algorithms) if algorithms is not None else (object(), object())
        self.heuristic_order = self.algorithms
        self.released = ()

    def reset_operands(self, stream=None, **kw):
        if not set(self.released) <= set(kw):
            raise ValueError(f"after release_operands every operand is needed, missing {set(self.released) - set(kw)}")
        self.operands.update(kw)
        self.released = ()
        self.log.append(("reset",))

    def release_operands(self):
        self.released, self.operands = tuple(self.operands), {}
        self.log.append(("release",))

    def autotune(self, iterations, stream=None):
        self.log.append(("autotune", iterations, {k: self.operands[k].clone() for k in ("b", "c") if k in self.operands}))
        self.algorithms = self.algorithms[::-1]  # the timing's order

    def execute(self, release_workspace=False, stream=None):
        self.log.append(("execute", self.operands["b"].clone()))
        return torch.zeros(self.operands["b"].shape[1], self.operands["a"].shape[0]).t()

    def free(self):
        self.log.append(("free",))


def test_planned_gemm_autotunes_once_per_shape_on_random_operands_then_runs_on_the_calls_own(monkeypatch):
    """_planned with autotune: the Matmul made for a new key is autotuned once, with the call's
    weights but random activations and residual of the same shapes and layouts (never the call's
    own, which can be a warm-up's dummy tokens); the call's own operands are back before it runs;
    a later call of the key only resets the operands; autotune 0 never tunes."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU torch has no CUDA
    x8 = torch.zeros(32, 16).to(torch.float8_e4m3fn)  # a warm-up's activations: one repeated value
    w8, c = torch.ones(48, 16).to(torch.float8_e4m3fn), torch.zeros(32, 48, dtype=torch.float16)
    ops = {"a": w8, "b": x8.t(), "c": c.t()}
    for tune in (3, 0):
        log, made = [], []

        def make(stream, algorithms):
            made.append(_FakeMatmul(ops, log, algorithms))
            return made[-1]

        key = ("test", tune)
        ge._PLANS.pop((*key, 0), None)
        try:
            for _ in range(2):
                out = ge._planned(key, "test GEMM", make, ops, None, tune)
                assert out.shape == (32, 48) and out.is_contiguous()
        finally:
            ge._PLANS.pop((*key, 0), None)
        # the candidates' plan is freed and the shape's plan holds the chosen algorithm alone (its
        # workspace only): the heuristic's first, or autotuning's fastest (the fake reverses them)
        candidates, kept = made
        assert candidates.given is None and kept.given == candidates.algorithms[:1]
        assert kept.given == (candidates.heuristic_order[-1 if tune else 0],)
        tuned = [e for e in log if e[0] == "autotune"]
        if not tune:
            assert not tuned and [e[0] for e in log] == ["free", "execute", "release", "reset", "execute", "release"]
            continue
        assert [e[0] for e in log] == ["reset", "autotune", "free", "execute", "release", "reset", "execute", "release"]
        assert len(tuned) == 1 and tuned[0][1] == 3
        for k, t in tuned[0][2].items():  # random, not the call's zeros, in the call's layout
            assert t.float().abs().max() > 0 and t.shape == ops[k].shape and t.stride() == ops[k].stride(), k
        assert all(torch.equal(e[1].float(), x8.t().float()) for e in log if e[0] == "execute")


def test_a_plan_keeps_no_reference_to_the_activations_it_ran_on(monkeypatch):
    """Each token bucket has its plan, and a plan that kept its last operands kept that bucket's
    activations allocated in the CUDA graph pool for the process's life: after _planned returns,
    the call's activation tensor is freed as soon as the caller drops it, at the first call and at
    a later one."""
    import gc
    import weakref

    from bertqa_bench.kernels import cublaslt_epilogues as ge

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w8 = torch.ones(48, 16).to(torch.float8_e4m3fn)
    made = []
    key = ("release-test",)
    try:
        for _ in range(2):
            x8 = torch.zeros(32, 16).to(torch.float8_e4m3fn)
            ops = {"a": w8, "b": x8.t()}

            def make(stream, algorithms, ops=ops):
                mm = _FakeMatmul(ops, [], algorithms)
                if algorithms is not None:  # the kept plan; the candidates' goes with _choose's frame
                    made.append(mm)
                return mm

            out = ge._planned(key, "test GEMM", make, ops, None, 0)
            assert out.shape == (32, 48)
            gone = weakref.ref(x8)
            del x8, ops, make
            gc.collect()
            assert gone() is None, "the plan still holds the call's activations"
    finally:
        ge._PLANS.pop((*key, 0), None)
    assert made[-1].operands == {} and made[-1].released == ("a", "b")


@pytest.mark.parametrize("autotune", [0, 3])
def test_each_graph_copy_plans_its_own_gemms_with_the_first_copys_algorithms(monkeypatch, autotune):
    """Graph copies replay at once on different streams, and a plan's workspace is written by
    every replay of a graph captured with it: _planned makes one Matmul per copy (plan_copy), and
    within a copy the layers of one shape share it. Later copies are planned with the algorithms
    the first copy's plan chose (autotuned or the heuristic's) and are not autotuned again, so a
    batch's bits do not depend on the copy it lands on."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x8, w8 = torch.zeros(32, 16).to(torch.float8_e4m3fn), torch.ones(48, 16).to(torch.float8_e4m3fn)
    ops = {"a": w8, "b": x8.t()}
    made = []

    def make(stream, algorithms):
        made.append(_FakeMatmul(ops, [], algorithms))
        return made[-1]

    key = ("copy-test", autotune)
    try:
        for copy in (0, 1, 0, 1, 2):
            with ge.plan_copy(copy):
                ge._planned(key, "test GEMM", make, ops, None, autotune)
        ge._planned(key, "test GEMM", make, ops, None, autotune)  # outside any copy: copy 0's
    finally:
        for copy in range(3):
            ge._PLANS.pop((*key, copy), None)
    # copy 0: the candidates' plan (freed) and the chosen algorithm's; copies 1 and 2: that algorithm
    assert len(made) == 4 and len({id(m) for m in made}) == 4
    candidates, first, *later = made
    assert [len([e for e in m.log if e[0] == "execute"]) for m in made] == [0, 3, 2, 1]
    assert candidates.given is None and [e[0] for e in candidates.log].count("autotune") == (1 if autotune else 0)
    assert [e[0] for e in candidates.log][-1] == "free" and len(first.given) == 1
    for m in later:
        assert m.given == first.algorithms and m.algorithms == first.algorithms
        assert not any(e[0] == "autotune" for e in m.log)


def test_each_copy_of_the_token_bucket_graphs_is_captured_on_a_stream_of_its_own(monkeypatch):
    """Torch keys cuBLAS's workspace by stream and a captured GEMM writes into its capture stream's
    workspace on every replay: copies of the graphs that replay at once must be captured on
    different streams (one copy keeps torch's default capture stream), each in a pool of its own
    and inside its own ``around`` context; every bucket of every copy is captured."""
    from bertqa_bench.backends.transforms.packed_encoder import TokenBuckets

    made, captured = [], []

    class FakeStream(_FakeStream):
        def __init__(self, device=None):
            super().__init__(device)
            made.append(self)

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        captured.append((current_copy[0], pool, stream))
        yield

    pools = iter(range(100))
    current_copy = [None]

    @contextlib.contextmanager
    def around(k):
        current_copy[0] = k
        yield
        current_copy[0] = None

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda st: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    encode = lambda ids, pos, types, cu, max_len: ids.float()  # noqa: E731
    for copies in (1, 2, 3):
        made.clear(), captured.clear()
        tb = TokenBuckets(encode, bucket=16, max_len=6, max_rows=4, max_tokens=40)
        assert tb.capture("cpu", copies=copies, around=around) == copies * len(tb.sizes)
        assert [len(c) for c in tb.copies] == [len(tb.sizes)] * copies and tb.graphs is tb.copies[0]
        streams = {k: {id(st) for c, _, st in captured if c == k} for k in range(copies)}
        pools_of = {k: {p for c, p, _ in captured if c == k} for k in range(copies)}
        assert all(len(v) == 1 for v in streams.values()) and all(len(v) == 1 for v in pools_of.values())
        if copies == 1:
            assert captured[0][2] is None  # torch's default capture stream, as before copies existed
        else:
            assert len(set.union(*streams.values())) == copies and None not in {st for *_, st in captured}
        assert len(set.union(*pools_of.values())) == copies
        assert tb.copies[0][tb.sizes[0]][1] is not tb.copies[-1][tb.sizes[0]][1] or copies == 1


def test_submit_sends_slot_k_to_stream_and_graph_copy_k_mod_n(monkeypatch):
    """With streams > 1, consecutive batches take consecutive slots, and slot k's work is queued on
    stream k mod n with graph copy k mod n, inside that stream's context: a slot's buffers (pinned
    inputs, packing, outputs) are then only ever used on one stream, and its copies into a graph's
    static inputs are ordered after that copy's previous replay. One stream: no stream context."""
    from bertqa_bench.backends.device_io import HostOutputs

    v = TABLE.get("torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune-2streams")
    current, seen = [None], []

    @contextlib.contextmanager
    def stream(st):
        before, current[0] = current[0], st
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "stream", stream)
    batch = {"input_ids": np.zeros((2, 8), np.int64), "attention_mask": np.ones((2, 8), np.int64)}
    for streams in (2, 3, 1):
        be = make_variant("x", "torch", "cuda", {**dataclasses.asdict(v.options), "streams": streams}).create()
        be._staging, be._host = [None] * be.in_flight(), HostOutputs()
        be._streams = [f"stream-{k}" for k in range(streams)] if streams > 1 else []
        seen.clear()
        monkeypatch.setattr(be, "_queue", lambda batch, b, slot, copy: seen.append((slot, copy, current[0])) or (lambda: {}))
        for _ in range(2 * be.in_flight() + 1):
            be.submit(batch)
        assert len(seen) == 2 * be.in_flight() + 1
        for slot, k, st in seen:
            assert k == slot % streams
            assert st == (f"stream-{k}" if streams > 1 else None)
        assert {slot for slot, _, _ in seen} == set(range(be.in_flight()))


class _FakeStream:
    """torch.cuda.Stream on a CPU torch: a distinct handle per stream."""

    def __init__(self, device=None):
        self.cuda_stream = object()

    def wait_stream(self, other):
        pass


def test_padded_graph_copies_are_captured_each_on_its_own_stream(monkeypatch):
    """cuda_graph: manual with streams > 1: every shape is captured once per copy, each copy on
    its own capture stream (the stream its batches then replay on); one copy keeps torch's default
    capture stream."""
    from bertqa_bench.backends.torch_backend import _GraphReplay

    captured = []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        captured.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda st: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    batches = [{n: np.zeros((b, s), np.int64) for n in ("input_ids", "attention_mask", "token_type_ids")}
               for b, s in ((2, 8), (4, 16))]
    for copies in (1, 2, 3):
        captured.clear()
        gr = _GraphReplay(lambda *a: (a[0].float(),), "cpu", copies=copies)
        for k in range(copies):
            for b in batches:
                gr.capture(b, k)
        assert sorted(gr.graphs) == sorted((b["input_ids"].shape + (c,)) for b in batches for c in range(copies))
        if copies == 1:
            assert captured == [None, None] and gr.capture_streams == [None]
        else:
            assert captured == [gr.capture_streams[c] for c in range(copies) for _ in batches]
            assert len({id(st) for st in gr.capture_streams}) == copies and None not in gr.capture_streams


def test_capture_streams_refuse_a_pool_that_repeats_a_stream(monkeypatch):
    """torch.cuda.Stream() hands out pooled streams in turn: copies that got the same CUDA stream
    would share its cuBLAS workspace, so that is an error, not a silent race."""
    from bertqa_bench.backends.device_io import capture_streams

    handles = iter([1, 2, 1])

    class Pooled(_FakeStream):
        def __init__(self, device=None):
            self.cuda_stream = next(handles)

    monkeypatch.setattr(torch.cuda, "Stream", Pooled)
    with pytest.raises(RuntimeError, match="fewer than 3 distinct CUDA streams"):
        capture_streams("cuda", 3)
    assert capture_streams("cuda", 1) == [None]
    with pytest.raises(ValueError):
        capture_streams("cuda", 0)


def test_streams_option_is_checked_and_keeps_two_batches_a_stream_in_flight():
    from bertqa_bench.errors import ConfigError

    packed = {"weights": "fp16", "packed": True, "token_bucket": 64, "host_pack": True, "pipeline": True}
    padded = {"weights": "fp16", "compile": "default", "cuda_graph": "manual", "pipeline": True}
    for opts in (packed, padded):
        v = make_variant("x", "torch", "cuda", {**opts, "streams": 3})
        assert v.options.streams == 3 and v.create().in_flight() == 6
    with pytest.raises(ConfigError, match="streams: 2 .* needs pipeline: true"):
        make_variant("x", "torch", "cuda", {**packed, "pipeline": False, "streams": 2})
    with pytest.raises(ConfigError, match="token_bucket with host_pack .* or cuda_graph: manual"):
        make_variant("x", "torch", "cuda", {"weights": "fp16", "compile": "default", "pipeline": True, "streams": 2})
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ConfigError, match=r"streams( -?\d+: the number of CUDA streams, 1 to 8| must be int)"):
            make_variant("x", "torch", "cuda", {**packed, "streams": bad})
    with pytest.raises(ConfigError, match="streams 9: the number of CUDA streams, 1 to 8"):
        make_variant("x", "torch", "cuda", {**packed, "streams": 9})
    # packed on the device (no host_pack) replays copy 0 from every stream: refused
    with pytest.raises(ConfigError, match="token_bucket with host_pack"):
        make_variant("x", "torch", "cuda", {**packed, "host_pack": False, "streams": 2})
    for name in ("torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune-2streams",
                 "torch-compile-fp8-graph-gelu-epilogue-autotune-2streams"):
        v = TABLE.get(name)
        assert v.options.streams == 2 and v.create().in_flight() == 4, name
        one = make_variant("x", "torch", "cuda", {**dataclasses.asdict(v.options), "streams": 1})
        assert one.create().in_flight() == 2


def test_cublaslt_options_are_checked():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="cublaslt_gemms must name some of qkv, attn_out, ffn_in, ffn_out"):
        torch_options.Fp8Options(cublaslt_gemms="proj")
    with pytest.raises(ConfigError, match="cublaslt_gemms names attn_out, which gemms .* leaves in 16 bits"):
        torch_options.Fp8Options(cublaslt_gemms="attn_out")
    with pytest.raises(ConfigError, match="cublaslt_gemms needs scaling 'tensor'"):
        torch_options.Fp8Options(cublaslt_gemms="qkv", scaling="rowwise")
    with pytest.raises(ConfigError, match="cublaslt_gemms: ffn_in writes e4m3 here"):
        torch_options.Fp8Options(cublaslt_gemms="ffn_in", ffn_hidden_fp8=True)
    with pytest.raises(ConfigError, match="cublaslt_gemms: qkv writes e4m3 here"):
        torch_options.Fp8Options(cublaslt_gemms="qkv", gemms="all", attention="fp8")
    with pytest.raises(ConfigError, match="cublaslt_autotune tunes the GEMMs planned through nvmath-python, and none is"):
        torch_options.Fp8Options(cublaslt_autotune=3)
    with pytest.raises(ConfigError, match="cublaslt_autotune must be an integer >= 0 .*not -1"):
        torch_options.Fp8Options(cublaslt_gemms="qkv", cublaslt_autotune=-1)
    torch_options.Fp8Options(ffn_hidden_fp8=True, ffn_gelu="epilogue", cublaslt_autotune=3)
    f = torch_options.Fp8Options(cublaslt_gemms="ffn_out")
    with pytest.raises(ConfigError, match="cublaslt_gemms plans one cuBLASLt GEMM per token count.*token_bucket"):
        torch_options.TorchOptions(weights="fp16", packed=True, fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=256, fp8=f)
    torch_options.TorchOptions(weights="fp16", fp8=f)  # padded: a few shapes, each planned in warm-up
    with pytest.raises(ConfigError, match="need weights: fp16, not bf16"):
        torch_options.TorchOptions(weights="bf16", fp8=f)
    with pytest.raises(ConfigError, match="cublaslt_gemms: attn_out already runs through cuBLASLt as the residual GEMM"):
        torch_options.Fp8Options(gemms="all", residual="gemm", cublaslt_gemms="qkv,attn_out")
    with pytest.raises(ConfigError, match="cublaslt_autotune must be an integer >= 0"):
        torch_options.Fp8Options(cublaslt_gemms="qkv", cublaslt_autotune="5")
    # the candidates are the algorithms autotuning times: without autotuning they change nothing
    with pytest.raises(ConfigError, match="cublaslt_candidates: 64 algorithms are timed only when autotuned"):
        torch_options.Fp8Options(cublaslt_gemms="qkv", cublaslt_candidates=64)
    for bad in (-1, True, "64"):
        with pytest.raises(ConfigError, match="cublaslt_candidates must be an integer >= 0"):
            torch_options.Fp8Options(cublaslt_gemms="qkv", cublaslt_autotune=5, cublaslt_candidates=bad)
    torch_options.Fp8Options(cublaslt_gemms="qkv", cublaslt_autotune=5, cublaslt_candidates=64)


@pytest.mark.gpu
def test_planned_fp8_gemm_on_gpu_is_its_formula_autotuned_or_not_and_captures():
    """cuBLASLt planned through nvmath (bias epilogue, fp16 out) against the formula in fp32, at the
    heuristic's algorithm and autotuned: within one fp16 rounding and fast accumulation's bound;
    the two settings are planned apart (the autotuned plan does not replace the heuristic's); a CUDA
    graph captured after planning replays the same bytes."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    if ge.nvmath_unavailable_reason():
        pytest.skip(ge.nvmath_unavailable_reason())
    before = len(ge._PLANS)
    # 120 tokens: not a multiple of 16, which cuBLASLt's FP8 kernels need (padded for the GEMM)
    for m in (256, 120):
        x8, w8, bias, sw, sx = (t.cuda() for t in _epilogue_operands(m=m, k=256, n=512))
        exact = (x8.float() @ w8.float().t()) * (sx * sw) + bias.float()
        magnitude = (x8.float().abs() @ w8.float().abs().t()) * (sx * sw) + bias.float().abs()
        for tune in (0, 3):
            _fp16_gemm_is_its_formula_and_captures(lambda: ge.fp8_gemm_bias(x8, w8, bias, sw, sx, True, tune), exact,
                                                   magnitude, (m, tune))
    assert len(ge._PLANS) == before + 4


def test_fp8_attention_options_are_checked():
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8.attention 'int8' is not one of fp16, fp8"):
        torch_options.Fp8Options(attention="int8")
    with pytest.raises(ConfigError, match="attention: fp8 needs .*qkv, attn_out"):
        torch_options.Fp8Options(attention="fp8")
    f = torch_options.Fp8Options(attention="fp8", gemms="all")
    with pytest.raises(ConfigError, match="needs packed: true and packed_attention: cudnn or triton"):
        torch_options.TorchOptions(weights="fp16", packed=True, fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, packed_attention="cudnn", fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, packed_attention="triton", token_bucket=64, fp8=f)
    # the second product's type: the Triton kernel's choice, for FP8 attention only
    with pytest.raises(ConfigError, match="fp8.attention_pv 'int8' is not one of e4m3, fp16"):
        torch_options.Fp8Options(attention="fp8", gemms="all", attention_pv="int8")
    with pytest.raises(ConfigError, match="fp8.attention_pv: fp16 is FP8 attention's second product: it needs attention: fp8"):
        torch_options.Fp8Options(attention_pv="fp16")
    f16 = torch_options.Fp8Options(attention="fp8", gemms="all", attention_pv="fp16")
    with pytest.raises(ConfigError, match="fp8.attention_pv: fp16 is the suite's Triton kernel's choice"):
        torch_options.TorchOptions(weights="fp16", packed=True, packed_attention="cudnn", fp8=f16)
    torch_options.TorchOptions(weights="fp16", packed=True, packed_attention="triton", token_bucket=64, fp8=f16)


@pytest.mark.gpu
def test_cudnn_fp8_attention_on_gpu_is_attention_up_to_the_e4m3_roundings():
    """cuDNN's FP8 attention on packed e4m3 views of a fused [T, 3, heads, d] tensor, within the
    same e4m3 bound as the reference (it rounds the unnormalized probabilities tile by tile instead:
    the same relative step); a CUDA graph replays the same bytes."""
    from bertqa_bench.kernels import cudnn_fp8_attention as fa

    if fa.unavailable_reason():
        pytest.skip(fa.unavailable_reason())
    qkv8, cu = _fp8_qkv(heads=4, d=64)
    q8, k8, v8 = (t.cuda() for t in qkv8.cuda().unbind(1))
    qkv_scale, o_inv, scale = 0.01, 100.0, 64 ** -0.5
    sq, so = torch.tensor(qkv_scale, device="cuda"), torch.tensor(o_inv, device="cuda")
    cu_gpu = cu.cuda()  # made before capture: a host-to-device copy cannot be captured
    got = fa.fp8_varlen_attention(q8, k8, v8, cu_gpu, 64, scale, sq, so)
    err, allowed = _fp8_attention_bound(q8.cpu(), k8.cpu(), v8.cpu(), cu, scale, qkv_scale, o_inv, got.cpu())
    assert bool((err <= allowed).all()), float((err - allowed).max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa.fp8_varlen_attention(q8, k8, v8, cu_gpu, 64, scale, sq, so)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), got.view(torch.uint8))


# --------------------------------------------------------------------------- GPU end-to-end

def _gpu_ctx(tmp_path, b=4, s=64):
    path = tmp_path / "tiny-bert-qa"
    tiny_bert(hidden=64).save_pretrained(path)

    def batch(bb, ss, seed):
        r = np.random.default_rng(seed)
        ids = r.integers(5, 1000, (bb, ss)).astype(np.int64)
        mask = np.ones((bb, ss), np.int64)
        mask[-1, ss // 2:] = 0
        types = np.zeros((bb, ss), np.int64)
        types[:, ss // 3:] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

    ctx = BackendContext(model_dir=path, task="squad", artifacts_dir=tmp_path / "art", output_names=OUTPUTS,
                         sample_batches=(batch(b, s, 0),), shapes=((b, s), (3, 40)), max_batch_size=b, max_seq_len=s)
    return ctx, [batch(b, s, 1), batch(3, 40, 2)]


def _run(name, ctx, batches, **over):
    base = TABLE.get(name)
    options = {**dataclasses.asdict(base.options), **over}
    backend = make_variant(name, base.implementation, base.device, options).create()
    backend.prepare(ctx)
    try:
        return backend.prepare_info, [backend.predict(b) for b in batches]
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name,over", [("torch-compile-fp8", {}), ("torch-compile-fp8-all", {}),
                                       ("torch-compile-fp8-rowwise", {}),
                                       ("torch-compile-fp8", {"cuda_graph": "trees"}),
                                       ("eager-fp8-packed", {}), ("torch-compile-fp8-packed", {}),
                                       ("torch-compile-fp8-packed-graph", {})])
def test_fp8_backend_tracks_fp32_on_gpu(tmp_path, name, over):
    reason = TABLE.get(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    ctx, batches = _gpu_ctx(tmp_path)
    _, refs = _run("eager-fp32-cuda", ctx, batches)
    info, outs = _run(name, ctx, batches, **over)
    assert info["fp8_linears"] >= 2 * 3 and info["fp8_fused_qkv"] is True
    if "-packed" in name:  # padding-free: no whole-model graphs, the token count changes every batch
        assert info["packed"] is True and info["cuda_graph"] == "none"
        if name.endswith("-graph"):  # one CUDA graph per token bucket instead
            assert info["token_bucket_graphs"] == info["token_buckets"] >= 1
            # where the memory sits, from the allocator's own snapshot: the graphs' private pools hold
            # what they allocated, the default pool the weights
            assert info["cuda_graph_pools"] >= 1 and info["cuda_graph_pools_mib"] > 0
            assert info["cuda_default_pool_mib"] > 0 and " x " in info["cuda_graph_largest_blocks_mib"]
    else:
        assert info["cuda_graph"] == ("trees" if over else "manual") and info["prepared_shapes"] == 2
    for out, ref, b in zip(outs, refs, batches):
        bs, s = b["input_ids"].shape
        for n in OUTPUTS:
            assert out[n].shape == (bs, s) and out[n].dtype == np.float32 and np.isfinite(out[n]).all()
            valid = b["attention_mask"].astype(bool)
            err = np.linalg.norm((out[n] - ref[n])[valid]) / np.linalg.norm(ref[n][valid])
            assert err < 0.08, (name, n, err)


@pytest.mark.gpu
def test_fp8_linear_on_gpu_matches_fp32():
    if TABLE.get("torch-compile-fp8").unavailable_reason():
        pytest.skip(TABLE.get("torch-compile-fp8").unavailable_reason())
    torch.manual_seed(3)
    lin = nn.Linear(768, 3072).cuda()
    x = torch.randn(512, 768, device="cuda")
    ref = lin(x)
    for scaling in fp8_rules.SCALINGS:
        act = None if scaling == "rowwise" else fp8_math.static_act_scale(float(x.abs().amax()), 1.0)
        f = fp8.fp8_classes()[0].from_linear(copy.deepcopy(lin).half(), scaling=scaling, act_scale=act)
        with torch.no_grad():
            y = f(x.half())
        assert y.dtype == torch.float16
        assert rel_l2(y, ref) < 0.05, scaling


@pytest.mark.gpu
def test_fp8_output_gemm_on_gpu_matches_fp32_and_saturates():
    """cuBLASLt's FP8-output GEMM (Fp8Linear with out_scale): y / out_scale in e4m3 with the bias,
    as on CPU, and saturated at +-448 (not NaN) past the calibrated range."""
    if TABLE.get("torch-compile-fp8").unavailable_reason():
        pytest.skip(TABLE.get("torch-compile-fp8").unavailable_reason())
    torch.manual_seed(5)
    lin = nn.Linear(768, 3072).cuda()
    x = torch.randn(512, 768, device="cuda")
    ref = lin(x).detach()
    act = fp8_math.static_act_scale(float(x.abs().amax()), 1.0)
    out_scale = fp8_math.static_act_scale(float(ref.abs().amax()), 2.0)
    f, tight = (fp8.fp8_classes()[0].from_linear(copy.deepcopy(lin).half(), scaling="tensor", act_scale=act,
                                                 out_scale=o, fast_accum=True)
                for o in (out_scale, fp8_math.static_act_scale(float(ref.abs().amax()), 0.1)))
    with torch.no_grad():
        y = f(x.half())
        big = tight(x.half())  # a tenth of the output's range: most outputs overflow e4m3
    assert y.dtype == torch.float8_e4m3fn
    assert rel_l2(y.float() * out_scale, ref) < 0.08
    assert torch.isfinite(big.float()).all() and float(big.float().abs().max()) == fp8_math.E4M3_MAX


@pytest.mark.gpu
def test_tanh_gelu_triton_op_on_gpu_matches_torch_and_compiles():
    """The custom op on CUDA (tanh.approx.f32): within one e4m3 code of torch's tanh form (the
    same code for nearly all elements) and, outside GELU's far negative tail, two of erf-GELU's;
    compiled with fullgraph (the op stays in the graph, its kernel compiled by Inductor), bit for
    bit the op run eagerly."""
    from bertqa_bench.kernels import gelu_fp8

    if gelu_fp8.triton_unavailable_reason():
        pytest.skip(gelu_fp8.triton_unavailable_reason())
    x8 = (torch.randn(4096, 3072, device="cuda") * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = gelu_fp8.gelu_tanh_fp8(x8, 0.05, 1 / 0.02)
    ref = gelu_fp8.gelu_tanh_fp8_reference(x8, 0.05, 1 / 0.02)
    assert got.dtype == torch.float8_e4m3fn and got.shape == x8.shape
    apart = e4m3_codes_apart(got, ref)
    assert float((apart == 0).float().mean()) > 0.99 and int(apart.max()) <= 1
    # Against erf-GELU: one code more than torch's tanh form (below) where |GELU| / 0.02 >= 1; in
    # the negative tail, where GELU is < 0.02 and the tanh form is relatively farthest from erf
    # (up to 4 codes at this finer scale, on the CPU too), the values stay within 2 codes' worth.
    erf = fp8_math.quantize_e4m3(nn.functional.gelu(x8.float() * 0.05), 0.02)
    big = erf.float().abs() >= 1
    assert int(e4m3_codes_apart(got, erf)[big].max()) <= 2
    assert float((got.float() - erf.float())[~big].abs().max()) <= 0.125
    compiled = torch.compile(lambda t: gelu_fp8.gelu_tanh_fp8(t, 0.05, 1 / 0.02), fullgraph=True)
    assert torch.equal(compiled(x8).view(torch.uint8), got.view(torch.uint8))



def test_a_torch_without_triton_op_still_imports_the_fp8_rows():
    """torch.library.triton_op came with torch 2.6; the FP8 modules and the packed encoder import
    the GELU kernel's module at their top, so on an older torch they must still import, and the
    GELU runs through torch, saying why (a fresh process: the op registers once per process)."""
    code = ("import torch.library as L\ndel L.triton_op\n"
            "import bertqa_bench.backends.transforms.fp8_modules, bertqa_bench.backends.transforms.packed_encoder\n"
            "from bertqa_bench.kernels import add_layernorm_fp8, gelu_fp8\n"
            "assert gelu_fp8.gelu_tanh_fp8_op is None and not gelu_fp8._runs_triton(True)\n"
            "assert add_layernorm_fp8.add_layernorm_fp8_op is None and not add_layernorm_fp8._runs_triton(True)\n"
            "print(gelu_fp8.implementation(True))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton_op" in out.stdout or "triton is not installed" in out.stdout, out.stdout

# --------------------------------------------------------------------------- INT8 and the sensitivity sweep

def test_int8_linear_matches_linear_within_int8_error():
    from bertqa_bench.backends.transforms.int8_dynamic import int8_linear_class

    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(4, 10, 64)
    q = int8_linear_class()(lin.weight, lin.bias)
    with torch.no_grad():
        assert rel_l2(q(x), lin(x)) < 0.02
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (64, 48)  # stored [K, N]


def test_swapped_int8_tiny_bert_tracks_fp32_and_keeps_the_layers_asked():
    from bertqa_bench.backends.transforms.int8_dynamic import swap_to_int8

    model = qa(tiny_bert(hidden=64, layers=3))
    ref = copy.deepcopy(model)
    done = swap_to_int8(model, keep_layers=[1])
    assert len(done["swapped"]) == 2 * 6 and all(".layer.1." in n for n in done["kept"])  # q, k, v, o, in, out
    ids, mask, types = inputs(4, 40)
    with torch.no_grad():
        for a, b in zip(model(ids, mask, types), ref(ids, mask, types)):
            assert rel_l2(a, b) < 0.05


def test_sensitivity_sweep_ranks_layers_by_how_far_they_move_the_outputs():
    from bertqa_bench.backends.transforms.layer_sensitivity import choose_kept_layers, layer_sensitivity

    model = qa(tiny_bert(hidden=32, layers=3))
    batches = [inputs(3, 24, seed=s) for s in range(2)]

    def damage(m, layer):  # a stand-in for quantization whose error grows with the layer index
        with torch.no_grad():
            w = m.model.bert.encoder.layer[layer].output.dense.weight
            w.add_(torch.randn_like(w) * 0.05 * (layer + 1))

    scores = layer_sensitivity(model, batches, damage)
    assert [layer for layer, _ in scores] == [2, 1, 0] and scores[0][1] > scores[-1][1] > 0
    assert choose_kept_layers(scores, 2) == (1, 2) and choose_kept_layers(scores, 0) == ()


def test_fp8_recipe_with_a_sensitivity_sweep_keeps_the_most_sensitive_layers(tmp_path):
    """The torch backend's fp8 option end to end on CPU (float8 GEMMs exist in CPU torch)."""
    if not _cpu_scaled_mm_works():
        pytest.skip("this CPU torch has no float8 _scaled_mm")
    from bertqa_bench.backends.torch_backend import TorchBackend

    path = tmp_path / "m"
    tiny_bert(hidden=64, layers=3).save_pretrained(path)
    rng = np.random.default_rng(0)
    b = {"input_ids": rng.integers(5, 1000, (4, 32)).astype(np.int64), "attention_mask": np.ones((4, 32), np.int64),
         "token_type_ids": np.zeros((4, 32), np.int64)}
    ctx = BackendContext(model_dir=path, task="squad", artifacts_dir=tmp_path / "a", output_names=OUTPUTS,
                         sample_batches=(b,), shapes=((4, 32),), max_batch_size=4, max_seq_len=32)
    v = make_variant("fp8-cpu", "torch", "cpu", {"weights": "fp32", "autocast": "none"})
    backend = TorchBackend(v)
    module, info = torch_builder.build_model(backend.options, ctx, backend.device, backend.name)  # no fp8 asked: nothing swapped
    assert info == {}
    import dataclasses as dc

    opts = dc.replace(v.options, weights="fp16")
    opts.fp8 = torch_options.Fp8Options(sensitivity_keep=1)
    backend.options = opts
    backend.device = "cpu"
    module, info = torch_builder.build_model(backend.options, ctx, backend.device, backend.name)
    kept = info["sensitivity_kept"]
    assert len(kept.split(",")) == 1 and info["fp8_keep_layers"] == kept
    assert len(info["sensitivity_max_abs_logit_shift"].split(";")) == 3


# --------------------------------------------------------------------------- the variant's options reach the model

def _layer_io(model, index):
    """The args, kwargs and output of encoder layer ``index`` in one forward of ``model``."""
    layer = _encoder(model).layer[index]
    seen = {}

    def hook(_m, args, kwargs, output):
        seen.update(args=args, kwargs=kwargs, output=output)

    h = layer.register_forward_hook(hook, with_kwargs=True)
    return h, seen


def _encoder(module):
    return module.model.bert.encoder


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@needs_cpu_scaled_mm
def test_a_variants_kept_layers_stay_unquantized_in_the_model_it_builds(tmp_path):
    """keep_layers declared in a variant's options reaches the module tree the backend predicts
    with: the kept layer is the 16-bit model's own (its Linears by type, its output bit for bit on
    the same input), the others are FP8 — not just reported so in prepare_info."""
    from bertqa_bench.backends.torch_backend import TorchBackend
    from bertqa_bench.model.modeling import load_inference_module

    path = tmp_path / "m"
    tiny_bert(hidden=64, layers=3).save_pretrained(path)
    rng = np.random.default_rng(0)
    b = {"input_ids": rng.integers(5, 1000, (4, 32)).astype(np.int64), "attention_mask": np.ones((4, 32), np.int64),
         "token_type_ids": np.zeros((4, 32), np.int64)}
    ctx = BackendContext(model_dir=path, task="squad", artifacts_dir=tmp_path / "a", output_names=OUTPUTS,
                         sample_batches=(b,), shapes=((4, 32),), max_batch_size=4, max_seq_len=32)
    v = make_variant("fp8-keep", "torch", "cpu", {"weights": "fp16", "autocast": "none", "fp8": {"keep_layers": "1"}})
    backend = v.create()
    assert isinstance(backend, TorchBackend)
    module, info = torch_builder.build_model(backend.options, ctx, backend.device, backend.name)
    assert info["fp8_keep_layers"] == "1"
    Fp8Linear, Fp8SelfAttention = fp8.fp8_classes()[:2]
    layers = _encoder(module).layer
    for i, layer in enumerate(layers):
        linears = [layer.attention.self.query, layer.attention.self.key, layer.attention.self.value,
                   layer.intermediate.dense, layer.output.dense] if i == 1 else []
        if i == 1:  # by type: plain 16-bit Linears, the unfused attention
            assert not isinstance(layer.attention.self, Fp8SelfAttention)
            assert all(type(m) is nn.Linear and m.weight.dtype == torch.float16 for m in linears)
        else:
            assert isinstance(layer.attention.self, Fp8SelfAttention)
            assert isinstance(layer.intermediate.dense, Fp8Linear) and isinstance(layer.output.dense, Fp8Linear)
    assert not any(isinstance(m, (Fp8Linear, Fp8SelfAttention)) for m in layers[1].modules())

    # by output: each layer against the unquantized 16-bit model's same layer, on the same input
    ref = load_inference_module(path, "squad", dtype=torch.float16).eval()
    x = tuple(torch.from_numpy(b[n]) for n in ("input_ids", "attention_mask", "token_type_ids"))
    hooks, seen = zip(*(_layer_io(module, i) for i in range(3)))
    with torch.inference_mode():
        module(*x)
        for h in hooks:
            h.remove()
        for i, s in enumerate(seen):
            want = _first(_encoder(ref).layer[i](*s["args"], **s["kwargs"]))
            got = _first(s["output"])
            if i == 1:
                assert torch.equal(got, want), "the kept layer computes something else than the 16-bit layer"
            else:
                assert not torch.equal(got, want) and rel_l2(got, want) < 0.1  # quantized, and close


# --------------------------------------------------------------------------- torchao FP8, cuDNN attention, host packing

TORCHAO_NAMES = ("torchao-fp8", "torchao-fp8-tensor", "torchao-fp8-packed-graph")


def test_torchao_variants_are_fp8_cuda_rows_with_checked_options():
    from bertqa_bench.errors import ConfigError

    for name in TORCHAO_NAMES:
        v = TABLE.get(name)
        assert (v.device, v.precision, v.parity_class) == ("cuda", "fp8", "reduced"), name
        assert v.options.torchao is not None and v.options.fp8 is None
    assert TABLE.get("torchao-fp8-packed-graph").batching == "packed"
    with pytest.raises(ConfigError, match="tensor, row"):
        make_variant("x", "torch", "cuda", {"weights": "bf16", "torchao": {"granularity": "block"}})
    with pytest.raises(ConfigError, match="name one"):
        make_variant("x", "torch", "cuda", {"weights": "bf16", "torchao": {}, "fp8": {}})
    with pytest.raises(ConfigError, match="16 bits"):
        make_variant("x", "torch", "cuda", {"torchao": {}})
    with pytest.raises(ConfigError, match="host_pack"):
        make_variant("x", "torch", "cuda", {"weights": "fp16", "packed": True, "host_pack": True})


def test_torchao_quantizes_the_encoder_gemms_named_and_never_the_head():
    model = qa(tiny_bert(hidden=64, layers=3))
    names = torch_options.torchao_targets(model, torch_options.TorchaoOptions())
    assert len(names) == 3 * 5  # query, key, value, intermediate, output per layer; attention output stays 16-bit
    assert not any("qa_outputs" in n or "attention.output" in n for n in names)
    kept = torch_options.torchao_targets(model, torch_options.TorchaoOptions(keep_layers="1", gemms="ffn_in"))
    assert sorted(kept) == sorted(n for n in names if n.endswith("intermediate.dense") and ".layer.1." not in n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_torchao_unavailable_without_cuda_names_the_reason():
    reason = TABLE.get("torchao-fp8").unavailable_reason()
    assert reason and "CUDA" in reason


def test_host_pack_gives_the_device_packs_values():
    """The host packing (numpy) against PackedEncoder.pack (torch) on right-padded rows of
    several lengths, with and without RoBERTa's position offset and token types."""
    from bertqa_bench.backends.transforms.packed_encoder import PackedEncoder, host_pack

    enc = PackedEncoder(tiny_bert(hidden=32).bert)
    r = np.random.default_rng(0)
    b, s = 5, 24
    ids = r.integers(5, 1000, (b, s))
    mask = np.zeros((b, s), np.int64)
    for i, n in enumerate((24, 1, 13, 7, 20)):
        mask[i, :n] = 1
    types = r.integers(0, 2, (b, s))
    for offset, tt in ((0, types), (2, None)):
        enc.position_offset = offset
        want = enc.pack(torch.from_numpy(ids), torch.from_numpy(mask), None if tt is None else torch.from_numpy(tt))
        got = host_pack(ids, mask, tt, offset)
        for w, g in zip(want[:5], got[:5]):
            np.testing.assert_array_equal(w.numpy(), g)
        assert want[5] == got[5] == 24


def test_the_first_call_before_capture_is_the_runs_real_batch_packed_as_forward_packs_it():
    """``first_packed_batch``: what ``TokenBuckets.capture(first=...)`` runs before any capture, so
    that the attention kernel's autotuner times its tiles on real sequences. It must be the sample
    batch's real tokens and lengths, exactly as the encoder's forward packs that batch."""
    from bertqa_bench.backends.transforms.packed_encoder import PackedEncoder, host_pack
    from bertqa_bench.backends.torch_backend import first_packed_batch

    enc = PackedEncoder(tiny_bert(hidden=32).bert)
    r = np.random.default_rng(1)
    ids = r.integers(5, 1000, (3, 20))
    mask = np.zeros((3, 20), np.int64)
    for i, n in enumerate((20, 3, 11)):
        mask[i, :n] = 1
    types = r.integers(0, 2, (3, 20))
    got = first_packed_batch(enc, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
                             torch.device("cpu"))
    assert len(got) == 4
    np.testing.assert_array_equal(got[3].numpy(), [0, 20, 23, 34])
    for g, w in zip(got, host_pack(ids, mask, types)[:4]):
        np.testing.assert_array_equal(g.numpy(), w)


def test_the_batch_tuned_on_is_the_sample_batch_of_median_mean_length():
    """``typical_batch``: the plan's sample batches run from few long sequences (the first, of the
    largest shape) to many short ones; the one the attention tile is tuned on has the median mean
    length, the lower median for an even count, the earliest on a tie."""
    from bertqa_bench.backends.torch_backend import typical_batch

    def batch(lengths, seq=40):
        return {"attention_mask": (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)}

    means = [38, 12, 30, 20, 25]  # the first: the largest shape, long sequences
    batches = [batch([m - 1, m, m + 1]) for m in means]
    assert typical_batch(batches) == 4  # 25: the median of 12, 20, 25, 30, 38
    assert typical_batch(batches[:4]) == 3  # 20: the lower median of 12, 20, 30, 38
    assert typical_batch([batch([10, 30]), batch([20, 20]), batch([5])]) == 0  # 20 twice: the earliest
    assert typical_batch(batches[:1]) == 0


def test_host_bucket_lengths_equal_the_devices():
    from bertqa_bench.backends.transforms.packed_encoder import TokenBuckets

    tb = TokenBuckets(None, bucket=16, max_len=6, max_rows=4, max_tokens=40)
    for lengths in ((5, 6, 1), (6, 6, 6, 6), (2,)):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        t = int(cu[-1])
        size = tb.size_for(t, len(lengths))
        np.testing.assert_array_equal(tb.host_cu(cu, t, size), tb.bucket_cu(torch.from_numpy(cu), t, size).numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("name", TORCHAO_NAMES + ("torch-compile-fp8-cudnn", "torch-compile-fp16-graph-cudnn",
                                                  "torch-compile-fp8-packed-host", "eager-fp16-packed-host",
                                                  "torch-compile-fp8-packed-ffn8", "torch-compile-fp8-cudnn-ffn8",
                                                  "torch-compile-fp8-packed-ffn8-tanh",
                                                  "torch-compile-fp8-packed-ffn8-tanh-head",
                                                  "torch-compile-fp8-cudnn-ffn8-tanh",
                                                  "torch-compile-fp8-graph-packed-cudnn-attn",
                                                  "torch-compile-fp8-graph-packed-gelu-epilogue",
                                                  "torch-compile-fp8-graph-packed-cudnn-epilogue",
                                                  "torch-compile-fp8all-graph-packed-cudnn-epilogue",
                                                  "torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune",
                                                  "torch-compile-fp8-graph-gelu-epilogue-autotune",
                                                  "torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune-2streams",
                                                  "torch-compile-fp8all-graph-packed-triton-epilogue-autotune-2streams",
                                                  "torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-2streams",
                                                  "torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-coordtune-2streams",
                                                  "torch-compile-fp8-graph-gelu-epilogue-autotune-2streams",
                                                  "torch-compile-fp8all-graph-packed-cudnn-attn",
                                                  "torch-compile-fp8all-graph-packed-cudnn-fp8attn",
                                                  "torch-compile-fp8all-graph-packed-cudnn-residual",
                                                  "torch-compile-fp16-packed-cudnn-attn",
                                                  "torch-compile-fp8-graph-packed+fp8-attention",
                                                  "torch-compile-fp8-graph-packed+fp8-attention-pv16",
                                                  "torch-compile-fp8-graph-packed+fused-layernorm",
                                                  "torch-compile-fp8-graph-packed+fp8-attention-pv16-fused-layernorm",
                                                  "torch-compile-fp8-graph-packed+fp8-attention-pv16-fused-layernorm-e4m3-dense"))
def test_fp8_attention_and_packing_variants_track_fp32_on_gpu(tmp_path, name):
    reason = TABLE.get(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    ctx, batches = _gpu_ctx(tmp_path)
    _, refs = _run("eager-fp32-cuda", ctx, batches)
    info, outs = _run(name, ctx, batches)
    if "host" in name or name == "torchao-fp8-packed-graph" or name.startswith("torch-compile-fp8-graph-packed"):
        assert info["packing"] == "host" and info["token_bucket_graphs"] >= 1
        # the same model packed on the device: the host's packing changes where, not what (on one
        # stream: several streams replay graph copies that the host's packing feeds)
        _, dev = _run(name, ctx, batches, host_pack=False, streams=1)
        for o, d, b in zip(outs, dev, batches):
            valid = b["attention_mask"].astype(bool)
            for n in OUTPUTS:
                assert np.abs(o[n] - d[n])[valid].max() < 1e-3, (name, n)
    if name.startswith("torchao"):
        assert info["fp8_linears"] == 2 * 5
    if "-ffn8" in name:
        assert info["fp8_ffn_hidden"] == "e4m3 in 2 layers"
        assert info["fp8_ffn_gelu"].startswith("tanh form, Triton" if "-tanh" in name else "exact")
    assert info.get("head_first", False) == TABLE.get(name).options.head_first
    if "cudnn-" in name and TABLE.get(name).options.packed:
        assert info["attention_kernel"].startswith("cuDNN")
    if "-triton-" in name:
        assert info["attention_kernel"].startswith("Triton")
        assert info["attention_tuning_source"] in ("timed", "cache") and info["attention_tuned_config"]
    if TABLE.get(name).options.token_bucket:  # the sample batch: 3 rows of 64 tokens and one of 32
        assert info["first_call_batch"].startswith("real: sample batch 0 of 1, 4 sequences, 224 tokens (56 a sequence)")
    if "-e4m3out-" in name:
        assert info["attention_kernel"].endswith("e4m3 output in 2 layers")
        assert info["fp8_attention_output"].startswith("e4m3 at the output GEMM's input scale")
    if "epilogue" in name:
        assert info["fp8_ffn_gelu"].startswith("tanh form, cuBLASLt GELU_BIAS epilogue")
    opts = TABLE.get(name).options
    if opts.fp8 is not None and opts.fp8.layernorm == "triton":  # both LayerNorms of each layer, the Triton op
        assert re.match(r"one pass writing the residual and its e4m3 copy before [1-9]\d* FP8 GEMMs: Triton kernel",
                        info["fp8_layernorm"]), info["fp8_layernorm"]
    if opts.fp8 is not None and opts.fp8.dense_output == "e4m3":  # every layer's but the last FFN-down's
        assert re.match(r"e4m3 at a calibrated scale for the LayerNorm kernel, [1-9]\d* GEMMs",
                        info["fp8_dense_output"]), info["fp8_dense_output"]
    if opts.fp8 is not None and opts.fp8.attention == "fp8":
        assert info["fp8_attention"].startswith("e4m3 Q, K, V")
        if opts.packed_attention == "triton":  # the Triton kernel on the QKV GEMM's e4m3 output
            assert info["attention_kernel"].startswith("Triton variable-length attention") and \
                f"on e4m3 Q, K, V, P V in {opts.fp8.attention_pv}" in info["attention_kernel"], info["attention_kernel"]
    for out, ref, b in zip(outs, refs, batches):
        valid = b["attention_mask"].astype(bool)
        for n in OUTPUTS:
            err = np.linalg.norm((out[n] - ref[n])[valid]) / np.linalg.norm(ref[n][valid])
            assert err < 0.08, (name, n, err)


@pytest.mark.gpu
def test_the_triton_attention_kernel_is_first_called_on_the_runs_real_batch_on_gpu(tmp_path, monkeypatch):
    """The autotuner times its tiles on the kernel's first call of a key: that call must carry the
    run's real sequences (the sample batch: lengths 64, 64, 64, 32), not the dummy ones of the
    captures' warm-ups."""
    from bertqa_bench.kernels import varlen_attention as ta

    name = "torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-2streams"
    reason = TABLE.get(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    calls = []
    launch = ta.launch

    def recording(q, k, v, cu_seqlens, *a, **kw):
        if not calls:  # the first call only, before any capture (a host copy inside one would fail)
            calls.append(cu_seqlens.cpu().tolist())
        return launch(q, k, v, cu_seqlens, *a, **kw)

    monkeypatch.setattr(ta, "launch", recording)
    ctx, batches = _gpu_ctx(tmp_path)
    info, _ = _run(name, ctx, batches[:1])
    assert calls[0][:5] == [0, 64, 128, 192, 224], calls[0]
    assert info["first_call_batch"].startswith("real: sample batch 0 of 1, 4 sequences, 224 tokens")


def _in_flight_gives_one_at_a_time_outputs(backend, batches, name, after_passes=None) -> None:
    """The prepared ``backend``'s batches through the runner's own loop (several in flight) are
    bit for bit what it gives one batch at a time; ``after_passes()``, if given, runs after both passes,
    before ``close()`` (checks of what the passes recorded)."""
    from bertqa_bench.measuring.runner import stream

    try:
        sync = [backend.predict(b) for b in batches]
        got = list(stream(backend, batches))
        if after_passes is not None:
            after_passes()
    finally:
        backend.close()
    assert [i for i, _, _ in got] == list(range(len(batches)))
    for (_, out, _), ref in zip(got, sync):
        for n in OUTPUTS:
            np.testing.assert_array_equal(out[n], ref[n], err_msg=f"{name} {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch-compile-fp8all-graph-packed-cudnn-epilogue-autotune-2streams",
                                  "torch-compile-fp8all-graph-packed-triton-epilogue-autotune-2streams",
                                  "torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-2streams",
                                  "torch-compile-fp8-graph-gelu-epilogue-autotune-2streams"])
def test_two_streams_replay_their_own_graph_copies_and_give_the_one_at_a_time_outputs_on_gpu(tmp_path, name,
                                                                                            monkeypatch):
    """Four batches in flight on two streams, through the runner's own loop, over more batches
    than slots: bit for bit what the same prepared backend gives one batch at a time. Batches of
    the two streams overlap there, so graph copies that shared a buffer (a static input, a pool,
    a cuBLAS or cuBLASLt workspace) would corrupt each other's outputs. Autotuning stays on: the
    second copy takes the first copy's algorithms, so a batch's bits do not depend on its copy.
    Both copies replay, each on its own capture stream."""
    from bertqa_bench.kernels import cublaslt_epilogues as ge

    reason = TABLE.get(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    ctx, batches = _gpu_ctx(tmp_path)
    batches = (batches * 5)[:9]
    base = TABLE.get(name)
    monkeypatch.setattr(ge, "_PLANS", {})  # this backend's plans only
    backend = make_variant(name, base.implementation, base.device, dataclasses.asdict(base.options)).create()
    backend.prepare(ctx)

    def streams_used():
        assert {c for c, _ in replays} == {0, 1}
        assert all(st == capture[c].cuda_stream for c, st in replays)

    try:
        assert backend.prepare_info["streams"] == 2 and backend.in_flight() == 4
        if base.options.packed:
            from bertqa_bench.backends.transforms.packed_encoder import encoder_of

            buckets = encoder_of(backend.module.model).buckets
            copies = buckets.copies
            assert len(copies) == 2 and copies[0].keys() == copies[1].keys()
            assert None not in buckets.capture_streams and len(set(map(id, buckets.capture_streams))) == 2
            assert copies[0][max(copies[0])][1].data_ptr() != copies[1][max(copies[1])][1].data_ptr()
        else:
            streams = backend._graphs.capture_streams
            assert None not in streams and len(set(map(id, streams))) == 2
            shapes = {k[:2] for k in backend._graphs.graphs}
            assert {k for k in backend._graphs.graphs} == {(*sh, c) for sh in shapes for c in (0, 1)}
        # each copy planned its own GELU epilogue GEMMs, for every shape (not the 16 x 16 x 16 saturation probe)
        planned = [k for k in ge._PLANS if k[0] == "gelu" and k[3:5] != (16, 16)]
        by_copy = [{k[:-1] for k in planned if k[-1] == c} for c in (0, 1)]
        assert by_copy[0] and by_copy[0] == by_copy[1] and len(planned) == 2 * len(by_copy[0])
        replays = []  # (copy, the CUDA stream it replayed on)
        if base.options.packed:
            capture, replay = buckets.capture_streams, buckets.replay
            monkeypatch.setattr(buckets, "replay", lambda size, t, copy=0: replays.append(
                (copy, torch.cuda.current_stream().cuda_stream)) or replay(size, t, copy))
        else:
            capture, call = streams, backend._graphs.__call__
            monkeypatch.setattr(backend, "_graphs", lambda batch, staging, copy=0: replays.append(
                (copy, torch.cuda.current_stream().cuda_stream)) or call(batch, staging, copy))
    except BaseException:
        backend.close()
        raise
    _in_flight_gives_one_at_a_time_outputs(backend, batches, name, after_passes=streams_used)


PIPELINED = ("torch-compile-fp8-packed-pipelined", "torch-compile-fp8-cudnn-pipelined",
             "torch-compile-fp16-graph-pipelined", "torch-compile-fp8-packed-autotune",
             "torch-compile-fp8-packed-ffn8", "torch-compile-fp8-cudnn-ffn8",
             "torch-compile-fp8-packed-ffn8-tanh", "torch-compile-fp8-cudnn-ffn8-tanh",
             "torch-compile-fp8-packed-ffn8-tanh-head")


def test_pipelined_variants_keep_two_batches_in_flight_on_cuda_only():
    for name in PIPELINED:
        v = TABLE.get(name)
        assert v.device == "cuda" and v.options.pipeline
        sync = make_variant("x", "torch", "cuda", {**dataclasses.asdict(v.options), "pipeline": False})
        assert v.create().in_flight() == 2 and sync.create().in_flight() == 1
    cpu = make_variant("x", "torch", "cpu", {"pipeline": True})
    assert "pipeline" in cpu.unavailable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("name", PIPELINED)
def test_pipelined_variants_give_the_synchronous_outputs_on_gpu(tmp_path, name):
    """Two batches in flight, through the runner's own loop, over more batches than slots (each
    slot's pinned inputs, packing and outputs reused): bit for bit what the same prepared backend
    gives one batch at a time (the same backend: two autotuned compiles may pick different
    kernels). A third batch submitted before the first is collected is refused."""
    reason = TABLE.get(name).unavailable_reason()
    if reason:
        pytest.skip(reason)
    ctx, batches = _gpu_ctx(tmp_path)
    batches = (batches * 3)[:5]
    base = TABLE.get(name)
    backend = make_variant(name, base.implementation, base.device, dataclasses.asdict(base.options)).create()
    backend.prepare(ctx)

    def third_is_refused():
        backend.submit(batches[0])
        backend.submit(batches[1])
        with pytest.raises(RuntimeError, match="in flight"):
            backend.submit(batches[0])

    _in_flight_gives_one_at_a_time_outputs(backend, batches, name, after_passes=third_is_refused)


def test_plans_held_counts_the_plans_and_the_workspace_they_keep(monkeypatch):
    """The prepare record's account of the nvmath plans: how many, and the device workspace their
    plans keep allocated (nvmath's Workspace.allocated_size), 0 for one not yet run."""
    from types import SimpleNamespace

    from bertqa_bench.kernels import cublaslt_epilogues as ge

    plans = {("a",): SimpleNamespace(workspace=SimpleNamespace(allocated_size=3 * 2**20)),
             ("b",): SimpleNamespace(workspace=SimpleNamespace(allocated_size=2**19)),
             ("c",): SimpleNamespace(workspace=SimpleNamespace(allocated_size=0))}
    monkeypatch.setattr(ge, "_PLANS", plans)
    assert ge.plans_held() == {"cublaslt_plans": 3, "cublaslt_workspace_mib": 3.5}
    monkeypatch.setattr(ge, "_PLANS", {})
    assert ge.plans_held() == {"cublaslt_plans": 0, "cublaslt_workspace_mib": 0.0}
