"""kernels/quack_gemm_gelu.py: the tile vocabulary and its refusals, the op's checks of its operands
(before any work), its CPU path (the kernel's formula), and on a Hopper GPU with quack installed the
kernel's e4m3 codes against that formula."""
import pytest
import torch

from bertqa_bench.kernels import quack_gemm_gelu as q
from bertqa_bench.kernels.cublaslt_epilogues import fp8_gemm_gelu_reference, gelu_tanh
from bertqa_bench.kernels.fp8_math import e4m3_codes_apart


def test_every_tile_spells_back_to_itself_and_the_default_is_one_of_them():
    spelled = q.tiles()
    assert len(spelled) == len(set(spelled)) == 2 * (len(q.PINGPONG_TILES) + len(q.COOP_TILES))
    assert all(q.parse_tile(t).spelled() == t for t in spelled)
    assert q.DEFAULT_TILE.spelled() in spelled
    assert q.parse_tile("coop-256x128-c1x2") == q.Tile(256, 128, 1, 2, False)


@pytest.mark.parametrize("bad, says", [
    ("pingpong-128x192", "expected KIND-MxN-cAxB"),
    ("warp-128x192-c2x1", "kind must be pingpong or coop, not 'warp'"),
    ("pingpong-256x128-c2x1", "pingpong tiles are 128x128, 128x160"),
    ("coop-128x128-c2x1", "coop tiles are 256x128"),
    ("pingpong-128x192-c2x2", "clusters c1x2 or c2x1"),
])
def test_a_bad_tile_is_refused_with_the_valid_ones(bad, says):
    with pytest.raises(ValueError, match=says):
        q.parse_tile(bad)


def _operands(m=40, n=48, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x8 = (torch.randn(m, k, generator=g) * 2).to(torch.float8_e4m3fn)
    w8 = (torch.randn(n, k, generator=g) * 2).to(torch.float8_e4m3fn)
    bias = torch.randn(n, generator=g)
    return x8, w8, bias, torch.tensor([0.05]), torch.tensor([4.0])


def test_the_cpu_op_is_the_epilogue_formula_with_the_scales_multiplied():
    x8, w8, bias, alpha, inv = _operands()
    got = q.fp8_gemm_gelu_quack(x8, w8, bias, alpha, inv)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (40, 48)
    # the same bits as cuBLASLt's reference given the two scales apart (their product is alpha)
    want = fp8_gemm_gelu_reference(x8, w8, bias, torch.tensor(0.25), torch.tensor(0.2), torch.tensor(4.0))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # and that formula is GELU_tanh(alpha x8 w8^T + bias) * inv, saturated and rounded to e4m3
    y = gelu_tanh(x8.float() @ w8.float().t() * 0.05 + bias) * 4.0
    assert torch.equal(got.float(), y.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_the_op_saturates_instead_of_overflowing():
    x8, w8, bias, alpha, _ = _operands()
    got = q.fp8_gemm_gelu_quack(x8, w8, bias, alpha, torch.tensor([1e6]))
    assert got.float().abs().max() == 448.0 and not got.float().isnan().any()


@pytest.mark.parametrize("change, says", [
    (lambda o: (o[0].float(),) + o[1:], "x8 must be a row-major 2-D float8_e4m3fn"),
    (lambda o: (o[0], o[1].t()) + o[2:], "w8 must be a row-major"),
    (lambda o: (o[0], o[1][:, :32].contiguous()) + o[2:], "K differs"),
    (lambda o: o[:2] + (o[2].half(),) + o[3:], r"bias must be float32 \[48\]"),
    (lambda o: o[:3] + (torch.ones(2),) + o[4:], "alpha must be a 1-element float32"),
    (lambda o: o[:4] + (torch.ones(1, dtype=torch.float64),), "out_inv_scale must be a 1-element float32"),
])
def test_bad_operands_are_refused_naming_the_operand(change, says):
    with pytest.raises(ValueError, match=says):
        q.fp8_gemm_gelu_quack(*change(_operands()))


def test_a_bad_tile_is_refused_by_the_op_too():
    with pytest.raises(ValueError, match="kind must be pingpong or coop"):
        q.fp8_gemm_gelu_quack(*_operands(), tile="x-128x128-c2x1")


def test_without_a_hopper_gpu_the_reason_says_so():
    why = q.quack_unavailable_reason()
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        assert why == "" or "pip install quack-kernels" in why
    else:
        assert why and ("no CUDA device" in why or "Hopper" in why)


@pytest.mark.gpu
@pytest.mark.skipif(bool(q.quack_unavailable_reason()), reason=q.quack_unavailable_reason() or "runs")
@pytest.mark.parametrize("tile", ["pingpong-128x128-c2x1", "coop-256x128-c1x2"])
def test_the_kernel_gives_the_formulas_codes_on_gpu(tile):
    # 1,000 tokens (not a tile multiple) x 4,096 x 1,024: the kernel's fp32 products sum in another
    # order than torch's and its tanh is the GPU's approximate one, so a code may differ by one
    # where the value sits near a rounding boundary; more than that only at GELU's flat negative
    # tail, where e4m3's subnormal steps are coarse relative to the value
    x8, w8, bias, alpha, inv = (t.cuda() for t in _operands(1000, 4096, 1024))
    got = q.launch(x8, w8, bias, alpha, inv, tile)
    diff = e4m3_codes_apart(got, q.reference(x8, w8, bias, alpha, inv))
    assert (diff <= 1).float().mean() > 0.999
