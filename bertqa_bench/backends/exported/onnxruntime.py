"""ONNX Runtime backends: fused fp32 and dynamic-int8 on CPU, fp32/fp16 (optionally CUDA graphs) on CUDA.

Pipeline (each step cached under ``artifacts_dir/onnx``, keyed by what it depends on):

1. ``onnx_export.export_onnx``: the fp32 eager-attention model exported with dynamic batch and
   sequence axes and checked against PyTorch at two shapes (see that module for why).
2. ``onnxruntime.transformers.optimizer.optimize_model(model_type="bert")``: fuses attention,
   skip-layer-norm, bias-GELU and the embedding layer norm into onnxruntime's contrib kernels.
   The fused-operator counts go into prepare_info; with the TorchScript export the optimizer
   fuses one Attention per layer (2/2 on the test model), with the dynamo export none.
3. CUDA fp16: ``convert_float_to_float16(keep_io_types=True)`` on the optimized graph, so inputs
   stay int64 and logits stay fp32. CPU int8: ``quantize_dynamic`` (QInt8 weights, activations
   quantized per batch at run time) on the optimized fp32 graph. CPU static int8 (``graph:
   int8-static``, options ``int8_static:``): QDQ with activation ranges calibrated on real batches
   of the run, on the optimized graph without the Attention fusion by default (ort_static.py says
   why).
4. The final session is checked against PyTorch at the same two shapes: fp32 must agree within
   ``validate_atol`` (1e-3) or prepare fails; fp16 within 0.25 (overflow/garbage, not rounding);
   int8 is measured only and reported as ``validation_max_abs_diff``.

Why onnxruntime's own optimizer rather than Hugging Face ``optimum``: optimum 2.x moved its
ONNX export and ORT optimizer/quantizer out into the separate ``optimum-onnx`` package, and
the only release of that (0.1.0) requires ``transformers<4.58`` and ``optimum~=2.1`` — it cannot
be installed next to the transformers 5.x this project uses (``optimum`` 2.3 itself no longer
contains ``optimum.onnxruntime``/``optimum.exporters.onnx``). optimum's ORTOptimizer is a thin
wrapper over the same ``onnxruntime.transformers.optimizer`` anyway, so calling it directly
gives the same fusions with one fewer dependency and its pins.

CUDA sessions use IO binding on torch CUDA tensors: inputs are copied once into reused device
buffers (from pinned host memory), ORT runs on the same (non-default) torch stream through
``user_compute_stream``, outputs are written to preallocated device buffers and copied to the
host on that stream. ``cuda_graph: true`` adds ``enable_cuda_graph``: ORT captures a graph per
shape of the run (``gpu_graph_id``), each with its own fixed input and output buffers, during
prepare.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ...errors import BackendUnavailableError, ConfigError, MissingDependencyError, import_optional
from ...io import atomic_path, atomic_write_json
from ...model.checkpoint import FAMILIES, model_dims, model_family
from ..base import Backend, BackendContext, batch_at_shape
from ..device_io import HostOutputs, batch_shape, cuda_unavailable_reason, gpu_info, pinned_empty
from .onnx_export import EXPORTERS, FP32_ATOL, OnnxExport, cache_key, check_against_reference, export_onnx
from .ort_static import REDUCE_RANGE, Int8StaticOptions, batches_digest, cpu_features, quantize_static_qdq, reduce_range_on

log = logging.getLogger(__name__)

FUSED_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization",
             "BiasGelu", "FastGelu", "Gelu", "LayerNormalization")
FP16_ATOL = 0.25


def _import_ort():
    return import_optional("onnxruntime", "the ONNX Runtime backend",
                           install="pip install onnxruntime (or onnxruntime-gpu for CUDA)")


_DLLS_PRELOADED = False


def _preload_cuda_dlls(ort) -> None:
    """onnxruntime-gpu finds CUDA/cuDNN from the nvidia-* pip packages (or torch's) only after
    preload_dlls(); without it the CUDA EP can fail to load and the session falls back to CPU."""
    global _DLLS_PRELOADED
    if _DLLS_PRELOADED or not hasattr(ort, "preload_dlls"):
        return
    try:
        ort.preload_dlls()
    except Exception as e:  # noqa: BLE001 - the provider check after session creation reports the outcome
        log.warning("onnxruntime.preload_dlls() failed: %s", e)
    _DLLS_PRELOADED = True


def _bert_dims(model_dir: Path) -> tuple[int, int, int]:
    d = model_dims(model_dir)  # through transformers' config: DistilBERT names them n_heads/dim/n_layers
    return d["heads"], d["hidden"], d["layers"]


def optimizer_model_type(model_dir: Path) -> str:
    """The transformer optimizer's model type for the checkpoint's family (checkpoint.FAMILIES)."""
    return FAMILIES.get(model_family(model_dir), "bert")


def _attention_fused(meta: Mapping[str, Any]) -> int:
    f = meta["fusions"]
    return int(f.get("Attention", 0)) + int(f.get("MultiHeadAttention", 0))


GRAPHS = ("fp32", "fp16", "int8", "int8-static")
SESSION_OPT_LEVELS = ("basic", "extended", "all")


@dataclass
class OrtOptions:
    # fp32 | fp16 (converted, keep_io_types) | int8 (dynamic quantization, CPU) | int8-static (QDQ, calibrated, CPU)
    graph: str = "fp32"
    cuda_graph: bool = False  # CUDA EP: capture a CUDA graph per shape of the run
    opt_level: int = 1  # onnxruntime.transformers.optimizer opt_level
    exporter: str = "auto"  # auto | torchscript | dynamo (see onnx_export.py)
    opset: int = 17
    per_channel: bool = False  # int8: per-output-channel weight scales
    quantize_ops: list = field(default_factory=list)  # int8: op types to quantize (empty: all)
    # int8: 7-bit weights (true | false | auto: on exactly for an x86 CPU without VNNI, where the
    # u8 x s8 GEMM's 16-bit pair sums saturate; measured on a 2-core AVX2 AMD EPYC: the CI model's
    # logits moved 1.55 against a range of 14.6 without it, ort_static.reduce_range_on)
    reduce_range: str = "auto"
    intra_op_num_threads: Optional[int] = None  # CPU: default torch's thread count
    inter_op_num_threads: int = 1
    validate_atol: Optional[float] = None  # default: 1e-3 fp32, 0.25 fp16, measure only for int8
    log_severity_level: int = 3
    int8_static: Optional[Int8StaticOptions] = None  # int8-static: calibration and what stays fp32 (ort_static.py)
    # CPU session: let idle intra-op threads spin (onnxruntime's default) or sleep at once
    allow_spinning: bool = True
    session_opt_level: str = "all"  # the session's graph optimization level: basic | extended | all

    def __post_init__(self):
        if self.graph not in GRAPHS:
            raise ConfigError(f"onnxruntime option graph '{self.graph}' is not one of {', '.join(GRAPHS)}")
        if self.session_opt_level not in SESSION_OPT_LEVELS:
            raise ConfigError(f"onnxruntime option session_opt_level '{self.session_opt_level}' is not one of "
                              f"{', '.join(SESSION_OPT_LEVELS)}")
        self.reduce_range = str(self.reduce_range).lower()
        if self.reduce_range not in REDUCE_RANGE:
            raise ConfigError(f"onnxruntime option reduce_range '{self.reduce_range}' is not one of {', '.join(REDUCE_RANGE)}")
        if self.graph == "int8-static" and self.int8_static is None:
            self.int8_static = Int8StaticOptions()
        elif self.graph != "int8-static" and self.int8_static is not None:
            raise ConfigError(f"onnxruntime option int8_static needs graph: int8-static (graph is '{self.graph}')")
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"onnxruntime option exporter '{self.exporter}' is not one of {', '.join(EXPORTERS)}")


class OnnxRuntimeBackend(Backend):
    Options = OrtOptions

    @classmethod
    def precision_of(cls, o: OrtOptions) -> str:
        return "int8" if o.graph.startswith("int8") else o.graph

    def __init__(self, variant):
        super().__init__(variant)
        self.session = None
        self._stream = None
        self._host = HostOutputs()
        self._per_shape: dict[tuple[int, int], dict] = {}

    @classmethod
    def unavailable_reason(cls, variant) -> Optional[str]:
        try:
            ort = _import_ort()
        except MissingDependencyError as e:
            return str(e)
        if variant.device == "cuda":
            if variant.options.graph.startswith("int8"):
                return "int8 quantization (dynamic or static) runs on the CPU execution provider only"
            why = cuda_unavailable_reason()
            if why:
                return f"onnxruntime on CUDA {why}"
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return ("onnxruntime has no CUDAExecutionProvider (this is the CPU build): "
                        "pip uninstall onnxruntime && pip install onnxruntime-gpu")
        elif variant.options.cuda_graph:
            return "cuda_graph needs device: cuda"
        return None

    @property
    def fp16(self) -> bool:
        return self.options.graph == "fp16"

    @property
    def int8(self) -> bool:
        return self.options.graph == "int8"

    @property
    def int8_static(self) -> bool:
        return self.options.graph == "int8-static"

    def _fuse_attention(self) -> bool:
        return not self.int8_static or self.options.int8_static.fuse_attention

    # --- artifacts -----------------------------------------------------------------------
    def _optimized_model(self, ctx: BackendContext, export: OnnxExport) -> tuple[Path, dict]:
        """Fuse (and convert/quantize); cached with the fusion statistics in a sidecar json."""
        ort = _import_ort()
        o: OrtOptions = self.options
        num_heads, hidden, layers = _bert_dims(ctx.model_dir)
        use_gpu = self.device == "cuda"
        model_type = optimizer_model_type(ctx.model_dir)
        key_parts: list[Any] = [export.key, "optimized", o.graph, o.opt_level, use_gpu, ort.__version__, num_heads,
                                 hidden, o.per_channel, tuple(o.quantize_ops), model_type]
        calib: list = []
        # dynamic int8: the quantized weights depend on what the CPU has (reduce_range: auto)
        reduce_range = reduce_range_on(o.reduce_range, cpu_features()) if self.int8 else None
        if self.int8:
            key_parts.append(reduce_range)
        if self.int8_static:
            # The calibrated scales depend on every static option, on the calibration data and on
            # what the CPU has (reduce_range: auto): all of them are in the key.
            s = o.int8_static
            calib = list(ctx.sample_batches[:s.calibration_batches])
            key_parts += [dataclasses.asdict(s), batches_digest(calib), s.reduce_range_for(cpu_features())]
        key = cache_key(*key_parts)
        path = export.path.parent / f"model-{o.graph}-{'gpu' if use_gpu else 'cpu'}-{key}.onnx"
        meta_path = path.with_suffix(".json")
        if path.exists() and meta_path.exists():
            meta = json.loads(meta_path.read_text())
            meta["optimized_cache_hit"] = True
            return path, meta

        from onnxruntime.transformers.optimizer import optimize_model

        fusion_options = None
        if not self._fuse_attention():
            from onnxruntime.transformers.fusion_options import FusionOptions

            fusion_options = FusionOptions(model_type)
            fusion_options.enable_attention = False  # static QDQ has no rule for Attention: keep Q/K/V MatMuls
        optimized = optimize_model(str(export.path), model_type=model_type, num_heads=num_heads, hidden_size=hidden,
                                   opt_level=o.opt_level, use_gpu=use_gpu, optimization_options=fusion_options)
        stats = {k: int(v) for k, v in optimized.get_fused_operator_statistics().items() if k in FUSED_OPS}
        meta: dict[str, Any] = {"opt_level": o.opt_level, "fusions": stats, "num_hidden_layers": layers,
                                "optimized_cache_hit": False, "model_type": model_type,
                                "attention_fusion": self._fuse_attention()}
        if self.fp16:
            # keep_io_types: int64 ids in, fp32 logits out; only the inside runs in half.
            optimized.convert_float_to_float16(keep_io_types=True)
        with atomic_path(path, suffix=".onnx") as tmp:
            if self.int8:
                import onnx
                from onnxruntime.quantization import QuantType, quantize_dynamic

                with tempfile.TemporaryDirectory(dir=path.parent) as scratch:  # the fp32 intermediate
                    fp32_tmp = Path(scratch) / "optimized-fp32.onnx"
                    optimized.save_model_to_file(str(fp32_tmp))
                    # Shape inference knows no types for contrib-op outputs (Attention, SkipLayerNorm...):
                    # DefaultTensorType tells the quantizer they are float. quantize_ops (e.g. [MatMul])
                    # limits INT8 to those op types.
                    quantize_dynamic(str(fp32_tmp), str(tmp), weight_type=QuantType.QInt8,
                                     per_channel=bool(o.per_channel), reduce_range=reduce_range,
                                     op_types_to_quantize=list(o.quantize_ops) or None,
                                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
                meta["quantization"] = "dynamic QInt8 weights, per_channel=%s, ops=%s" % (
                    bool(o.per_channel), ",".join(o.quantize_ops) or "all")
                meta["reduce_range"] = reduce_range
            elif self.int8_static:
                with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                    fp32_tmp = Path(scratch) / "optimized-fp32.onnx"
                    optimized.save_model_to_file(str(fp32_tmp))
                    t0 = time.perf_counter()
                    meta.update(quantize_static_qdq(fp32_tmp, Path(tmp), calib, o.int8_static, cpu_features()))
                    meta["quantize_s"] = round(time.perf_counter() - t0, 2)
            else:
                optimized.save_model_to_file(str(tmp))
        atomic_write_json(meta_path, meta)
        return path, meta

    def _export_and_optimize(self, ctx: BackendContext):
        """Export and fuse; with exporter=auto, keep whichever exporter's graph fuses attention.

        Which one fuses depends on the torch/transformers/onnxruntime versions (onnxruntime
        learned transformers 5's eager mask pattern only in 1.31), so it is measured, not assumed.
        """
        o: OrtOptions = self.options

        def export(name):
            return export_onnx(ctx.model_dir, ctx.task, ctx.artifacts_dir, ctx.output_names, ctx.sample_batch,
                               max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len, shapes=ctx.shapes,
                               exporter=name, opset=o.opset)

        exp = export(o.exporter)
        path, meta = self._optimized_model(ctx, exp)
        tried = {exp.exporter: _attention_fused(meta)}
        # (int8-static leaves Attention unfused on purpose by default: nothing to retry for)
        if o.exporter == "auto" and self._fuse_attention() and tried[exp.exporter] < meta["num_hidden_layers"]:
            other = "dynamo" if exp.exporter == "torchscript" else "torchscript"
            try:
                alt = export(other)
                alt_path, alt_meta = self._optimized_model(ctx, alt)
                tried[other] = _attention_fused(alt_meta)
                if tried[other] > tried[exp.exporter]:
                    exp, path, meta = alt, alt_path, alt_meta
            except Exception as e:  # noqa: BLE001 - the first export is valid; the retry only hoped for more fusion
                log.warning("%s: %s export for better fusion failed: %s", self.name, other, e)
                tried[other] = -1
        return exp, path, meta, tried

    # --- session -------------------------------------------------------------------------
    def _make_session(self, path: Path):
        import torch

        ort = _import_ort()
        o: OrtOptions = self.options
        so = ort.SessionOptions()
        so.log_severity_level = int(o.log_severity_level)
        so.graph_optimization_level = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                       "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                       "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[o.session_opt_level]
        if self.device == "cpu":
            if not o.allow_spinning:
                so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            # Default to torch's thread count so ORT and the torch reference use the same cores.
            so.intra_op_num_threads = int(o.intra_op_num_threads or torch.get_num_threads())
            so.inter_op_num_threads = int(o.inter_op_num_threads)
            providers: list[Any] = ["CPUExecutionProvider"]
        else:
            self._stream = torch.cuda.Stream()  # not the legacy default stream: ORT rejects 0, and graphs can't capture on it
            cuda_opts = {
                "device_id": str(torch.cuda.current_device()),
                "user_compute_stream": str(self._stream.cuda_stream),
                # Honest fp32: the CUDA EP uses TF32 matmuls by default.
                "use_tf32": "0" if not self.fp16 else "1",
            }
            if o.cuda_graph:
                cuda_opts["enable_cuda_graph"] = "1"
            providers = [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]
        sess = ort.InferenceSession(str(path), so, providers=providers)
        if self.device == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
            raise BackendUnavailableError(
                f"{self.name}: onnxruntime could not load the CUDA execution provider (got {sess.get_providers()}); "
                "check that onnxruntime-gpu matches the installed CUDA/cuDNN")
        return sess

    def prepare(self, ctx: BackendContext) -> None:
        ort = _import_ort()
        o: OrtOptions = self.options
        why = self.unavailable_reason(self.variant)
        if why:
            raise BackendUnavailableError(f"{self.name}: {why}")
        if self.device == "cuda":
            _preload_cuda_dlls(ort)  # before optimize_model too: with use_gpu it opens a CUDA session
        self.output_names = tuple(ctx.output_names)

        export, path, meta, tried = self._export_and_optimize(ctx)
        self._seq_outputs = set(export.seq_axis_outputs)
        self._ref_shapes = {n: export.references[0][n].shape for n in self.output_names}
        self.session = self._make_session(path)
        self._input_names = [i.name for i in self.session.get_inputs()]
        if self.device == "cuda":
            self._setup_cuda(ctx)

        fusions = meta["fusions"]
        self.prepare_info = {
            **export.info(),
            "exporters_tried": ",".join(f"{k}:{v}" for k, v in tried.items()),  # exporter:fused attention count
            "device": self.device,
            "onnxruntime": ort.__version__,
            "providers": ",".join(self.session.get_providers()),
            "model_file": path.name,
            "optimizer": f"onnxruntime.transformers.optimizer (model_type={meta.get('model_type', 'bert')})",
            "opt_level": meta["opt_level"],
            "optimized_cache_hit": meta["optimized_cache_hit"],
            **{f"fused_{k}": v for k, v in fusions.items()},
            "graph_precision": o.graph,
        }
        for k in ("quantization", "reduce_range"):  # dynamic int8's (the static graph's follow)
            if k in meta:
                self.prepare_info[k] = meta[k]
        if self.int8_static:
            for k in ("calibration_batches", "calibration_rows", "calibration_tokens", "calibrate_method",
                      "reduce_range", "quantized_nodes", "kept_fp32", "quantizer", "quantize_s"):
                if k in meta:
                    self.prepare_info[k] = meta[k]
        if self.int8 or self.int8_static:
            cpu = cpu_features()  # what the integer GEMMs run on, read here, not assumed
            self.prepare_info.update(cpu_model=cpu["cpu_model"], cpu_flags=cpu["cpu_flags"], cpu_vnni=cpu["vnni"])
        if self._fuse_attention() and _attention_fused(meta) < meta["num_hidden_layers"]:
            # Not fatal (results stay correct) but the timing is of an unfused graph: say so.
            hint = ""
            if tuple(int(x) for x in ort.__version__.split(".")[:2]) < (1, 31):
                hint = f" (onnxruntime {ort.__version__}: fusing transformers 5 eager attention needs >= 1.31)"
            self.prepare_info["fusion_warning"] = (
                f"only {_attention_fused(meta)} of {meta['num_hidden_layers']} attention blocks fused{hint}")
            log.warning("%s: %s", self.name, self.prepare_info["fusion_warning"])
        if self.device == "cpu":
            self.prepare_info["intra_op_num_threads"] = self.session.get_session_options().intra_op_num_threads
            self.prepare_info.update(session_opt_level=o.session_opt_level, allow_spinning=o.allow_spinning)
        else:
            self.prepare_info.update(cuda_graph=o.cuda_graph, io_binding=True, **gpu_info())

        # The session that will be timed must reproduce PyTorch at the run's shapes (and, without
        # fixed-shape CUDA graphs, at one more); this also warms it up and captures the graphs.
        atol = o.validate_atol if o.validate_atol is not None else (
            None if self.int8 or self.int8_static else FP16_ATOL if self.fp16 else FP32_ATOL)
        batches, refs = export.run_batches if o.cuda_graph else (export.batches, export.references)
        diffs = check_against_reference(self.predict, batches, refs, atol, f"{self.name} ({path.name})")
        self.prepare_info["validation_max_abs_diff"] = max(diffs.values(), default=0.0)
        for b, s in ctx.shapes:  # every shape once: graphs are captured here, not while timing
            self.predict(batch_at_shape(ctx.sample_batch, b, s))

    # --- CUDA IO binding -------------------------------------------------------------------
    def _setup_cuda(self, ctx: BackendContext) -> None:
        import torch

        # Stage inputs in the graph's own integer type (int64 from the exporter; int32 if an
        # optimizer pass narrowed them), so binding never needs a cast on the device.
        self._in_dtypes = {i.name: (torch.int32 if i.type == "tensor(int32)" else torch.int64)
                           for i in self.session.get_inputs()}
        self._out_dtypes = {o.name: torch.float16 if o.type == "tensor(float16)" else torch.float32
                            for o in self.session.get_outputs()}
        ort = _import_ort()
        self._graph_ids = {shape: i for i, shape in enumerate(sorted(set(ctx.shapes)))}
        self._run_options = {}
        for shape, gid in self._graph_ids.items():
            ro = ort.RunOptions()
            if self.options.cuda_graph and len(self._graph_ids) > 1:
                ro.add_run_config_entry("gpu_graph_id", str(gid))  # one captured graph per shape
            self._run_options[shape] = ro

    def _out_shape(self, n: str, b: int, s: int) -> tuple[int, ...]:
        if n in self._seq_outputs:
            return (b, s, *self._ref_shapes[n][2:])
        return (b, *self._ref_shapes[n][1:])

    def _buffers(self, b: int, s: int) -> dict:
        """Device input/output buffers and an IO binding for one shape, made once and reused:
        a CUDA graph replays against fixed addresses, and rebinding costs host time anyway."""
        import torch

        key = (b, s)
        if key not in self._per_shape:
            dev_id = torch.cuda.current_device()
            ins = {n: torch.empty((b, s), dtype=self._in_dtypes[n], device="cuda") for n in self._input_names}
            host = {n: pinned_empty((b, s), self._in_dtypes[n]) for n in self._input_names}
            outs = {n: torch.empty(self._out_shape(n, b, s), dtype=self._out_dtypes.get(n, torch.float32),
                                   device="cuda") for n in self.output_names}
            io = self.session.io_binding()
            for n, t in ins.items():
                io.bind_input(n, "cuda", dev_id, np.int32 if t.dtype == torch.int32 else np.int64, (b, s), t.data_ptr())
            for n, t in outs.items():
                io.bind_output(n, "cuda", dev_id, np.float16 if t.dtype == torch.float16 else np.float32,
                               tuple(t.shape), t.data_ptr())
            self._per_shape[key] = {"in": ins, "host": host, "out": outs, "io": io}
        return self._per_shape[key]

    def _predict_cuda(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        b, s = batch_shape(batch)
        if self.options.cuda_graph and (b, s) not in self._graph_ids:
            raise BackendUnavailableError(f"{self.name}: shape {b}x{s} was not prepared (CUDA graphs are per shape)")
        buf = self._buffers(b, s)
        with torch.cuda.stream(self._stream):
            for n in self._input_names:
                buf["host"][n].numpy()[...] = batch[n]
                buf["in"][n].copy_(buf["host"][n], non_blocking=True)
            ro = self._run_options.get((b, s))
            self.session.run_with_iobinding(buf["io"], ro) if ro is not None else \
                self.session.run_with_iobinding(buf["io"])
            # Same stream as ORT's kernels, so the copy waits for them: the call is synchronous.
            return self._host.fetch(self.output_names, [buf["out"][n] for n in self.output_names], b)

    # --- predict -------------------------------------------------------------------------
    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.device == "cuda":
            return self._predict_cuda(batch)
        feed = {n: np.ascontiguousarray(batch[n], dtype=np.int64) for n in self._input_names}
        outs = self.session.run(list(self.output_names), feed)
        return {n: np.asarray(o, dtype=np.float32) for n, o in zip(self.output_names, outs)}

    def close(self) -> None:
        self.session = None
        self._per_shape = {}
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
