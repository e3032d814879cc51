"""The Triton variable-length attention kernel (bertqa_bench/kernels/varlen_attention.py).

Without a GPU: its arithmetic and indexing under Triton's interpreter (in a subprocess), and its
ahead-of-time compilation for sm_90 (Triton's own ptxas). On a GPU: the BERT-large-like case
against SDPA, eagerly and replayed from a CUDA graph.

Tolerances (fp16; the kernel's numerics are in the module docstring). Against attention in fp64
on the same fp16 inputs, the kernel's only non-negligible roundings are P to fp16 before the
second matmul and the output to fp16, each relative <= u = 2^-11 per element (the fp32 scores,
exp2 and sums are ~2^-23 relative). Per element, |error| <= u * max|V| (P's rounding: a
p-weighted mean of |V| over the row sum of the unrounded P) + u * |O| <= 2 u max|V|: the max-abs
bound. Relative to ||O|| over many elements, the errors are independent roundings of rms ~u/sqrt(3)
each, ~0.8 u = 4e-4 for the two: the 1e-3 limit (~2u) has 2.5x margin, while a 1% error in the
scale (checked) already exceeds it. bf16: u = 2^-8, the same formulas.

The e4m3 output (``out_inv_scale`` c): the fp32 output x (|x - y| <= u max|V| from P's rounding,
y the exact attention) times c, rounded once to e4m3, whose rounding is relative <= 2^-4 (half a
step of 3 mantissa bits) among normal values and absolute <= 2^-10 among subnormals; so
|e4m3 / c - y| <= 2^-4 (|y| + u max|V|) + 2^-10 / c + u max|V| wherever |x c| < 448, and exactly
+-448 beyond. Against the 16-bit output quantized afterwards (what the output GEMM did): the same
x, rounded to fp16 first, so the two differ by at most one e4m3 step (a second rounding can only
cross one midpoint), and only where fp16's rounding crossed one: a fraction of about
2^-11 / 2^-4 = 2^-7 of the normal values.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertqa_bench.kernels import varlen_attention as ta

# Triton 3.5's interpreter converts a loaded scalar (a 1-element numpy array) to a Python int with
# int(array), which numpy >= 2.4 refuses for arrays of ndim > 0: a loop bounded by a loaded value
# then fails under the interpreter only. Triton's later interpreter squeezes the array first; the
# subprocess does the same when this numpy refuses (the compiled kernel is not concerned).
_INTERPRETER_NUMPY_SHIM = """
import numpy as np
from triton.runtime import interpreter as _interp
try:
    int(np.array([1]))
except TypeError:
    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor):
        _orig_patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    _interp._patch_lang_tensor = _patch_lang_tensor
"""

# Shared by the interpreter's script and the GPU test. c = 97: V (fp16, <= 11 significant bits) times
# 97 is exact in fp32 and never lies on, or within 2^-18 relative of, a midpoint between e4m3 values
# (97 would have to divide a midpoint's odd mantissa of <= 5 bits), so a last-bit difference in
# the kernel's fp32 output (the GPU's division by the row sum of exactly 1) cannot flip a rounding.
# Magnitudes from 1e-6 to ~20 put V * c among e4m3's subnormals, its normals and past 448.
_ONE_TOKEN = """
def one_token_sequences(gen, device="cpu"):
    n, heads, d = 96, 2, 64
    mag = torch.logspace(-6, 1.3, n * heads * d).reshape(n, heads, d)
    v = (torch.randn(n, heads, d, generator=gen) * mag).to(torch.float16)
    q, k = torch.randn(2, n, heads, d, generator=gen).to(torch.float16)
    q, k, v = (x.to(device) for x in (q, k, v))
    cu = torch.arange(n + 1, dtype=torch.int32, device=device)
    c = torch.tensor([97.0], device=device)
    o8 = ta.launch(q, k, v, cu, 1, d ** -0.5, out_inv_scale=c)
    want = (v.float() * c).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert int((want.float().abs() == 448).sum()) > 0 and int((want.float().abs() < 2 ** -6).sum()) > 0
    return o8, want  # compared as values: a V of -0 gives +0 (the accumulator starts at +0)
"""

_INTERPRETED = _INTERPRETER_NUMPY_SHIM + """
import sys
import torch
import triton
import triton.language as tl
from bertqa_bench.kernels import varlen_attention as ta
from bertqa_bench.kernels._varlen_attention_triton import round_to_e4m3
from bertqa_bench.kernels.fp8_math import e4m3_codes_apart

seed = int(sys.argv[1])
g = torch.Generator().manual_seed(seed)
bm, bn = ta.INTERPRETER_CONFIG["BLOCK_M"], ta.INTERPRETER_CONFIG["BLOCK_N"]


def reference(q, k, v, cu, scale):
    ref = torch.zeros(q.shape, dtype=torch.float64)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        if e > s:
            qi, ki, vi = (x[s:e].double().transpose(0, 1) for x in (q, k, v))
            ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    return ref


def check(lens, heads, d, dtype, u):
    # lens: one, exactly BLOCK_M, BLOCK_M + 1, exactly BLOCK_N, an empty one in the middle, a long
    # one (several q tiles and K/V blocks, a partial last block); a trailing empty sequence is the
    # repeated last entry of cu_seqlens
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist() + [sum(lens)], dtype=torch.int32)
    t = sum(lens)
    qkv = torch.randn(t, 3, heads, d, generator=g).to(dtype)
    q, k, v = qkv.unbind(1)  # strided views of one fused tensor, as the packed encoder's
    assert q.stride(0) == 3 * heads * d and not q.is_contiguous()
    scale = d ** -0.5
    out = torch.full((t, heads, d), float("nan"), dtype=dtype)
    ret = ta.launch(q, k, v, cu, max(lens), scale, out=out)
    assert ret is out
    assert not out.isnan().any(), f"unwritten elements: {int(out.isnan().sum())}"
    ref = reference(q, k, v, cu, scale)
    err = out.double() - ref
    rel = float(err.norm() / ref.norm())
    max_abs = float(err.abs().max())
    bound = 2 * u * float(v.abs().max())
    print(f"{lens} H={heads} D={d} {dtype}: rel {rel:.2e} (limit {2 * u:.1e}), max abs {max_abs:.2e} (bound {bound:.2e})")
    assert rel <= 2 * u and max_abs <= bound, (rel, max_abs, bound)
    return q, k, v, cu, ref, out


ONE_TOKEN = """ + repr(_ONE_TOKEN) + """
exec(ONE_TOKEN)
long = 3 * bm + 5  # 4 q tiles, 7 K/V blocks the last partial
q, k, v, cu, ref, out = check([1, bm, bm + 1, 0, long, bn, bn + 1], 2, 64, torch.float16, 2.0 ** -11)
# the comparison detects a 1% error in the scale
wrong = ta.launch(q, k, v, cu, long, 1.01 * 64 ** -0.5).double()
assert float((wrong - ref).norm() / ref.norm()) > 2 * 2.0 ** -11
# an explicit tile (config=, how the kernel bench times each tile): the other tiling (BLOCK_N
# above BLOCK_M) within the same bounds, the grid sized by its own BLOCK_M, every row written;
# the autotuner's choice untouched
tuned_before, tuned = ta.best_config(), ta._tuned


def _no_autotuner():
    raise AssertionError("launch(config=...) went through the autotuner")


ta._tuned = _no_autotuner  # launch looks it up at call time
try:
    tile = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=1, num_stages=1)
    tiled = ta.launch(q, k, v, cu, long, 64 ** -0.5, out=torch.full_like(out, float("nan")), config=tile)
finally:
    ta._tuned = tuned
assert not tiled.isnan().any(), f"unwritten elements with BLOCK_M 16: {int(tiled.isnan().sum())}"
err = tiled.double() - ref
assert float(err.norm() / ref.norm()) <= 2 * 2.0 ** -11 and float(err.abs().max()) <= 2 * 2.0 ** -11 * float(v.abs().max())
assert ta.best_config() == tuned_before, (ta.best_config(), tuned_before)
check([bm + 1, 7, 2 * bm], 2, 32, torch.float16, 2.0 ** -11)
check([bm + 1, 7, 2 * bm], 1, 128, torch.float16, 2.0 ** -11)
# the e4m3 output, at a scale c that puts a tenth of the values past 448 (saturated)
c = 448.0 / float(out.float().abs().flatten().quantile(0.9))
inv = torch.tensor([c], dtype=torch.float32)
poisoned = torch.full(q.shape, float("nan"), dtype=torch.float32).to(torch.float8_e4m3fn)
o8 = ta.launch(q, k, v, cu, long, 64 ** -0.5, out=poisoned, out_inv_scale=inv)
assert o8 is poisoned and o8.dtype == torch.float8_e4m3fn
assert not o8.float().isnan().any(), "unwritten or NaN elements"
got = o8.double() / c
u, vmax = 2.0 ** -11, float(v.abs().max())
sat = (ref * c).abs() > 448 + c * u * vmax  # certainly past 448 before rounding
free = (ref * c).abs() < 448 - c * u * vmax  # certainly inside
assert int(sat.sum()) > 0 and bool((o8.float()[sat].abs() == 448).all())
allowed = 2.0 ** -4 * (ref.abs() + u * vmax) + 2.0 ** -10 / c + u * vmax
assert bool(((got - ref).abs() <= allowed)[free].all()), float(((got - ref).abs() - allowed)[free].max())
# against the fp16 output quantized afterwards as the output GEMM did: at most one step apart,
# and rarely that (the fraction where fp16's rounding crossed an e4m3 midpoint, ~2^-7)
after = (out.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
apart = e4m3_codes_apart(o8, after)
frac = float((apart > 0).float().mean())
print(f"e4m3 output: {int(sat.sum())} saturated, {frac:.2%} one step from the fp16 output quantized after")
assert int(apart.max()) <= 1 and frac <= 2.0 ** -6, (int(apart.max()), frac)
# the custom op with the scale: the same bytes, an e4m3 fake output
assert torch.equal(ta.varlen_attention_op(q, k, v, cu, long, 64 ** -0.5, inv).view(torch.uint8), o8.view(torch.uint8))
torch.library.opcheck(ta.varlen_attention_op, (q, k, v, cu, long, 64 ** -0.5, inv),
                      test_utils=("test_schema", "test_faketensor"))


# sequences of one token: the softmax over one key is 1, so the output is V itself and the e4m3
# output must be quantize(V * c) bit for bit, whatever the path (the whole epilogue: scale,
# saturation, rounding, subnormals)
o8, want = one_token_sequences(g)
assert torch.equal(o8.float(), want.float()), int((o8.float() != want.float()).sum())


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, round_to_e4m3(tl.load(X + offs)).to(Y.dtype.element_ty))


# round_to_e4m3 is torch's round-to-nearest-even cast after saturation, bit for bit: ties (odd
# and even), the smallest subnormals and half of them, both zeros, past 448 and 464 (a tie
# above 448), and a random spread of magnitudes 1e-5..3e3
ties = [2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 1.03125, 2.0 ** -9, 2.0 ** -6 - 2.0 ** -10, 464.0, 460.0, 0.0, -0.0]
n = 1 << 14
x = torch.randn(n, generator=g) * torch.logspace(-5, 3.5, n)
x[: 2 * len(ties)] = torch.tensor(ties + [-t for t in ties])
y = torch.empty(n, dtype=torch.float8_e4m3fn)
_round_kernel[(1,)](x, y, N=n)
want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(y.view(torch.uint8), want.view(torch.uint8)), int((y.view(torch.uint8) != want.view(torch.uint8)).sum())
# no bf16 here: Triton 3.5's interpreter keeps bf16 as uint16 bit patterns and its tl.dot
# multiplies those as integers (it converts only 8-bit floats); the GPU test covers bf16
assert "BLOCK_M: 32" in ta.best_config() and "BLOCK_N: 16" in ta.best_config(), ta.best_config()
# the custom op the packed encoder calls (torch.compile keeps it in its graph): the same bytes as
# the kernel, and torch's own checks of its registration (schema, fake implementation's shape,
# dtype and strides against the real one's)
torch.testing.assert_close(ta.varlen_attention_op(q, k, v, cu, long, 64 ** -0.5), out, rtol=0, atol=0)
torch.library.opcheck(ta.varlen_attention_op, (q, k, v, cu, long, 64 ** -0.5),
                      test_utils=("test_schema", "test_faketensor"))
print("interpreted kernel matches")
"""


def test_triton_attention_in_the_interpreter_matches_fp64_sdpa(tmp_path):
    """Indexing, masking (lengths 1, BLOCK_M, BLOCK_M + 1, BLOCK_N, BLOCK_N + 1, long, empty),
    strided QKV views, the online softmax and the output's coverage (poisoned with NaN first),
    run by Triton's interpreter on the CPU against per-sequence SDPA in fp64, at head_dim 32, 64,
    128, fp16 (bf16: the GPU test), with a fresh seed each run; the e4m3 output against the same
    reference and against the fp16 output quantized afterwards, and its rounding helper against
    torch's cast. In a process of its own: the interpreter patches
    triton.language for good, and a kernel compiled later in the same process fails to lower."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    seed = int.from_bytes(os.urandom(4), "little")
    root = str(Path(ta.__file__).resolve().parents[2])  # the same package as this process's
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    script = tmp_path / "interpreted.py"  # a file: the interpreter reads a jitted function's source
    script.write_text(_INTERPRETED)
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "interpreted kernel matches" in r.stdout, f"seed {seed}\n{r.stdout}\n{r.stderr[-3000:]}"


def test_sequence_bucket_and_config_pruning():
    assert [ta.seq_bucket(n) for n in (1, 16, 17, 100, 128, 129, 384, 512)] == [16, 16, 32, 128, 128, 256, 512, 512]
    # tiles longer than the bucket are dropped, except the smallest (64), which always stays
    assert not ta.keep_config(128, 64, 8, 64, ta.seq_bucket(60))
    assert not ta.keep_config(64, 128, 8, 64, ta.seq_bucket(60))
    assert ta.keep_config(64, 64, 4, 64, ta.seq_bucket(5))
    assert ta.keep_config(128, 128, 8, 64, ta.seq_bucket(384))
    # register pressure: [128, 128] scores + [128, 64] accumulator over 4 warps spill
    assert not ta.keep_config(128, 128, 4, 64, 512) and ta.keep_config(128, 64, 4, 64, 512)
    for d in ta.HEAD_DIMS:
        for n in (1, 64, 100, 384, 4096):
            assert ta.keep_config(64, 64, 4, d, ta.seq_bucket(n))


def test_the_autotuner_prunes_with_the_launch_arguments():
    """The GPU autotuner's configurations, pruned through Triton's own call (positional arguments
    in nargs, HEAD_DIM as a keyword) as a launch at max_seqlen 384 and 60 would."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    tuner = ta._tuned()
    assert len(tuner.configs) == 24 and tuner.keys == ["HEAD_DIM", "seq_bucket", "P_SCALE"]

    def pruned(max_seqlen, d):
        tuner.nargs = {"seq_bucket": ta.seq_bucket(max_seqlen)}
        try:
            return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    for c in tuner.prune_configs({"HEAD_DIM": d})}
        finally:
            tuner.nargs = None

    assert pruned(384, 64) == {(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8)
                               for s in (2, 3) if (m, n, w) != (128, 128, 4)}
    assert pruned(60, 64) == {(64, n, w, s) for n in (32, 64) for w in (4, 8) for s in (2, 3)}
    # the kernel bench's list of tiles to time is the autotuner's own, pruned the same way
    for max_seqlen, d in ((384, 64), (60, 64), (384, 128)):
        assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in ta.candidate_configs(d, max_seqlen)} == pruned(max_seqlen, d)


def test_bad_inputs_raise_one_line_errors_naming_the_field():
    qkv = torch.zeros(10, 3, 2, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        ta._check(q, k, v, cu.long(), 6, 0.125)
    with pytest.raises(ValueError, match="q must be float16 or bfloat16"):
        ta._check(q.float(), k, v, cu, 6, 0.125)
    with pytest.raises(ValueError, match=r"head_dim 48 is not supported; valid: \[16, 32, 64, 128\]"):
        z = torch.zeros(10, 2, 48, dtype=torch.float16)
        ta._check(z, z, z, cu, 6, 0.125)
    with pytest.raises(ValueError, match="k is"):
        ta._check(q, k[:5], v, cu, 6, 0.125)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        ta._check(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, 6, 0.125)
    with pytest.raises(ValueError, match="max_seqlen must be >= 1"):
        ta._check(q, k, v, cu, 0, 0.125)
    with pytest.raises(ValueError, match="scale must be > 0"):
        ta._check(q, k, v, cu, 6, 0.0)
    with pytest.raises(ValueError, match="cu_seqlens must be contiguous"):
        ta._check(q, k, v, torch.tensor([0, 9, 4, 9, 10], dtype=torch.int32)[::2], 6, 0.125)
    ta._check(q, k, v, cu, 6, 0.125)  # the valid call passes
    if ta.HAS_TRITON:  # an explicit tile without its block sizes, refused before any launch
        with pytest.raises(ValueError, match="config must be a triton.Config with BLOCK_M and BLOCK_N, got"):
            ta.launch(q, k, v, cu, 6, 0.125, config={"BLOCK_M": 64, "BLOCK_N": 32})


def test_packed_encoder_refuses_a_head_size_the_kernel_does_not_take_before_any_work():
    """A model whose head size the Triton kernel has no tiles for (48 here; FlashAttention-2 and
    cuDNN take it) is refused when the encoder is built, naming the sizes it takes."""
    from transformers import BertConfig, BertModel

    from bertqa_bench.backends.transforms.packed_encoder import PackedEncoder

    bert = BertModel(BertConfig(hidden_size=96, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                                vocab_size=50), add_pooling_layer=False)
    with pytest.raises(ValueError, match="attention 'triton' takes head sizes 16, 32, 64, 128; this model's is 48"):
        PackedEncoder(bert, attention="triton")
    PackedEncoder(bert, attention="cudnn")  # the other kernels take it


def _compile_sm90(tmp_path, monkeypatch, head_dim, block_m, block_n, num_warps, num_stages, e4m3_out=False,
                  e4m3_in=False, pv_e4m3=False):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = ta._kernel()
    qkv = "*fp8e4nv" if e4m3_in else "*fp16"
    sig = {"Q": qkv, "K": qkv, "V": qkv, "O": "*fp8e4nv" if e4m3_out else "*fp16", "cu_seqlens": "*i32",
           "o_inv_scale": "*fp32" if e4m3_out else "constexpr", "qkv_scale": "*fp32" if e4m3_in else "constexpr"}
    sig.update({f"stride_{x}{y}": "i32" for x in "qkvo" for y in "th"})
    sig.update(qk_scale="fp32", seq_bucket="i32", HEAD_DIM="constexpr", E4M3_OUT="constexpr", E4M3_IN="constexpr",
               PV_DTYPE="constexpr", P_SCALE="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr")
    assert list(sig) == kernel.arg_names
    # as a [T, 3, H, D] fp16 tensor's views pass them: 16-byte aligned pointers, strides multiples
    # of 16 (Triton specializes integer arguments divisible by 16 at launch the same way)
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
             if t in ("*fp16", "*fp8e4nv", "*i32", "i32")}
    pv_dtype, p_scale = ta._pv_operands(torch.float8_e4m3fn if e4m3_in else torch.float16, pv_e4m3)
    constexprs = {"HEAD_DIM": head_dim, "E4M3_OUT": e4m3_out, "E4M3_IN": e4m3_in, "PV_DTYPE": pv_dtype,
                  "P_SCALE": p_scale, "BLOCK_M": block_m, "BLOCK_N": block_n}
    assert isinstance(pv_dtype, tl.dtype)
    if not e4m3_out:
        constexprs["o_inv_scale"] = None  # what a launch without the scale passes
    if not e4m3_in:
        constexprs["qkv_scale"] = None
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold cache: compiled here, not read back
    # GPUTarget's third field is the warp size (32 on NVIDIA GPUs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


def _ptxas_spill_bytes(ptx: str, tmp_path) -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    f = tmp_path / "k.ptx"
    f.write_text(ptx)
    r = subprocess.run([get_ptxas().path, "-v", "--gpu-name=sm_90a", str(f), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr))


def test_attention_kernel_compiles_for_hopper_with_wgmma_and_pipelined_loads(tmp_path, monkeypatch):
    """What the interpreter cannot run: the kernel compiled ahead of time for sm_90 at head_dim 64
    with one of the autotuner's configurations: Hopper's warpgroup MMA (wgmma) for both matmuls,
    exp2 through the SFU's ex2.approx, K/V loads asynchronous (cp.async, software-pipelined by
    num_stages) and 16 bytes wide, no register spills."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    compiled = _compile_sm90(tmp_path, monkeypatch, 64, 128, 64, 8, 3)
    ptx = compiled.asm["ptx"]
    assert "mma" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in ptx  # S = Q K^T and O += P V, fp32 accumulation
    assert "ex2.approx" in ptx
    assert "cp.async" in ptx and "ld.global.v4" in ptx
    assert _ptxas_spill_bytes(ptx, tmp_path) == 0
    # no e4m3 in the code; the .file directives name source paths, which may contain anything
    assert "e4m3" not in "\n".join(ln for ln in ptx.splitlines() if not ln.lstrip().startswith(".file"))


def test_attention_kernel_with_e4m3_output_compiles_for_hopper_without_spills(tmp_path, monkeypatch):
    """The e4m3-output form of the tile the end-to-end runs chose (64 x 32, 4 warps, 3 stages):
    its stores convert with Hopper's cvt.rn.satfinite from fp32 (round to nearest-even: what the
    compiled kernel relies on, where the interpreter rounds in arithmetic), the matmuls stay on
    wgmma, and nothing spills."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    ptx = _compile_sm90(tmp_path, monkeypatch, 64, 64, 32, 4, 3, e4m3_out=True).asm["ptx"]
    # straight from fp32, to nearest-even, saturating: the rounding the kernel relies on
    # (ROUND_IN_ARITHMETIC off); never through fp16, which would round twice
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "no fp32 -> e4m3 conversion in the PTX"
    assert "e4m3x2.f16x2" not in ptx
    assert "wgmma.mma_async" in ptx
    assert _ptxas_spill_bytes(ptx, tmp_path) == 0


@pytest.mark.parametrize("head_dim", [64, 32, 128])
def test_register_pruning_matches_ptxas_spills(head_dim, tmp_path, monkeypatch):
    """keep_config's register rule, checked against ptxas: every configuration it keeps compiles
    for sm_90a without spilling, every one it drops spills (num_stages changes shared memory, not
    registers: compiled at 2)."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    verdicts = {}
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for w in (4, 8):
                ptx = _compile_sm90(tmp_path, monkeypatch, head_dim, bm, bn, w, 2).asm["ptx"]
                verdicts[(bm, bn, w)] = (ta.keep_config(bm, bn, w, head_dim, 512), _ptxas_spill_bytes(ptx, tmp_path))
    assert all(keep == (spill == 0) for keep, spill in verdicts.values()), verdicts


def _bert_large_like(seed: int, dtype, tokens: int = 32768, heads: int = 16, d: int = 64):
    gen = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while True:
        n = int(torch.randint(100, 385, (1,), generator=gen))
        if total + n > tokens:
            break
        lens.append(n)
        total += n
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qkv = torch.randn(total, 3, heads, d, generator=gen).to(dtype).cuda()
    return lens, cu, qkv


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_attention_on_cuda_matches_sdpa_and_replays_in_a_cuda_graph(dtype):
    """The BERT-large-like case (~32k tokens in sequences of 100-384, 16 heads, head_dim 64, fp16/bf16,
    strided views of one fused QKV tensor) against per-sequence SDPA in fp64 with the module
    docstring's bounds; then captured in a CUDA graph after the eager (autotuning) call: the
    replay writes the same bytes as the eager call."""
    if ta.triton_unavailable_reason():
        pytest.skip(ta.triton_unavailable_reason())
    seed = int.from_bytes(os.urandom(4), "little")
    lens, cu, qkv = _bert_large_like(seed, dtype)
    q, k, v = qkv.unbind(1)
    scale, u = 64 ** -0.5, (2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8)
    out = ta.varlen_attention(q, k, v, cu, 384, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert ta.best_config() is not None
    ref = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qi, ki, vi = (x[s:e].double().transpose(0, 1) for x in (q, k, v))
        ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    err = out.double() - ref
    assert not out.isnan().any(), seed
    assert float(err.norm() / ref.norm()) <= 2 * u, seed
    assert float(err.abs().max()) <= 2 * u * float(v.abs().max()), seed

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ta.varlen_attention(q, k, v, cu, 384, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ta.varlen_attention(q, k, v, cu, 384, scale)
    gout.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout.view(torch.int16), out.view(torch.int16))


@pytest.mark.gpu
def test_triton_attention_e4m3_output_on_cuda_is_within_its_bound_and_replays_in_a_cuda_graph():
    """The BERT-large-like case with the e4m3 output, at a scale that saturates a tenth of the
    values: within the module docstring's bound of fp64 SDPA and exactly +-448 where saturated; a
    CUDA graph's replay writes the eager call's bytes; on one-token sequences, torch's own
    quantization of V bit for bit. (Not compared code for code with the fp16
    output quantized afterwards, as the interpreter test does: each output dtype is tuned on its
    own, and another tile rounds P differently.)"""
    if ta.triton_unavailable_reason():
        pytest.skip(ta.triton_unavailable_reason())
    seed = int.from_bytes(os.urandom(4), "little")
    lens, cu, qkv = _bert_large_like(seed, torch.float16)
    q, k, v = qkv.unbind(1)
    scale, u, vmax = 64 ** -0.5, 2.0 ** -11, float(v.abs().max())
    out16 = ta.varlen_attention(q, k, v, cu, 384, scale)
    c = 448.0 / float(out16.float().abs().flatten()[::7].quantile(0.9))
    inv = torch.tensor([c], dtype=torch.float32, device="cuda")
    o8 = ta.varlen_attention(q, k, v, cu, 384, scale, inv)
    assert o8.dtype == torch.float8_e4m3fn and o8.shape == q.shape and not o8.float().isnan().any()
    ref = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qi, ki, vi = (x[s:e].double().transpose(0, 1) for x in (q, k, v))
        ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    sat = (ref * c).abs() > 448 + c * u * vmax
    free = (ref * c).abs() < 448 - c * u * vmax
    assert int(sat.sum()) > 0 and bool((o8.float()[sat].abs() == 448).all()), seed
    allowed = 2.0 ** -4 * (ref.abs() + u * vmax) + 2.0 ** -10 / c + u * vmax
    assert bool(((o8.double() / c - ref).abs() <= allowed)[free].all()), seed

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ta.varlen_attention(q, k, v, cu, 384, scale, inv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ta.varlen_attention(q, k, v, cu, 384, scale, inv)
    gout.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout.view(torch.uint8), o8.view(torch.uint8))
    # one-token sequences: the output is V, so the e4m3 output is quantize(V * c) bit for bit: the
    # GPU's cast rounds to nearest-even and the kernel saturates
    scope = {"torch": torch, "ta": ta}
    exec(_ONE_TOKEN, scope)
    o1, want = scope["one_token_sequences"](torch.Generator().manual_seed(seed), "cuda")
    assert torch.equal(o1.float(), want.float()), seed
