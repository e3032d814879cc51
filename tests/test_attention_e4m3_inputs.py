"""The Triton variable-length attention kernel on e4m3 Q, K and V (bertqa_bench/kernels/varlen_attention.py,
``qkv_scale``): what the packed encoder runs when its fused QKV GEMM writes e4m3 (fp8 option
``attention: fp8`` with ``packed_attention: triton``).

Without a GPU: its arithmetic under Triton's interpreter (in a subprocess, as
test_triton_attention's) and its ahead-of-time compilation for sm_90 (FP8 warpgroup MMA). On a
GPU: the BERT-large-like case, eagerly and replayed from a CUDA graph.

Tolerances. The reference is attention in fp64 on the decoded inputs (the e4m3 codes times
``qkv_scale``), so the inputs' own quantization is not the kernel's error; the e4m3 products are
exact and the scales are applied in fp32 (relative 2^-24 each). Under the interpreter the products
are summed in fp32, so what remains is what the 16-bit kernel has (below). On the GPU, Hopper's FP8
MMA sums them with fewer bits: about 2^-13 of the products' magnitudes (published measurements of
the H100/H800 MMA), taken as 2^-12 * scale * sum_d |q_d k_d| for a score here (twice that, for the
two 32-deep MMA steps of head size 64); a score error d moves each probability by a factor within
exp(+-d) and the output by at most expm1(2 d) * max|V| (``_score_accumulation_term``), added to each
bound below on the GPU:
* ``pv_e4m3`` off (P in fp16, V's e4m3 values exact in fp16): P's rounding and the output's, the
  16-bit kernel's bounds with u = 2^-11 (test_triton_attention's docstring derives them); with the
  e4m3 output, the same bound as the 16-bit kernel's e4m3 output.
* ``pv_e4m3`` on (P times 256 rounded to e4m3): each probability's rounding, relative 2^-4 among
  e4m3's normals and absolute 2^-10 / 256 below them, summed over the sequence's n keys, times the
  head's max |V|; then the output's rounding: ``test_fp8._fp8_attention_bound``, the bound cuDNN's
  FP8 attention is held to (the same pipeline: P rounded unnormalized, tile by tile, the row sum
  from the unrounded P, so each term's relative error is as in the reference's).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fp8 import _fp8_attention_bound
from test_triton_attention import _INTERPRETER_NUMPY_SHIM, _compile_sm90, _ptxas_spill_bytes, _bert_large_like

from bertqa_bench.kernels import varlen_attention as ta

_INTERPRETED = _INTERPRETER_NUMPY_SHIM + """
import sys
import torch
from bertqa_bench.kernels import varlen_attention as ta
from test_fp8 import _fp8_attention_bound

seed = int(sys.argv[1])
g = torch.Generator().manual_seed(seed)
bm, bn = ta.INTERPRETER_CONFIG["BLOCK_M"], ta.INTERPRETER_CONFIG["BLOCK_N"]
U = 2.0 ** -11


def reference(q, k, v, cu, scale):
    ref = torch.zeros(q.shape, dtype=torch.float64)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        if e > s:
            qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
            ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    return ref


def e4m3_inputs(lens, heads, d):
    # codes over most of e4m3's range (|code| up to ~300, a few saturated at 448), at a scale that
    # is no power of two, so that a decoding by any other scale shows
    t = sum(lens)
    s_qkv = float(torch.empty(()).uniform_(0.002, 0.02, generator=g))
    qkv8 = (torch.randn(t, 3, heads, d, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist() + [t], dtype=torch.int32)
    return qkv8.unbind(1), cu, s_qkv


def check(lens, heads, d):
    (q8, k8, v8), cu, s_qkv = e4m3_inputs(lens, heads, d)
    assert q8.stride(0) == 3 * heads * d and not q8.is_contiguous()  # views of one fused tensor
    sq, scale, long = torch.tensor([s_qkv]), d ** -0.5, max(lens)
    ref = reference(*(x.double() * s_qkv for x in (q8, k8, v8)), cu, scale)
    vmax = float(v8.float().abs().max()) * s_qkv
    # P and V in fp16, a 16-bit output: the 16-bit kernel's bounds
    out = torch.full(q8.shape, float("nan"), dtype=torch.float16)
    assert ta.launch(q8, k8, v8, cu, long, scale, out=out, qkv_scale=sq) is out
    assert not out.isnan().any(), f"unwritten elements: {int(out.isnan().sum())}"
    err = out.double() - ref
    rel, max_abs = float(err.norm() / ref.norm()), float(err.abs().max())
    print(f"{lens} H={heads} D={d}: fp16 P V: rel {rel:.2e} (limit {2 * U:.1e}), max abs {max_abs:.2e}")
    assert rel <= 2 * U and max_abs <= 2 * U * vmax, (rel, max_abs, 2 * U * vmax)
    # the scale is applied: decoding by 1% more breaks the bound
    wrong = ta.launch(q8, k8, v8, cu, long, scale, qkv_scale=sq * 1.01).double()
    assert float((wrong - ref).norm() / ref.norm()) > 2 * U
    # the e4m3 output at a scale c that saturates a tenth of the values, P V in fp16 or e4m3
    c = 448.0 / float(out.float().abs().flatten().quantile(0.9))
    inv = torch.tensor([c])
    got = {}
    for pv in (False, True):
        poisoned = torch.full(q8.shape, float("nan")).to(torch.float8_e4m3fn)
        o8 = ta.launch(q8, k8, v8, cu, long, scale, out=poisoned, out_inv_scale=inv, qkv_scale=sq, pv_e4m3=pv)
        assert o8 is poisoned and not o8.float().isnan().any(), ("unwritten or NaN elements", pv)
        got[pv] = o8
    sat = (ref * c).abs() > 448 + c * U * vmax
    free = (ref * c).abs() < 448 - c * U * vmax
    assert int(sat.sum()) > 0 and bool((got[False].float()[sat].abs() == 448).all())
    allowed = 2.0 ** -4 * (ref.abs() + U * vmax) + 2.0 ** -10 / c + U * vmax
    assert bool(((got[False].double() / c - ref).abs() <= allowed)[free].all())
    err8, allowed8 = _fp8_attention_bound(q8, k8, v8, cu, scale, s_qkv, c, got[True])
    inside = (ref * c).abs() < 448 - c * (2.0 ** -4 + 2.0 ** -18 * long) * vmax
    assert bool((err8 <= allowed8)[inside].all()), float((err8 - allowed8)[inside].max())
    # e4m3 P really is rounded (not the fp16 path under another name): some outputs move a code
    moved = float((got[True].float() != got[False].float()).float().mean())
    print(f"  e4m3 out: {int(sat.sum())} saturated; e4m3 P V moved {moved:.1%} of the codes")
    assert moved > 0
    # the custom op: the same bytes as the launch, an e4m3 fake output, torch's check of the fake
    # implementation (its schema check mutates the inputs arithmetically, which torch's CPU kernels
    # do not do on e4m3; test_triton_attention runs it on the 16-bit form of the same schema)
    for pv in (False, True):
        op = ta.varlen_attention_op(q8, k8, v8, cu, long, scale, inv, sq, pv)
        assert torch.equal(op.view(torch.uint8), got[pv].view(torch.uint8))
        torch.library.opcheck(ta.varlen_attention_op, (q8, k8, v8, cu, long, scale, inv, sq, pv),
                              test_utils=("test_faketensor",))
    op16 = ta.varlen_attention_op(q8, k8, v8, cu, long, scale, None, sq)
    assert op16.dtype == torch.float16
    torch.library.opcheck(ta.varlen_attention_op, (q8, k8, v8, cu, long, scale, None, sq),
                          test_utils=("test_faketensor",))


check([1, bm, bm + 1, 0, 3 * bm + 5, bn, bn + 1], 2, 64)
check([bm + 1, 7, 2 * bm], 2, 32)

# one-token sequences: the softmax over one key is 1 (and 256 in e4m3 exactly), so the output is
# V decoded, and the e4m3 output must be quantize((V8 * s) * c) bit for bit on either P V path
(q8, k8, v8), cu1, s_qkv = e4m3_inputs([1] * 96, 2, 64)
c = 3.0 / s_qkv / 97.0
want = ((v8.float() * s_qkv) * c).clamp(-448, 448).to(torch.float8_e4m3fn)
for pv in (False, True):
    o1 = ta.launch(q8, k8, v8, cu1, 1, 64 ** -0.5, out_inv_scale=torch.tensor([c]), qkv_scale=torch.tensor([s_qkv]),
                   pv_e4m3=pv)
    assert torch.equal(o1.float(), want.float()), (pv, int((o1.float() != want.float()).sum()))
print("interpreted e4m3-input kernel matches")
"""


def test_e4m3_inputs_in_the_interpreter_are_attention_within_their_bounds(tmp_path):
    """Indexing, masking (lengths 1, BLOCK_M, BLOCK_M + 1, BLOCK_N, BLOCK_N + 1, long, empty), strided
    e4m3 views of one fused QKV tensor, the decoding scale, both P V paths, the e4m3 output's
    saturation and rounding, and the output's coverage (poisoned first), under Triton's interpreter
    against fp64 attention of the decoded inputs, head_dim 64 and 32, a fresh seed each run."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    seed = int.from_bytes(os.urandom(4), "little")
    root = str(Path(ta.__file__).resolve().parents[2])
    tests = str(Path(__file__).resolve().parent)  # test_fp8's bound, imported by the script
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, tests, os.environ.get("PYTHONPATH")]))}
    script = tmp_path / "interpreted_e4m3.py"  # a file: the interpreter reads a jitted function's source
    script.write_text(_INTERPRETED)
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "interpreted e4m3-input kernel matches" in r.stdout, \
        f"seed {seed}\n{r.stdout}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("pv_e4m3", [False, True])
def test_e4m3_inputs_compile_to_fp8_warpgroup_mma_without_spills(pv_e4m3, tmp_path, monkeypatch):
    """Ahead of time for sm_90 at head_dim 64 (64 x 64 tile, 4 warps, 3 stages): Q K^T on Hopper's FP8
    warpgroup MMA (e4m3 x e4m3, fp32 accumulation); P V on it too with ``pv_e4m3``, else on the
    fp16 one with V converted from e4m3; the e4m3 output converted straight from fp32; no spills."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    ptx = _compile_sm90(tmp_path, monkeypatch, 64, 64, 64, 4, 3, e4m3_out=True, e4m3_in=True,
                        pv_e4m3=pv_e4m3).asm["ptx"]
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32\.(\w+)\.(\w+)", ptx))
    assert ("e4m3", "e4m3") in mmas, mmas
    assert (("f16", "f16") in mmas) == (not pv_e4m3), mmas
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    assert "ex2.approx" in ptx
    assert _ptxas_spill_bytes(ptx, tmp_path) == 0


def test_e4m3_input_arguments_are_checked_before_any_launch():
    qkv8 = torch.zeros(10, 3, 2, 64).to(torch.float8_e4m3fn)
    q8, k8, v8 = qkv8.unbind(1)
    cu, one = torch.tensor([0, 4, 10], dtype=torch.int32), torch.ones(1)
    with pytest.raises(ValueError, match=r"q must be float16 or bfloat16 \(float8_e4m3fn with qkv_scale\)"):
        ta._check(q8, k8, v8, cu, 6, 0.125)
    with pytest.raises(ValueError, match="with qkv_scale, q must be float8_e4m3fn"):
        ta._check(q8.half(), k8.half(), v8.half(), cu, 6, 0.125, qkv_scale=one)
    with pytest.raises(ValueError, match=r"head_dim 16 is not supported with e4m3 inputs; valid: \[32, 64, 128\]"):
        z = torch.zeros(10, 2, 16).to(torch.float8_e4m3fn)
        ta._check(z, z, z, cu, 6, 0.125, qkv_scale=one)
    with pytest.raises(ValueError, match="qkv_scale must be a 1-element float32 tensor"):
        ta._check(q8, k8, v8, cu, 6, 0.125, qkv_scale=torch.ones(2))
    ta._check(q8, k8, v8, cu, 6, 0.125, qkv_scale=one)  # the valid call passes
    if ta.HAS_TRITON:
        with pytest.raises(ValueError, match="pv_e4m3 rounds P to e4m3 for an e4m3 V: it needs e4m3 inputs"):
            ta.launch(q8.half(), k8.half(), v8.half(), cu, 6, 0.125, pv_e4m3=True)
    assert ta.output_dtype(torch.float8_e4m3fn) == torch.float16
    assert ta.output_dtype(torch.bfloat16) == torch.bfloat16
    assert ta.output_dtype(torch.float8_e4m3fn, one) == torch.float8_e4m3fn


def _score_accumulation_term(q8, k8, cu, s_qkv: float, scale: float, vmax: float):
    """Per output element [T, heads, 1]: expm1(2 d) * max|V|, d the largest error the FP8 MMA's
    accumulation (2^-12 of the products' magnitudes, the module docstring) can put in a score of
    the element's query row."""
    term = torch.zeros(q8.shape[0], q8.shape[1], 1, dtype=torch.float64, device=q8.device)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        if e > s:
            qa, ka = (x[s:e].double().abs().transpose(0, 1) * s_qkv for x in (q8, k8))  # [heads, n, d]
            d = 2.0 ** -12 * scale * (qa @ ka.transpose(1, 2)).amax(-1)  # [heads, n]
            term[s:e, :, 0] = torch.expm1(2 * d).transpose(0, 1) * vmax
    return term


def test_the_accumulation_term_is_the_score_bound_it_says():
    """On a planted case: one-token sequences of Q = K = (1, 0, ...) at scale 1: sum |q_d k_d| = 1."""
    q8 = torch.zeros(3, 1, 32)
    q8[:, 0, 0] = 1.0
    q8 = q8.to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    term = _score_accumulation_term(q8, q8, cu, 1.0, 0.5, 2.0)
    assert term.shape == (3, 1, 1)
    assert torch.allclose(term, torch.full_like(term, math.expm1(2 * 2.0 ** -12 * 0.5) * 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("pv_e4m3", [False, True])
def test_e4m3_inputs_on_cuda_are_within_their_bounds_and_replay_in_a_cuda_graph(pv_e4m3):
    """The BERT-large-like case (~32k tokens in sequences of 100-384, 16 heads, head_dim 64) on e4m3
    views of one fused QKV tensor, e4m3 out at a scale that saturates a tenth of the values: within
    the module docstring's bound of fp64 attention of the decoded inputs; a CUDA graph's replay
    writes the eager call's bytes."""
    if ta.triton_unavailable_reason():
        pytest.skip(ta.triton_unavailable_reason())
    seed = int.from_bytes(os.urandom(4), "little")
    lens, cu, qkv = _bert_large_like(seed, torch.float32)
    s_qkv = 0.01
    q8, k8, v8 = (qkv / s_qkv).clamp(-448, 448).to(torch.float8_e4m3fn).unbind(1)
    sq, scale, u = torch.tensor([s_qkv], device="cuda"), 64 ** -0.5, 2.0 ** -11
    out16 = ta.varlen_attention(q8, k8, v8, cu, 384, scale, qkv_scale=sq)
    assert out16.dtype == torch.float16 and not out16.isnan().any(), seed
    c = 448.0 / float(out16.float().abs().flatten()[::7].quantile(0.9))
    inv = torch.tensor([c], device="cuda")
    o8 = ta.varlen_attention(q8, k8, v8, cu, 384, scale, inv, qkv_scale=sq, pv_e4m3=pv_e4m3)
    assert o8.dtype == torch.float8_e4m3fn and not o8.float().isnan().any(), seed
    ref = torch.empty(q8.shape, dtype=torch.float64, device="cuda")
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qi, ki, vi = (x[s:e].double().transpose(0, 1) * s_qkv for x in (q8, k8, v8))
        ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    vmax = float(v8.float().abs().max()) * s_qkv
    acc = _score_accumulation_term(q8, k8, cu, s_qkv, scale, vmax)  # the FP8 MMA's sums (module docstring)
    err16 = out16.double() - ref
    assert float(err16.norm() / ref.norm()) <= 2 * u + float(acc.expand_as(ref).norm() / ref.norm()), seed
    assert bool((err16.abs() <= 2 * u * vmax + acc).all()), seed
    if pv_e4m3:
        err, allowed = _fp8_attention_bound(q8.cpu(), k8.cpu(), v8.cpu(), cu.cpu(), scale, s_qkv, c, o8.cpu())
        allowed = allowed.double() + (1 + 2.0 ** -4) * acc.cpu()
        inside = ((ref.abs() + acc) * c < 448 - c * (2.0 ** -4 + 2.0 ** -18 * 384) * vmax).cpu()
        assert bool((err <= allowed)[inside].all()), (seed, float((err - allowed)[inside].max()))
    else:
        free = (ref.abs() + acc) * c < 448 - c * u * vmax
        allowed = 2.0 ** -4 * (ref.abs() + u * vmax + acc) + 2.0 ** -10 / c + u * vmax + acc
        assert bool(((o8.double() / c - ref).abs() <= allowed)[free].all()), seed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ta.varlen_attention(q8, k8, v8, cu, 384, scale, inv, qkv_scale=sq, pv_e4m3=pv_e4m3)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ta.varlen_attention(q8, k8, v8, cu, 384, scale, inv, qkv_scale=sq, pv_e4m3=pv_e4m3)
    gout.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout.view(torch.uint8), o8.view(torch.uint8)), seed
