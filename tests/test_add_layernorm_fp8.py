"""kernels/add_layernorm_fp8.py: residual add + LayerNorm + e4m3 quantize in one Triton pass.

Without a GPU: the torch reference against fp64 LayerNorm, the kernel under Triton's interpreter
(in a subprocess, as the other Triton kernels' tests) against fp64 of the same decoded inputs, and
the kernel compiled ahead of time for sm_90 (Triton's own ptxas, no GPU) for what the interpreter
cannot show: 16-byte accesses, packed e4m3 conversions, no fp64 and no spills. On a GPU: the op
against the reference, and inside torch.compile and a CUDA graph.

The bound (``_bound``): every value is compared with fp64 LayerNorm of the decoded inputs, within
what fp32 arithmetic in any summation order guarantees (u = 2^-24): the inputs decoded and summed
with 4 roundings (|ds| <= 4u a, a = the terms' magnitudes); the mean of H values within
(H + 4) u A (A = max a over the row); d = s - mean within (H + 10) u A; the variance's relative
error within 2 (H + 10) u A / std + (H + 2) u, half of it in rstd, plus 2u; the affine step 3u.
A one-pass variance (E[s^2] - E[s]^2) breaks it on rows with a large mean, which the tests have.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertqa_bench.kernels import add_layernorm_fp8 as aln
from bertqa_bench.kernels.fp8_math import E4M3_MAX, e4m3_codes_apart

U = 2.0 ** -24


def _truth(y, r, w, b, eps, y_scale=1.0, dense_bias=None, residual_scale=1.0):
    """fp64 LayerNorm of the decoded inputs: (x, d, rstd, A) per row, for the bound."""
    terms = [y.double() * y_scale, r.double() * residual_scale] + ([] if dense_bias is None
                                                                    else [dense_bias.double().expand_as(y)])
    s = sum(terms)
    a = sum(t.abs() for t in terms)
    mean = s.mean(-1, keepdim=True)
    d = s - mean
    var = (d * d).mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(var + eps)
    return d * rstd * w.double() + b.double(), d, rstd, a.amax(-1, keepdim=True), var.sqrt()


def _bound(y, r, w, b, eps, **kw):
    """(fp64 x, the bound on |fp32 x - x| per element), as the module docstring derives it."""
    x, d, rstd, big, std = _truth(y, r, w, b, eps, **kw)
    h = y.shape[-1]
    dd = (h + 10) * U * big
    rel_rstd = (2 * (h + 10) * U * big / std + (h + 2) * U) / 2 + 2 * U
    wa = w.double().abs()
    return x, wa * rstd * (dd + d.abs() * rel_rstd) + 3 * U * (wa * (d * rstd).abs() + b.double().abs())


def _case(rows=7, hidden=96, offset=0.0, seed=0, dtype=torch.float16):
    """Inputs as the layer's: y and residual of unit scale (plus a common offset: a large mean),
    LayerNorm weights near 1."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, hidden, generator=g) * 0.7 + offset).to(dtype)
    r = (torch.randn(rows, hidden, generator=g) + offset).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    b = (0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return y, r, w, b


@pytest.mark.parametrize("offset", [0.0, 60.0])
def test_the_torch_reference_is_layernorm_within_the_fp32_bound(offset):
    """The reference the CPU path runs: within the bound of fp64 LayerNorm, on centred rows and
    on rows with a large mean; and torch's own LayerNorm agrees with it."""
    y, r, w, b = _case(offset=offset)
    x, bound = _bound(y, r, w, b, 1e-12)
    xs, x8 = aln.add_layernorm_scaled(y, r, w, b, 1e-12, x8_inv_scale=8.0)
    assert ((xs.double() - x).abs() <= bound).all()
    assert ((x8.double() - (x * 8).clamp(-E4M3_MAX, E4M3_MAX)).abs() <= bound * 8 + U * x8.double().abs()).all()
    ln = torch.nn.functional.layer_norm((y.float() + r.float()), (y.shape[1],), w.float(), b.float(), 1e-12)
    assert ((ln.double() - x).abs() <= bound).all()


def test_the_reference_rounds_once_each_output_from_the_same_value():
    """x in the residual's dtype and x8 in e4m3 are each one rounding of the fp32 value (x8 not
    a rounding of the rounded x); values past the e4m3 range saturate, never NaN."""
    y, r, w, b = _case(rows=64, hidden=128, seed=3)
    xs, q = aln.add_layernorm_scaled(y, r, w, b, 1e-5, x8_inv_scale=300.0)
    x, x8 = aln.add_layernorm_fp8_reference(y, r, w, b, 1e-5, x8_inv_scale=300.0)
    assert x.dtype == torch.float16 and x8.dtype == torch.float8_e4m3fn
    assert torch.equal(x, xs.half()) and torch.equal(x8, q.to(torch.float8_e4m3fn))
    assert float(x8.float().abs().max()) == E4M3_MAX and not torch.isnan(x8.float()).any()
    assert (x8.float().abs() == E4M3_MAX).float().mean() > 0.05  # the saturation was exercised


def test_arguments_are_checked_before_any_launch():
    y, r, w, b = _case()
    with pytest.raises(ValueError, match="one \\[rows, hidden\\] shape"):
        aln.launch(y, r[:3], w, b, y, y, 1e-5)
    with pytest.raises(ValueError, match="must be \\[96\\]"):
        aln.launch(y, r, w[:5], b, y, y, 1e-5)


def test_launch_shapes():
    assert aln.triton_block(768) == 1024 and aln.triton_block(1024) == 1024 and aln.triton_block(96) == 128
    # 16 bytes of fp16 a thread over a 1,024-wide row: 4 warps
    assert aln.default_config(1024) == (1, 4) and aln.default_config(768) == (1, 4)
    assert aln.default_config(96) == (1, 1)


_INTERPRETED = r"""
import torch
from bertqa_bench.kernels import add_layernorm_fp8 as aln
from tests.test_add_layernorm_fp8 import _bound, _case, U

E = 448.0
cases = [  # (rows, hidden, offset, launch rows, warps, 16-bit inputs or e4m3)
    (7, 96, 0.0, 2, 1, "fp16"),     # a row tile past the last row, columns past hidden (96 of 128)
    (9, 64, 500.0, 4, 2, "fp16"),   # a large common mean: a one-pass variance (E[s^2] - E[s]^2) fails here
    (5, 96, 0.0, 1, 1, "e4m3"),     # e4m3 y and residual with their scales, the dense bias here
]
for n, h, offset, rows, warps, kind in cases:
    y, r, w, b = _case(rows=n, hidden=h, offset=offset, seed=n)
    kw = {}
    if kind == "e4m3":
        g = torch.Generator().manual_seed(1)
        kw = {"y_scale": 0.02, "residual_scale": 0.03, "dense_bias": (0.5 * torch.randn(h, generator=g)).half()}
        y = (y.float() / 0.02).clamp(-E, E).to(torch.float8_e4m3fn)
        r = (r.float() / 0.03).clamp(-E, E).to(torch.float8_e4m3fn)
    x_true, bound = _bound(y, r, w, b, 1e-5, **kw)
    for inv8 in (10.0, 400.0):  # in range; partly saturated
        x = torch.full((n, h), float("nan"))  # poisoned: every element must be written
        q = torch.full((n, h), float("nan"))
        aln.launch(y, r, w, b, x, q, 1e-5, x8_inv_scale=inv8, rows=rows, warps=warps, **kw)
        assert not torch.isnan(x).any() and not torch.isnan(q).any(), "an element was not written"
        assert ((x.double() - x_true).abs() <= bound).all(), (kind, float(((x.double() - x_true).abs() / bound).max()))
        want = (x_true * inv8).clamp(-E, E)
        assert ((q.double() - want).abs() <= bound * inv8 + U * q.double().abs()).all(), kind
        if inv8 == 400.0:
            assert (q.abs() == E).any()
    # the 16-bit output: one rounding of the kernel's fp32 value
    x16 = torch.empty(n, h, dtype=torch.float16)
    aln.launch(y, r if kind != "e4m3" else r.float().half(), w, b, x16, torch.empty(n, h), 1e-5,
               x8_inv_scale=10.0, rows=rows, warps=warps, **{**kw, "residual_scale": kw.get("residual_scale", 1.0)})
    half_ulp = x_true.abs() * 2.0 ** -11 + 2.0 ** -25
    assert ((x16.double() - x_true).abs() <= bound + half_ulp).all(), kind
print("interpreted add-layernorm kernel matches")
"""


def test_the_kernel_in_the_interpreter_is_layernorm_within_the_bound(tmp_path):
    """The kernel's indexing (row tiles past the last row, columns past the hidden size), its
    masked statistics, its scales and dense bias, e4m3 inputs and the saturating output, under
    Triton's interpreter against fp64 LayerNorm of the decoded inputs. Outputs written in fp32
    and fp16 (the interpreter's own e4m3 rounding drops mantissa carries; the GPU test checks
    the e4m3 codes), poisoned first."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    root = str(Path(aln.__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "interpreted add-layernorm kernel matches" in r.stdout, r.stderr[-3000:]


def test_the_kernel_compiles_for_hopper_with_16_byte_accesses_and_no_spills(tmp_path, monkeypatch):
    """The BERT-large row (1,024 fp16 values, 4 warps: 8 a thread) compiled for sm_90 as Inductor
    launches it (hidden and pointers 16-divisible, the scales fp64): one 16-byte load a thread of
    each fp16 input, a 16-byte store of x and an 8-byte store of x8, e4m3 conversions two at a
    time, no per-element fp64 and nothing in local memory."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"y_ptr": "*fp16", "db_ptr": "*fp16", "r_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "x_ptr": "*fp16",
           "x8_ptr": "*fp8e4nv", "n_rows": "i32", "hidden": "i32", "y_scale": "fp64", "r_scale": "fp64",
           "x_inv_scale": "fp64", "x8_inv_scale": "fp64", "eps": "fp64", "BLOCK": "constexpr", "ROWS": "constexpr",
           "HAS_DENSE_BIAS": "constexpr", "X_SATURATES": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 8)}
    rows, warps = aln.default_config(1024)
    src = ASTSource(fn=aln._kernel(), signature=sig, attrs=attrs,
                    constexprs={"BLOCK": 1024, "ROWS": rows, "HAS_DENSE_BIAS": False, "X_SATURATES": False})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    per_thread = 1024 // (warps * 32)
    assert per_thread == 8
    assert ptx.count("ld.global.v4.b32") == 4  # y, residual, LayerNorm weight and bias: 8 fp16 each
    assert ptx.count("st.global.v4.b32") == 1 and ptx.count("st.global.v2.b32") == 1  # x (fp16), x8 (e4m3)
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == per_thread // 2
    assert "ld.global.b16" not in ptx and "st.global.b8" not in ptx
    assert not any(op in ptx for op in ("mul.f64", "mul.rn.f64", "fma.rn.f64", "add.rn.f64", "div.rn.f64"))
    assert ".local" not in ptx  # no spills


def test_the_op_is_registered_and_the_cpu_path_is_the_reference():
    assert str(torch.ops.bertqa.add_layernorm_fp8.default._schema).startswith("bertqa::add_layernorm_fp8(Tensor y")
    y, r, w, b = _case()
    x, x8 = aln.add_layernorm_fp8(y, r, w, b, 1e-5, x8_inv_scale=10.0)
    rx, rx8 = aln.add_layernorm_fp8_reference(y, r, w, b, 1e-5, x8_inv_scale=10.0)
    assert torch.equal(x, rx) and torch.equal(x8.view(torch.uint8), rx8.view(torch.uint8))
    assert aln.implementation(False).startswith("torch (not on CUDA")


@pytest.mark.gpu  # skipped without a CUDA device (conftest)
@pytest.mark.parametrize("hidden", [768, 1024])
def test_on_the_gpu_the_op_matches_the_reference_eagerly_compiled_and_graphed(hidden):
    """BERT's widths at a batch's row count: the e4m3 codes at most one apart from the reference
    (fp32 summation order differs: a value at a rounding tie may go either way) and almost all
    equal; the same results from torch.compile (fullgraph) and a CUDA-graph replay."""
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(4099, hidden, device="cuda", generator=g).half()
    r = torch.randn(4099, hidden, device="cuda", generator=g).half() * 2
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).half()
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).half()
    x, x8 = aln.add_layernorm_fp8(y, r, w, b, 1e-12, x8_inv_scale=40.0)
    rx, rx8 = aln.add_layernorm_fp8_reference(y, r, w, b, 1e-12, x8_inv_scale=40.0)
    apart = e4m3_codes_apart(x8, rx8)
    assert int(apart.max()) <= 1 and float((apart == 0).float().mean()) > 0.99
    assert float(((x.float() - rx.float()).abs() / (rx.float().abs() * 2 ** -10 + 2 ** -24)).max()) <= 1.0
    f = torch.compile(lambda *a: aln.add_layernorm_fp8(*a, 1e-12, x8_inv_scale=40.0), fullgraph=True)
    cx, cx8 = f(y, r, w, b)
    assert torch.equal(cx, x) and torch.equal(cx8.view(torch.uint8), x8.view(torch.uint8))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gx, gx8 = aln.add_layernorm_fp8(y, r, w, b, 1e-12, x8_inv_scale=40.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gx, x) and torch.equal(gx8.view(torch.uint8), x8.view(torch.uint8))
    assert math.isfinite(float(x.float().abs().max()))
