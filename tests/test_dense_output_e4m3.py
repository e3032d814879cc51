"""fp8 option ``dense_output: e4m3``: the attention-output and FFN-down GEMMs write their output in
e4m3 (cuBLASLt's BIAS epilogue with an e4m3 result, cublaslt_epilogues.fp8_gemm_bias_e4m3) for the
add + LayerNorm kernel after them, which reads it at its calibrated scale."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bertqa_bench.backends import torch_builder, torch_options
from bertqa_bench.backends.transforms import fp8_rules
from bertqa_bench.backends.transforms import fp8_surgery as fp8
from bertqa_bench.backends.transforms.packed_encoder import pack_model
from bertqa_bench.errors import BackendUnavailableError, ConfigError
from bertqa_bench.kernels import cublaslt_epilogues as ge
from bertqa_bench.kernels.fp8_math import E4M3_MAX, e4m3_codes_apart, static_act_scale
from test_fp8 import _epilogue_operands, inputs, needs_cpu_scaled_mm, qa, tiny_bert

# e4m3's rounding to nearest: half a step, 2^-4 of the value among the normals, 2^-10 below them
E4M3_HALF_STEP_REL, E4M3_HALF_SUBNORMAL = 2.0 ** -4, 2.0 ** -10
# fp16's rounding of the bias cuBLASLt takes (half an ulp, relative)
FP16_REL = 2.0 ** -11


def test_bias_e4m3_op_rounds_the_exact_value_once_and_saturates():
    """The op's CPU path is its formula: the fp32 GEMM of the decoded e4m3 values, the bias, the
    output scale, one rounding to e4m3. fp32 accumulation moves a value by far less than an e4m3 step,
    so every code is the exact value's nearest or, at a rounding boundary, its neighbour; past +-448
    it saturates, before the cast."""
    x8, w8, bias, sw, sx = _epilogue_operands()
    inv = torch.tensor(1 / 0.05)
    got = ge.fp8_gemm_bias_e4m3(x8, w8, bias, sw, sx, inv)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (64, 128)
    exact = ((x8.double() @ w8.double().t()) * (float(sw) * float(sx)) + bias.double()) * float(inv)
    assert float(exact.abs().max()) < E4M3_MAX  # the case tests rounding, not saturation
    assert int(e4m3_codes_apart(got, exact.float().to(torch.float8_e4m3fn)).max()) <= 1
    # without the bias the codes move: the bias is inside the rounded value
    no_bias = ge.fp8_gemm_bias_e4m3(x8, w8, torch.zeros_like(bias), sw, sx, inv)
    assert int(e4m3_codes_apart(no_bias, got).max()) > 1
    big = ge.fp8_gemm_bias_e4m3(x8, w8, bias, sw, sx, torch.tensor(1e4))
    assert not big.float().isnan().any() and float(big.float().abs().max()) == E4M3_MAX
    assert float(ge.fp8_gemm_bias_e4m3_scaled(x8, w8, bias, sw, sx, torch.tensor(1e4)).abs().max()) == E4M3_MAX
    with pytest.raises(ValueError, match="epilog must be one of GELU_BIAS, BIAS"):
        ge.epilogue_saturates("cpu", "RELU")


def test_bias_e4m3_op_traces_without_graph_breaks():
    schema = str(torch.ops.bertqa.fp8_gemm_bias_e4m3.default._schema)
    assert schema.startswith("bertqa::fp8_gemm_bias_e4m3(Tensor x8, Tensor w8, Tensor bias, Tensor w_scale"), schema
    explained = torch._dynamo.explain(lambda *a: ge.fp8_gemm_bias_e4m3(*a))(*_epilogue_operands(), torch.tensor(20.0))
    assert explained.graph_break_count == 0, explained.break_reasons


@needs_cpu_scaled_mm
def test_forward_e4m3_is_the_16bit_gemm_rounded_to_e4m3_at_its_scale():
    """Fp8Linear.forward_e4m3 decodes to the layer's own 16-bit GEMM within one e4m3 rounding (and
    the bias's fp16 one, which cuBLASLt takes): the same quantized input, weight and bias; forward
    stays that GEMM (the padded model calls it)."""
    Fp8Linear = fp8.fp8_classes()[0]
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 64, generator=g) * 0.1, torch.randn(48, generator=g)  # a bias that matters
    x = torch.randn(4, 9, 64, generator=g)
    lin = Fp8Linear(w, b, scaling="tensor", act_scale=static_act_scale(float(x.abs().max())))
    y = lin(x)
    with pytest.raises(RuntimeError, match="write_e4m3_for_layernorm first"):
        lin.forward_e4m3(x)
    s = static_act_scale(float(y.abs().max()))
    lin.write_e4m3_for_layernorm(s)
    assert "e4m3 out at" in lin.extra_repr() and torch.equal(lin(x), y)
    y8 = lin.forward_e4m3(x)
    assert y8.dtype == torch.float8_e4m3fn and y8.shape == y.shape
    # the two fp32 GEMMs of the same decoded values may sum in other orders: each within
    # K * 2^-24 of the products' magnitudes
    xq, sa = lin.quantize_input(x.reshape(-1, 64))
    magnitudes = (xq.float().abs() @ lin.weight_fp8.float().abs().t()) * (sa * lin.weight_scale)
    order = 2 * 64 * 2.0 ** -24 * magnitudes.reshape(y.shape)
    bound = (E4M3_HALF_STEP_REL * (y.abs() + order) + E4M3_HALF_SUBNORMAL * s
             + FP16_REL * b.abs() * (1 + E4M3_HALF_STEP_REL) + order)
    assert bool(((y8.float() * s - y).abs() <= bound).all())
    # a scale off by a step gives other codes: the scale is the one asked for
    lin.write_e4m3_for_layernorm(s * 1.5)
    assert not torch.equal(lin.forward_e4m3(x).view(torch.uint8), y8.view(torch.uint8))


class _Decoded(nn.Module):
    """A producer GEMM whose output is its own e4m3 output decoded (fp32): what the LayerNorm
    kernel computes from, if it reads the e4m3 y at its scale."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin.forward_e4m3(x).float() * self.lin.e4m3_out_scale


def _calibrated(model, x):
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    return fp8.calibrate_amax(model, [x], targets, fp8.dense_names(targets))


@needs_cpu_scaled_mm
def test_dense_output_e4m3_hands_each_layernorm_kernel_its_gemms_e4m3_output_at_that_scale():
    """dense_output: e4m3 with layernorm: triton: the GEMM before every fused LayerNorm (not the last
    layer's FFN-down, whose LayerNorm the QA head reads) writes e4m3 at the scale of its calibrated
    output amax, and the kernel reads it there: the logits are bit for bit those of the 16-bit
    path whose producers return their e4m3 output decoded. A kernel reading y at another scale, or
    the 16-bit y, changes them."""
    model = qa(tiny_bert(hidden=64))
    x = inputs()
    amax = _calibrated(model, x)
    ref = copy.deepcopy(model)
    done = fp8.swap_to_fp8(model, amax, gemms="all", layernorm="triton", dense_output="e4m3")
    base = "model.bert.encoder.layer."
    assert done["dense_output_e4m3"] == [f"{base}0.attention.output.dense", f"{base}0.output.dense",
                                         f"{base}1.attention.output.dense"]
    assert model.get_submodule(f"{base}1.output.dense").e4m3_out_scale is None
    for name in done["dense_output_e4m3"]:
        assert model.get_submodule(name).e4m3_out_scale == static_act_scale(amax[name + fp8.OUT])
    fp8.swap_to_fp8(ref, amax, gemms="all", layernorm="triton")
    for name in done["dense_output_e4m3"]:
        lin = ref.get_submodule(name)
        lin.write_e4m3_for_layernorm(static_act_scale(amax[name + fp8.OUT]))
        parent = name.rsplit(".", 1)[0]
        ref.get_submodule(parent).dense = _Decoded(lin)
    plain = copy.deepcopy(ref)
    for name in done["dense_output_e4m3"]:
        parent = name.rsplit(".", 1)[0]
        lin16 = plain.get_submodule(name).lin
        lin16.e4m3_out_scale = None  # the 16-bit GEMM again
        plain.get_submodule(parent).dense = lin16
    ffn_down = model.get_submodule(f"{base}0.output.dense")
    for m in (model, ref, plain):
        pack_model(m.model)
    with torch.no_grad():
        got, want, sixteen = model(*x), ref(*x), plain(*x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not torch.equal(got[0], sixteen[0])  # the e4m3 rounding is there: not the 16-bit path
    ffn_down.e4m3_out_scale *= 1.5  # the kernel told another scale
    with torch.no_grad():
        assert not torch.equal(model(*x)[0], want[0])


def test_dense_output_options_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="fp8.dense_output 'bf16' is not one of fp16, e4m3"):
        torch_options.Fp8Options(dense_output="bf16")
    with pytest.raises(ConfigError, match="dense_output: e4m3 is read by the add \\+ LayerNorm kernel: it needs "
                                          "layernorm: triton, not inductor"):
        torch_options.Fp8Options(dense_output="e4m3")
    # a LayerNorm is fused only where an FP8 GEMM reads it: without an FP8 pair nothing would switch
    for gemms, fuse in (("qkv,ffn_in", True), ("qkv,attn_out", True), ("qkv,ffn_out", False)):
        with pytest.raises(ConfigError, match="attn_out with the ffn_in that reads its LayerNorm or ffn_out with "
                                              "the fused qkv"):
            torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms=gemms, fuse_qkv=fuse)
    for gemms in ("attn_out,ffn_in", "qkv,ffn_out"):
        torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms=gemms)
    # its GEMMs are planned through nvmath: autotuning them alone is asked for something
    torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all", cublaslt_autotune=5)
    with pytest.raises(ConfigError, match="cublaslt_gemms: attn_out already runs through cuBLASLt as the "
                                          "e4m3-output GEMM before the LayerNorm"):
        torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all", cublaslt_gemms="attn_out")
    with pytest.raises(ConfigError, match="name only the others \\(qkv, ffn_in\\)"):
        torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all", cublaslt_gemms="ffn_out,qkv")
    torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all", cublaslt_gemms="qkv")
    f = torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all")
    with pytest.raises(ConfigError, match="fp8.dense_output: e4m3 plans one cuBLASLt GEMM per token count"):
        torch_options.TorchOptions(weights="fp16", packed=True, fp8=f)
    with pytest.raises(ConfigError, match="need weights: fp16, not bf16"):
        torch_options.TorchOptions(weights="bf16", packed=True, token_bucket=256, fp8=f)
    torch_options.TorchOptions(weights="fp16", packed=True, token_bucket=256, fp8=f)
    assert fp8_rules.needs_nvmath(f) and not fp8_rules.needs_nvmath(torch_options.Fp8Options(layernorm="triton"))
    model = qa(tiny_bert())
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    amax = fp8.calibrate_amax(model, [inputs()], targets)  # no output amax
    with pytest.raises(ValueError, match="dense_output: e4m3 needs the calibrated output amax of "
                                         "model.bert.encoder.layer.0.attention.output.dense .*dense_names"):
        fp8.swap_to_fp8(model, amax, gemms="all", layernorm="triton", dense_output="e4m3")
    # refused before the model is touched
    assert all(type(model.get_submodule(n)) is nn.Linear for n in targets)
    amax = _calibrated(model, inputs())
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="dense_output: e4m3 runs in fp16 .*attention.output.dense is bfloat16"):
        fp8.swap_to_fp8(bf16, amax, gemms="all", layernorm="triton", dense_output="e4m3")
    assert all(type(bf16.get_submodule(n)) is nn.Linear for n in targets)


@needs_cpu_scaled_mm
def test_dense_output_e4m3_that_switches_no_gemm_is_refused():
    """The options check asks for an FP8 GEMM pair, but a model can still leave none: every layer
    kept in 16 bits is refused before the model is touched; shapes no FP8 GEMM takes (a width of 40,
    not a multiple of 16) are found after the swap. Either way a row named e4m3-dense would time the
    base row under another name."""
    model = qa(tiny_bert(hidden=64))
    amax = _calibrated(model, inputs())
    targets = fp8.target_linears(model, fp8_rules.GEMM_KINDS)
    with pytest.raises(ValueError, match="dense_output: e4m3 would switch no GEMM: keep_layers keeps every layer"):
        fp8.swap_to_fp8(model, amax, gemms="all", layernorm="triton", dense_output="e4m3", keep_layers=iter([0, 1]))
    assert all(type(model.get_submodule(n)) is nn.Linear for n in targets)
    odd = qa(tiny_bert(hidden=40))
    amax = _calibrated(odd, inputs())
    with pytest.raises(ValueError, match="dense_output: e4m3 switched no GEMM: .*not a multiple of 16"):
        fp8.swap_to_fp8(odd, amax, gemms="all", layernorm="triton", dense_output="e4m3")


def test_a_gpu_whose_bias_epilogue_writes_nan_refuses_dense_output_e4m3(monkeypatch):
    """check_e4m3_epilogues asks the probe about each e4m3 epilogue the recipe uses: a BIAS
    epilogue that writes NaN past the range refuses dense_output: e4m3 (and names the way out),
    while the GELU epilogue's answer is asked only for ffn_gelu: epilogue."""
    asked = []
    monkeypatch.setattr(ge, "epilogue_saturates", lambda device, epilog: asked.append(epilog) or epilog != "BIAS")
    f = torch_options.Fp8Options(dense_output="e4m3", layernorm="triton", gemms="all")
    with pytest.raises(BackendUnavailableError, match="BIAS epilogue on this GPU writes NaN.*dense_output: fp16"):
        torch_builder.check_e4m3_epilogues("row", f, "cuda")
    assert asked == ["BIAS"]
    torch_builder.check_e4m3_epilogues("row", torch_options.Fp8Options(layernorm="triton", gemms="all"), "cuda")
    torch_builder.check_e4m3_epilogues("row", f, "cpu")  # no cuBLASLt on the CPU: nothing to ask
    assert asked == ["BIAS"]


@pytest.mark.gpu
def test_bias_e4m3_op_on_gpu_is_its_formula_saturates_and_captures():
    """cuBLASLt's BIAS epilogue with an e4m3 D (nvmath-python) against the formula: with fast FP8
    accumulation off the fp32 results differ by far less than an e4m3 step, so each code is the
    formula's or its neighbour; it saturates (epilogue_saturates) and replays in a CUDA graph."""
    if not torch.cuda.is_available() or ge.nvmath_unavailable_reason():
        pytest.skip(ge.nvmath_unavailable_reason() or "no CUDA device")
    x8, w8, bias, sw, sx = (t.cuda() for t in _epilogue_operands(m=256, k=128, n=192))
    inv = torch.tensor(1 / 0.05, device="cuda")
    got = ge.fp8_gemm_bias_e4m3(x8, w8, bias, sw, sx, inv)
    want = ge.fp8_gemm_bias_e4m3_reference(x8, w8, bias, sw, sx, inv)
    assert got.dtype == torch.float8_e4m3fn and got.is_contiguous() and got.shape == (256, 192)
    assert int(e4m3_codes_apart(got, want).max()) <= 1
    assert ge.epilogue_saturates("cuda", "BIAS")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ge.fp8_gemm_bias_e4m3(x8, w8, bias, sw, sx, inv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), got.view(torch.uint8))
