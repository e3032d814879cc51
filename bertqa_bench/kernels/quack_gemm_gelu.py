"""The FFN up-projection with its bias, tanh-GELU and e4m3 output in one Hopper GEMM kernel written
in CUTLASS's Python DSL (CuTe DSL), through quack's composable GEMM epilogues (PyPI
``quack-kernels``, Tri Dao's; ``quack.epilogue.frontend.gemm_epilogue``).

Why: cuBLASLt's GELU_BIAS epilogue (cublaslt_epilogues.py) is the layer's largest kernel. On an
H200, BERT-large at 32,768 tokens, it takes 263-265 us against 218 us for the same GEMM writing e4m3
without the GELU (every algorithm cuBLASLt lists, 8 of them whatever the limit asked:
``kernel_bench.py --only gemm_candidates``), and 301 us a layer in the pass: the GELU (a tanh on
134 M elements) runs after the main loop instead of under it. quack's Hopper GEMM has ping-pong
kernels, where one warpgroup's epilogue runs while the other's tensor-core products do, so the GELU
can hide behind the next tile's main loop. Inductor's Triton GEMM template with the GELU fused
(max-autotune) took 478 us on the same operands: not that route.

Measured (H200, 2026-12-02, results/reference/h200-bert-large-ffn-up-epilogue.md): **no row uses
this kernel.** With quack 0.6.5 and CUTLASS DSL 4.8.1 it takes 714 us at its best tile (cooperative
256 x 128) and up to 3,859 us (ping-pong 128 x 208), against 264 us for cuBLASLt's epilogue; its
codes match the formula (99.98 % within one e4m3 code). quack's own FP8 GEMM without any epilogue
takes 700 us autotuned, so the main loop, not this epilogue, is what is slow: FP8 on SM90 is not
where quack is tuned. The kernel stays as the kernel bench's measure of the route
(``kernel_bench.py --only ffn_up``), to be re-measured when quack's SM90 FP8 GEMM changes.

Numerics: h8 = e4m3(clamp(GELU_tanh(alpha * (x8 @ w8^T) + bias) * out_inv_scale, +-448)), with
alpha = x_scale * w_scale: the formula of ``cublaslt_epilogues.fp8_gemm_gelu_reference`` (the CPU
path and the tests' reference), with the bias in fp32 rather than fp16 and tanh in the GPU's
approximate form (``tanh.approx.f32``, relative error ~2^-11), both far inside e4m3's rounding
(2^-4). The products accumulate in fp32 on the FP8 tensor cores without periodic promotion, as the
cuBLASLt path with fast accumulation does.

Layout: A is x8 [M, K] row-major and B is w8^T (the [N, K] row-major weight's transpose: K
contiguous, the only layout Hopper's FP8 MMA takes); the result is [M, N] row-major, what the
down-projection reads.

CUDA graphs: the first call of a shape and configuration compiles the kernel (seconds; CuTe DSL
JIT, cached on disk by quack) and is not capturable; later calls launch the compiled kernel on
torch's current stream, with the scales read from device memory (no host copy), so they capture.
The packed encoder's buckets run every shape once before capturing it.
"""
# No ``from __future__ import annotations``: custom_op reads the op's annotations as types.
import functools
from dataclasses import dataclass

import torch

from .cublaslt_epilogues import fp8_gemm_gelu_reference
from .fp8_math import E4M3_MAX

INSTALL = "pip install quack-kernels nvidia-cutlass-dsl[cu13] (CUTLASS's CuTe DSL; cu12 for CUDA 12)"


@dataclass(frozen=True)
class Tile:
    """One kernel configuration: the CTA tile (M x N; K is the DSL's choice for the dtype), the
    thread-block cluster, and ping-pong (two warpgroups taking turns: one's epilogue under the
    other's main loop) or cooperative (both on one tile)."""
    m: int = 128
    n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True

    def spelled(self) -> str:
        return f"{'pingpong' if self.pingpong else 'coop'}-{self.m}x{self.n}-c{self.cluster_m}x{self.cluster_n}"


# quack's SM90 tile space (quack.gemm_config._get_sm90_configs): ping-pong tiles are 128 rows (or
# 192 x 128), cooperative ones 256 (or 128 x 224/256); clusters of 2 along M or N
PINGPONG_TILES = ((128, 128), (128, 160), (128, 192), (128, 208), (192, 128))
COOP_TILES = ((256, 128), (256, 160), (256, 192), (256, 208), (128, 224), (128, 256))
DEFAULT_TILE = Tile()


def parse_tile(spelled: str) -> Tile:
    """``Tile.spelled()``'s inverse: 'pingpong-128x192-c2x1' -> Tile(128, 192, 2, 1, True)."""
    try:
        kind, mn, cl = spelled.split("-")
        m, n = (int(v) for v in mn.split("x"))
        cm, cn = (int(v) for v in cl.lstrip("c").split("x"))
    except ValueError:
        raise ValueError(f"quack GEMM tile {spelled!r}: expected KIND-MxN-cAxB, e.g. "
                         f"{DEFAULT_TILE.spelled()!r}") from None
    if kind not in ("pingpong", "coop"):
        raise ValueError(f"quack GEMM tile {spelled!r}: kind must be pingpong or coop, not {kind!r}")
    tile = Tile(m, n, cm, cn, kind == "pingpong")
    valid = PINGPONG_TILES if tile.pingpong else COOP_TILES
    if (m, n) not in valid or (cm, cn) not in ((1, 2), (2, 1)):
        raise ValueError(f"quack GEMM tile {spelled!r}: {kind} tiles are {', '.join(f'{a}x{b}' for a, b in valid)}, "
                         "clusters c1x2 or c2x1")
    return tile


def tiles() -> list:
    """Every configuration this module can launch, spelled: the kernel bench times each."""
    return [Tile(m, n, cm, cn, pp).spelled() for pp, space in ((True, PINGPONG_TILES), (False, COOP_TILES))
            for m, n in space for cm, cn in ((2, 1), (1, 2))]


def quack_unavailable_reason() -> str:
    """Why the quack kernel cannot run here ('' when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return (f"the quack FP8 GEMM + GELU kernel is built for Hopper (compute capability 9.x), not "
                f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    try:
        import quack.epilogue.frontend  # noqa: F401
    except ImportError as e:
        return f"the quack GEMM + GELU kernel needs quack-kernels and CUTLASS's DSL ({INSTALL}): {e}"
    return ""


@functools.lru_cache(maxsize=None)
def _epilogue():
    """The epilogue, built on first use (it imports the DSL): per accumulator element,
    e4m3-ready clamp(GELU_tanh(acc * alpha + bias) * inv, +-448), stored to the output ``h8``."""
    from cutlass import Float32
    from cutlass._mlir.dialects import arith
    from quack.activation import gelu_tanh_approx
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import RowVecLoad, Scalar

    def clamp_e4m3(x):
        # arith's NaN-propagating min/max (one FMNMX each): saturate before the e4m3 store, not
        # left to the conversion's behaviour past +-448
        hi = arith.minimumf(Float32(x).ir_value(), Float32(E4M3_MAX).ir_value())
        return Float32(arith.maximumf(hi, Float32(-E4M3_MAX).ir_value()))

    # the operands' kinds pinned: inferred from shapes, a bias would be ambiguous where the token
    # count equals N (a bucket of 4,096 tokens against BERT-large's 4,096 FFN columns)
    @gemm_epilogue(outputs=("h8",), ops={"alpha": Scalar("alpha"), "bias": RowVecLoad("bias"), "inv": Scalar("inv")})
    def gelu_e4m3(acc, alpha, bias, inv):
        return {"h8": clamp_e4m3(gelu_tanh_approx(acc * alpha + bias) * inv)}

    return gelu_e4m3


def _gemm_config(tile: Tile):
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=tile.m, tile_n=tile.n, pingpong=tile.pingpong, cluster_m=tile.cluster_m,
                      cluster_n=tile.cluster_n, is_dynamic_persistent=False, device_capacity=9)


@functools.lru_cache(maxsize=None)
def _config(spelled: str):
    """One GemmConfig object per tile: quack keys its warm launch cache on the config's identity."""
    return _gemm_config(parse_tile(spelled))


def _check(x8, w8, bias, alpha, out_inv_scale) -> None:
    for name, t in (("x8", x8), ("w8", w8)):
        if t.dtype != torch.float8_e4m3fn or t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"quack GEMM + GELU: {name} must be a row-major 2-D float8_e4m3fn tensor, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if x8.shape[1] != w8.shape[1]:
        raise ValueError(f"quack GEMM + GELU: x8 is {tuple(x8.shape)}, w8 {tuple(w8.shape)}: K differs")
    if bias.shape != (w8.shape[0],) or bias.dtype != torch.float32:
        raise ValueError(f"quack GEMM + GELU: bias must be float32 [{w8.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("alpha", alpha), ("out_inv_scale", out_inv_scale)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"quack GEMM + GELU: {name} must be a 1-element float32 tensor, got {t.dtype} {tuple(t.shape)}")


def reference(x8, w8, bias, alpha, out_inv_scale):
    """The kernel's formula in torch (``cublaslt_epilogues.fp8_gemm_gelu_reference`` with the two
    input scales already multiplied into ``alpha``)."""
    return fp8_gemm_gelu_reference(x8, w8, bias, torch.ones((), device=alpha.device), alpha.reshape(()),
                                   out_inv_scale.reshape(()))


def launch(x8, w8, bias, alpha, out_inv_scale, tile: str = DEFAULT_TILE.spelled()) -> torch.Tensor:
    """Run the kernel: e4m3 [M, K] x8 and [N, K] w8 -> a new e4m3 [M, N] (see the module's
    numerics). ``tile``: a ``Tile.spelled()`` configuration."""
    _check(x8, w8, bias, alpha, out_inv_scale)
    h8 = torch.empty((x8.shape[0], w8.shape[0]), dtype=torch.float8_e4m3fn, device=x8.device)
    _epilogue()(x8, w8.t(), out={"h8": h8}, store_d=False, config=_config(tile), tuned=False,
                alpha=alpha.reshape(()), bias=bias.reshape(1, -1), inv=out_inv_scale.reshape(()))
    return h8


# A custom op with a fake, as cublaslt_epilogues' GEMMs: its body compiles (on a shape's first call)
# and launches a CuTe DSL kernel from the host at call time, which torch.compile must leave opaque.
@torch.library.custom_op("bertqa::fp8_gemm_gelu_quack", mutates_args=())
def fp8_gemm_gelu_quack(x8: torch.Tensor, w8: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
                        out_inv_scale: torch.Tensor, tile: str = DEFAULT_TILE.spelled()) -> torch.Tensor:
    """e4m3 [M, K] x8, [N, K] w8 -> e4m3 [M, N]: the quack kernel on CUDA, its formula in torch
    elsewhere (``reference``)."""
    if x8.is_cuda:
        return launch(x8, w8, bias, alpha, out_inv_scale, tile)
    _check(x8, w8, bias, alpha, out_inv_scale)
    parse_tile(tile)
    return reference(x8, w8, bias, alpha, out_inv_scale)


@fp8_gemm_gelu_quack.register_fake
def _(x8, w8, bias, alpha, out_inv_scale, tile=DEFAULT_TILE.spelled()):
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=torch.float8_e4m3fn)


def gemm_gelu_quack(x8, w8, bias, alpha, out_inv_scale, tile: str = DEFAULT_TILE.spelled()):
    """``fp8_gemm_gelu_quack`` as a plain function: what a module holds (a custom op object does not copy)."""
    return fp8_gemm_gelu_quack(x8, w8, bias, alpha, out_inv_scale, tile)


def implementation(on_cuda: bool, tile: str = DEFAULT_TILE.spelled()) -> str:
    """What runs the up-projection + GELU for tensors on CUDA (or not), in words."""
    return (f"quack CuTe-DSL GEMM with the bias + GELU + e4m3 epilogue ({tile})" if on_cuda
            else "torch (the kernel's formula; not on CUDA)")
