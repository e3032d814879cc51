"""FP8 (e4m3) encoder GEMMs through ``torch._scaled_mm``: the quantization math and the model surgery.

Hopper (and Ada) tensor cores multiply float8 matrices at twice the fp16 rate. The torch
backend (``torch_backend.py``, option ``fp8:``) loads the model in fp16, calibrates activation
ranges on real batches, then replaces encoder linear layers by FP8 ones (``swap_to_fp8``): by
default the attention query/key/value projections, fused into one GEMM, and both FFN GEMMs
(``gemms: qkv,ffn_in,ffn_out``: 3 of the 4 GEMMs per layer, ~92% of the linear-layer FLOPs).
The attention output projection (768x768) stays fp16 unless ``gemms`` names ``attn_out`` (or
``all``): at M=12,288 its FP8 GEMM measured slower than fp16 on an H100 (0.041-0.047 ms vs
0.030 ms), and its input would need a quantize pass of its own. ``keep_layers`` leaves whole
encoder layers in 16 bits (the ones a sensitivity sweep finds fragile).

* the weight is quantized once to ``float8_e4m3fn`` (stored [N, K] row-major, so its ``.t()``
  is the column-major [K, N] operand ``_scaled_mm`` wants) with a per-tensor scale
  (``scaling: tensor``) or a per-output-channel scale (``rowwise`` / ``static-rowwise``);
* the activation is quantized in the module's forward: scale, clamp to ±448, cast. Under
  torch.compile inductor fuses this into the elementwise kernel that produced the activation
  (residual-add + LayerNorm, GELU): no separate quantize kernel. Scales are *static* (one per
  tensor: calibrated input amax x ``act_margin`` / 448; no reduction at run time) or *dynamic
  per row* (``rowwise``: each token's amax — measured slower: the 3072-wide GELU row amax
  became a two-pass reduction kernel of ~0.17 ms/layer);
* the GEMM writes fp16 (tensorwise) or bf16 (the rowwise kernels only write bf16) with the bias
  added in its epilogue, using Hopper's fast fp8 accumulation by default (``fast_accum``:
  ~7% faster end to end, no measurable accuracy difference here).

Attention itself (QK^T, softmax, PV) stays in 16 bits through SDPA; embeddings, LayerNorms,
the residual stream and the QA head stay fp16. Parity class: reduced.

Measured earlier (H100 80GB HBM3, torch 2.11+cu130, BERT-base shape, batch 32 x 384): GPU time
per batch 4.55-4.60 ms against 5.46-5.53 for fp16 under the same compile + CUDA graph path;
FP8 GEMMs 1.79 ms, fp16 attn-out GEMM 0.31, attention 1.04-1.08, fused elementwise
(LayerNorm/GELU + quantize) ~1.3: after FP8, attention and the memory-bound elementwise
kernels are the main cost, not the GEMMs.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from .fp8_math import (  # noqa: F401 - the module's public names, as before the math moved
    E4M3_MAX, SCALINGS, FFN_GELUS, RESIDUALS, ATTENTION_OUTPUTS, GELU_CLASSES, _EPS, _LAYER_PREFIX, _QKV,
    weight_scale, static_act_scale, saturate_to_e4m3, quantize_fp8, dequantize_fp8, e4m3_codes_apart,
    _GEMM_SATURATES, gemm_writes_saturated_e4m3, _probe_saturation)

# --------------------------------------------------------------------------- modules

def _define_modules():
    """The module classes (fp8_modules.py, which imports torch): loaded on first use, so that
    importing the variant registry does not import torch."""
    from .fp8_modules import Fp8Intermediate, Fp8Linear, Fp8SelfAttention

    return Fp8Linear, Fp8SelfAttention, Fp8Intermediate


_CLASSES: Optional[tuple] = None
_CLASS_NAMES = ("Fp8Linear", "Fp8SelfAttention", "Fp8Intermediate")


def fp8_classes():
    """(Fp8Linear, Fp8SelfAttention, Fp8Intermediate), created on first use."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define_modules()
    return _CLASSES


def __getattr__(name: str):
    # ``from bertqa_bench.backends.torch_fp8 import Fp8Linear`` works, without importing torch
    # when only the registry is loaded.
    if name in _CLASS_NAMES:
        return fp8_classes()[_CLASS_NAMES.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- model surgery

# The four GEMM kinds of a BERT layer, by the Linear's name inside ``encoder.layer.N``.
GEMM_KINDS = ("qkv", "attn_out", "ffn_in", "ffn_out")
# attn_out (768 -> 768) is left in fp16 by default: at M=12,288 the fp8 GEMM measured slower
# than fp16 on an H100 (0.041-0.047 ms vs 0.030 ms), and its input would need a quantize pass.
DEFAULT_GEMMS = ("qkv", "ffn_in", "ffn_out")


def _in_encoder(name: str) -> bool:
    return f".{_LAYER_PREFIX}" in f".{name}"


def gemm_kind(name: str) -> Optional[str]:
    """Which of GEMM_KINDS an encoder Linear is (None for anything else)."""
    if not _in_encoder(name):
        return None
    if name.rsplit(".", 1)[-1] in _QKV and name.rsplit(".", 2)[-2] == "self":
        return "qkv"
    if name.endswith("attention.output.dense"):
        return "attn_out"
    if name.endswith("intermediate.dense"):
        return "ffn_in"
    if name.endswith("output.dense"):
        return "ffn_out"
    return None


def target_linears(model, gemms=GEMM_KINDS) -> list[str]:
    """Qualified names of the Linear layers FP8 replaces: Linears inside an encoder layer
    (``encoder.layer.N``) whose kind is in ``gemms`` (q/k/v, attention output, FFN intermediate,
    FFN output). Embeddings, pooler and the QA heads are outside and stay as they are."""
    from torch import nn

    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and gemm_kind(n) in tuple(gemms)]


def _self_attention_modules(model) -> list[str]:
    from torch import nn

    out = []
    for n, m in model.named_modules():
        if _in_encoder(n) and all(isinstance(getattr(m, a, None), nn.Linear) for a in _QKV) \
                and hasattr(m, "num_attention_heads") and hasattr(m, "attention_head_size"):
            out.append(n)
    return out


def layer_index(name: str) -> Optional[int]:
    """The encoder layer a module belongs to (``...encoder.layer.7.attention...`` -> 7)."""
    if not _in_encoder(name):
        return None
    return int(f".{name}".split(f".{_LAYER_PREFIX}", 1)[1].split(".", 1)[0])


def _set_submodule(model, name: str, new) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def parse_gemms(value) -> tuple[str, ...]:
    items = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip()]
    if value in ("all", ["all"]) or items == ["all"]:
        return GEMM_KINDS
    bad = [v for v in items if v not in GEMM_KINDS]
    if bad or not items:
        raise ValueError(f"fp8_gemms must name some of {GEMM_KINDS} (or 'all'), got {value!r}")
    return tuple(v for v in GEMM_KINDS if v in items)


OUT = ":out"  # calibrate_amax's key suffix for a module's output (module names never hold ':')


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


def calibrate_amax(model, batches, inputs: list[str], outputs: Iterable[str] = ()) -> dict[str, float]:
    """Max |input| seen by each module named in ``inputs``, and max |output| (key ``name + OUT``)
    by each named in ``outputs``, over ``batches`` (eager forward passes)."""
    import torch

    amax: dict[str, float] = {**{n: 0.0 for n in inputs}, **{n + OUT: 0.0 for n in outputs}}
    hooks = []

    def seen(key, t):
        amax[key] = max(amax[key], float(t.detach().abs().amax().float()))

    for n in inputs:
        hooks.append(model.get_submodule(n).register_forward_pre_hook(lambda _m, args, k=n: seen(k, args[0])))
    for n in outputs:
        hooks.append(model.get_submodule(n).register_forward_hook(lambda _m, _a, out, k=n + OUT: seen(k, out)))
    try:
        with torch.inference_mode():
            for b in batches:
                model(*b)
    finally:
        for h in hooks:
            h.remove()
    return amax


def ffn_up_names(names: Iterable[str]) -> list[str]:
    """The FFN up-projections (``...intermediate.dense``) among ``names``: the Linears whose
    outputs ``swap_to_fp8(ffn_hidden_fp8=True)`` needs calibrated."""
    return [n for n in names if gemm_kind(n) == "ffn_in"]


def swap_to_fp8(model, act_amax: Optional[Mapping[str, float]] = None, *, scaling: str = "tensor",
                gemms=DEFAULT_GEMMS, fuse_qkv: bool = True, fast_accum: bool = False,
                act_margin: float = 2.0, keep_layers: Iterable[int] = (),
                ffn_hidden_fp8: bool = False, ffn_gelu: str = "exact",
                attention_fp8: bool = False, residual: str = "layernorm",
                cublaslt_gemms="", cublaslt_autotune: int = 0, attention_output: str = "fp16") -> dict[str, Any]:
    """Replace encoder Linears of ``model`` (those of the kinds in ``gemms``) in place by FP8 modules.

    ``act_amax`` (name -> calibrated input amax, ``calibrate_amax``) is needed for the static
    scalings. ``ffn_hidden_fp8``: in every layer whose two FFN GEMMs are both FP8, the hidden
    activations between them stay e4m3 (``Fp8Intermediate``; needs per-tensor scaling and the
    up-projections' calibrated output amax, ``name + OUT``); ``ffn_gelu`` (FFN_GELUS) is the GELU
    between them. ``attention_fp8``: in every layer whose fused QKV and attention-output GEMMs are
    both FP8, Q, K and V are written in e4m3 (needs the q/k/v outputs' calibrated amax, ``name +
    OUT``) and the attention output is read in e4m3 at the output GEMM's input scale: the packed
    encoder runs attention in FP8 there (cudnn_fp8_attention.py). ``attention_output``
    (ATTENTION_OUTPUTS): "e4m3" has the 16-bit attention of every layer whose fused QKV and
    attention-output GEMMs are both FP8 write its output in e4m3 at the output GEMM's input scale
    (the packed encoder's Triton kernel does). Either way the layer's ``o_inv_scale`` (1 / that
    scale) says that its attention writes e4m3. ``residual`` (RESIDUALS): "gemm"
    adds the residual in the attention-output and FFN-down FP8 GEMMs (``Fp8Linear.plus``, which
    the padding-free encoder calls). ``cublaslt_gemms``: GEMM kinds (16-bit output) run through
    cuBLASLt planned by nvmath-python instead of torch._scaled_mm (``Fp8Linear.use_cublaslt``);
    ``cublaslt_autotune`` > 0: every GEMM planned there (those, the GELU epilogue, the residual
    GEMMs) has its algorithm autotuned per shape.
    ``keep_layers``: encoder layer indices left in 16 bits. Returns what was done: ``swapped``
    (Linear names now in FP8), ``fused_qkv`` (attention modules with one fused-QKV FP8 GEMM),
    ``gemms`` (FP8 GEMMs per forward), ``kept`` (targeted Linears left alone, with why)."""
    _check_swap(model, act_amax, scaling, parse_gemms(gemms), fuse_qkv, ffn_hidden_fp8, ffn_gelu, attention_fp8,
                residual, cublaslt_gemms, cublaslt_autotune, attention_output)
    gemms = parse_gemms(gemms)
    Fp8Linear_, Fp8SelfAttention_, Fp8Intermediate_ = fp8_classes()
    static = scaling != "rowwise"

    def scale_for(names: list[str]) -> Optional[float]:
        if not static:
            return None
        return static_act_scale(max(float(act_amax[n]) for n in names), act_margin)

    keep, targets = {int(i) for i in keep_layers}, target_linears(model, gemms)
    kept = {name: f"layer {layer_index(name)} kept in 16 bits (keep_layers)" for name in targets
            if layer_index(name) in keep}
    done: set[str] = set(kept)
    fused: list[str] = []
    swapped: list[str] = []
    if fuse_qkv and "qkv" in gemms:
        for attn_name in _self_attention_modules(model):
            names = [f"{attn_name}.{a}" for a in _QKV]
            attn = model.get_submodule(attn_name)
            if layer_index(attn_name) in keep or any(d[0] % 16 or d[1] % 16 for d in
                                                     (getattr(attn, a).weight.shape for a in _QKV)):
                continue  # kept, or handled (and reported) per Linear below
            out_scale = None
            if attention_fp8 and _fp8_able(model, attn_name[: -len("self")] + "output.dense", targets, done):
                out_scale = static_act_scale(max(float(act_amax[n + OUT]) for n in names), act_margin)
            _set_submodule(model, attn_name, Fp8SelfAttention_(attn, act_scale=scale_for(names), scaling=scaling,
                                                               fast_accum=fast_accum, out_scale=out_scale))
            fused.append(attn_name)
            swapped += names
            done.update(names)
    for name in targets:
        if name in done:
            continue
        lin = model.get_submodule(name)
        n, k = lin.weight.shape
        if n % 16 or k % 16:
            kept[name] = f"{k}->{n} not a multiple of 16"
            continue
        out_scale = None
        if ffn_hidden_fp8 and gemm_kind(name) == "ffn_in" and _fp8_able(model, _ffn_down(name), targets, done):
            out_scale = static_act_scale(act_amax[name + OUT], act_margin)
        _set_submodule(model, name, Fp8Linear_.from_linear(lin, scaling=scaling, act_scale=scale_for([name]),
                                                           fast_accum=fast_accum, out_scale=out_scale))
        swapped.append(name)
    attention_fp8_layers, e4m3_output_layers = _attention_outputs(model, fused, swapped, attention_output)
    return {"swapped": swapped, "fused_qkv": fused, "gemms": len(fused) + len(swapped) - 3 * len(fused),
            "kept": kept, "ffn_hidden_fp8": _hidden_fp8(model, swapped, ffn_gelu, Fp8Intermediate_),
            "attention_fp8": attention_fp8_layers, "attention_output_e4m3": e4m3_output_layers,
            "residual_in_gemm": _residual_in_gemm(model, swapped) if residual == "gemm" else [],
            "cublaslt": _plan_cublaslt(model, swapped, fused, cublaslt_gemms, cublaslt_autotune)}


def _check_swap(model, act_amax, scaling: str, gemms, fuse_qkv, ffn_hidden_fp8, ffn_gelu, attention_fp8, residual,
                cublaslt_gemms, cublaslt_autotune, attention_output) -> None:
    """Every combination swap_to_fp8 refuses, named before the model is touched."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, not '{scaling}'")
    if scaling != "rowwise" and not act_amax:
        raise ValueError(f"scaling '{scaling}' needs calibrated activation amax values (act_amax)")
    check_ffn_hidden(scaling, gemms, ffn_hidden_fp8, ffn_gelu)
    check_attention_fp8(scaling, gemms, fuse_qkv, attention_fp8)
    check_attention_output(scaling, gemms, fuse_qkv, attention_output, attention_fp8)
    check_residual(scaling, gemms, residual)
    check_cublaslt(scaling, gemms, cublaslt_gemms, cublaslt_autotune, ffn_hidden_fp8=ffn_hidden_fp8,
                   ffn_gelu=ffn_gelu, attention_fp8=attention_fp8, residual=residual)
    for on, names, calibrate in ((attention_fp8, qkv_names, "qkv_names"), (ffn_hidden_fp8, ffn_up_names, "ffn_up_names")):
        missing = [n for n in names(target_linears(model, gemms)) if n + OUT not in act_amax] if on else []
        if missing:
            what = "attention_fp8" if names is qkv_names else "ffn_hidden_fp8"
            raise ValueError(f"{what} needs the calibrated output amax of {missing[0]} "
                             f"(calibrate_amax(..., outputs={calibrate}(...)))")


def _attention_outputs(model, fused: list, swapped: list, attention_output: str) -> tuple[list, list]:
    """The fused attention modules whose output is written in e4m3 for an FP8 output projection:
    (those with FP8 attention, those with the e4m3-output 16-bit attention); each gets the output
    GEMM's inverse input scale (``o_inv_scale``)."""
    import torch  # the caller swaps modules of a torch model: torch is loaded

    attention_fp8_layers, e4m3_output_layers = [], []
    for attn_name in fused:
        sa = model.get_submodule(attn_name)
        out = attn_name[: -len("self")] + "output.dense"
        if sa.qkv_out_scale is not None:
            if out not in swapped:  # never reached: _fp8_able said it would be swapped
                raise ValueError(f"{attn_name} writes e4m3 Q, K, V but {out} is not an FP8 GEMM")
            attention_fp8_layers.append(attn_name)
        elif attention_output == "e4m3" and out in swapped:
            e4m3_output_layers.append(attn_name)
        else:
            continue
        dense = model.get_submodule(out)
        sa.o_inv_scale = torch.tensor(1.0 / dense.act_scale_value, dtype=torch.float32, device=dense.weight_fp8.device)
    return attention_fp8_layers, e4m3_output_layers


def _hidden_fp8(model, swapped: list, ffn_gelu: str, intermediate_cls) -> list:
    """Layers whose FFN keeps its hidden activations in e4m3 between its two FP8 GEMMs."""
    hidden_fp8 = []
    for name in swapped:
        up = model.get_submodule(name) if gemm_kind(name) == "ffn_in" else None
        down = _ffn_down(name)
        if up is None or up.out_scale_value is None or down not in swapped:
            continue
        inter = name.rsplit(".", 1)[0]  # ...intermediate, transformers' BertIntermediate
        act = model.get_submodule(inter).intermediate_act_fn
        _set_submodule(model, inter, intermediate_cls(up, act, model.get_submodule(down).act_scale_value, ffn_gelu))
        hidden_fp8.append(inter)
    return hidden_fp8


def _residual_in_gemm(model, swapped: list) -> list:
    done = []
    for name in swapped:
        if gemm_kind(name) in RESIDUAL_GEMMS:
            model.get_submodule(name).add_residual_in_gemm()
            done.append(name)
    return done


def _plan_cublaslt(model, swapped: list, fused: list, cublaslt_gemms, cublaslt_autotune: int) -> list:
    """The GEMM kinds ``cublaslt_gemms`` names run through cuBLASLt (nvmath-python); every FP8
    GEMM learns the autotune setting (its epilogue and residual GEMMs plan there too)."""
    planned = []
    kinds = parse_cublaslt_gemms(cublaslt_gemms)
    for name in swapped:
        kind, parent = gemm_kind(name), name.rsplit(".", 1)[0]
        if kind == "qkv" and parent in fused:  # one fused Fp8Linear per attention module, met at its query
            if not name.endswith(".query"):
                continue
            lin, label = model.get_submodule(parent).qkv, parent + ".qkv"
        else:
            lin, label = model.get_submodule(name), name
        if kind in kinds:
            lin.use_cublaslt(cublaslt_autotune)
            planned.append(label)
        lin.cublaslt_autotune = int(cublaslt_autotune)
    return planned


def qkv_names(names: Iterable[str]) -> list[str]:
    """The query/key/value projections among ``names``: the Linears whose outputs
    ``swap_to_fp8(attention_fp8=True)`` needs calibrated."""
    return [n for n in names if gemm_kind(n) == "qkv"]


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


# the GEMMs a residual follows
RESIDUAL_GEMMS = ("attn_out", "ffn_out")


def check_residual(scaling: str, gemms, residual: str) -> None:
    """ValueError unless the residual's place fits the rest."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual '{residual}' is not one of {', '.join(RESIDUALS)}")
    if residual == "gemm" and (scaling != "tensor" or not set(RESIDUAL_GEMMS) & set(parse_gemms(gemms))):
        raise ValueError("residual: gemm adds the residual in FP8 GEMMs with per-tensor scales: it needs scaling "
                         f"'tensor' and attn_out or ffn_out in gemms, not scaling '{scaling}' with gemms "
                         f"{','.join(parse_gemms(gemms))}")


def parse_cublaslt_gemms(value) -> tuple[str, ...]:
    """``cublaslt_gemms``: '' (none) or GEMM kinds, as ``parse_gemms``."""
    if isinstance(value, str) and not value.strip():
        return ()
    return parse_gemms(value)


def check_cublaslt(scaling: str, gemms, cublaslt_gemms, autotune: int, *, ffn_hidden_fp8: bool = False,
                   ffn_gelu: str = "exact", attention_fp8: bool = False, residual: str = "layernorm") -> None:
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
    if residual == "gemm":
        taken = [k for k in kinds if k in RESIDUAL_GEMMS]
        if taken:
            raise ValueError(f"cublaslt_gemms: {','.join(taken)} already runs through cuBLASLt as the residual GEMM "
                             "(residual: gemm); name only the others (qkv)")
    if isinstance(autotune, bool) or not isinstance(autotune, int) or autotune < 0:
        raise ValueError(f"cublaslt_autotune must be an integer >= 0 (0: the heuristic's choice), not {autotune!r}")
    if autotune > 0 and not (kinds or ffn_gelu == "epilogue" or residual == "gemm"):
        raise ValueError("cublaslt_autotune tunes the GEMMs planned through nvmath-python, and none is: name some in "
                         "cublaslt_gemms, or use ffn_gelu: epilogue or residual: gemm")


def _fp8_able(model, name: str, targets: list[str], done: set[str]) -> bool:
    """Whether swap_to_fp8's Linear loop will make ``name`` an FP8 GEMM."""
    if name not in targets or name in done:
        return False
    n, k = model.get_submodule(name).weight.shape
    return not (n % 16 or k % 16)


def _ffn_down(ffn_up: str) -> str:
    """``encoder.layer.N.intermediate.dense`` -> ``encoder.layer.N.output.dense``."""
    return ffn_up[: -len("intermediate.dense")] + "output.dense"
