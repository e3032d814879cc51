"""ONNX export shared by the onnxruntime and TensorRT backends, validated before anyone uses it.

Why the exporter choice matters (observed with torch 2.13, transformers 5.24, onnxruntime 1.32):

* The legacy TorchScript exporter (``dynamo=False``, opset 17) of the eager-attention model gives
  a graph that onnxruntime's transformer optimizer fuses completely: one Attention node per
  layer, SkipLayerNormalization, BiasGelu and EmbedLayerNormalization.
* The dynamo exporter (``dynamo=True`` with ``dynamic_shapes``) gives a correct graph too, but the
  optimizer fuses no Attention node in it (and no EmbedLayerNormalization), so onnxruntime would
  run unfused attention and the comparison would be unfair to it.

So ``exporter="auto"`` tries TorchScript first and falls back to dynamo only when TorchScript
fails (it is deprecated and may go away) or its graph does not match PyTorch.

Why every export is checked against PyTorch at two shapes: an exported graph can silently bake
in the example's shape (a traced constant, a specialised broadcast); one such export gave
logits off by about 1.0 at a batch/sequence shape other than the one it was traced at. The check
runs the ONNX model with onnxruntime's CPU provider at the run's sample batch and at a second
batch of another batch size and sequence length (with padded rows), and fails prepare with the
measured difference if it is above tolerance. It runs on every prepare, also when the export
came from the cache, because the run's shape may differ from the one the cache was checked at.
Batches of more than ``CHECK_ROWS`` rows are checked in chunks of rows (host memory; see there),
so the CPU check sees the run's sequence lengths, batch sizes up to ``CHECK_ROWS`` and the odd
second batch; the timed session is checked at the run's full shapes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ...errors import BenchError
from ...io import atomic_path
from ..base import INPUT_NAMES, batch_at_shape

log = logging.getLogger(__name__)

EXPORTERS = ("auto", "torchscript", "dynamo")
DEFAULT_OPSET = 17  # LayerNormalization is a real op from 17 on: TensorRT keeps it in fp32-safe form
FP32_ATOL = 1e-3


class OnnxExportError(BenchError):
    """The model could not be exported, or the export does not reproduce PyTorch's outputs."""


@dataclass
class OnnxExport:
    path: Path
    exporter: str
    opset: int
    cache_hit: bool
    key: str
    # The batches the export was validated at, with PyTorch fp32 (eager attention) outputs:
    # callers validate their own optimised/converted artifacts against the same references.
    batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    references: list[dict[str, np.ndarray]] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # raw export vs PyTorch, worst shape
    seq_axis_outputs: tuple[str, ...] = ()  # outputs whose axis 1 is the sequence axis
    failed_exporters: dict[str, str] = field(default_factory=dict)
    n_run_batches: int = 1  # batches[:n_run_batches] are at the run's own shapes

    @property
    def run_batches(self) -> tuple[list, list]:
        """(batches, references) at the run's shapes: what a fixed-shape session (CUDA graphs) is checked at."""
        return self.batches[:self.n_run_batches], self.references[:self.n_run_batches]

    def info(self, prefix: str = "onnx_") -> dict[str, Any]:
        out = {f"{prefix}exporter": self.exporter, f"{prefix}opset": self.opset,
               f"{prefix}cache_hit": self.cache_hit,
               f"{prefix}validated_shapes": ";".join("x".join(map(str, b["input_ids"].shape)) for b in self.batches),
               f"{prefix}max_abs_diff": max(self.max_abs_diff.values(), default=0.0)}
        for name, why in self.failed_exporters.items():
            out[f"{prefix}{name}_failed"] = why[:200]
        return out


# --------------------------------------------------------------------------- fingerprints

def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """Content hash of a saved model (config and weights), so a retrained model re-exports.

    Hashing content rather than mtimes costs about a second for BERT-base and survives copies.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in (".safetensors", ".bin")))
    if not files:
        raise OnnxExportError(f"{model_dir}: no config.json or weights to export")
    for p in files:
        h.update(p.name.encode())
        h.update(file_digest(p).encode())
    return h.hexdigest()


def cache_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- validation batches

def as_int64_batch(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: np.ascontiguousarray(batch[n], dtype=np.int64) for n in INPUT_NAMES}


def run_shape_subset(shapes: Sequence[tuple[int, int]], limit: int = 3) -> list[tuple[int, int]]:
    """Up to ``limit`` of the run's shapes to validate at: the largest, the shortest, one between."""
    ordered = sorted(set(shapes), key=lambda bs: (bs[1], bs[0]), reverse=True)
    if len(ordered) <= limit:
        return ordered
    picks = [ordered[0], ordered[len(ordered) // 2], ordered[-1]]
    return list(dict.fromkeys(picks))[:limit]


def validation_batches(sample_batch: Mapping[str, np.ndarray], max_batch_size: int, max_seq_len: int,
                       shapes: Sequence[tuple[int, int]] = ()) -> list[dict[str, np.ndarray]]:
    """Real batches at (up to three of) the run's shapes, then one at a shape the run never uses.

    The run's shapes are what the timed session must get right; the extra batch (another
    batch size and sequence length, its last row padded) catches an export that baked the
    traced shape in. Rows are cut from (or tiled out of) the sample's real rows: never zeros.
    """
    first = as_int64_batch(sample_batch)
    b, s = first["input_ids"].shape
    run = [first] + [batch_at_shape(first, rb, rs) for rb, rs in run_shape_subset(shapes) if (rb, rs) != (b, s)]
    b2 = b - 1 if b > 1 else min(2, max_batch_size)  # stays inside a TensorRT profile's batch range
    if s >= 12:
        s2 = (s * 2) // 3
    elif s + 4 <= max_seq_len:
        s2 = s + 4
    else:
        s2 = max(1, s - 1)
    second = batch_at_shape(first, b2, s2)
    # Pad the tail of the last row so this batch has masked positions whatever the sample had.
    keep = max(1, s2 // 2)
    for n in INPUT_NAMES:
        second[n][-1, keep:] = 0
    return run + [second]


def seq_axis_outputs(batches: Sequence[Mapping[str, np.ndarray]],
                     references: Sequence[Mapping[str, np.ndarray]]) -> tuple[str, ...]:
    names = references[0].keys()
    out = []
    for n in names:
        if all(r[n].ndim >= 2 and r[n].shape[1] == b["input_ids"].shape[1] for b, r in zip(batches, references)):
            out.append(n)
    return tuple(out)


# The CPU checks hold a lot of host memory at large batches: eager attention in fp32 keeps a
# batch x heads x seq x seq score tensor per layer (1.8 GB at 256 x 384 for BERT-base), and
# onnxruntime's CPU arena keeps its peak. A BERT row does not
# depend on the other rows, so the CPU checks run in chunks of rows: the same numbers, bounded
# memory. The timed session itself is still checked at the run's full shapes (on its device).
CHECK_ROWS = 32


def in_row_chunks(run, rows: int = CHECK_ROWS):
    """``run(batch) -> {name: array}`` applied to at most ``rows`` rows at a time, outputs joined
    along the batch axis (every output here is batch-first)."""
    def chunked(batch):
        n = batch["input_ids"].shape[0]
        if n <= rows:
            return run(batch)
        parts = [run({k: v[i:i + rows] for k, v in batch.items()}) for i in range(0, n, rows)]
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    return chunked


def torch_reference(module, batches: Iterable[Mapping[str, np.ndarray]],
                    output_names: Sequence[str], rows: int = CHECK_ROWS) -> list[dict[str, np.ndarray]]:
    import torch

    def run(b):
        outs = module(*(torch.from_numpy(b[n]) for n in INPUT_NAMES))
        return {n: o.float().numpy().copy() for n, o in zip(output_names, outs)}

    with torch.inference_mode():
        return [in_row_chunks(run, rows)(b) for b in batches]


def max_abs_diff(outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> dict[str, float]:
    diffs = {}
    for n, ref in reference.items():
        got = np.asarray(outputs[n], dtype=np.float32)
        if got.shape != ref.shape:
            diffs[n] = float("inf")
        elif not np.isfinite(got).all():
            diffs[n] = float("nan")
        else:
            diffs[n] = float(np.abs(got - ref).max()) if ref.size else 0.0
    return diffs


def check_against_reference(run, batches, references, atol: Optional[float], what: str) -> dict[str, float]:
    """Run ``run(batch) -> {name: array}`` on every batch; worst |diff| per output.

    Raises OnnxExportError when any diff exceeds ``atol`` (None: only measure) or is not finite.
    """
    worst: dict[str, float] = {}
    for b, ref in zip(batches, references):
        diffs = max_abs_diff(run(b), ref)
        for n, d in diffs.items():
            bad = not np.isfinite(d) or (atol is not None and d > atol)
            if bad:
                shape = "x".join(map(str, b["input_ids"].shape))
                raise OnnxExportError(
                    f"{what} does not match PyTorch at batch x seq = {shape}: max|diff| of '{n}' is {d:.3g}"
                    + (f" (tolerance {atol:g})" if atol is not None else "")
                    + "; the exported graph is not shape-generic or the conversion broke it")
            worst[n] = max(worst.get(n, 0.0), d)
    return worst


def ort_cpu_runner(path: Path | str, output_names: Sequence[str]):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}

    def run(batch):
        outs = sess.run(list(output_names), {n: batch[n] for n in INPUT_NAMES if n in wanted})
        return dict(zip(output_names, outs))

    return run


# --------------------------------------------------------------------------- export

# Rows of the example the exporter traces. The graph has dynamic batch and sequence axes, so a
# few rows at the sample's sequence length give the same graph as the whole sample batch (the
# validation at the run's shapes is what proves it), and tracing them is cheaper. Three rows: not
# 1 (torch.export specialises a size-1 dim to a constant) and unlike any other dimension of a BERT
# (2 logits, 12 heads), so no size can be mistaken for another.
EXPORT_ROWS = 3


def _export_example(batch: Mapping[str, np.ndarray], rows: int = EXPORT_ROWS):
    """``rows`` rows of the batch (its own rows repeated when it has fewer), at its sequence length."""
    import torch

    b = batch["input_ids"].shape[0]
    take = np.arange(rows) % b
    return tuple(torch.from_numpy(np.ascontiguousarray(batch[n][take])) for n in INPUT_NAMES)


def _export_torchscript(module, example, path: Path, output_names, seq_outputs, opset: int) -> None:
    import torch

    dynamic_axes = {n: {0: "batch", 1: "sequence"} for n in INPUT_NAMES}
    for n in output_names:
        dynamic_axes[n] = {0: "batch", 1: "sequence"} if n in seq_outputs else {0: "batch"}
    with warnings.catch_warnings():
        # TracerWarnings about Python bools in transformers' mask code are expected; the
        # two-shape validation is what tells whether they mattered.
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), input_names=list(INPUT_NAMES),
                          output_names=list(output_names), dynamic_axes=dynamic_axes,
                          opset_version=opset, do_constant_folding=True, dynamo=False)


def _export_dynamo(module, example, path: Path, output_names, opset: int, max_positions: int) -> None:
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1)
    seq = Dim("sequence", min=1, max=max_positions)
    dynamic_shapes = {n: {0: batch, 1: seq} for n in INPUT_NAMES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # dynamo emits opset >= 18 natively; asking for less makes it run a version converter.
        torch.onnx.export(module, example, str(path), input_names=list(INPUT_NAMES),
                          output_names=list(output_names), dynamic_shapes=dynamic_shapes,
                          opset_version=max(opset, 18), dynamo=True, optimize=True,
                          external_data=False, verbose=False)


def export_onnx(model_dir: str | Path, task: str, artifacts_dir: str | Path, output_names: Sequence[str],
                sample_batch: Mapping[str, np.ndarray], *, max_batch_size: int, max_seq_len: int,
                shapes: Sequence[tuple[int, int]] = (), exporter: str = "auto", opset: int = DEFAULT_OPSET,
                atol: float = FP32_ATOL, validate_with_ort: bool = True) -> OnnxExport:
    """Export (or reuse) the fp32, eager-attention model as ONNX with dynamic batch and sequence.

    The file is cached under ``artifacts_dir/onnx`` keyed by the model's content, the exporter,
    the opset and the torch version. Returns the path and the validation batches/references.
    """
    import torch

    from ...model.modeling import load_inference_module

    if exporter not in EXPORTERS:
        raise OnnxExportError(f"unknown ONNX exporter '{exporter}'; choose one of {', '.join(EXPORTERS)}")
    output_names = tuple(output_names)
    out_dir = Path(artifacts_dir) / "onnx"
    out_dir.mkdir(parents=True, exist_ok=True)

    # Eager attention: onnxruntime's optimizer fuses Attention only in that graph (0 with SDPA).
    module = load_inference_module(model_dir, task, attn_implementation="eager", dtype=torch.float32).float().cpu()
    max_positions = int(getattr(module.model.config, "max_position_embeddings", max(max_seq_len, 512)))
    batches = validation_batches(sample_batch, max_batch_size, min(max_seq_len, max_positions), shapes)
    references = torch_reference(module, batches, output_names)
    seq_outputs = seq_axis_outputs(batches, references)

    fingerprint = model_fingerprint(model_dir)
    candidates = ["torchscript", "dynamo"] if exporter == "auto" else [exporter]
    failed: dict[str, str] = {}
    try:
        for name in candidates:
            key = cache_key(fingerprint, name, opset, torch.__version__, output_names, seq_outputs)
            path = out_dir / f"model-{name}-{key}.onnx"
            cache_hit = path.exists()
            try:
                if not cache_hit:
                    example = _export_example(batches[0])
                    # atomic: a killed export never leaves a half file in the cache
                    # no_grad: with autograd on, the trace kept every layer's saved activations;
                    # prepare peaked at 77.7 GiB of host memory at 256 x 384 on the H100 host
                    # (results/reference/h100-sweep.md). MiniLM at 64 x 384 on a CPU: 6.7 GiB
                    # without it, 1.7 GiB with it.
                    with atomic_path(path, suffix=".onnx") as tmp, torch.no_grad():
                        if name == "torchscript":
                            _export_torchscript(module, example, tmp, output_names, seq_outputs, opset)
                        else:
                            _export_dynamo(module, example, tmp, output_names, opset, max_positions)
                diffs: dict[str, float] = {}
                if validate_with_ort:
                    runner = in_row_chunks(ort_cpu_runner(path, output_names))
                    diffs = check_against_reference(runner, batches, references, atol,
                                                    f"ONNX export ({name} exporter)")
            except Exception as e:  # noqa: BLE001 - any failure of one exporter means: try the next
                failed[name] = f"{type(e).__name__}: {e}"
                log.warning("ONNX export with the %s exporter failed: %s", name, failed[name])
                if path.exists() and not cache_hit:
                    path.unlink()
                continue
            return OnnxExport(path=path, exporter=name, opset=opset if name == "torchscript" else max(opset, 18),
                              cache_hit=cache_hit, key=key, batches=batches, references=references,
                              max_abs_diff=diffs, seq_axis_outputs=seq_outputs, failed_exporters=failed,
                              n_run_batches=len(batches) - 1)
    finally:
        del module
    details = "; ".join(f"{k}: {v}" for k, v in failed.items())
    raise OnnxExportError(f"could not export {model_dir} to a valid ONNX model ({details})")
