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
   quantized per batch at run time) on the optimized fp32 graph.
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
host on that stream. ``cuda_graph: true`` adds ``enable_cuda_graph``: ORT captures the first
run and replays it, which needs fixed shapes and fixed buffer addresses, so every batch is
padded to max_batch_size x max_seq_len and the outputs sliced.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ..errors import BackendUnavailableError, MissingDependencyError
from .base import FP32_CLASS, REDUCED_CLASS, Backend, BackendContext
from .device_io import CudaStaging, batch_shape, cuda_unavailable_reason, gpu_info, merged_options, resolve_device
from .onnx_export import FP32_ATOL, OnnxExport, cache_key, check_against_reference, export_onnx
from .registry import register

log = logging.getLogger(__name__)

FUSED_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization",
             "BiasGelu", "FastGelu", "Gelu", "LayerNormalization")
FP16_ATOL = 0.25


def _import_ort():
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependencyError("onnxruntime", "the onnxruntime backends",
                                     install="pip install onnxruntime (or onnxruntime-gpu for CUDA)") from None
    return onnxruntime


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
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["num_attention_heads"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])


def _attention_fused(meta: Mapping[str, Any]) -> int:
    f = meta["fusions"]
    return int(f.get("Attention", 0)) + int(f.get("MultiHeadAttention", 0))


class OnnxRuntimeBackend(Backend):
    precision = "fp32"
    parity_class = FP32_CLASS
    fp16 = False
    int8 = False

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.session = None
        self._device = "cpu"
        self._stream = None
        self._staging: Optional[CudaStaging] = None
        self._outbufs: dict[str, Any] = {}

    @classmethod
    def unavailable_reason(cls, device: str) -> Optional[str]:
        try:
            ort = _import_ort()
        except MissingDependencyError as e:
            return str(e)
        if device == "cuda":
            why = cuda_unavailable_reason()
            if why:
                return f"onnxruntime on CUDA {why}"
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return ("onnxruntime has no CUDAExecutionProvider (this is the CPU build): "
                        "pip uninstall onnxruntime && pip install onnxruntime-gpu")
        return None

    # --- artifacts -----------------------------------------------------------------------
    def _optimized_model(self, ctx: BackendContext, export: OnnxExport, opts: Mapping[str, Any]) -> tuple[Path, dict]:
        """Fuse (and convert/quantize); cached with the fusion statistics in a sidecar json."""
        ort = _import_ort()
        num_heads, hidden, layers = _bert_dims(ctx.model_dir)
        use_gpu = self._device == "cuda"
        opt_level = int(opts.get("opt_level", 1))
        variant = "int8" if self.int8 else "fp16" if self.fp16 else "fp32"
        key = cache_key(export.key, "optimized", variant, opt_level, use_gpu, ort.__version__, num_heads, hidden,
                        opts.get("per_channel", False), tuple(opts.get("quantize_ops") or ()))
        path = export.path.parent / f"model-{variant}-{'gpu' if use_gpu else 'cpu'}-{key}.onnx"
        meta_path = path.with_suffix(".json")
        if path.exists() and meta_path.exists():
            meta = json.loads(meta_path.read_text())
            meta["optimized_cache_hit"] = True
            return path, meta

        from onnxruntime.transformers.optimizer import optimize_model

        optimized = optimize_model(str(export.path), model_type="bert", num_heads=num_heads, hidden_size=hidden,
                                   opt_level=opt_level, use_gpu=use_gpu)
        stats = {k: int(v) for k, v in optimized.get_fused_operator_statistics().items() if k in FUSED_OPS}
        meta: dict[str, Any] = {"opt_level": opt_level, "fusions": stats, "num_hidden_layers": layers,
                                "optimized_cache_hit": False}
        tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")
        if self.fp16:
            # keep_io_types: int64 ids in, fp32 logits out; only the inside runs in half.
            optimized.convert_float_to_float16(keep_io_types=True)
        if self.int8:
            import onnx
            from onnxruntime.quantization import QuantType, quantize_dynamic

            fp32_tmp = path.with_suffix(f".fp32tmp{os.getpid()}.onnx")
            optimized.save_model_to_file(str(fp32_tmp))
            try:
                # Shape inference knows no types for contrib-op outputs (Attention, SkipLayerNorm...):
                # DefaultTensorType tells the quantizer they are float.
                # quantize_ops (e.g. [MatMul]) limits INT8 to those op types: leaving the fused
                # Attention in fp32 is what keeps answers stable on small models.
                quantize_dynamic(str(fp32_tmp), str(tmp), weight_type=QuantType.QInt8,
                                 per_channel=bool(opts.get("per_channel", False)),
                                 op_types_to_quantize=list(opts.get("quantize_ops") or []) or None,
                                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
            finally:
                fp32_tmp.unlink(missing_ok=True)
            meta["quantization"] = "dynamic QInt8 weights, per_channel=%s, ops=%s" % (
                bool(opts.get("per_channel", False)), ",".join(opts.get("quantize_ops") or []) or "all")
        else:
            optimized.save_model_to_file(str(tmp))
        os.replace(tmp, path)
        meta_path.write_text(json.dumps(meta, indent=1))
        return path, meta

    def _export_and_optimize(self, ctx: BackendContext, opts: Mapping[str, Any]):
        """Export and fuse; with exporter=auto, keep whichever exporter's graph fuses attention.

        Which one fuses depends on the torch/transformers/onnxruntime versions (onnxruntime
        learned transformers 5's eager mask pattern only in 1.31), so it is measured, not assumed.
        """
        exporter = opts.get("exporter", "auto")
        kwargs = dict(max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len, opset=int(opts.get("opset", 17)))
        export = export_onnx(ctx.model_dir, ctx.artifacts_dir, ctx.output_names, ctx.sample_batch,
                             exporter=exporter, **kwargs)
        path, meta = self._optimized_model(ctx, export, opts)
        tried = {export.exporter: _attention_fused(meta)}
        if exporter == "auto" and tried[export.exporter] < meta["num_hidden_layers"]:
            other = "dynamo" if export.exporter == "torchscript" else "torchscript"
            try:
                alt = export_onnx(ctx.model_dir, ctx.artifacts_dir, ctx.output_names, ctx.sample_batch,
                                  exporter=other, **kwargs)
                alt_path, alt_meta = self._optimized_model(ctx, alt, opts)
                tried[other] = _attention_fused(alt_meta)
                if tried[other] > tried[export.exporter]:
                    export, path, meta = alt, alt_path, alt_meta
            except Exception as e:  # noqa: BLE001 - the first export is valid; the retry only hoped for more fusion
                log.warning("%s: %s export for better fusion failed: %s", self.name, other, e)
                tried[other] = -1
        return export, path, meta, tried

    # --- session -------------------------------------------------------------------------
    def _make_session(self, path: Path, opts: Mapping[str, Any], ctx: BackendContext):
        import torch

        ort = _import_ort()
        so = ort.SessionOptions()
        so.log_severity_level = int(opts.get("log_severity_level", 3))
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self._device == "cpu":
            # Default to torch's thread count so ORT and the torch reference use the same cores.
            threads = opts.get("intra_op_num_threads", opts.get("num_threads")) or torch.get_num_threads()
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = int(opts.get("inter_op_num_threads", 1))
            providers: list[Any] = ["CPUExecutionProvider"]
        else:
            self._stream = torch.cuda.Stream()  # not the legacy default stream: ORT rejects 0, and graphs can't capture on it
            cuda_opts = {
                "device_id": str(torch.cuda.current_device()),
                "user_compute_stream": str(self._stream.cuda_stream),
                # Honest fp32: the CUDA EP uses TF32 matmuls by default.
                "use_tf32": "0" if not self.fp16 else "1",
            }
            if self._cuda_graph:
                cuda_opts["enable_cuda_graph"] = "1"
            providers = [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]
        sess = ort.InferenceSession(str(path), so, providers=providers)
        if self._device == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
            raise BackendUnavailableError(
                f"{self.name}: onnxruntime could not load the CUDA execution provider (got {sess.get_providers()}); "
                "check that onnxruntime-gpu matches the installed CUDA/cuDNN")
        return sess

    def prepare(self, ctx: BackendContext) -> None:
        ort = _import_ort()
        opts = merged_options(self.options, ctx)
        self._device = resolve_device(self.device, opts)
        if self._device == "cuda":
            why = self.unavailable_reason("cuda")
            if why:
                raise BackendUnavailableError(f"{self.name}: {why}")
            _preload_cuda_dlls(ort)  # before optimize_model too: with use_gpu it opens a CUDA session
        if self.int8 and self._device != "cpu":
            raise BackendUnavailableError(f"{self.name}: dynamic int8 quantization is for the CPU provider")
        self._cuda_graph = self._device == "cuda" and bool(opts.get("cuda_graph", False))
        self.output_names = tuple(ctx.output_names)
        self._max_shape = (ctx.max_batch_size, ctx.max_seq_len)

        export, path, meta, tried = self._export_and_optimize(ctx, opts)
        self._seq_outputs = set(export.seq_axis_outputs)
        self._ref_shapes = {n: export.references[0][n].shape for n in self.output_names}
        self.session = self._make_session(path, opts, ctx)
        self._input_names = [i.name for i in self.session.get_inputs()]
        if self._device == "cuda":
            self._setup_cuda(ctx)

        fusions = meta["fusions"]
        self.prepare_info = {
            **export.info(),
            "exporters_tried": ",".join(f"{k}:{v}" for k, v in tried.items()),  # exporter:fused attention count
            "device": self._device,
            "onnxruntime": ort.__version__,
            "providers": ",".join(self.session.get_providers()),
            "model_file": path.name,
            "optimizer": "onnxruntime.transformers.optimizer (model_type=bert)",
            "opt_level": meta["opt_level"],
            "optimized_cache_hit": meta["optimized_cache_hit"],
            **{f"fused_{k}": v for k, v in fusions.items()},
            "graph_precision": "int8" if self.int8 else "fp16" if self.fp16 else "fp32",
        }
        if "quantization" in meta:
            self.prepare_info["quantization"] = meta["quantization"]
        if _attention_fused(meta) < meta["num_hidden_layers"]:
            # Not fatal (results stay correct) but the timing is of an unfused graph: say so.
            hint = ""
            if tuple(int(x) for x in ort.__version__.split(".")[:2]) < (1, 31):
                hint = f" (onnxruntime {ort.__version__}: fusing transformers 5 eager attention needs >= 1.31)"
            self.prepare_info["fusion_warning"] = (
                f"only {_attention_fused(meta)} of {meta['num_hidden_layers']} attention blocks fused{hint}")
            log.warning("%s: %s", self.name, self.prepare_info["fusion_warning"])
        if self._device == "cpu":
            so = self.session.get_session_options()
            self.prepare_info["intra_op_num_threads"] = so.intra_op_num_threads
        else:
            self.prepare_info.update(cuda_graph=self._cuda_graph, io_binding=True, **gpu_info())

        # The session that will be timed must reproduce PyTorch at the run's shapes; this also
        # warms it up (and captures the CUDA graph).
        atol = opts.get("validate_atol", None if self.int8 else FP16_ATOL if self.fp16 else FP32_ATOL)
        diffs = check_against_reference(self.predict, export.batches, export.references, atol,
                                         f"{self.name} ({path.name})")
        self.prepare_info["validation_max_abs_diff"] = max(diffs.values(), default=0.0)

    # --- CUDA IO binding -------------------------------------------------------------------
    def _setup_cuda(self, ctx: BackendContext) -> None:
        import torch

        # Stage inputs in the graph's own integer type (int64 from the exporter; int32 if an
        # optimizer pass narrowed them), so binding never needs a cast on the device.
        in_types = {i.name: (torch.int32 if i.type == "tensor(int32)" else torch.int64)
                    for i in self.session.get_inputs()}
        self._in_np = {n: (np.int32 if t == torch.int32 else np.int64) for n, t in in_types.items()}
        self._staging = CudaStaging(ctx.max_batch_size, ctx.max_seq_len, device="cuda", dtypes=in_types,
                                    names=self._input_names)
        mb, ms = self._max_shape
        self._out_dtypes = {}
        for o in self.session.get_outputs():
            self._out_dtypes[o.name] = torch.float16 if o.type == "tensor(float16)" else torch.float32
        for n in self.output_names:
            trailing = self._ref_shapes[n][2:] if n in self._seq_outputs else self._ref_shapes[n][1:]
            numel = mb * (ms if n in self._seq_outputs else 1) * int(np.prod(trailing, dtype=np.int64))
            self._outbufs[n] = torch.empty(numel, dtype=self._out_dtypes.get(n, torch.float32), device="cuda")
        self._binding = self.session.io_binding()
        self._bound_shape: Optional[tuple[int, int]] = None

    def _out_shape(self, n: str, b: int, s: int) -> tuple[int, ...]:
        if n in self._seq_outputs:
            return (b, s, *self._ref_shapes[n][2:])
        return (b, *self._ref_shapes[n][1:])

    def _bind(self, dev: Mapping[str, Any], b: int, s: int) -> dict[str, Any]:
        import torch

        io, dev_id = self._binding, torch.cuda.current_device()
        outs = {n: self._outbufs[n][: int(np.prod(self._out_shape(n, b, s)))].view(self._out_shape(n, b, s))
                for n in self.output_names}
        # The flat buffers never move, so the same (b, s) means identical bindings: with CUDA
        # graphs the shape is always the max one and this binds exactly once.
        if self._bound_shape != (b, s):
            io.clear_binding_inputs()
            io.clear_binding_outputs()
            for n in self._input_names:
                t = dev[n]
                io.bind_input(n, "cuda", dev_id, self._in_np[n], tuple(t.shape), t.data_ptr())
            for n, t in outs.items():
                np_dtype = np.float16 if t.dtype == torch.float16 else np.float32
                io.bind_output(n, "cuda", dev_id, np_dtype, tuple(t.shape), t.data_ptr())
            self._bound_shape = (b, s)
        return outs

    def _predict_cuda(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        b, s = batch_shape(batch)
        pb, ps = self._max_shape if self._cuda_graph else (b, s)
        with torch.cuda.stream(self._stream):
            dev = self._staging.to_device(batch, pad_to=(pb, ps))
            outs = self._bind(dev, pb, ps)
            self.session.run_with_iobinding(self._binding)
            # Same stream as ORT's kernels, so .cpu() waits for them: the call is synchronous.
            res = {}
            for n, t in outs.items():
                t = t[:b]
                if n in self._seq_outputs:
                    t = t[:, :s]
                res[n] = t.float().cpu().numpy()
        return res

    # --- predict -------------------------------------------------------------------------
    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._device == "cuda":
            return self._predict_cuda(batch)
        feed = {n: np.ascontiguousarray(batch[n], dtype=np.int64) for n in self._input_names}
        outs = self.session.run(list(self.output_names), feed)
        return {n: np.asarray(o, dtype=np.float32) for n, o in zip(self.output_names, outs)}

    def close(self) -> None:
        self.session = None
        self._binding = None
        self._staging = None
        self._outbufs = {}
        if self._device == "cuda":
            import torch

            torch.cuda.empty_cache()


class OnnxRuntimeInt8Backend(OnnxRuntimeBackend):
    precision = "int8"
    parity_class = REDUCED_CLASS
    int8 = True


class OnnxRuntimeFp16Backend(OnnxRuntimeBackend):
    precision = "fp16"
    parity_class = REDUCED_CLASS
    fp16 = True


register("onnxruntime", OnnxRuntimeBackend, device="cpu",
         description="ONNX Runtime CPU, fp32, fused BERT graph")
# per_channel: measured on the CI model, per-tensor weight scales cost 13% of F1, per-channel 0.1%.
register("onnxruntime-int8", OnnxRuntimeInt8Backend, device="cpu", per_channel=True,
         description="ONNX Runtime CPU, dynamic int8 (per-channel QInt8 weights) on the fused graph")
register("ort-cuda-fp32", OnnxRuntimeBackend, device="cuda", cuda_graph=False,
         description="ONNX Runtime CUDA EP, fp32 (TF32 off), IO binding")
register("ort-cuda-fp16", OnnxRuntimeFp16Backend, device="cuda", cuda_graph=False,
         description="ONNX Runtime CUDA EP, fp16 fused graph, IO binding")
register("ort-cuda-fp16-graph", OnnxRuntimeFp16Backend, device="cuda", cuda_graph=True,
         description="ONNX Runtime CUDA EP, fp16, CUDA graph (padded static shapes)")
