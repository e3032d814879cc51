"""The typed options of the PyTorch backends (a variant's ``options:``): the model builder's
(weights dtype, attention implementation, FP8 / INT8 / torchao quantization, the padding-free
encoder) and the executor's (compile, CUDA graphs, autocast, TF32), checked when a suite loads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from ..model.checkpoint import PACKED_FAMILIES  # noqa: F401 - the families the padding-free encoder computes
from .transforms.fp8_rules import check_fp8, parse_gemms
from .transforms.fp8_surgery import layer_index, target_linears

DTYPES = ("fp32", "fp16", "bf16")
# Families whose encoder is BertModel's layout (tests/test_checkpoint.py checks the FP8/INT8
# target Linears are found in each).
QUANT_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
COMPILE_MODES = ("none", "default", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPHS = ("none", "trees", "manual")
SDPA_BACKENDS = ("cudnn", "efficient", "flash", "math")
# the padding-free encoder's variable-length attention on CUDA (packed_encoder.py)
PACKED_ATTENTION = ("flash", "cudnn", "triton")
# streams: every stream holds a copy of every captured graph (memory), and torch hands out its
# streams from a pool of 32, which must give each copy a distinct one
MAX_STREAMS = 8


TOKEN_BUCKET_DUMMIES = ("auto", "tokens")


def parse_layers(text: str) -> tuple[int, ...]:
    """'0, 11' -> (0, 11): encoder layers named in an option."""
    return tuple(int(x) for x in str(text).split(",") if x.strip())


@dataclass
class Fp8Options:
    scaling: str = "tensor"  # tensor | rowwise | static-rowwise
    gemms: str = "qkv,ffn_in,ffn_out"  # some of qkv, attn_out, ffn_in, ffn_out, or "all"
    fuse_qkv: bool = True
    fast_accum: bool = True
    act_margin: float = 2.0  # static scale = calibrated amax x margin / 448
    calibration_batches: int = 8  # real batches of the run the activation ranges are taken over
    keep_layers: str = ""  # encoder layers left in 16 bits, e.g. "0,11"
    # keep this many more layers in 16 bits: the most sensitive ones by a per-layer sweep in
    # prepare (quantize one layer at a time, measure max |Δ logit| on the calibration batches)
    sensitivity_keep: int = 0
    # the FFN's hidden activations in e4m3: the up-projection GEMM writes FP8 and GELU reads it
    # (fp8_modules.Fp8Intermediate); needs scaling: tensor and both FFN GEMMs in FP8
    ffn_hidden_fp8: bool = False
    # that hidden path's GELU: exact (the model's erf form) or tanh (one Triton kernel with the
    # GPU's tanh.approx; fp8_rules.FFN_GELUS, gelu_fp8.py); tanh needs ffn_hidden_fp8
    ffn_gelu: str = "exact"
    # attention itself: fp16 (the packed encoder's kernel or SDPA, in 16 bits), or fp8 (the fused
    # QKV GEMM writes e4m3 Q, K, V at a calibrated scale; both products on FP8 tensor cores, the
    # output in e4m3 for the attention-output GEMM; packed, both attention GEMMs in FP8): cuDNN's
    # FP8 attention (packed_attention: cudnn, cudnn_fp8_attention.py) or the suite's Triton kernel
    # on e4m3 inputs (packed_attention: triton, varlen_attention.py)
    attention: str = "fp16"
    # FP8 attention's P V on the Triton kernel (fp8_rules.ATTENTION_PVS): e4m3 (P rounded to e4m3,
    # as cuDNN's) or fp16 (P in fp16, V's e4m3 values exact: one e4m3 rounding fewer)
    attention_pv: str = "e4m3"
    # the 16-bit attention's output, read by the FP8 attention-output GEMM: fp16 (quantized by that
    # GEMM in a pass of its own) or e4m3 (written by the attention kernel at the GEMM's static
    # input scale, fp8_rules.ATTENTION_OUTPUTS; the packed encoder's Triton kernel: packed_attention:
    # triton; needs scaling: tensor, fuse_qkv and attn_out in FP8)
    attention_output: str = "fp16"
    # where the attention-output and FFN-down GEMMs' residual is added: layernorm (in the fused
    # LayerNorm + quantize pass) or gemm (cuBLASLt's C operand, beta 1, through nvmath-python:
    # that pass then reads one tensor instead of two); gemm needs scaling: tensor and the packed
    # encoder, whose layer calls the GEMM with its residual
    residual: str = "layernorm"
    # the residual add + LayerNorm + e4m3 quantize before the QKV and FFN-up GEMMs: inductor (the
    # LayerNorm and the GEMM's quantize fused by torch.compile) or triton (one pass of the suite's
    # kernel, add_layernorm_fp8.py, writing the fp16 residual and its e4m3 copy at that GEMM's scale;
    # fp8_rules.LAYERNORMS; needs scaling: tensor, residual: layernorm and the packed encoder)
    layernorm: str = "inductor"
    # what the attention-output and FFN-down GEMMs write for that kernel: fp16, or e4m3 at a scale
    # calibrated on their outputs (cuBLASLt's BIAS epilogue, nvmath-python), read by the kernel at
    # that scale (fp8_rules.DENSE_OUTPUTS; needs layernorm: triton, weights: fp16, token_bucket)
    dense_output: str = "fp16"
    # FP8 GEMMs with a 16-bit output (some of qkv, attn_out, ffn_in, ffn_out, or all, whose output is
    # 16-bit here; "" none) run through cuBLASLt planned by nvmath-python, with their bias in its
    # epilogue, instead of torch._scaled_mm: what lets cublaslt_autotune choose their algorithm
    # (needs scaling: tensor and weights: fp16; packed needs token_bucket)
    cublaslt_gemms: str = ""
    # > 0: every GEMM planned through nvmath-python (cublaslt_gemms, ffn_gelu: epilogue, residual:
    # gemm) times cuBLASLt's candidate algorithms this many times each when its shape is first run
    # (a warm-up batch) and keeps the fastest; 0: the heuristic's first choice
    cublaslt_autotune: int = 0
    # with cublaslt_autotune: how many algorithms cuBLASLt is asked for, the ones autotuning times
    # (0: nvmath's default, 8); the FFN-up GEMM's GELU epilogue took 301 us a layer in a BERT-large
    # pass against 195 for the FFN-down GEMM of the same FLOPs (h200-bert-large-pass-profile.md)
    cublaslt_candidates: int = 0

    def __post_init__(self):
        check_fp8(self)  # the recipe alone; TorchOptions checks it again against the variant around it

    def layers_kept(self) -> tuple[int, ...]:
        return parse_layers(self.keep_layers)


@dataclass
class Int8Options:
    gemms: str = "all"  # some of qkv, attn_out, ffn_in, ffn_out, or "all"
    keep_layers: str = ""
    sensitivity_keep: int = 0  # as Fp8Options.sensitivity_keep
    calibration_batches: int = 8  # batches the sensitivity sweep measures on

    def __post_init__(self):
        try:
            parse_gemms(self.gemms)
            self.layers_kept()
        except ValueError as e:
            raise ConfigError(f"int8: {e}") from None
        if self.sensitivity_keep < 0 or self.calibration_batches < 1:
            raise ConfigError("int8: sensitivity_keep must be >= 0 and calibration_batches >= 1")

    def layers_kept(self) -> tuple[int, ...]:
        return parse_layers(self.keep_layers)


TORCHAO_GRANULARITIES = ("tensor", "row")


@dataclass
class TorchaoOptions:
    """torchao's FP8 inference (``Float8DynamicActivationFloat8WeightConfig``), the maintained
    library beside the suite's own FP8 path (``fp8:``): dynamic activation scales, e4m3 weights,
    swapped into the same encoder Linears by ``torchao.quantization.quantize_``."""

    granularity: str = "row"  # tensor | row (per-token activations x per-channel weights)
    gemms: str = "qkv,ffn_in,ffn_out"  # the encoder Linears, named as fp8.gemms names them
    keep_layers: str = ""  # encoder layers left in 16 bits

    def __post_init__(self):
        if self.granularity not in TORCHAO_GRANULARITIES:
            raise ConfigError(f"torchao.granularity '{self.granularity}' is not one of "
                              f"{', '.join(TORCHAO_GRANULARITIES)}")
        try:
            parse_gemms(self.gemms)
            parse_layers(self.keep_layers)
        except ValueError as e:
            raise ConfigError(f"torchao: {e}") from None


def torchao_targets(module, t: TorchaoOptions) -> set[str]:
    """The encoder Linears torchao quantizes: the kinds ``t.gemms`` names outside the kept layers."""
    keep = set(parse_layers(t.keep_layers))
    return {n for n in target_linears(module, parse_gemms(t.gemms)) if layer_index(n) not in keep}


@dataclass
class TorchOptions:
    weights: str = "fp32"  # fp32 | fp16 | bf16
    autocast: str = "none"  # none | fp16 | bf16 (weights stay as they are; matmuls run in this dtype)
    tf32: bool = False  # TF32 matmuls on CUDA
    attn_implementation: str = "sdpa"  # sdpa | eager
    compile: str = "none"  # none | default | max-autotune | max-autotune-no-cudagraphs
    dynamic: Optional[bool] = False  # torch.compile(dynamic=...)
    fullgraph: bool = False
    cuda_graph: str = "none"  # none | trees (inductor's) | manual (one torch.cuda.CUDAGraph per shape)
    fp8: Optional[Fp8Options] = None
    int8: Optional[Int8Options] = None  # W8A8 dynamic int8 encoder GEMMs (int8_dynamic.py)
    torchao: Optional[TorchaoOptions] = None  # torchao's FP8 inference instead of the suite's own
    sdpa_backend: Optional[str] = None  # restrict SDPA's kernel while compiling/capturing
    inductor_config: dict = field(default_factory=dict)  # patched into torch._inductor.config while compiling
    num_threads: Optional[int] = None  # CPU threads (default: torch's)
    packed: bool = False  # real tokens only: the padding-free encoder (packed_encoder.py)
    # packed only: round each batch's token count up to a multiple of this and capture one CUDA
    # graph per bucket (packed_encoder.TokenBuckets); 0 = the exact token count, no graphs
    token_bucket: int = 0
    # token_bucket: how the dummy sequences that fill a batch's fixed-length cumulative-length vector
    # get tokens (TOKEN_BUCKET_DUMMIES): auto (empty where the attention kernel takes empty
    # sequences, packed_attention: triton, so a batch takes the bucket of its real tokens) or
    # tokens (at least 1 each, so a batch of t tokens and k dummies takes the bucket of t + k: the
    # behaviour before 2026-12-04, ~3 % of a full 32k-token batch's tokens computed for dummies)
    token_bucket_dummies: str = "auto"
    # token_bucket on CUDA only: pack each batch on the host into the bucket graph's inputs
    # (packed_encoder.HostPacker) instead of on the device (two host syncs and ~15 kernels a batch)
    host_pack: bool = False
    # packed only: the QA span head runs on the packed tokens inside the encoder (and its token
    # buckets' graphs), so 2 logits a token are scattered back instead of the hidden states
    # (packed_encoder.fuse_token_head)
    head_first: bool = False
    # packed only: the variable-length attention kernel on CUDA (PACKED_ATTENTION, packed_encoder.py):
    # flash (FlashAttention-2, torch's varlen_attn) | cudnn (cuDNN's fused attention through
    # nvidia-cudnn-frontend, told each sequence's length by ragged offsets) | triton (the suite's
    # own Triton kernel for short sequences, varlen_attention.py, measured against both)
    packed_attention: str = "flash"
    # CUDA only: keep two batches in flight (Backend.submit), so the host prepares batch i+1 and
    # scatters batch i's outputs while the GPU computes; every buffer the host writes or reads
    # (pinned inputs, packing, outputs) has one copy per batch in flight
    pipeline: bool = False
    # CUDA, with pipeline and captured graphs (token_bucket + host_pack, or cuda_graph: manual):
    # run the batches in flight on this many CUDA streams (at most MAX_STREAMS), batch i on stream
    # i mod n, each stream replaying its own copy of every CUDA graph, captured on that stream (own
    # static inputs, memory pool, cuBLAS workspace and cuBLASLt plans: copies run at once, so
    # nothing they write may be shared). One batch's kernels then fill the other's launch gaps and
    # the last, partly idle wave of each kernel; the batches in flight grow to two a stream
    streams: int = 1

    def __post_init__(self):
        for name, value, valid in (("weights", self.weights, DTYPES), ("autocast", self.autocast, ("none",) + DTYPES[1:]),
                                   ("compile", self.compile, COMPILE_MODES), ("cuda_graph", self.cuda_graph, CUDA_GRAPHS),
                                   ("attn_implementation", self.attn_implementation, ("sdpa", "eager"))):
            if value not in valid:
                raise ConfigError(f"torch option {name} '{value}' is not one of {', '.join(valid)}")
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise ConfigError(f"torch option sdpa_backend '{self.sdpa_backend}' is not one of {', '.join(SDPA_BACKENDS)}")
        if self.cuda_graph == "trees" and self.compile == "none":
            raise ConfigError("cuda_graph: trees are inductor's; they need compile other than none")
        if sum(q is not None for q in (self.fp8, self.int8, self.torchao)) > 1:
            raise ConfigError("fp8, int8 and torchao are three ways of quantizing the same GEMMs: name one")
        if self.torchao is not None and self.weights == "fp32":
            raise ConfigError("torchao FP8 keeps the rest of the model in 16 bits (weights: bf16 or fp16)")
        if self.packed and self.cuda_graph != "none":
            raise ConfigError("packed (padding-free) runs eager or compiled; its token count changes every batch, "
                              "so no whole-model CUDA graphs (cuda_graph: none); token_bucket captures its graphs")
        if self.token_bucket_dummies not in TOKEN_BUCKET_DUMMIES:
            raise ConfigError(f"torch option token_bucket_dummies '{self.token_bucket_dummies}' is not one of "
                              f"{', '.join(TOKEN_BUCKET_DUMMIES)}")
        if self.token_bucket < 0 or (self.token_bucket and not self.packed):
            raise ConfigError(f"token_bucket {self.token_bucket}: a bucket size in tokens (>= 1) for packed: true, "
                              "or 0 for none")
        if self.head_first and not self.packed:
            raise ConfigError("head_first runs the QA head on the packed tokens before the scatter: it needs packed: true")
        if self.packed_attention not in PACKED_ATTENTION:
            raise ConfigError(f"torch option packed_attention '{self.packed_attention}' is not one of "
                              f"{', '.join(PACKED_ATTENTION)}")
        if self.packed_attention != "flash" and not self.packed:
            raise ConfigError(f"packed_attention: {self.packed_attention} is the padding-free encoder's attention "
                              "kernel: it needs packed: true (padded rows choose SDPA's with sdpa_backend)")
        if self.packed_attention == "triton" and not self.token_bucket:
            # the kernel tunes its tile once per sequence-length bucket, for seconds; the token
            # buckets' warm-up does it in prepare, whereas batches packed to their own longest
            # length would tune inside the timed passes whenever a new bucket first appears
            raise ConfigError("packed_attention: triton tunes its tile in the token buckets' warm-up, in prepare: it "
                              "needs token_bucket (batches packed to their own length would tune while timed)")
        if self.fp8 is not None:
            check_fp8(self.fp8, self)  # the FP8 recipe against weights, packed, packed_attention, token_bucket
        if self.host_pack and not self.token_bucket:
            raise ConfigError("host_pack feeds the token buckets' CUDA graphs: it needs packed: true and token_bucket")
        if not isinstance(self.streams, int) or isinstance(self.streams, bool) or not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"torch option streams {self.streams!r}: the number of CUDA streams, 1 to {MAX_STREAMS}")
        if self.streams > 1 and not (self.pipeline and ((self.token_bucket and self.host_pack)
                                                       or self.cuda_graph == "manual")):
            raise ConfigError(f"streams: {self.streams} runs the batches in flight on several CUDA streams, each "
                              "replaying its own copy of the captured graphs: it needs pipeline: true and either "
                              "token_bucket with host_pack (packed) or cuda_graph: manual (padded)")

    def inductor_mode(self) -> str:
        """torch.compile's mode: graph trees come with reduce-overhead / max-autotune."""
        if self.cuda_graph == "trees":
            return "reduce-overhead" if self.compile == "default" else "max-autotune"
        return "max-autotune-no-cudagraphs" if self.compile == "max-autotune" else self.compile
