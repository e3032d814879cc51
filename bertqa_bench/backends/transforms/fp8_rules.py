"""The FP8 options' vocabularies and the one check of their combinations.

``check_fp8(fp8, torch_options)`` is where an FP8 recipe (the torch backend's ``fp8:`` options,
torch_options.Fp8Options) is validated: every field, the fields against each other, and, given
the torch options, against the rest of the variant (weights, packed, packed_attention,
token_bucket). Fp8Options, TorchOptions and the torch backend call it, and ``swap_to_fp8``
(fp8_surgery.py) calls the same pieces (``check_recipe``) on its own arguments, so a combination
is refused the same way whether it comes from a suite or from code; the pieces raise ValueError,
check_fp8 turns it into one ConfigError naming the option (``fp8.<field>``).

Its own module, below the surgery and the FP8 modules (both import it): torch is never imported
here, so the variant registry can check a suite's FP8 options without loading torch.
"""
from __future__ import annotations

from ...errors import ConfigError

SCALINGS = ("tensor", "rowwise", "static-rowwise")
# the GELU between e4m3 FFN GEMMs (ffn_hidden_fp8): the model's own (erf), the tanh form in one
# Triton kernel (gelu_fp8.py), or the tanh form in the up-projection's cuBLASLt epilogue with its
# bias (cublaslt_epilogues.py: one kernel for GEMM, bias, GELU and the e4m3 output)
FFN_GELUS = ("exact", "tanh", "epilogue")
# where the attention-output and FFN-down GEMMs' residual is added: in the LayerNorm pass after
# them (Inductor fuses the add there), or in the GEMM itself as cuBLASLt's C operand
# (cublaslt_epilogues.py), so that the LayerNorm pass reads one tensor instead of two
RESIDUALS = ("layernorm", "gemm")
# the residual add + LayerNorm + e4m3 quantize before an FP8 GEMM: Inductor's fused pass (the
# LayerNorm module, then the GEMM's quantize, fused by torch.compile), or the suite's Triton kernel
# (kernels/add_layernorm_fp8.py: one pass writing the 16-bit residual and its e4m3 copy at the
# consuming GEMM's static input scale, which that GEMM takes as it is)
LAYERNORMS = ("inductor", "triton")
# what the attention-output and FFN-down GEMMs write for the add + LayerNorm kernel after them
# (layernorm: triton): fp16, or e4m3 at a scale calibrated on their outputs (cuBLASLt's BIAS epilogue
# with an e4m3 result, cublaslt_epilogues.fp8_gemm_bias_e4m3), which the kernel reads at that scale:
# one byte an element out of the GEMM and into the LayerNorm instead of two
DENSE_OUTPUTS = ("fp16", "e4m3")
# the 16-bit attention's output, which the FP8 attention-output GEMM reads: fp16 (the model's
# 16-bit dtype; that GEMM quantizes it in a pass of its own) or e4m3 (the packed encoder's Triton
# attention kernel writes it at the GEMM's static input scale: half the bytes, no separate pass)
ATTENTION_OUTPUTS = ("fp16", "e4m3")
# the activations (transformers' and torch's classes) whose function the tanh form computes or
# approximates: erf-GELU and the tanh forms; not QuickGELU (x * sigmoid(1.702 x))
GELU_CLASSES = ("GELUActivation", "GELU", "NewGELUActivation", "PytorchGELUTanh", "GELUTanh", "FastGELUActivation")
FP8_ATTENTION = ("fp16", "fp8")  # attention itself: in 16 bits, or on e4m3 Q, K, V (fp8.attention)
# FP8 attention's second product on the Triton kernel (fp8.attention_pv): P rounded to e4m3 times
# an e4m3 V (FP8 tensor cores both ways, as cuDNN's FP8 attention does), or P in fp16 times V's
# e4m3 values, exact in fp16 (one rounding of P fewer, at the 16-bit product's rate)
ATTENTION_PVS = ("e4m3", "fp16")
# Names of the encoder Linear layers inside one transformer layer (HF BERT naming).
_QKV = ("query", "key", "value")

# The four GEMM kinds of a BERT layer, by the Linear's name inside ``encoder.layer.N``.
GEMM_KINDS = ("qkv", "attn_out", "ffn_in", "ffn_out")
# attn_out (768 -> 768) is left in fp16 by default: at M=12,288 the fp8 GEMM measured slower
# than fp16 on an H100 (0.041-0.047 ms vs 0.030 ms), and its input would need a quantize pass.
DEFAULT_GEMMS = ("qkv", "ffn_in", "ffn_out")
# the GEMMs a residual follows
RESIDUAL_GEMMS = ("attn_out", "ffn_out")


def parse_gemms(value) -> tuple[str, ...]:
    items = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip()]
    if value in ("all", ["all"]) or items == ["all"]:
        return GEMM_KINDS
    bad = [v for v in items if v not in GEMM_KINDS]
    if bad or not items:
        raise ValueError(f"fp8_gemms must name some of {GEMM_KINDS} (or 'all'), got {value!r}")
    return tuple(v for v in GEMM_KINDS if v in items)


def parse_cublaslt_gemms(value) -> tuple[str, ...]:
    """``cublaslt_gemms``: '' (none) or GEMM kinds, as ``parse_gemms``."""
    if isinstance(value, str) and not value.strip():
        return ()
    return parse_gemms(value)


def check_ffn_hidden(scaling: str, gemms, ffn_hidden_fp8: bool, ffn_gelu: str) -> None:
    """ValueError unless the e4m3 FFN hidden path's options fit the rest (swap_to_fp8's and the
    torch backend's fp8 options' one check)."""
    if ffn_gelu not in FFN_GELUS:
        raise ValueError(f"ffn_gelu '{ffn_gelu}' is not one of {', '.join(FFN_GELUS)}")
    if ffn_gelu != "exact" and not ffn_hidden_fp8:
        raise ValueError(f"ffn_gelu: {ffn_gelu} is the GELU between e4m3 FFN GEMMs: it needs ffn_hidden_fp8: true")
    if ffn_hidden_fp8 and (scaling != "tensor" or not {"ffn_in", "ffn_out"} <= set(parse_gemms(gemms))):
        raise ValueError("ffn_hidden_fp8 needs scaling 'tensor' and both FFN GEMMs (ffn_in, ffn_out) in FP8, "
                         f"not scaling '{scaling}' with gemms {','.join(parse_gemms(gemms))}")


def check_attention_fp8(scaling: str, gemms, fuse_qkv: bool, attention_fp8: bool) -> None:
    """ValueError unless FP8 attention's options fit the rest."""
    if attention_fp8 and (scaling != "tensor" or not fuse_qkv or not {"qkv", "attn_out"} <= set(parse_gemms(gemms))):
        raise ValueError("attention: fp8 needs scaling 'tensor', fuse_qkv and both attention GEMMs (qkv, attn_out) "
                         f"in FP8, not scaling '{scaling}' with gemms {','.join(parse_gemms(gemms))}"
                         + ("" if fuse_qkv else " and fuse_qkv false"))


def check_attention_output(scaling: str, gemms, fuse_qkv: bool, attention_output: str, attention_fp8: bool) -> None:
    """ValueError unless the attention output's type fits the rest."""
    if attention_output not in ATTENTION_OUTPUTS:
        raise ValueError(f"attention_output '{attention_output}' is not one of {', '.join(ATTENTION_OUTPUTS)}")
    if attention_output == "e4m3" and attention_fp8:
        raise ValueError("attention_output: e4m3 is for 16-bit attention; attention: fp8 writes its output in e4m3 "
                         "already")
    if attention_output == "e4m3" and (scaling != "tensor" or not fuse_qkv or "attn_out" not in parse_gemms(gemms)):
        raise ValueError("attention_output: e4m3 needs scaling 'tensor' (the output GEMM's static input scale), "
                         f"fuse_qkv and the attention output GEMM (attn_out) in FP8, not scaling '{scaling}' with "
                         f"gemms {','.join(parse_gemms(gemms))}" + ("" if fuse_qkv else " and fuse_qkv false"))


def check_residual(scaling: str, gemms, residual: str) -> None:
    """ValueError unless the residual's place fits the rest."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual '{residual}' is not one of {', '.join(RESIDUALS)}")
    if residual == "gemm" and (scaling != "tensor" or not set(RESIDUAL_GEMMS) & set(parse_gemms(gemms))):
        raise ValueError("residual: gemm adds the residual in FP8 GEMMs with per-tensor scales: it needs scaling "
                         f"'tensor' and attn_out or ffn_out in gemms, not scaling '{scaling}' with gemms "
                         f"{','.join(parse_gemms(gemms))}")


def check_layernorm(scaling: str, gemms, layernorm: str, residual: str) -> None:
    """ValueError unless the add + LayerNorm pass's kernel fits the rest."""
    if layernorm not in LAYERNORMS:
        raise ValueError(f"layernorm '{layernorm}' is not one of {', '.join(LAYERNORMS)}")
    if layernorm != "triton":
        return
    if residual != "layernorm":
        raise ValueError("layernorm: triton adds the residual in its own kernel; residual: gemm adds it in the GEMM "
                         "before: choose one (residual: layernorm)")
    if scaling != "tensor" or not {"qkv", "ffn_in"} & set(parse_gemms(gemms)):
        raise ValueError("layernorm: triton writes e4m3 at the next GEMM's static input scale: it needs scaling "
                         f"'tensor' and qkv or ffn_in in FP8, not scaling '{scaling}' with gemms "
                         f"{','.join(parse_gemms(gemms))}")


def check_dense_output(scaling: str, gemms, dense_output: str, layernorm: str, fuse_qkv: bool = True) -> None:
    """ValueError unless the e4m3 output of the GEMMs before a LayerNorm fits the rest, and
    switches something: a LayerNorm is fused only where an FP8 GEMM reads it (the attention's
    feeds the FFN-up, the FFN's the next layer's fused QKV), so some GEMM pair must be FP8."""
    if dense_output not in DENSE_OUTPUTS:
        raise ValueError(f"dense_output '{dense_output}' is not one of {', '.join(DENSE_OUTPUTS)}")
    if dense_output != "e4m3":
        return
    if layernorm != "triton":
        raise ValueError("dense_output: e4m3 is read by the add + LayerNorm kernel: it needs layernorm: triton, "
                         f"not {layernorm}")
    kinds = set(parse_gemms(gemms))
    pairs = {"attn_out", "ffn_in"} <= kinds or (fuse_qkv and {"ffn_out", "qkv"} <= kinds)
    if scaling != "tensor" or not pairs:
        raise ValueError("dense_output: e4m3 writes at a static per-tensor output scale for a fused LayerNorm: it "
                         "needs scaling 'tensor' and, in FP8, attn_out with the ffn_in that reads its LayerNorm or "
                         f"ffn_out with the fused qkv that reads its; not scaling '{scaling}' with gemms "
                         f"{','.join(sorted(kinds))}" + ("" if fuse_qkv else " and fuse_qkv false"))


def check_cublaslt(scaling: str, gemms, cublaslt_gemms, autotune: int, *, ffn_hidden_fp8: bool = False,
                   ffn_gelu: str = "exact", attention_fp8: bool = False, residual: str = "layernorm",
                   dense_output: str = "fp16") -> None:
    """ValueError unless the GEMMs planned through nvmath-python (``cublaslt_gemms``) and their
    autotuning fit the rest: FP8 GEMMs with per-tensor scales and a 16-bit output, and something
    planned there when ``autotune`` > 0."""
    try:
        kinds = parse_cublaslt_gemms(cublaslt_gemms)
    except ValueError:
        raise ValueError(f"cublaslt_gemms must name some of {', '.join(GEMM_KINDS)} (or 'all', or ''), "
                         f"not {cublaslt_gemms!r}") from None
    fp8_kinds = set(parse_gemms(gemms))
    if kinds and scaling != "tensor":
        raise ValueError(f"cublaslt_gemms needs scaling 'tensor' (per-tensor scales), not '{scaling}'")
    missing = [k for k in kinds if k not in fp8_kinds]
    if missing:
        raise ValueError(f"cublaslt_gemms names {','.join(missing)}, which gemms ({','.join(sorted(fp8_kinds))}) "
                         "leaves in 16 bits")
    e4m3_out = (["ffn_in"] if ffn_hidden_fp8 else []) + (["qkv"] if attention_fp8 else [])
    clash = [k for k in kinds if k in e4m3_out]
    if clash:
        raise ValueError(f"cublaslt_gemms: {','.join(clash)} writes e4m3 here (ffn_hidden_fp8 / attention: fp8); "
                         "only GEMMs with a 16-bit output run as a planned cuBLASLt GEMM")
    # the whole kind is refused, also where one of its GEMMs keeps a 16-bit output (the last
    # layer's FFN-down, whose LayerNorm the QA head reads): one kind, one path
    for on, what, others in ((residual == "gemm", "the residual GEMM (residual: gemm)", "qkv"),
                             (dense_output == "e4m3", "the e4m3-output GEMM before the LayerNorm (dense_output: "
                              "e4m3)", "qkv, ffn_in")):
        taken = [k for k in kinds if k in RESIDUAL_GEMMS] if on else []
        if taken:
            raise ValueError(f"cublaslt_gemms: {','.join(taken)} already runs through cuBLASLt as {what}; name only "
                             f"the others ({others})")
    if isinstance(autotune, bool) or not isinstance(autotune, int) or autotune < 0:
        raise ValueError(f"cublaslt_autotune must be an integer >= 0 (0: the heuristic's choice), not {autotune!r}")
    if autotune > 0 and not (kinds or ffn_gelu == "epilogue" or residual == "gemm" or dense_output == "e4m3"):
        raise ValueError("cublaslt_autotune tunes the GEMMs planned through nvmath-python, and none is: name some in "
                         "cublaslt_gemms, or use ffn_gelu: epilogue, residual: gemm or dense_output: e4m3")



def check_candidates(autotune: int, candidates: int) -> None:
    """ValueError unless ``cublaslt_candidates`` is a whole number >= 0 and, above 0, something is
    autotuned: without autotuning the heuristic's first algorithm runs, however many it lists."""
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 0:
        raise ValueError(f"cublaslt_candidates must be an integer >= 0 (0: nvmath's default, 8), not {candidates!r}")
    if candidates > 0 and not autotune:
        raise ValueError(f"cublaslt_candidates: {candidates} algorithms are timed only when autotuned: set "
                         "cublaslt_autotune > 0")


def _one_of(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{field} '{value}' is not one of {', '.join(choices)}")


def check_recipe(scaling: str, gemms, *, fuse_qkv: bool = True, ffn_hidden_fp8: bool = False,
                 ffn_gelu: str = "exact", attention_fp8: bool = False, attention_output: str = "fp16",
                 residual: str = "layernorm", cublaslt_gemms="", cublaslt_autotune: int = 0,
                 layernorm: str = "inductor", cublaslt_candidates: int = 0, dense_output: str = "fp16") -> None:
    """ValueError, its message led by the field's name, unless the FP8 recipe's fields fit each
    other (what both check_fp8 and swap_to_fp8 refuse)."""
    _one_of("scaling", scaling, SCALINGS)
    try:
        parse_gemms(gemms)
    except ValueError as e:
        raise ValueError(f"gemms: {e}") from None
    check_ffn_hidden(scaling, gemms, ffn_hidden_fp8, ffn_gelu)
    check_attention_fp8(scaling, gemms, fuse_qkv, attention_fp8)
    check_attention_output(scaling, gemms, fuse_qkv, attention_output, attention_fp8)
    check_residual(scaling, gemms, residual)
    check_layernorm(scaling, gemms, layernorm, residual)
    check_dense_output(scaling, gemms, dense_output, layernorm, fuse_qkv)
    check_cublaslt(scaling, gemms, cublaslt_gemms, cublaslt_autotune, ffn_hidden_fp8=ffn_hidden_fp8,
                   ffn_gelu=ffn_gelu, attention_fp8=attention_fp8, residual=residual, dense_output=dense_output)
    check_candidates(cublaslt_autotune, cublaslt_candidates)


def needs_nvmath(fp8) -> bool:
    """Whether the recipe plans GEMMs through nvmath-python (cuBLASLt): the GELU epilogue, the
    residual GEMMs, the e4m3-output GEMMs before the LayerNorms or ``cublaslt_gemms``."""
    return (fp8.ffn_gelu == "epilogue" or fp8.residual == "gemm" or fp8.dense_output == "e4m3"
            or bool(parse_cublaslt_gemms(fp8.cublaslt_gemms)))


def check_fp8(fp8, torch_options=None) -> None:
    """The one check of an FP8 recipe (torch_options.Fp8Options): ConfigError naming the option
    (``fp8.<field>``) unless its fields fit each other and, given ``torch_options`` (a
    TorchOptions), the variant around it."""
    try:
        _one_of("attention", fp8.attention, FP8_ATTENTION)
        _one_of("attention_pv", fp8.attention_pv, ATTENTION_PVS)
        if fp8.attention_pv != "e4m3" and fp8.attention != "fp8":
            raise ValueError(f"attention_pv: {fp8.attention_pv} is FP8 attention's second product: it needs attention: fp8")
        check_recipe(fp8.scaling, fp8.gemms, fuse_qkv=fp8.fuse_qkv, ffn_hidden_fp8=fp8.ffn_hidden_fp8,
                     ffn_gelu=fp8.ffn_gelu, attention_fp8=fp8.attention == "fp8",
                     attention_output=fp8.attention_output, residual=fp8.residual,
                     cublaslt_gemms=fp8.cublaslt_gemms, cublaslt_autotune=fp8.cublaslt_autotune,
                     layernorm=fp8.layernorm, cublaslt_candidates=fp8.cublaslt_candidates,
                     dense_output=fp8.dense_output)
        if fp8.act_margin <= 0 or fp8.calibration_batches < 1:
            raise ValueError("act_margin must be > 0 and calibration_batches >= 1")
        try:
            fp8.layers_kept()
        except ValueError:
            raise ValueError(f"keep_layers must be comma-separated layer indices, not {fp8.keep_layers!r}") from None
    except ValueError as e:
        raise ConfigError(f"fp8.{e}") from None
    if torch_options is not None:
        _check_in_variant(fp8, torch_options)


def _check_in_variant(fp8, t) -> None:
    """The recipe against the rest of the torch options ``t``: the first clash, as ConfigError."""
    planned = bool(parse_cublaslt_gemms(fp8.cublaslt_gemms)) or fp8.residual == "gemm" or fp8.dense_output == "e4m3"
    clashes = (
        (t.weights == "fp32", "fp8 needs 16-bit weights for the parts that stay out of FP8 (weights: fp16 or bf16)"),
        (fp8.ffn_gelu == "epilogue" and t.packed and not t.token_bucket,
         "fp8.ffn_gelu: epilogue plans one cuBLASLt GEMM per token count; packed batches need token_bucket (a few "
         "bucket sizes), not a new token count every batch"),
        (planned and t.weights != "fp16",
         "fp8.cublaslt_gemms, fp8.residual: gemm and fp8.dense_output: e4m3 plan GEMMs through cuBLASLt, whose FP8 "
         f"kernels take the bias in fp16 (the output's type, or C's for an e4m3 one): they need weights: fp16, not "
         f"{t.weights}"),
        (fp8.dense_output == "e4m3" and not (t.packed and t.token_bucket),
         "fp8.dense_output: e4m3 plans one cuBLASLt GEMM per token count for the padding-free encoder's add + "
         "LayerNorm kernel: it needs packed: true and token_bucket"),
        (bool(parse_cublaslt_gemms(fp8.cublaslt_gemms)) and t.packed and not t.token_bucket,
         "fp8.cublaslt_gemms plans one cuBLASLt GEMM per token count; packed batches need token_bucket (a few bucket "
         "sizes), not a new token count every batch"),
        (fp8.residual == "gemm" and not (t.packed and t.token_bucket),
         "fp8.residual: gemm is the padding-free encoder's layer calling its GEMMs with the residual, one cuBLASLt "
         "GEMM planned per token count: it needs packed: true and token_bucket"),
        (fp8.attention == "fp8" and not (t.packed and t.packed_attention in ("cudnn", "triton")),
         "fp8.attention: fp8 is the padding-free encoder's FP8 attention (cuDNN's, or the suite's Triton kernel on "
         "e4m3 inputs): it needs packed: true and packed_attention: cudnn or triton"),
        (fp8.attention_pv != "e4m3" and t.packed_attention != "triton",
         f"fp8.attention_pv: {fp8.attention_pv} is the suite's Triton kernel's choice (cuDNN's FP8 attention takes "
         "P in e4m3): it needs packed_attention: triton"),
        (fp8.layernorm == "triton" and not t.packed,
         "fp8.layernorm: triton is the padding-free encoder's layer calling the add + LayerNorm kernel with the "
         "GEMM's output and the residual apart (the padded model adds them itself): it needs packed: true"),
        (fp8.attention_output == "e4m3" and not (t.packed and t.packed_attention == "triton"),
         "fp8.attention_output: e4m3 is written by the padding-free encoder's Triton attention kernel: it needs "
         "packed: true and packed_attention: triton"),
    )
    for clash, message in clashes:
        if clash:
            raise ConfigError(message)
