"""OpenVINO on the CPU: fp32, bf16 and static INT8 (NNCF post-training quantization).

Why it is here (the CPU suite's fastest rows): on the project's 2-core AMD EPYC (AVX-512 VNNI and
BF16, no AMX), one 16 x 128 batch of the default model, interleaved in one process
(2026-11-27): PyTorch eager fp32 397 ms, ONNX Runtime dynamic INT8 156 ms (2.54x), OpenVINO bf16
134 ms (2.97x), OpenVINO INT8 93 ms (4.28x). ONNX Runtime's INT8 leaves the activations' min/max
pass per GEMM and its attention in fp32 (cpu-int8-static.md); OpenVINO's CPU plugin runs the
whole quantized encoder in its own fused int8 kernels.

Pipeline (cached under ``artifacts_dir/openvino``, keyed by what it depends on):

1. The fp32 ONNX export of ``onnx_export.export_onnx`` (eager attention, dynamic batch and
   sequence axes, checked against PyTorch), read by ``openvino.Core.read_model``.
2. ``int8``: ``nncf.quantize`` with ``ModelType.TRANSFORMER`` (SmoothQuant on the GEMM inputs,
   softmax/LayerNorm/GELU kept in floating point, fast bias correction), its activation ranges
   from ``calibration_batches`` real batches of the run (BackendContext.sample_batches); the QA
   head's GEMM stays fp32 (``exclude_head``). Saved as OpenVINO IR (xml + bin).
3. ``compile_model(..., "CPU")`` with ``INFERENCE_PRECISION_HINT`` f32 or bf16 (set both ways:
   OpenVINO's CPU plugin picks bf16 by itself on CPUs with native BF16, so fp32 must say so), the
   thread count of torch (the reference's cores) and the LATENCY hint (one stream: the runner
   calls predict one batch at a time). The precision the compiled model really runs is read back;
   a bf16 request the CPU cannot honour is refused, not reported as bf16.
4. The compiled model is checked against PyTorch at the export's shapes: fp32 within 1e-3 (or
   prepare fails), bf16 and int8 measured only (``validation_max_abs_diff``); the run's answers
   are what parity judges. Every shape of the run is run once in prepare.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ...errors import BackendUnavailableError, ConfigError, MissingDependencyError, import_optional
from ...io import atomic_path, atomic_write_json
from ..base import Backend, BackendContext, batch_at_shape
from .onnx_export import FP32_ATOL, cache_key, check_against_reference, export_onnx
from .ort_static import batches_digest, cpu_features

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "int8")
PRESETS = ("performance", "mixed")  # nncf.QuantizationPreset: symmetric / asymmetric activations


def _import_openvino():
    return import_optional("openvino", "the OpenVINO backend")


def _import_nncf():
    return import_optional("nncf", "the openvino int8 backend (post-training quantization)")


@dataclass
class OvInt8Options:
    calibration_batches: int = 8  # real batches of the run the activation ranges come from
    preset: str = "mixed"  # mixed: asymmetric activations (after GELU, softmax) | performance: symmetric
    smooth_quant: bool = True  # ModelType.TRANSFORMER's SmoothQuant (outlier channels moved into the weights)
    exclude_head: bool = True  # keep the task head's GEMM (QA start/end logits) in fp32

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ConfigError(f"openvino option int8.preset '{self.preset}' is not one of {', '.join(PRESETS)}")
        if self.calibration_batches < 1:
            raise ConfigError("openvino option int8.calibration_batches must be >= 1")


@dataclass
class OvOptions:
    precision: str = "fp32"  # fp32 | bf16 (CPU inference precision) | int8 (NNCF static INT8, fp32 elsewhere)
    num_threads: Optional[int] = None  # default: torch's thread count (the reference's cores)
    performance_hint: str = "LATENCY"  # one stream, all threads on one batch (the runner's call pattern)
    # ENABLE_CPU_PINNING. OpenVINO's CPU plugin binds its threads to cores by default on Linux. On
    # a shared 2-vCPU VM a bound thread cannot move off a core the hypervisor or this bench's own
    # processes take for a while, and the batch waits for it: interleaved with eager FP32 in one
    # run (4 rounds), the pinned row had a pass 40% slower than its others and an interval of
    # +-44%, the unpinned one none and +-15%, at the same median (26.3 and 26.4 s a pass). Off by
    # default; None leaves OpenVINO's own default. What is in force is read back into prepare_info.
    cpu_pinning: Optional[bool] = False
    int8: Optional[OvInt8Options] = None  # int8 only: calibration and what stays fp32
    validate_atol: Optional[float] = None  # default: 1e-3 fp32, measure only for bf16 / int8

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ConfigError(f"openvino option precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        if self.performance_hint not in ("LATENCY", "THROUGHPUT"):
            raise ConfigError(f"openvino option performance_hint '{self.performance_hint}' is not one of "
                              "LATENCY, THROUGHPUT")
        if self.precision == "int8" and self.int8 is None:
            self.int8 = OvInt8Options()
        elif self.precision != "int8" and self.int8 is not None:
            raise ConfigError(f"openvino option int8 needs precision: int8 (precision is '{self.precision}')")


def _head_nodes(model) -> list[str]:
    """The names of the task head's GEMM nodes: the MatMuls feeding the model's outputs through
    at most a few reshapes/adds/splits (BertForQuestionAnswering's qa_outputs Linear)."""
    names, seen = [], set()
    stack = [(r, 0) for r in model.get_results()]
    while stack:
        node, depth = stack.pop()
        if node.get_friendly_name() in seen or depth > 8:
            continue
        seen.add(node.get_friendly_name())
        if node.get_type_name() == "MatMul":
            names.append(node.get_friendly_name())
            continue
        stack += [(i.get_source_output().get_node(), depth + 1) for i in node.inputs()]
    return names


def _type_name(t) -> str:
    """An OpenVINO element type (or its string) as "f32", "bf16", ..."""
    return t.get_type_name() if hasattr(t, "get_type_name") else str(t).lower()


class OpenVinoBackend(Backend):
    Options = OvOptions

    @classmethod
    def precision_of(cls, o: OvOptions) -> str:
        return o.precision

    def __init__(self, variant):
        super().__init__(variant)
        self.compiled = None
        self._request = None

    @classmethod
    def unavailable_reason(cls, variant) -> Optional[str]:
        if variant.device != "cpu":
            return "the openvino backend runs on the CPU only (device: cpu)"
        try:
            _import_openvino()
            if variant.options.precision == "int8":
                _import_nncf()
        except MissingDependencyError as e:
            return str(e)
        return None

    # --- artifacts -----------------------------------------------------------------------
    def _int8_ir(self, ctx: BackendContext, onnx_path: Path, export_key: str) -> tuple[Path, dict]:
        """NNCF's static INT8 model as OpenVINO IR, cached by the export, the options, the
        calibration batches and the library versions."""
        ov, nncf = _import_openvino(), _import_nncf()
        s: OvInt8Options = self.options.int8
        calib = [{k: np.ascontiguousarray(v, dtype=np.int64) for k, v in b.items()}
                 for b in ctx.sample_batches[:s.calibration_batches]]
        key = cache_key(export_key, dataclasses.asdict(s), batches_digest(calib), ov.__version__, nncf.__version__)
        out_dir = Path(ctx.artifacts_dir) / "openvino"
        out_dir.mkdir(parents=True, exist_ok=True)
        xml = out_dir / f"model-int8-{key}.xml"
        meta_path = xml.with_suffix(".json")
        if xml.exists() and xml.with_suffix(".bin").exists() and meta_path.exists():
            return xml, {**json.loads(meta_path.read_text()), "ir_cache_hit": True}
        core = ov.Core()
        model = core.read_model(str(onnx_path))
        inputs = [i.get_any_name() for i in model.inputs]
        data = nncf.Dataset([{n: b[n] for n in inputs} for b in calib])
        head = _head_nodes(model) if s.exclude_head else []
        t0 = time.perf_counter()
        quantized = nncf.quantize(
            model, data, preset=getattr(nncf.QuantizationPreset, s.preset.upper()),
            model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calib),  # dataset items: whole batches
            ignored_scope=nncf.IgnoredScope(names=head) if head else None,
            advanced_parameters=None if s.smooth_quant else nncf.AdvancedQuantizationParameters(
                smooth_quant_alphas=nncf.AdvancedSmoothQuantParameters(matmul=-1)))  # -1: off
        quantize_s = time.perf_counter() - t0
        fq = sum(1 for op in quantized.get_ops() if op.get_type_name() == "FakeQuantize")
        meta = {"quantizer": f"nncf {nncf.__version__} quantize (ModelType.TRANSFORMER, preset {s.preset}, "
                             f"smooth_quant {s.smooth_quant})",
                "calibration_batches": len(calib), "calibration_rows": sum(len(b["input_ids"]) for b in calib),
                "calibration_tokens": int(sum(int(np.asarray(b["attention_mask"]).sum()) for b in calib)),
                "fake_quantize_ops": fq, "kept_fp32": ",".join(head) or "none", "quantize_s": round(quantize_s, 2)}
        # xml and bin are written together into a scratch name, then moved: a killed run leaves no half IR
        with atomic_path(xml, suffix=".xml") as tmp:
            ov.save_model(quantized, str(tmp), compress_to_fp16=False)
            Path(tmp).with_suffix(".bin").replace(xml.with_suffix(".bin"))
        atomic_write_json(meta_path, meta)
        return xml, {**meta, "ir_cache_hit": False}

    # --- prepare / predict ---------------------------------------------------------------
    def prepare(self, ctx: BackendContext) -> None:
        import torch

        why = self.unavailable_reason(self.variant)
        if why:
            raise BackendUnavailableError(f"{self.name}: {why}")
        ov = _import_openvino()
        o: OvOptions = self.options
        self.output_names = tuple(ctx.output_names)
        export = export_onnx(ctx.model_dir, ctx.task, ctx.artifacts_dir, ctx.output_names, ctx.sample_batch,
                             max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len, shapes=ctx.shapes)
        meta: dict[str, Any] = {}
        path = export.path
        if o.precision == "int8":
            path, meta = self._int8_ir(ctx, export.path, export.key)
        core = ov.Core()
        threads = int(o.num_threads or torch.get_num_threads())
        hint = "bf16" if o.precision == "bf16" else "f32"  # int8: the non-quantized ops in fp32
        config = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads,
                  "PERFORMANCE_HINT": o.performance_hint}
        if o.cpu_pinning is not None:
            config["ENABLE_CPU_PINNING"] = bool(o.cpu_pinning)
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
        ran = _type_name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        if o.precision == "bf16" and ran != "bf16":
            raise BackendUnavailableError(f"{self.name}: OpenVINO compiled the model in {ran}, not bf16: this CPU has "
                                          "no native BF16 (avx512_bf16 or AMX)")
        self._request = self.compiled.create_infer_request()
        self._input_names = [i.get_any_name() for i in self.compiled.inputs]
        self._outputs = {n: self.compiled.output(n) for n in self.output_names}
        cpu = cpu_features()
        self.prepare_info = {
            **export.info(), "device": "cpu", "openvino": ov.__version__, "model_file": Path(path).name,
            "inference_precision": ran, "num_threads": threads, "performance_hint": o.performance_hint,
            "cpu_model": cpu["cpu_model"], "cpu_flags": cpu["cpu_flags"], "cpu_vnni": cpu["vnni"],
            **_threading(self.compiled), **meta}
        atol = o.validate_atol if o.validate_atol is not None else (FP32_ATOL if o.precision == "fp32" else None)
        diffs = check_against_reference(self.predict, export.batches, export.references, atol,
                                        f"{self.name} ({Path(path).name})")
        self.prepare_info["validation_max_abs_diff"] = max(diffs.values(), default=0.0)
        for b, s in ctx.shapes:  # every shape once: the plugin builds its kernels per shape here, not while timing
            self.predict(batch_at_shape(ctx.sample_batch, b, s))

    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {n: np.ascontiguousarray(batch[n], dtype=np.int64) for n in self._input_names}
        self._request.infer(feed)
        # copies: the request's output tensors are reused by the next infer
        return {n: np.array(self._request.get_tensor(p).data, dtype=np.float32) for n, p in self._outputs.items()}

    def close(self) -> None:
        self._request = None
        self.compiled = None


def _threading(compiled) -> dict:
    """What the compiled model's threading is, as OpenVINO reports it (pinning, streams, threads)."""
    out = {}
    for key, prop in (("cpu_pinning", "ENABLE_CPU_PINNING"), ("streams", "NUM_STREAMS"),
                      ("ov_threads", "INFERENCE_NUM_THREADS"), ("hyper_threading", "ENABLE_HYPER_THREADING")):
        try:
            out[key] = str(compiled.get_property(prop))
        except Exception:  # noqa: BLE001 - an older plugin without the property: not reported
            pass
    return out


__all__ = ["OpenVinoBackend", "OvOptions", "OvInt8Options", "PRECISIONS"]
