"""ONNX Runtime static INT8 (QDQ) for the CPU: calibrated on real batches of the run.

Used by the onnxruntime backend's ``graph: int8-static`` (options ``int8_static:``,
``Int8StaticOptions``). What it does, in order:

1. The fp32 graph to quantize is onnxruntime's transformer-optimizer output, as for dynamic INT8,
   but by default *without the Attention fusion* (``fuse_attention: false``): the static QDQ
   quantizer has no rule for the contrib ``Attention`` op (onnxruntime.quantization.registry:
   ``QDQRegistry`` lists MatMul/Gemm, not Attention; only the dynamic ``IntegerOps`` mode turns
   Attention into QAttention), so on the fully fused graph the fused QKV projection — a quarter of
   an encoder layer's GEMM work — would stay fp32. Unfused, the Q, K and V projections are plain
   MatMuls with constant weights and are quantized like the others; SkipLayerNormalization,
   BiasGelu and EmbedLayerNormalization are still fused.
2. ``quantize_static(QuantFormat.QDQ)`` on the MatMul/Gemm nodes whose second input is a constant
   weight (the attention-score MatMuls of two activations stay fp32), minus the nodes kept fp32:
   the QA head (``exclude_head``), every weight GEMM of the encoder layers in ``keep_layers``,
   and any node named in ``exclude_nodes``. Weights per output channel (``per_channel``),
   activations per tensor with ranges from ``calibrate_method`` over ``calibration_batches`` real
   batches of the run (BackendContext.sample_batches). GEMM outputs are not quantized
   (``OpTypesToExcludeOutputQuantization``): they feed fp32 bias/LayerNorm ops, so the session
   runs each as MatMulIntegerToFloat (u8 x s8 -> fp32) rather than QLinearMatMul + Dequantize.
3. ``activation_type``/``reduce_range``: on x86 the u8 x s8 integer GEMM is the fast path; without
   VNNI it can saturate its 16-bit intermediate, which 7-bit weights (``reduce_range``) avoid, so
   ``reduce_range: auto`` is on exactly when /proc/cpuinfo shows no VNNI (onnxruntime's own
   quantize_static docstring, "Choosing parameters for CPU inference"). What the CPU has is read
   and reported, not assumed.
"""
from __future__ import annotations

import hashlib
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ...errors import ConfigError
from .onnx_export import OnnxExportError

CALIBRATE_METHODS = ("minmax", "entropy", "percentile")
QUANT_TYPES = ("uint8", "int8")
REDUCE_RANGE = ("auto", "true", "false")
WEIGHT_OPS = ("MatMul", "Gemm")
_LAYER = re.compile(r"(?:^|[/._])layers?[._/](\d+)(?:[/._]|$)")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_features(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """What this CPU has for INT8/BF16 inference, read from /proc/cpuinfo's flags (empty off Linux)."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    has = [f for f in CPU_FLAGS if f in flags]
    return {"cpu_model": model, "machine": platform.machine(), "cpu_flags": ",".join(has) or "none read",
            "vnni": "avx512_vnni" in flags or "avx_vnni" in flags, "amx_int8": "amx_int8" in flags}


@dataclass
class Int8StaticOptions:
    calibration_batches: int = 8  # real batches of the run (BackendContext.sample_batches) the ranges come from
    calibrate_method: str = "minmax"  # minmax | entropy | percentile (onnxruntime CalibrationMethod)
    percentile: float = 99.999  # percentile method only
    per_channel: bool = True  # per-output-channel weight scales
    activation_type: str = "uint8"  # uint8 (u8s8: the x86 integer GEMM's fast path) | int8
    weight_type: str = "int8"
    reduce_range: str = "auto"  # 7-bit weights: auto = on only for a CPU without VNNI
    fuse_attention: bool = False  # quantize the graph with fused Attention (its QKV GEMM then stays fp32)
    exclude_head: bool = True  # keep the task head's GEMM (QA start/end logits) in fp32
    keep_layers: str = ""  # encoder layers whose weight GEMMs stay fp32, e.g. "0,5"
    exclude_nodes: list = field(default_factory=list)  # more node names kept fp32
    quantize_outputs: bool = False  # also Q/DQ the GEMM outputs (QLinearMatMul); off: MatMulIntegerToFloat

    def __post_init__(self):
        self.reduce_range = str(self.reduce_range).lower()
        for name, value, valid in (("calibrate_method", self.calibrate_method, CALIBRATE_METHODS),
                                   ("activation_type", self.activation_type, QUANT_TYPES),
                                   ("weight_type", self.weight_type, QUANT_TYPES),
                                   ("reduce_range", self.reduce_range, REDUCE_RANGE)):
            if value not in valid:
                raise ConfigError(f"int8_static.{name} '{value}' is not one of {', '.join(valid)}")
        if self.calibration_batches < 1:
            raise ConfigError("int8_static.calibration_batches must be >= 1")
        if not 0 < self.percentile <= 100:
            raise ConfigError(f"int8_static.percentile must be in (0, 100], not {self.percentile}")
        try:
            self.layers_kept()
        except ValueError:
            raise ConfigError(f"int8_static.keep_layers must be comma-separated layer indices, "
                              f"not {self.keep_layers!r}") from None

    def layers_kept(self) -> tuple[int, ...]:
        return tuple(int(x) for x in str(self.keep_layers).split(",") if x.strip())

    def reduce_range_for(self, cpu: Mapping[str, Any]) -> bool:
        return reduce_range_on(self.reduce_range, cpu)


def reduce_range_on(setting: str, cpu: Mapping[str, Any]) -> bool:
    """Whether 7-bit weights are used: ``setting`` true | false | auto (on exactly for an x86 CPU
    without VNNI, whose u8 x s8 GEMM adds pairs of products in 16 bits and can saturate there);
    shared by the static and the dynamic INT8 graphs."""
    if setting == "auto":
        return not cpu.get("vnni", False) and cpu.get("machine", "") in ("x86_64", "AMD64", "i686")
    return setting == "true"


def layer_of(node_name: str) -> Optional[int]:
    m = _LAYER.search(node_name)
    return int(m.group(1)) if m else None


def select_nodes(model, o: Int8StaticOptions) -> tuple[list[str], dict[str, str]]:
    """(weight-GEMM nodes to quantize, {kept node: why}) of an onnx ModelProto."""
    inits = {i.name for i in model.graph.initializer}
    keep_layers = set(o.layers_kept())
    named = set(o.exclude_nodes)
    quantize, kept = [], {}
    for n in model.graph.node:
        if n.op_type not in WEIGHT_OPS or len(n.input) < 2 or n.input[1] not in inits:
            continue
        layer = layer_of(n.name)
        if n.name in named:
            kept[n.name] = "exclude_nodes"
        elif layer is None and o.exclude_head:
            kept[n.name] = "head"
        elif layer is not None and layer in keep_layers:
            kept[n.name] = f"keep_layers ({layer})"
        else:
            quantize.append(n.name)
    missing = named - {n.name for n in model.graph.node}
    if missing:
        raise ConfigError(f"int8_static.exclude_nodes names no node of the graph: {', '.join(sorted(missing))}")
    return quantize, kept


def activations_not_quantized(model, names: Sequence[str]) -> list[str]:
    """The GEMMs among ``names`` whose activation input does not come from a DequantizeLinear."""
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    wanted = set(names)
    return [n.name for n in model.graph.node
            if n.name in wanted and producer.get(n.input[0]) != "DequantizeLinear"]


def batches_digest(batches: Sequence[Mapping[str, np.ndarray]]) -> str:
    """Content hash of the calibration batches: other data, other scales, another cache entry."""
    h = hashlib.sha256()
    for b in batches:
        for n in sorted(b):
            a = np.ascontiguousarray(b[n], dtype=np.int64)
            h.update(n.encode())
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
    return h.hexdigest()[:16]


def _reader(batches: Sequence[Mapping[str, np.ndarray]], input_names: Sequence[str]):
    from onnxruntime.quantization import CalibrationDataReader

    class Batches(CalibrationDataReader):
        def __init__(self):
            self._it = iter([{n: np.ascontiguousarray(b[n], dtype=np.int64) for n in input_names} for b in batches])

        def get_next(self):
            return next(self._it, None)

    return Batches()


def quantize_static_qdq(fp32_path: Path, out_path: Path, batches: Sequence[Mapping[str, np.ndarray]],
                        o: Int8StaticOptions, cpu: Mapping[str, Any]) -> dict[str, Any]:
    """Calibrate on ``batches`` and write the QDQ model; returns what was done (for prepare_info)."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    # The documented preprocessing (quant_pre_process): symbolic shape inference knows the contrib
    # ops' output types (SkipLayerNormalization, BiasGelu...); without it the QDQ quantizer cannot
    # type their outputs and silently leaves those GEMM inputs unquantized (weights-only DQ, fp32
    # GEMM). No further optimization here: the graph is already onnxruntime's optimizer output.
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre_path = Path(out_path).with_name(Path(out_path).stem + "-pre.onnx")
    quant_pre_process(str(fp32_path), str(pre_path), skip_optimization=True, auto_merge=True,
                      guess_output_rank=True)
    fp32_path = pre_path
    model = onnx.load(str(fp32_path))
    input_names = [i.name for i in model.graph.input]
    quantize, kept = select_nodes(model, o)
    if not quantize:
        raise ConfigError("int8_static: every weight GEMM is excluded; nothing to quantize")
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[o.calibrate_method]
    qtype = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    reduce_range = o.reduce_range_for(cpu)
    extra = {
        # Shape inference knows no types for contrib-op outputs (SkipLayerNorm...): they are float.
        "DefaultTensorType": onnx.TensorProto.FLOAT,
        "WeightSymmetric": True,
        "ActivationSymmetric": o.activation_type == "int8",
    }
    if not o.quantize_outputs:
        extra["OpTypesToExcludeOutputQuantization"] = list(WEIGHT_OPS)
    if o.calibrate_method == "percentile":
        extra["CalibPercentile"] = float(o.percentile)
    quantize_static(str(fp32_path), str(out_path), _reader(batches, input_names), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=list(WEIGHT_OPS), per_channel=bool(o.per_channel),
                    reduce_range=reduce_range, activation_type=qtype[o.activation_type],
                    weight_type=qtype[o.weight_type], nodes_to_quantize=quantize, calibrate_method=method,
                    calibration_providers=["CPUExecutionProvider"], extra_options=extra)
    pre_path.unlink(missing_ok=True)
    unquantized = activations_not_quantized(onnx.load(str(out_path)), quantize)
    if unquantized:
        raise OnnxExportError(f"int8_static: the activation input of {len(unquantized)} of {len(quantize)} GEMMs "
                              f"was left fp32 (untyped tensors?), e.g. {unquantized[0]}")
    rows = int(sum(int(np.shape(b["input_ids"])[0]) for b in batches))
    tokens = int(sum(int(np.asarray(b["attention_mask"]).sum()) for b in batches))
    a, w = o.activation_type, o.weight_type
    return {
        "quantization": (f"static QDQ, {'U' if a == 'uint8' else 'S'}8{'U' if w == 'uint8' else 'S'}8 "
                         f"(activations {a} per tensor, {o.calibrate_method}; weights {w} "
                         f"{'per channel' if o.per_channel else 'per tensor'}{', 7-bit' if reduce_range else ''}), "
                         f"{len(quantize)} weight GEMMs, attention "
                         f"{'fused (QKV fp32)' if o.fuse_attention else 'unfused'}"),
        "calibration_batches": len(batches), "calibration_rows": rows, "calibration_tokens": tokens,
        "calibrate_method": o.calibrate_method, "reduce_range": reduce_range,
        "quantized_nodes": len(quantize), "kept_fp32": ";".join(f"{k} [{v}]" for k, v in kept.items()) or "none",
        "quantizer": f"onnxruntime.quantization.quantize_static {ort.__version__}",
    }


__all__ = ["CALIBRATE_METHODS", "Int8StaticOptions", "batches_digest", "cpu_features", "layer_of",
           "quantize_static_qdq", "select_nodes"]
