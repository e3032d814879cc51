"""FP8 (e4m3) encoder GEMMs through ``torch._scaled_mm``: the model surgery that swaps them in.

The e4m3 arithmetic is bertqa_bench/kernels/fp8_math.py's, the options' vocabularies and their
one check fp8_rules.py's, the FP8 modules fp8_modules.py's.

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

Attention itself (QK^T, softmax, PV) stays in 16 bits by default (SDPA on the padded path, the
packed encoder's variable-length kernel on the padding-free one), unless ``attention: fp8``
(cuDNN's FP8 attention, packed only) or ``attention_output: e4m3`` (the Triton kernel writes its
output in e4m3); embeddings, LayerNorms, the residual stream and the QA head stay fp16. Parity
class: reduced.

Measured earlier (H100 80GB HBM3, torch 2.11+cu130, BERT-base shape, batch 32 x 384): GPU time
per batch 4.55-4.60 ms against 5.46-5.53 for fp16 under the same compile + CUDA graph path;
FP8 GEMMs 1.79 ms, fp16 attn-out GEMM 0.31, attention 1.04-1.08, fused elementwise
(LayerNorm/GELU + quantize) ~1.3: after FP8, attention and the memory-bound elementwise
kernels are the main cost, not the GEMMs.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from ...kernels.fp8_math import static_act_scale
from .fp8_rules import _QKV, DEFAULT_GEMMS, GEMM_KINDS, RESIDUAL_GEMMS, check_recipe, parse_cublaslt_gemms, parse_gemms

# Names of the encoder Linear layers inside one transformer layer (HF BERT naming): encoder.layer.N.
_LAYER_PREFIX = "encoder.layer."

# --------------------------------------------------------------------------- modules

def _define_modules():
    """The module classes (fp8_modules.py, which imports torch): loaded on first use, so that
    importing the variant registry does not import torch."""
    from .fp8_modules import Fp8AddLayerNorm, Fp8Intermediate, Fp8Linear, Fp8SelfAttention

    return Fp8Linear, Fp8SelfAttention, Fp8Intermediate, Fp8AddLayerNorm


_CLASSES: Optional[tuple] = None
_CLASS_NAMES = ("Fp8Linear", "Fp8SelfAttention", "Fp8Intermediate", "Fp8AddLayerNorm")


def fp8_classes():
    """(Fp8Linear, Fp8SelfAttention, Fp8Intermediate, Fp8AddLayerNorm), created on first use."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define_modules()
    return _CLASSES


def __getattr__(name: str):
    # ``from bertqa_bench.backends.transforms.fp8_surgery import Fp8Linear`` works, without importing torch
    # when only the registry is loaded.
    if name in _CLASS_NAMES:
        return fp8_classes()[_CLASS_NAMES.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- model surgery


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


OUT = ":out"  # calibrate_amax's key suffix for a module's output (module names never hold ':')


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


def dense_names(names: Iterable[str]) -> list[str]:
    """The GEMMs a residual add + LayerNorm follows (attention output, FFN down) among ``names``:
    the Linears whose outputs ``swap_to_fp8(dense_output="e4m3")`` needs calibrated."""
    return [n for n in names if gemm_kind(n) in RESIDUAL_GEMMS]


def ffn_up_names(names: Iterable[str]) -> list[str]:
    """The FFN up-projections (``...intermediate.dense``) among ``names``: the Linears whose
    outputs ``swap_to_fp8(ffn_hidden_fp8=True)`` needs calibrated."""
    return [n for n in names if gemm_kind(n) == "ffn_in"]


def swap_to_fp8(model, act_amax: Optional[Mapping[str, float]] = None, *, scaling: str = "tensor",
                gemms=DEFAULT_GEMMS, fuse_qkv: bool = True, fast_accum: bool = False,
                act_margin: float = 2.0, keep_layers: Iterable[int] = (),
                ffn_hidden_fp8: bool = False, ffn_gelu: str = "exact",
                attention_fp8: bool = False, residual: str = "layernorm",
                cublaslt_gemms="", cublaslt_autotune: int = 0, attention_output: str = "fp16",
                layernorm: str = "inductor", cublaslt_candidates: int = 0,
                dense_output: str = "fp16") -> dict[str, Any]:
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
    GEMMs) has its algorithm autotuned per shape, among up to ``cublaslt_candidates`` algorithms
    (0: nvmath's default, 8). ``layernorm`` (LAYERNORMS): "triton" makes each
    LayerNorm an FP8 GEMM reads an ``Fp8AddLayerNorm`` (``_fuse_layernorms``). ``dense_output``
    (DENSE_OUTPUTS): "e4m3" has the FP8 GEMM before each of those LayerNorms (attention output, FFN
    down) write its output in e4m3 for it, at a scale from its calibrated output amax (``name +
    OUT``, ``dense_names``; ``Fp8Linear.write_e4m3_for_layernorm``). ``keep_layers``:
    encoder layer indices left in 16 bits. Returns what was done: ``swapped``
    (Linear names now in FP8), ``fused_qkv`` (attention modules with one fused-QKV FP8 GEMM),
    ``gemms`` (FP8 GEMMs per forward), ``kept`` (targeted Linears left alone, with why)."""
    gemms = parse_gemms(gemms)
    keep, targets = {int(i) for i in keep_layers}, target_linears(model, gemms)
    _check_swap(model, act_amax, scaling, gemms, fuse_qkv, ffn_hidden_fp8, ffn_gelu, attention_fp8,
                residual, cublaslt_gemms, (cublaslt_autotune, cublaslt_candidates), attention_output, layernorm,
                dense_output, keep, targets)
    Fp8Linear_, Fp8SelfAttention_ = fp8_classes()[:2]
    static = scaling != "rowwise"

    def scale_for(names: list[str]) -> Optional[float]:
        if not static:
            return None
        return static_act_scale(max(float(act_amax[n]) for n in names), act_margin)

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

    def make(name, lin):
        out_scale = None
        if ffn_hidden_fp8 and gemm_kind(name) == "ffn_in" and _fp8_able(model, _ffn_down(name), targets, done):
            out_scale = static_act_scale(act_amax[name + OUT], act_margin)
        return Fp8Linear_.from_linear(lin, scaling=scaling, act_scale=scale_for([name]), fast_accum=fast_accum,
                                      out_scale=out_scale)

    swapped += _swap_linears(model, [n for n in targets if n not in done], kept, make)
    return _finish_swap(model, fused, swapped, kept, ffn_gelu, attention_output, residual, cublaslt_gemms,
                        (cublaslt_autotune, cublaslt_candidates), layernorm,
                        _output_scales(act_amax, dense_names(swapped), act_margin) if dense_output == "e4m3" else None)


def _output_scales(act_amax: Mapping[str, float], names: list, act_margin: float) -> dict:
    """name -> the static scale of that GEMM's e4m3 output, from its calibrated output amax."""
    return {n: static_act_scale(float(act_amax[n + OUT]), act_margin) for n in names}


def _swap_linears(model, names: list, kept: dict, make) -> list:
    """Each Linear of ``names`` replaced by ``make(name, linear)``, but those whose shape an FP8 GEMM
    cannot take (recorded in ``kept`` with why); returns the names swapped."""
    swapped = []
    for name in names:
        lin = model.get_submodule(name)
        n, k = lin.weight.shape
        if n % 16 or k % 16:
            kept[name] = f"{k}->{n} not a multiple of 16"
            continue
        _set_submodule(model, name, make(name, lin))
        swapped.append(name)
    return swapped


def _finish_swap(model, fused: list, swapped: list, kept: dict, ffn_gelu: str, attention_output: str, residual: str,
                 cublaslt_gemms, cublaslt_tuning: tuple[int, int], layernorm: str,
                 dense_scales: Optional[Mapping[str, float]]) -> dict[str, Any]:
    """What follows the GEMM swaps (the e4m3 paths between them, the cuBLASLt plans, the fused
    LayerNorms and the e4m3 outputs before them), and swap_to_fp8's account of what was done.
    ``dense_scales`` None: dense_output fp16; a dict: e4m3, which must switch some GEMM."""
    attention_fp8_layers, e4m3_output_layers = _attention_outputs(model, fused, swapped, attention_output)
    done = {"swapped": swapped, "fused_qkv": fused, "gemms": len(fused) + len(swapped) - 3 * len(fused),
            "kept": kept, "ffn_hidden_fp8": _hidden_fp8(model, swapped, ffn_gelu, fp8_classes()[2]),
            "attention_fp8": attention_fp8_layers, "attention_output_e4m3": e4m3_output_layers,
            "residual_in_gemm": _residual_in_gemm(model, swapped) if residual == "gemm" else [],
            "cublaslt": _plan_cublaslt(model, swapped, fused, cublaslt_gemms, *cublaslt_tuning),
            "fused_layernorms": _fuse_layernorms(model) if layernorm == "triton" else []}
    done["dense_output_e4m3"] = _dense_outputs_e4m3(model, done["fused_layernorms"], dense_scales or {})
    if dense_scales is not None and not done["dense_output_e4m3"]:
        # the recipe's check asks for an FP8 GEMM pair; here every such pair was kept in 16 bits
        # (keep_layers, shapes): a row named e4m3-dense that switched nothing would time the base row
        shown = [f"{n} ({kept[n]})" for n in sorted(kept)[:2]] + ([f"{len(kept) - 2} more"] if len(kept) > 2 else [])
        raise ValueError("dense_output: e4m3 switched no GEMM: no FP8 attention-output or FFN-down GEMM feeds a "
                         f"fused LayerNorm here (kept: {', '.join(shown) or 'none'})")
    return done


def _dense_outputs_e4m3(model, fused_norms: list, scales: Mapping[str, float]) -> list:
    """The FP8 GEMM before each fused LayerNorm (``...output.LayerNorm`` -> ``...output.dense``)
    that has a calibrated output scale writes e4m3 at it for that LayerNorm's kernel. A producer
    left in 16 bits (a kept layer before an FP8 one) stays as it is."""
    done = []
    for norm_name in fused_norms:
        producer = norm_name[: -len("LayerNorm")] + "dense"
        if producer in scales and isinstance(model.get_submodule(producer), fp8_classes()[0]):
            model.get_submodule(producer).write_e4m3_for_layernorm(scales[producer])
            done.append(producer)
    return done


def _check_swap(model, act_amax, scaling: str, gemms, fuse_qkv, ffn_hidden_fp8, ffn_gelu, attention_fp8, residual,
                cublaslt_gemms, cublaslt_tuning, attention_output, layernorm, dense_output, keep_layers,
                targets: list) -> None:
    """Every combination swap_to_fp8 refuses, named before the model is touched (``targets``: the
    Linears of ``gemms``' kinds, target_linears)."""
    # the recipe's own rules, as check_fp8 applies them to a suite's options (fp8_rules.py)
    check_recipe(scaling, gemms, fuse_qkv=fuse_qkv, ffn_hidden_fp8=ffn_hidden_fp8, ffn_gelu=ffn_gelu,
                 attention_fp8=attention_fp8, attention_output=attention_output, residual=residual,
                 cublaslt_gemms=cublaslt_gemms, cublaslt_autotune=cublaslt_tuning[0],
                 cublaslt_candidates=cublaslt_tuning[1], layernorm=layernorm, dense_output=dense_output)
    if scaling != "rowwise" and not act_amax:
        raise ValueError(f"scaling '{scaling}' needs calibrated activation amax values (act_amax)")
    if dense_output == "e4m3":
        _check_fp16_dense(model, targets)
        layers = {layer_index(n) for n in targets}
        if layers and layers <= set(keep_layers):
            raise ValueError("dense_output: e4m3 would switch no GEMM: keep_layers keeps every layer in 16 bits")
    for what, on, names in (("attention_fp8", attention_fp8, qkv_names), ("ffn_hidden_fp8", ffn_hidden_fp8, ffn_up_names),
                            ("dense_output: e4m3", dense_output == "e4m3", dense_names)):
        missing = [n for n in names(targets) if n + OUT not in act_amax] if on else []
        if missing:
            raise ValueError(f"{what} needs the calibrated output amax of {missing[0]} "
                             f"(calibrate_amax(..., outputs={names.__name__}(...)))")


def _check_fp16_dense(model, targets: list) -> None:
    """dense_output: e4m3 runs cuBLASLt's e4m3-output kernels, which take the bias in C's type,
    fp16, where a bf16 model's residual stream would meet it: refuse a bf16 model before it is
    touched (Fp8Linear.write_e4m3_for_layernorm refuses it too, but only after the swap). An fp32
    model is the CPU's formula path, as the other FP8 GEMMs' are."""
    import torch  # the caller swaps modules of a torch model: torch is loaded

    bf16 = [n for n in dense_names(targets)
            if model.get_submodule(n).weight.dtype == torch.bfloat16]
    if bf16:
        raise ValueError("dense_output: e4m3 runs in fp16 (cuBLASLt's e4m3-output kernels take the bias in fp16): "
                         f"{bf16[0]} is bfloat16; convert the model with .half() first")


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


def _e4m3_input_scale(module) -> Optional[float]:
    """The static per-tensor input scale of an FP8 GEMM that takes an e4m3 input as it is (the
    fused QKV's, an FFN-up's: Fp8Linear, or inside Fp8SelfAttention / Fp8Intermediate); None
    for anything else (a 16-bit Linear, a kept layer, dynamic or per-row scales)."""
    lin = module
    for inner in ("qkv", "dense"):
        lin = getattr(lin, inner, lin)
    if not isinstance(lin, fp8_classes()[0]) or lin.scaling != "tensor":
        return None
    return lin.act_scale_value


def _fuse_layernorms(model) -> list:
    """Each residual + LayerNorm whose output an FP8 GEMM reads (the attention's feeds the FFN-up,
    the FFN's the next layer's fused QKV) becomes an ``Fp8AddLayerNorm`` writing that GEMM's e4m3
    input at its scale; the last layer's, which the QA head reads, stays as it is."""
    add_norm = fp8_classes()[3]
    blocks = [n for _, n in sorted((layer_index(n), n) for n, _ in model.named_modules()
                                   if n.endswith(f"{_LAYER_PREFIX}{layer_index(n)}"))]  # encoder.layer.N itself
    done = []
    for here, after in zip(blocks, blocks[1:] + [None]):
        consumers = [(f"{here}.attention.output.LayerNorm", f"{here}.intermediate")]
        if after is not None:
            consumers.append((f"{here}.output.LayerNorm", f"{after}.attention.self"))
        for norm_name, consumer in consumers:
            try:
                norm, scale = model.get_submodule(norm_name), _e4m3_input_scale(model.get_submodule(consumer))
            except AttributeError:  # not a BERT layer's names
                continue
            if scale is not None:
                _set_submodule(model, norm_name, add_norm(norm, scale))
                done.append(norm_name)
    return done


def _residual_in_gemm(model, swapped: list) -> list:
    done = []
    for name in swapped:
        if gemm_kind(name) in RESIDUAL_GEMMS:
            model.get_submodule(name).add_residual_in_gemm()
            done.append(name)
    return done


def _plan_cublaslt(model, swapped: list, fused: list, cublaslt_gemms, cublaslt_autotune: int,
                   cublaslt_candidates: int = 0) -> list:
    """The GEMM kinds ``cublaslt_gemms`` names run through cuBLASLt (nvmath-python); every FP8
    GEMM learns the autotune settings (its epilogue and residual GEMMs plan there too)."""
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
        lin.cublaslt_autotune, lin.cublaslt_candidates = int(cublaslt_autotune), int(cublaslt_candidates)
    return planned


def qkv_names(names: Iterable[str]) -> list[str]:
    """The query/key/value projections among ``names``: the Linears whose outputs
    ``swap_to_fp8(attention_fp8=True)`` needs calibrated."""
    return [n for n in names if gemm_kind(n) == "qkv"]


def _fp8_able(model, name: str, targets: list[str], done: set[str]) -> bool:
    """Whether swap_to_fp8's Linear loop will make ``name`` an FP8 GEMM."""
    if name not in targets or name in done:
        return False
    n, k = model.get_submodule(name).weight.shape
    return not (n % 16 or k % 16)


def _ffn_down(ffn_up: str) -> str:
    """``encoder.layer.N.intermediate.dense`` -> ``encoder.layer.N.output.dense``."""
    return ffn_up[: -len("intermediate.dense")] + "output.dense"
