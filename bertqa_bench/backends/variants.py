"""Backend variants: name -> implementation + device + typed options, declared, not coded.

Three sources, one table:

* the built-in variants below (``CATALOGUE``);
* installed packages that declare the entry-point group ``bertqa_bench.backends``: each entry
  point names a Backend subclass, registered as an implementation under the entry point's
  name; its ``variants`` class attribute (``{variant name: {"device": ..., "options": {...}}}``)
  adds variants, and with none the entry-point name itself becomes a variant on
  ``default_device``;
* a suite's ``variants:`` section (``config.VariantConfig``): ``base:`` an existing variant
  with some options changed, or ``implementation:`` + ``device:`` + ``options:``.

Options are checked against the implementation's ``Options`` dataclass when the table is
built, so a typo fails before any work with the valid keys listed. Precision and parity
class follow from the options (``Backend.precision_of``), the device from the variant: one
source of truth each.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import yaml

from ..config import BENCHMARKS_DIR, VariantConfig, build
from ..errors import ConfigError, UnknownBackendError
from .base import DEVICES, Backend, parity_class_of

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bertqa_bench.backends"

# Implementation name -> "module:Class". Modules import their heavy packages lazily.
IMPLEMENTATIONS = {
    "torch": "bertqa_bench.backends.torch_backend:TorchBackend",
    "onnxruntime": "bertqa_bench.backends.exported.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "bertqa_bench.backends.exported.tensorrt:TensorRTBackend",
    "openvino": "bertqa_bench.backends.exported.openvino:OpenVinoBackend",
}


# Modules that moved (issue 61: kernels/, backends/transforms/, backends/exported/), old dotted
# name -> new. A plug-in config or entry point naming an old ``module:Class`` keeps working: the
# class is the same, so a run is not lost to a rename, and a warning (once per path) names the
# path to write instead.
MOVED_MODULES = {
    "bertqa_bench.backends.onnxruntime": "bertqa_bench.backends.exported.onnxruntime",
    "bertqa_bench.backends.tensorrt": "bertqa_bench.backends.exported.tensorrt",
    "bertqa_bench.backends.openvino_backend": "bertqa_bench.backends.exported.openvino",
    "bertqa_bench.backends.onnx_export": "bertqa_bench.backends.exported.onnx_export",
    "bertqa_bench.backends.ort_static": "bertqa_bench.backends.exported.ort_static",
    "bertqa_bench.backends.torch_fp8": "bertqa_bench.backends.transforms.fp8_surgery",
    "bertqa_bench.backends.fp8_modules": "bertqa_bench.backends.transforms.fp8_modules",
    "bertqa_bench.backends.packed_bert": "bertqa_bench.backends.transforms.packed_encoder",
    "bertqa_bench.backends.quantize": "bertqa_bench.backends.transforms.int8_dynamic",
    "bertqa_bench.backends.fp8_math": "bertqa_bench.kernels.fp8_math",
    "bertqa_bench.backends.gelu_fp8": "bertqa_bench.kernels.gelu_fp8",
    "bertqa_bench.backends.gemm_epilogue": "bertqa_bench.kernels.cublaslt_epilogues",
    "bertqa_bench.backends.cudnn_fp8_attention": "bertqa_bench.kernels.cudnn_fp8_attention",
    "bertqa_bench.backends.triton_attention": "bertqa_bench.kernels.varlen_attention",
    "bertqa_bench.backends._triton_attention_kernels": "bertqa_bench.kernels._varlen_attention_triton",
    "bertqa_bench.backends.catalogue": "bertqa_bench.reporting.backend_listing",
}
_WARNED_MOVED: set[str] = set()


def _moved(module: str, target: str) -> str:
    """``module``'s new name if it moved (a warning naming the new path, once per path), else itself."""
    new = MOVED_MODULES.get(module)
    if new is None:
        return module
    if target not in _WARNED_MOVED:
        _WARNED_MOVED.add(target)
        log.warning("%s: module %s moved to %s; write %s:%s (the old path still works for now)",
                    target, module, new, new, target.partition(":")[2])
    return new


def import_object(target: str):
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(f"'{target}' is not an import path of the form package.module:Class")
    module = _moved(module, target)
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"cannot import {module} (for {target}): {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module} has no attribute '{attr}' (for {target})") from None
    return obj


def _as_backend_class(obj, where: str) -> type[Backend]:
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise ConfigError(f"{where}: {obj!r} is not a subclass of bertqa_bench.backends.Backend")
    return obj


def options_dict(options) -> dict:
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})


@dataclass(frozen=True)
class Variant:
    """One way of running the model, fully specified."""

    name: str
    implementation: str  # key of the implementation table, or package.module:Class
    device: str
    options: Any  # the implementation's Options dataclass instance
    description: str = ""
    source: str = "builtin"  # builtin | suite | entry point <dist>
    # How this variant is run, where it differs from the suite's bench section: a length-aware
    # variant beside padded ones in one table, a sweep point, a slow build with more time.
    timeout_s: Optional[float] = None
    batching: Optional[str] = None
    batch_size: Optional[int] = None
    devices: Optional[int] = None  # data-parallel prediction over this many GPUs (one process each)

    @property
    def backend_class(self) -> type[Backend]:
        return _implementation_class(self.implementation)

    @property
    def precision(self) -> str:
        return self.backend_class.precision_of(self.options)

    @property
    def parity_class(self) -> str:
        return parity_class_of(self.precision)

    def create(self) -> Backend:
        return self.backend_class(self)

    def unavailable_reason(self) -> Optional[str]:
        return self.backend_class.unavailable_reason(self)

    def to_dict(self) -> dict:
        """Plain data (for a worker's job file and the results); ``from_dict`` reverses it."""
        return {"name": self.name, "implementation": self.implementation, "device": self.device,
                "options": options_dict(self.options), "description": self.description, "source": self.source,
                **{k: getattr(self, k) for k in RUN_FIELDS}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Variant":
        return make_variant(d["name"], d["implementation"], d["device"], d.get("options") or {},
                            d.get("description", ""), d.get("source", "builtin"),
                            **{k: d.get(k) for k in RUN_FIELDS})


_EXTRA_IMPLEMENTATIONS: dict[str, str] = {}  # from entry points
_ENTRY_POINTS_READ = False


def _implementation_class(name: str) -> type[Backend]:
    target = IMPLEMENTATIONS.get(name) or _EXTRA_IMPLEMENTATIONS.get(name)
    if target is None and ":" in name:
        target = name
    if target is None and not _ENTRY_POINTS_READ:  # e.g. in a worker process: read the plug-ins once
        _entry_point_variants()
        target = _EXTRA_IMPLEMENTATIONS.get(name)
    if target is None:
        known = sorted(IMPLEMENTATIONS) + sorted(_EXTRA_IMPLEMENTATIONS)
        raise ConfigError(f"unknown backend implementation '{name}'; known: {', '.join(known)} "
                          "(or an import path package.module:Class)")
    return _as_backend_class(import_object(target), name)


RUN_FIELDS = ("timeout_s", "batching", "batch_size", "devices")


def make_variant(name: str, implementation: str, device: str, options: Mapping | Any = None,
                 description: str = "", source: str = "builtin", **run) -> Variant:
    if device not in DEVICES:
        raise ConfigError(f"variant '{name}': device '{device}' is not one of {', '.join(DEVICES)}")
    cls = _implementation_class(implementation)
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        options = build(cls.Options, dict(options or {}), f"variant '{name}' options")
    return Variant(name, implementation, device, options, description, source,
                   **{k: run.get(k) for k in RUN_FIELDS})


def _v(name: str, impl: str, device: str, description: str, when: str = "", **options) -> dict:
    return {"name": name, "implementation": impl, "device": device, "options": options, "description": description,
            "when": when}


_FP8 = {"scaling": "tensor", "gemms": "qkv,ffn_in,ffn_out"}
# The FP8 recipe of the fastest rows measured (results/reference/h100-perf.md): FP8 e4m3 GEMMs on
# the fused QKV and the FFN, the FFN's hidden activations kept in e4m3 between its two GEMMs, and
# the GELU between them in its tanh form (one Triton kernel, gelu_fp8.py).
_FP8_FAST = {**_FP8, "ffn_hidden_fp8": True, "ffn_gelu": "tanh"}

# --- the catalogue ------------------------------------------------------------------------------
# The variants a user chooses from, named by one rule:
#
#     <runtime>-<precision>[-<executor>][-<batching>]
#
# runtime    eager (PyTorch eager) | torch-compile (PyTorch under torch.compile / Inductor) |
#            ort (ONNX Runtime) | openvino (OpenVINO) | tensorrt (TensorRT)
# precision  fp32 | tf32 | bf16 | fp16 | int8 | fp8: the arithmetic of the encoder's GEMMs (fp8 and
#            int8 keep the rest in 16 bits, or fp32 on the CPU)
# executor   absent: kernels launched batch by batch; graph: every shape (padded) or 1,024-token
#            bucket (packed) replayed from one captured CUDA graph
# batching   absent: padded to the run's fixed shapes; sorted: length-sorted batches under a token
#            budget; packed: padding-free (real tokens only). ``<name>-sorted`` and
#            ``<name>-trimmed`` exist for every name (the table derives them).
#
# The device is a field, never part of the name: a name on both devices (eager-fp32, eager-bf16)
# runs on the suite's ``bench.device``. ``when`` is the one line ``bertqa-bench backends`` shows.
# Research rows and superseded recipes are declared in benchmarks/experiments.yaml (``base:`` a
# catalogue name + typed options) under the names they were measured by; old names of catalogue
# rows are ALIASES below.
CATALOGUE = (
    # CPU
    _v("eager-fp32", "torch", "cpu", "PyTorch eager fp32, SDPA attention",
       "the CPU reference: every CPU speedup and parity verdict is against it"),
    _v("eager-bf16", "torch", "cpu", "PyTorch eager with bf16 weights",
       "stay in PyTorch on a CPU with native BF16 (AMX, avx512_bf16); answers may move slightly", weights="bf16"),
    _v("torch-compile-fp32", "torch", "cpu", "torch.compile (Inductor), fp32",
       "stay in PyTorch with fp32 answers; a little faster than eager", compile="default"),
    _v("ort-fp32", "onnxruntime", "cpu", "ONNX Runtime CPU, fp32, fused BERT graph",
       "deploy an ONNX model with fp32 answers"),
    # per_channel: measured on the CI model, per-tensor weight scales cost 13% of F1, per-channel 0.1%.
    _v("ort-int8", "onnxruntime", "cpu",
       "ONNX Runtime CPU, dynamic int8 (per-channel QInt8 weights) on the fused graph",
       "INT8 with ONNX Runtime and no calibration step", graph="int8", per_channel=True),
    # OpenVINO's CPU plugin (openvino.py): fp32, bf16 where the CPU has it natively, and
    # NNCF's static INT8 (calibrated on the run's batches, SmoothQuant, the QA head fp32).
    _v("openvino-fp32", "openvino", "cpu", "OpenVINO CPU, fp32 (inference precision f32), from the ONNX export",
       "the fastest CPU backend with fp32 answers measured"),
    _v("openvino-bf16", "openvino", "cpu", "OpenVINO CPU, bf16 inference precision",
       "CPUs with native BF16 only; answers may move slightly", precision="bf16"),
    _v("openvino-int8", "openvino", "cpu",
       "OpenVINO CPU, NNCF static INT8 (calibrated on the run's batches, SmoothQuant, head fp32)",
       "static INT8 at fixed shapes (padded batches)", precision="int8"),
    {**_v("openvino-int8-sorted", "openvino", "cpu", "openvino-int8 with length-sorted batches",
          "the fastest CPU backend measured at parity", precision="int8"), "batching": "sorted"},
    # CUDA
    _v("eager-fp32", "torch", "cuda", "PyTorch eager fp32 on CUDA, TF32 off",
       "the GPU reference: every GPU speedup and parity verdict is against it"),
    _v("eager-tf32", "torch", "cuda", "PyTorch eager, fp32 weights, TF32 matmuls",
       "fp32-class answers (TF32 keeps fp32 storage and accumulation) at a few times fp32's speed", tf32=True),
    _v("eager-fp16", "torch", "cuda", "PyTorch eager with fp16 weights",
       "the simplest reduced precision, no compile step", weights="fp16"),
    _v("eager-bf16", "torch", "cuda", "PyTorch eager with bf16 weights",
       "bf16's fp32 range where fp16 would overflow", weights="bf16"),
    _v("torch-compile-fp16-graph", "torch", "cuda",
       "torch.compile fp16, one captured torch.cuda.CUDAGraph per shape of the run",
       "fixed-shape fp16 on GPUs without FP8 (before Hopper/Ada)", weights="fp16", compile="default",
       cuda_graph="manual"),
    {**_v("torch-compile-fp16-packed", "torch", "cuda",
          "padding-free fp16 (real tokens only, variable-length FlashAttention, packed_encoder.py) under "
          "torch.compile with a dynamic token count",
          "the fastest fp16 backend on GPUs without FP8", weights="fp16", compile="default", dynamic=True,
          packed=True), "batching": "packed"},
    # The fastest padded path measured, its levers at their measured best: the FFN-up GEMM with its
    # bias and GELU in one cuBLASLt kernel, its algorithm autotuned per shape (nvmath-python), two
    # CUDA streams. The row without them: torch-compile-fp8-graph+plain.
    _v("torch-compile-fp8-graph", "torch", "cuda",
       "FP8 e4m3 GEMMs (fused QKV and the FFN, static activation scales calibrated in prepare; the FFN's hidden "
       "activations in e4m3; the FFN-up GEMM, its bias and GELU in one cuBLASLt kernel, autotuned per shape), fp16 "
       "elsewhere, SDPA on cuDNN attention, torch.compile, one CUDA graph per shape, two CUDA streams",
       "the fastest fixed-shape backend measured (FP8: Hopper or Ada GPUs; pip install nvmath-python)",
       weights="fp16", compile="default", cuda_graph="manual", sdpa_backend="cudnn", pipeline=True, streams=2,
       fp8={**_FP8_FAST, "ffn_gelu": "epilogue", "cublaslt_autotune": 5}),
    # The fastest path measured, with its levers as typed options at their measured best (each
    # measured beside the row without it in one run, results/reference/h200-mlperf-bert-large*.md):
    # every GEMM in FP8 (the attention output projection too), the suite's Triton variable-length
    # attention writing e4m3 for that projection, the FFN-up GEMM with its bias and GELU in one
    # cuBLASLt kernel and cuBLASLt's algorithms autotuned per token bucket (nvmath-python), the
    # batches on two CUDA streams. The row without them: torch-compile-fp8-graph-packed+plain.
    {**_v("torch-compile-fp8-graph-packed", "torch", "cuda",
          "padding-free FP8 (every GEMM in e4m3, static scales), one CUDA graph per 1,024-token bucket, each batch "
          "packed on the host, the QA head inside the graphs; the suite's Triton variable-length attention writing "
          "e4m3 for the FP8 output projection, the FFN-up GEMM + bias + GELU in one cuBLASLt kernel, cuBLASLt's "
          "algorithms autotuned per bucket (nvmath-python), two CUDA streams",
          "the fastest backend measured (FP8: Hopper or Ada GPUs; pip install nvmath-python)", weights="fp16",
          compile="default", packed=True, token_bucket=1024, host_pack=True, pipeline=True, head_first=True,
          packed_attention="triton", streams=2,
          fp8={**_FP8_FAST, "gemms": "all", "attention_output": "e4m3", "ffn_gelu": "epilogue",
               "cublaslt_gemms": "attn_out", "cublaslt_autotune": 5}),
     "batching": "packed"},
    _v("ort-fp16-graph", "onnxruntime", "cuda", "ONNX Runtime CUDA EP, fp16 fused graph, one CUDA graph per shape",
       "deploy an ONNX model on a GPU", graph="fp16", cuda_graph=True),
    _v("tensorrt-fp16", "tensorrt", "cuda", "TensorRT 10 fp16 engine from the ONNX export (execute_async_v3)",
       "deploy with TensorRT (pip install .[tensorrt])"),
)

# Old names -> (catalogue name, device or None). results/reference/ and old commands keep working:
# a suite or --backends naming one runs the new variant, and bench prints the new name.
ALIASES = {
    "eager-fp32-cuda": ("eager-fp32", "cuda"),
    "eager-bf16-cpu": ("eager-bf16", "cpu"),
    "torch-compile": ("torch-compile-fp32", "cpu"),
    "onnxruntime": ("ort-fp32", "cpu"),
    "onnxruntime-int8": ("ort-int8", "cpu"),
    "openvino": ("openvino-fp32", "cpu"),
    "ort-cuda-fp16-graph": ("ort-fp16-graph", "cuda"),
}
# Research rows and superseded recipes, under the names they were measured by.
EXPERIMENTS_FILE = BENCHMARKS_DIR / "experiments.yaml"
# Batchings the table derives for any name: ``<name>-sorted`` is <name> with sorted batching.
DERIVED_BATCHINGS = ("sorted", "trimmed")


def _entry_point_variants() -> list[dict]:
    global _ENTRY_POINTS_READ
    _ENTRY_POINTS_READ = True
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point '{ep.name}' ({ep.value})"
        try:
            cls = _as_backend_class(ep.load(), where)
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not take the built-in backends down
            log.warning("skipping %s: %s", where, e)
            continue
        _EXTRA_IMPLEMENTATIONS[ep.name] = ep.value
        declared = getattr(cls, "variants", None) or {
            ep.name: {"device": getattr(cls, "default_device", "cpu")}}
        dist = getattr(ep, "dist", None)
        source = f"entry point {dist.name if dist else ep.name}"
        for vname, spec in declared.items():
            out.append(_plugin_variant(vname, spec, ep.name, getattr(cls, "default_device", "cpu"),
                                       cls.__doc__ or "", source, where))
    return out


# What a plug-in's ``variants`` entry may say: the same fields as a suite's ``variants:`` entry.
PLUGIN_VARIANT_KEYS = ("device", "options", "description") + RUN_FIELDS


def _plugin_variant(name, spec, implementation: str, default_device: str, doc: str, source: str, where: str) -> dict:
    """A plug-in's declared variant, its keys checked like a suite's: an unknown key (a typo of
    timeout_s, say) is an error naming the valid ones, kept with the variant and raised when it is
    used, so one bad plug-in never takes the other backends down."""
    d = {"name": name, "implementation": implementation, "source": source, "device": default_device,
         "options": {}, "description": doc}
    if not isinstance(spec, Mapping):
        d["error"] = f"{where}: variant '{name}' must be a mapping of {', '.join(PLUGIN_VARIANT_KEYS)}, not {spec!r:.80}"
        return d
    unknown = sorted(map(str, set(spec) - set(PLUGIN_VARIANT_KEYS)))
    if unknown:
        d["error"] = (f"{where}: variant '{name}' has unknown field(s) {', '.join(unknown)}; "
                      f"valid: {', '.join(sorted(PLUGIN_VARIANT_KEYS))}")
        return d
    d.update({k: v for k, v in spec.items() if k != "options" or v is not None})
    return d


class VariantTable:
    """Every variant a suite can name, resolved and validated: the catalogue (and plug-ins), the
    research rows of benchmarks/experiments.yaml, the suite's own ``variants:``; old names through
    ``ALIASES``; ``<name>-sorted`` / ``<name>-trimmed`` derived from any name. A name may exist on
    several devices (eager-fp32 on cpu and cuda): the suite's ``bench.device`` picks, else cpu."""

    def __init__(self, declared: Iterable[dict], device: Optional[str] = None):
        self._raw: dict[str, list[dict]] = {}  # name -> its declarations, one per device
        self.device = device
        for d in declared:
            self._add(d)
        self._resolved: dict[tuple, Variant] = {}
        self.aliases: dict = dict(ALIASES)  # old name -> (its row's name now, device or None)

    def _add(self, d: dict) -> None:
        """A built-in or plug-in declaration: one per (name, device), a later one replacing it."""
        others = [x for x in self._raw.get(d["name"], []) if x.get("device") != d.get("device")]
        self._raw[d["name"]] = others + [d]

    @classmethod
    def for_suite(cls, variants: Optional[dict] = None, device: Optional[str] = None) -> "VariantTable":
        """The catalogue, plug-ins, research rows and a suite's own ``variants:`` (SuiteConfig.variants),
        names resolved on ``device`` (bench.device) first."""
        table = cls(list(CATALOGUE) + _entry_point_variants(), device)
        table.aliases = {**ALIASES, **{old: (new, None) for old, new in experiment_renames().items()}}
        for name, decl in experiment_declarations().items():  # never shadowing a catalogue name
            if name not in table._raw:
                table._raw[name] = [{**table._from_suite(name, decl), "source": "experiments"}]
        for name, decl in (variants or {}).items():
            table._raw[name] = [table._from_suite(name, decl)]  # a suite's own name means what it says
        for decls in table._raw.values():  # validate everything now: a bad option fails before any work
            for d in decls:
                if not d.get("error"):  # (a broken plug-in variant fails when it is used)
                    make_variant(d["name"], d["implementation"], d["device"], d.get("options"),
                                 d.get("description", ""), d.get("source", "builtin"),
                                 **{k: d.get(k) for k in RUN_FIELDS})
        return table

    def _pick(self, name: str, device: Optional[str] = None) -> Optional[dict]:
        """``name``'s declaration on ``device``; without one, on the table's device, else the only one
        or the CPU one."""
        decls = self._raw.get(name) or []
        if device:
            return next((d for d in decls if d.get("device") == device), None)
        if len(decls) <= 1:
            return decls[0] if decls else None
        want = self.device or "cpu"
        return next((d for d in decls if d.get("device") == want), decls[0])

    def _from_suite(self, name: str, decl) -> dict:
        if decl.base:
            try:
                _, base = self._lookup(decl.base, decl.device)
            except UnknownBackendError:  # a base on another device: its options, this device
                try:
                    _, base = self._lookup(decl.base)
                except UnknownBackendError:
                    raise UnknownBackendError(decl.base, self.names(), what=f"base of variant '{name}'") from None
            options = _merge(base.get("options") or {}, decl.options)
            run = {k: getattr(decl, k) if getattr(decl, k) is not None else base.get(k) for k in RUN_FIELDS}
            return {"name": name, "implementation": base["implementation"], "device": decl.device or base["device"],
                    "options": options, "description": decl.description or _describe(decl), "source": "suite", **run}
        return {"name": name, "implementation": decl.implementation, "device": decl.device or "cpu",
                "options": decl.options, "description": decl.description, "source": "suite",
                **{k: getattr(decl, k) for k in RUN_FIELDS}}

    def _lookup(self, name: str, device: Optional[str] = None) -> tuple[str, dict]:
        """(the name its row gets, its declaration)."""
        if name in self._raw:
            d = self._pick(name, device)
            if d is not None:
                return name, d
        elif name in self.aliases:
            new, dev = self.aliases[name]
            d = self._pick(new, device or dev)
            if d is not None:
                # the new name where it means this device in this table; else (eager-fp32-cuda in a
                # CPU suite) the row keeps the old name, so it never collides with the new one's row
                return (new if d is self._pick(new) else name), d
        m = re.fullmatch(rf"(.+)-({'|'.join(DERIVED_BATCHINGS)})", name)
        if m and name not in self._raw:
            try:
                row, base = self._lookup(m[1], device)
            except UnknownBackendError:
                base = None
            if base is not None and base.get("batching") in (None, "padded"):
                return f"{row}-{m[2]}", {**base, "name": f"{row}-{m[2]}", "batching": m[2],
                                         "description": f"{row} with {m[2]} batching"}
        raise UnknownBackendError(name, self.names()) if device is None else UnknownBackendError(
            name, [n for n in self.names() if self._pick(n, device)], what=f"backend on {device}")

    def names(self) -> list[str]:
        return sorted(self._raw)

    def get(self, name: str, device: Optional[str] = None) -> Variant:
        """The variant ``name`` means in this table (an old name: its new variant, named as
        ``canonical`` says); ``device`` picks among a name's devices."""
        key = (name, device)
        if key not in self._resolved:
            row, d = self._lookup(name, device)
            if d.get("error"):
                raise ConfigError(d["error"])
            self._resolved[key] = make_variant(row, d["implementation"], d["device"], d.get("options"),
                                               d.get("description", ""), d.get("source", "builtin"),
                                               **{k: d.get(k) for k in RUN_FIELDS})
        return self._resolved[key]

    def require(self, names: Iterable[str]) -> list[Variant]:
        return [self.get(n) for n in names]

    def canonical(self, name: str) -> str:
        """The name ``name``'s row gets (old names: the catalogue's)."""
        return self.get(name).name

    def alias_note(self, name: str) -> Optional[str]:
        """What an old name means now, in one line; None for a current name."""
        base = re.sub(rf"-({'|'.join(DERIVED_BATCHINGS)})$", "", name) if name not in self._raw else name
        if base in self._raw or base not in self.aliases:
            return None
        v = self.get(name)
        new = self.aliases[base][0] + name[len(base):]
        if v.name == name:
            return (f"'{name}' is an old name of '{new}' on {v.device}; this suite's device is "
                    f"{self.device or 'cpu'}, so its row keeps the old name")
        return f"'{name}' is an old name: its row is '{v.name}'"

    def canonical_names(self, names: Iterable[str], note: Optional[Callable[[str], None]] = None) -> list[str]:
        """Each name as its row is named, in order, without repeats; ``note`` gets a line for each old name."""
        out: list[str] = []
        for n in names:
            msg = self.alias_note(n)
            if msg and note is not None:
                note(f"note: {msg}")
            c = self.canonical(n)
            if c not in out:
                out.append(c)
        return out

    def declarations(self, source: Optional[str] = None) -> list[dict]:
        """Every declaration (one per name and device) in the order declared (the catalogue's first),
        optionally of one source: builtin (the catalogue), entry point <dist>, experiments, suite."""
        return [d for decls in self._raw.values() for d in decls if source is None or d.get("source", "builtin") == source]

    def all(self) -> list[Variant]:
        """Every usable variant, one per name and device."""
        return [self.get(d["name"], d.get("device") if len(self._raw[d["name"]]) > 1 else None)
                for d in self.declarations() if not d.get("error")]

    def broken(self) -> dict[str, str]:
        """Declared variants that cannot be used, with why (plug-ins with bad fields)."""
        return {d["name"]: d["error"] for d in self.declarations() if d.get("error")}


def experiment_declarations() -> dict:
    """benchmarks/experiments.yaml's ``variants:`` (research rows and superseded recipes), typed;
    none when the file is absent (an installed package without the benchmarks folder)."""
    global _EXPERIMENTS
    if _EXPERIMENTS is None:
        raw = {}
        if EXPERIMENTS_FILE.is_file():
            raw = (yaml.safe_load(EXPERIMENTS_FILE.read_text(encoding="utf-8")) or {}).get("variants") or {}
        _EXPERIMENTS = {name: build(VariantConfig, dict(decl or {}), f"{EXPERIMENTS_FILE}: variant '{name}'")
                        for name, decl in raw.items()}
    return _EXPERIMENTS


_EXPERIMENTS: Optional[dict] = None
_RENAMES: Optional[dict] = None


def experiment_renames() -> dict:
    """benchmarks/experiments.yaml's ``renamed:``: the names research rows were measured by -> their
    names now (catalogue grammar plus a ``+`` suffix, or the catalogue row they became)."""
    global _RENAMES
    if _RENAMES is None:
        raw = {}
        if EXPERIMENTS_FILE.is_file():
            raw = (yaml.safe_load(EXPERIMENTS_FILE.read_text(encoding="utf-8")) or {}).get("renamed") or {}
        _RENAMES = {str(k): str(v) for k, v in raw.items()}
    return _RENAMES


def _describe(decl) -> str:
    parts = [f"{decl.base}"] + [f"{k}={getattr(decl, k)}" for k in RUN_FIELDS if getattr(decl, k) is not None]
    return " ".join(parts) + (f" with {decl.options}" if decl.options else "")


def _merge(base: Mapping, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def default_table() -> VariantTable:
    return VariantTable.for_suite()


_NOTED: set = set()


def note_once(line: str) -> None:
    """An old name's note, on stderr, once per process."""
    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr)


__all__ = ["ALIASES", "BUILTIN", "CATALOGUE", "ENTRY_POINT_GROUP", "IMPLEMENTATIONS", "Variant", "VariantTable", "default_table",
           "import_object", "make_variant"]
