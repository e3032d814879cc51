"""The PyTorch backends' model builder: load the saved model with the task's head in the weights
dtype and attention implementation, move it to the device; with ``fp8:`` / ``int8:`` / ``torchao:``
calibrate on real batches of the run and swap the encoder GEMMs (``fp8_surgery.py``,
``int8_dynamic.py``); with ``packed:`` swap in the padding-free encoder (``packed_encoder.py``). The
executor that runs the result is ``torch_backend.TorchBackend``."""
from __future__ import annotations

import time

import numpy as np

from ..errors import BackendUnavailableError
from .base import INPUT_NAMES, BackendContext
from .torch_options import Fp8Options, Int8Options, TorchaoOptions, TorchOptions, parse_layers, torchao_targets
from .transforms.fp8_rules import parse_cublaslt_gemms, parse_gemms
from .transforms.fp8_surgery import calibrate_amax, dense_names, ffn_up_names, qkv_names, swap_to_fp8, target_linears
from .transforms.int8_dynamic import swap_to_int8
from .transforms.layer_sensitivity import choose_kept_layers, layer_sensitivity, n_encoder_layers


def gelu_info(gelu: str, module) -> str:
    """What computes the FFN's GELU between e4m3 GEMMs (prepare_info's fp8_ffn_gelu)."""
    if gelu == "exact":
        return "exact (the model's own GELU, fused by Inductor)"
    if gelu == "epilogue":
        from ..kernels.cublaslt_epilogues import implementation as epilogue

        return f"tanh form, {epilogue(next(module.parameters()).is_cuda)}"
    from ..kernels.gelu_fp8 import implementation

    return f"tanh form, {implementation(next(module.parameters()).is_cuda)}"


def layernorm_info(layernorm: str, module, fused: int) -> str:
    """What computes the residual + LayerNorm + quantize before the FP8 GEMMs (prepare_info's fp8_layernorm)."""
    if layernorm != "triton":
        return "the LayerNorm, then the GEMM's quantize (fused by torch.compile)"
    from ..kernels.add_layernorm_fp8 import implementation

    return (f"one pass writing the residual and its e4m3 copy before {fused} FP8 GEMMs: "
            f"{implementation(next(module.parameters()).is_cuda)}")


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def build_model(o: TorchOptions, ctx: BackendContext, device: str, name: str):
    """The saved model with the task's head, in the options' dtype and attention, on ``device``;
    quantized (INT8, FP8, torchao) and packed as the options say. Returns (module, prepare info)."""
    import torch

    from ..model.modeling import load_inference_module

    module = load_inference_module(ctx.model_dir, ctx.task, attn_implementation=o.attn_implementation,
                                   dtype=torch_dtype(o.weights)).to(device).eval()
    info: dict = {}
    if o.head_first:  # before calibration and the sensitivity sweep, which a refusal would waste
        from .transforms.packed_encoder import head_first_reason

        why = head_first_reason(module.model)
        if why:
            raise BackendUnavailableError(f"{name}: {why}")
    as_tensors = lambda bs: [tuple(torch.from_numpy(np.ascontiguousarray(b[n], dtype=np.int64))  # noqa: E731
                                   .to(device) for n in INPUT_NAMES) for b in bs]
    # Quantize first, on the padded model (calibration and the sensitivity sweep run it), then
    # pack: the padding-free encoder calls the swapped Linears as they are.
    if o.int8 is not None:
        info = quantize_int8(module, o.int8, as_tensors(ctx.sample_batches[:o.int8.calibration_batches]))
    elif o.fp8 is not None:
        check_e4m3_epilogues(name, o.fp8, device)  # before calibration, which a refusal would waste
        info = calibrate_and_swap_fp8(module, o.fp8, as_tensors(ctx.sample_batches[:o.fp8.calibration_batches]))
    elif o.torchao is not None:
        info = quantize_torchao(module, o.torchao)
    if o.packed:
        from .transforms.packed_encoder import pack_model

        pack_model(module.model, head_first=o.head_first, attention=o.packed_attention,
                   fp8_pv=o.fp8.attention_pv if o.fp8 is not None else "e4m3")
        from .transforms.packed_encoder import encoder_of

        info.update(packed=True, attention_kernel=encoder_of(module.model).kernel_name, head_first=o.head_first)
    return module, info

def check_e4m3_epilogues(name: str, f: Fp8Options, device: str) -> None:
    """BackendUnavailableError where a cuBLASLt epilogue the recipe writes e4m3 through (the GELU
    epilogue, the e4m3 output before the LayerNorms) writes NaN rather than +-448 past the range on
    this GPU: an e4m3 output cannot be clamped after the kernel wrote it."""
    if device != "cuda":
        return
    from ..kernels.cublaslt_epilogues import epilogue_saturates

    for on, epilog, instead in ((f.ffn_gelu == "epilogue", "GELU_BIAS", "ffn_gelu: tanh"),
                                (f.dense_output == "e4m3", "BIAS", "dense_output: fp16")):
        if on and not epilogue_saturates(device, epilog):
            raise BackendUnavailableError(
                f"{name}: cuBLASLt's {epilog} epilogue on this GPU writes NaN, not +-448, for e4m3 results past the "
                f"range, and an e4m3 output cannot be clamped after the kernel wrote it ({instead})")


def sensitivity_sweep(module, batches, quantize_layer, keep: int) -> tuple[tuple[int, ...], dict]:
    if keep <= 0:
        return (), {}
    t0 = time.perf_counter()
    scores = layer_sensitivity(module, batches, quantize_layer)
    kept = choose_kept_layers(scores, keep)
    return kept, {"sensitivity_max_abs_logit_shift": ";".join(f"{l}:{v:.3g}" for l, v in scores),
                  "sensitivity_kept": ",".join(map(str, kept)), "sensitivity_s": round(time.perf_counter() - t0, 2)}

def quantize_int8(module, f: Int8Options, batches) -> dict:
    n = n_encoder_layers(module)
    kept, info = sensitivity_sweep(module, batches, lambda m, layer: swap_to_int8(
        m, gemms=f.gemms, keep_layers=[i for i in range(n) if i != layer]), f.sensitivity_keep)
    keep = sorted(set(f.layers_kept()) | set(kept))
    done = swap_to_int8(module, gemms=f.gemms, keep_layers=keep)
    return {**info, "int8_scheme": "W8A8 dynamic: per-channel weights, per-token activations, torch._int_mm",
            "int8_gemm_kinds": ",".join(parse_gemms(f.gemms)), "int8_linears": len(done["swapped"]),
            "int8_keep_layers": ",".join(map(str, keep)) or "none"}

def quantize_torchao(module, t: TorchaoOptions) -> dict:
    """torchao's FP8 swapped into the same encoder Linears as the suite's own FP8 path (the
    QA head and the kept layers stay 16-bit), before any compile."""
    import torchao
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    names = torchao_targets(module, t)
    keep = set(parse_layers(t.keep_layers))
    gran = PerRow() if t.granularity == "row" else PerTensor()
    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=gran),
              filter_fn=lambda m, fqn: fqn in names)
    return {"torchao": torchao.__version__, "fp8_scheme": f"torchao Float8DynamicActivationFloat8WeightConfig "
            f"({'per-token x per-channel' if t.granularity == 'row' else 'per-tensor'} dynamic scales)",
            "fp8_gemm_kinds": ",".join(parse_gemms(t.gemms)), "fp8_linears": len(names),
            "fp8_keep_layers": ",".join(map(str, sorted(keep))) or "none"}


def calibrate_and_swap_fp8(module, f: Fp8Options, batches) -> dict:
    """Calibrate the activation ranges on ``batches``, sweep the layers' sensitivity (``f.sensitivity_keep``)
    and swap the encoder GEMMs for FP8 ones in place; returns what was done for the prepare info."""
    gemms = parse_gemms(f.gemms)
    targets = target_linears(module, gemms)
    amax, t0 = None, time.perf_counter()
    if f.scaling != "rowwise":
        outputs = ((ffn_up_names(targets) if f.ffn_hidden_fp8 else []) + (qkv_names(targets) if f.attention == "fp8" else [])
                   + (dense_names(targets) if f.dense_output == "e4m3" else []))
        amax = calibrate_amax(module, batches, targets, outputs)
    calib_s = time.perf_counter() - t0
    n = n_encoder_layers(module)

    def swap(m, keep):
        return swap_to_fp8(m, amax, scaling=f.scaling, gemms=gemms, fuse_qkv=f.fuse_qkv, fast_accum=f.fast_accum,
                           act_margin=f.act_margin, keep_layers=keep, ffn_hidden_fp8=f.ffn_hidden_fp8,
                           ffn_gelu=f.ffn_gelu, attention_fp8=f.attention == "fp8", residual=f.residual,
                           cublaslt_gemms=f.cublaslt_gemms, cublaslt_autotune=f.cublaslt_autotune,
                           attention_output=f.attention_output, layernorm=f.layernorm,
                           cublaslt_candidates=f.cublaslt_candidates, dense_output=f.dense_output)

    kept, info = sensitivity_sweep(module, batches, lambda m, layer: swap(m, [i for i in range(n) if i != layer]),
                             f.sensitivity_keep)
    keep = sorted(set(f.layers_kept()) | set(kept))
    done = swap(module, keep)
    info.update({
        "fp8_scaling": f.scaling, "fp8_gemm_kinds": ",".join(gemms),
        "fp8_weight_scale": "per-tensor" if f.scaling == "tensor" else "per-output-channel",
        "fp8_act_scale": "dynamic per-token" if f.scaling == "rowwise" else "static per-tensor (calibrated)",
        "fp8_linears": len(done["swapped"]), "fp8_gemms_per_forward": done["gemms"],
        "fp8_fused_qkv": bool(done["fused_qkv"]), "fp8_fast_accum": f.fast_accum,
        "fp8_keep_layers": ",".join(map(str, keep)) or "none", "fp8_kept_linears": len(done["kept"]),
        "fp8_ffn_hidden": f"e4m3 in {len(done['ffn_hidden_fp8'])} layers" if f.ffn_hidden_fp8 else "16-bit",
        "fp8_ffn_gelu": gelu_info(f.ffn_gelu, module),
        "fp8_layernorm": layernorm_info(f.layernorm, module, len(done["fused_layernorms"])),
        "fp8_dense_output": (f"e4m3 at a calibrated scale for the LayerNorm kernel, {len(done['dense_output_e4m3'])} "
                             "GEMMs (cuBLASLt BIAS epilogue, nvmath-python)" if f.dense_output == "e4m3" else "16-bit"),
        "fp8_residual": (f"added in {len(done['residual_in_gemm'])} GEMMs (cuBLASLt C operand, nvmath-python)"
                         if f.residual == "gemm" else "added in the LayerNorm pass"),
        "fp8_cublaslt": (f"{len(done['cublaslt'])} GEMMs ({','.join(parse_cublaslt_gemms(f.cublaslt_gemms))}) through "
                         "cuBLASLt planned by nvmath-python" if done["cublaslt"] else "none: torch._scaled_mm"),
        "fp8_cublaslt_algorithm": (f"autotuned per shape ({f.cublaslt_autotune} timings of each of up to "
                                   f"{f.cublaslt_candidates or 8} candidates)" if f.cublaslt_autotune
                                   else "cuBLASLt's heuristic"),
        "fp8_attention": ((f"e4m3 Q, K, V, probabilities and output in {len(done['attention_fp8'])} layers"
                           if f.attention_pv == "e4m3" else
                           f"e4m3 Q, K, V and output, probabilities in fp16, in {len(done['attention_fp8'])} layers")
                          + " (the packed encoder's FP8 attention kernel)" if f.attention == "fp8" else "16-bit"),
        "fp8_attention_output": (f"e4m3 at the output GEMM's input scale, written by the attention kernel, in "
                                 f"{len(done['attention_output_e4m3'])} layers" if f.attention_output == "e4m3"
                                 else "e4m3 only with attention: fp8" if f.attention == "fp8"
                                 else "16-bit (quantized by the output GEMM)" if "attn_out" in gemms else "16-bit"),
        "fp8_not_fp8": "embeddings, layernorms, "
                       + ("" if f.attention == "fp8" else "attention softmax/PV (SDPA), ") + "qa head"
                       + ("" if "attn_out" in gemms else ", attention output projection"),
    })
    if amax is not None:
        vals = [v for k, v in amax.items() if k in targets]  # the GEMM inputs' ranges
        info.update(calibration_batches=len(batches), calibration_rows=int(sum(int(b[0].shape[0]) for b in batches)),
                    act_margin=f.act_margin, calibration_s=round(calib_s, 3),
                    act_amax_min=round(min(vals), 4), act_amax_max=round(max(vals), 4))
    return info
