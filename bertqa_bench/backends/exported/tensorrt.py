"""TensorRT 10 fp16 engine built from the validated ONNX export.

The engine is built with the official ``tensorrt`` Python API: ``trt.OnnxParser`` on the raw
(unfused: onnxruntime's contrib ops are not ONNX) export from ``onnx_export``, ``BuilderFlag.FP16``,
one optimization profile spanning the run's shapes (from the smallest batch and sequence to the
largest, the largest as the optimum), serialized and cached under ``artifacts_dir/tensorrt`` keyed by the ONNX,
the TensorRT version, the GPU and the build settings. Inference is ``execute_async_v3`` with
``set_input_shape``/``set_tensor_address`` on torch CUDA tensors and a torch CUDA stream.

LayerNormalization (a real op at opset 17) is pinned to fp32 by default (``layernorm_fp32``):
in fp16 its variance overflows on BERT activations, which TensorRT itself warns about.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from dataclasses import dataclass

from ...errors import BackendUnavailableError, BenchError, ConfigError
from ...io import atomic_write_bytes
from ..base import Backend, BackendContext
from ..device_io import CudaStaging, HostOutputs, batch_shape, cuda_unavailable_reason, gpu_info
from .onnx_export import EXPORTERS, cache_key, check_against_reference, export_onnx

log = logging.getLogger(__name__)

MISSING_TENSORRT = ("TensorRT backend needs the 'tensorrt' package "
                    "(pip install tensorrt --extra-index-url https://pypi.nvidia.com); not run")
FP16_ATOL = 0.25


def _import_trt():
    try:
        import tensorrt as trt
    except ImportError:
        return None
    return trt


def _torch_dtype(trt, dt):
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int8: torch.int8, trt.bool: torch.bool}
    for name, tdt in (("int64", torch.int64), ("bf16", torch.bfloat16)):
        if hasattr(trt, name):  # TensorRT >= 10 has both
            table[getattr(trt, name)] = tdt
    return table[dt]


@dataclass
class TrtOptions:
    workspace_gib: int = 4
    builder_optimization_level: Optional[int] = None
    layernorm_fp32: bool = True  # keep LayerNormalization in fp32 (its variance overflows in fp16)
    exporter: str = "auto"
    opset: int = 17
    validate_atol: float = FP16_ATOL

    def __post_init__(self):
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"tensorrt option exporter '{self.exporter}' is not one of {', '.join(EXPORTERS)}")


class TensorRTBackend(Backend):
    Options = TrtOptions

    @classmethod
    def precision_of(cls, o: TrtOptions) -> str:
        return "fp16"

    def __init__(self, variant):
        super().__init__(variant)
        self.engine = None
        self.context = None
        self._runtime = None
        self._stream = None
        self._host = HostOutputs()

    @classmethod
    def unavailable_reason(cls, variant) -> Optional[str]:
        if variant.device != "cuda":
            return "TensorRT runs on CUDA only"
        if _import_trt() is None:
            return MISSING_TENSORRT
        why = cuda_unavailable_reason()
        if why:
            return f"TensorRT {why}"
        return None

    # --- build -----------------------------------------------------------------------------
    def _build(self, trt, onnx_path: Path, opts: TrtOptions, shapes) -> bytes:
        logger = self._logger
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # TensorRT 10: networks are always explicit-batch
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BenchError(f"TensorRT could not parse {onnx_path.name}: {errors}")

        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_gib) << 30)
        config.set_flag(trt.BuilderFlag.FP16)
        if opts.builder_optimization_level is not None:
            config.builder_optimization_level = int(opts.builder_optimization_level)
        if opts.layernorm_fp32:
            pinned = 0
            for i in range(network.num_layers):
                layer = network.get_layer(i)
                if layer.type == trt.LayerType.NORMALIZATION:
                    layer.precision = trt.float32
                    layer.set_output_type(0, trt.float32)
                    pinned += 1
            if pinned:
                config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)
            self.prepare_info["layernorm_fp32_layers"] = pinned

        (mn, opt, mx) = shapes
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            profile.set_shape(network.get_input(i).name, mn, opt, mx)
        config.add_optimization_profile(profile)

        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BenchError("TensorRT engine build failed (see the TensorRT log above)")
        return bytes(serialized)

    def prepare(self, ctx: BackendContext) -> None:
        import torch

        trt = _import_trt()
        opts: TrtOptions = self.options
        why = self.unavailable_reason(self.variant)
        if why:
            raise BackendUnavailableError(f"{self.name}: {why}")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.output_names = tuple(ctx.output_names)

        export = export_onnx(ctx.model_dir, ctx.task, ctx.artifacts_dir, ctx.output_names, ctx.sample_batch,
                             max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len, shapes=ctx.shapes,
                             exporter=opts.exporter, opset=opts.opset)
        # One profile over every shape the run uses (and the validation batches inside it).
        bs = [b for b, _ in ctx.shapes] + [b["input_ids"].shape[0] for b in export.batches]
        ss = [s for _, s in ctx.shapes] + [b["input_ids"].shape[1] for b in export.batches]
        largest = max(ctx.shapes, key=lambda x: x[0] * x[1])
        shapes = ((min(bs), min(ss)), largest, (max(bs), max(ss)))
        info = gpu_info()
        key = cache_key(export.key, trt.__version__, info.get("gpu"), info.get("gpu_capability"), shapes, "fp16",
                        opts.layernorm_fp32, opts.builder_optimization_level, opts.workspace_gib)
        engine_dir = Path(ctx.artifacts_dir) / "tensorrt"
        engine_dir.mkdir(parents=True, exist_ok=True)
        engine_path = engine_dir / f"engine-{key}.plan"

        self._runtime = trt.Runtime(self._logger)
        cache_hit = False
        if engine_path.exists():
            self.engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
            cache_hit = self.engine is not None  # a stale/corrupt plan deserializes to None: rebuild
        if self.engine is None:
            plan = self._build(trt, export.path, opts, shapes)
            atomic_write_bytes(engine_path, plan)
            self.engine = self._runtime.deserialize_cuda_engine(plan)
            if self.engine is None:
                raise BenchError("TensorRT could not deserialize the engine it just built")
        self.context = self.engine.create_execution_context()
        self._stream = torch.cuda.Stream()

        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        missing = set(self.output_names) - set(names)
        if missing:
            raise BenchError(f"TensorRT engine lacks outputs {sorted(missing)} (has {names})")
        in_dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in self._inputs}
        # Inputs are staged in the engine's own dtype (int32 if the parser narrowed int64).
        self._staging = CudaStaging(shapes[2][0], shapes[2][1], device="cuda",
                                    dtypes=in_dtypes, names=self._inputs)
        # Output buffers sized at the profile's max shape, reused for every batch.
        for n in self._inputs:
            self.context.set_input_shape(n, shapes[2])
        self._outbufs = {}
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            dt = _torch_dtype(trt, self.engine.get_tensor_dtype(n))
            self._outbufs[n] = torch.empty(int(np.prod(shape)), dtype=dt, device="cuda")

        self.prepare_info.update(
            **export.info(), device="cuda", tensorrt=trt.__version__, engine_cache_hit=cache_hit,
            engine_file=engine_path.name, profile_min="x".join(map(str, shapes[0])),
            profile_opt="x".join(map(str, shapes[1])), profile_max="x".join(map(str, shapes[2])),
            builder_flags="FP16", input_dtypes=",".join(f"{n}:{d}" for n, d in in_dtypes.items()), **info,
        )
        atol = opts.validate_atol
        diffs = check_against_reference(self.predict, export.batches, export.references, atol,
                                        f"{self.name} engine")
        self.prepare_info["validation_max_abs_diff"] = max(diffs.values(), default=0.0)

    # --- predict -------------------------------------------------------------------------
    def predict(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        b, s = batch_shape(batch)
        ctx = self.context
        with torch.cuda.stream(self._stream):
            dev = self._staging.to_device(batch)
            for n in self._inputs:
                t = dev[n]
                ctx.set_input_shape(n, tuple(t.shape))
                ctx.set_tensor_address(n, t.data_ptr())
            outs = {}
            for n in self.output_names:
                shape = tuple(ctx.get_tensor_shape(n))
                t = self._outbufs[n][: int(np.prod(shape))].view(shape)
                ctx.set_tensor_address(n, t.data_ptr())
                outs[n] = t
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise BenchError(f"{self.name}: execute_async_v3 failed at batch x seq = {b}x{s}")
            # Copied on the engine's stream, so it waits for it: the call is synchronous.
            return self._host.fetch(list(outs), list(outs.values()), b)

    def close(self) -> None:
        self.context = None
        self.engine = None
        self._runtime = None
        self._staging = None
        self._outbufs = {}
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass
