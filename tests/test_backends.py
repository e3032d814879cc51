"""Backends on a tiny random BERT: registry contract, CPU parity, availability reasons, GPU parity.

CPU tests run everywhere (about half a minute on one core, most of it one tiny torch.compile);
tests marked ``gpu`` skip with a reason when torch sees no CUDA device.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bertqa_bench.backends import BackendContext, create, get_spec, names, specs
from bertqa_bench.backends.onnx_export import (OnnxExportError, check_against_reference, model_fingerprint,
                                               validation_batches)
from bertqa_bench.errors import UnknownBackendError

OUTPUTS = ("start_logits", "end_logits")
LAYERS = 2
MAX_BATCH, MAX_SEQ = 4, 64
PRECISIONS = {"fp32", "tf32", "amp-fp16", "fp16", "bf16", "int8", "fp8"}
FP32_CLASS_PRECISIONS = {"fp32", "tf32"}  # TF32 keeps fp32 storage/accumulation: FP32-class tolerances
EXPECTED = {
    "eager-fp32": ("cpu", "fp32", "fp32"),
    "eager-fp32-cuda": ("cuda", "fp32", "fp32"),
    "eager-tf32": ("cuda", "tf32", "fp32"),
    "eager-amp-fp16": ("cuda", "amp-fp16", "reduced"),
    "eager-fp16": ("cuda", "fp16", "reduced"),
    "eager-bf16": ("cuda", "bf16", "reduced"),
    "eager-bf16-cpu": ("cpu", "bf16", "reduced"),
    "torch-compile": ("cpu", "fp32", "fp32"),
    "torch-compile-fp16": ("cuda", "fp16", "reduced"),
    "torch-compile-fp16-max-autotune": ("cuda", "fp16", "reduced"),
    "torch-compile-fp16-cudagraphs": ("cuda", "fp16", "reduced"),
    "onnxruntime": ("cpu", "fp32", "fp32"),
    "onnxruntime-int8": ("cpu", "int8", "reduced"),
    "ort-cuda-fp32": ("cuda", "fp32", "fp32"),
    "ort-cuda-fp16": ("cuda", "fp16", "reduced"),
    "ort-cuda-fp16-graph": ("cuda", "fp16", "reduced"),
    "tensorrt-fp16": ("cuda", "fp16", "reduced"),
}

def _ort_fuses_transformers5_attention() -> bool:
    # onnxruntime's optimizer matches transformers 5's eager-attention mask only from 1.31 on.
    import onnxruntime
    import transformers

    ort = tuple(int(x) for x in onnxruntime.__version__.split(".")[:2])
    return ort >= (1, 31) or int(transformers.__version__.split(".")[0]) < 5


def assert_attention_fused(info) -> None:
    if _ort_fuses_transformers5_attention():
        assert info["fused_Attention"] == LAYERS, info
    else:
        assert "fusion_warning" in info, info


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertForQuestionAnswering

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    model = BertForQuestionAnswering(config)
    # Larger-than-init QA head weights so logits are O(1) and differences are meaningful.
    with torch.no_grad():
        model.qa_outputs.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("models") / "tiny-bert-qa"
    model.save_pretrained(path)
    return path


def make_batch(b: int, s: int, seed: int = 0, pad_rows: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 1000, (b, s)).astype(np.int64)
    ids[:, 0] = 101
    mask = np.ones((b, s), np.int64)
    types = np.zeros((b, s), np.int64)
    types[:, s // 3:] = 1
    for r in range(min(pad_rows, b)):
        cut = s - 1 - (s // 4) * (r + 1) // pad_rows
        mask[b - 1 - r, cut:] = 0
        ids[b - 1 - r, cut:] = 0
        types[b - 1 - r, cut:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


@pytest.fixture()
def make_ctx(tiny_model, tmp_path):
    def _make(device: str = "cpu", artifacts: Path | None = None, **options) -> BackendContext:
        return BackendContext(model_dir=tiny_model, artifacts_dir=artifacts or tmp_path / "artifacts",
                              output_names=OUTPUTS, sample_batch=make_batch(MAX_BATCH, 48), max_batch_size=MAX_BATCH,
                              max_seq_len=MAX_SEQ, device=device, options=options)

    return _make


def run(name: str, ctx: BackendContext, batches):
    backend = create(name)
    backend.prepare(ctx)
    try:
        return backend, [backend.predict(b) for b in batches]
    finally:
        backend.close()


def max_diff(a, b) -> float:
    return max(float(np.abs(a[n] - b[n]).max()) for n in OUTPUTS)


def check_outputs(out, b: int, s: int) -> None:
    assert set(out) == set(OUTPUTS)
    for n in OUTPUTS:
        assert out[n].shape == (b, s) and out[n].dtype == np.float32, (n, out[n].shape, out[n].dtype)
        assert np.isfinite(out[n]).all()


# Two shapes that differ in batch and sequence length: the second is also a "last, smaller batch".
SHAPES = [(MAX_BATCH, 48), (3, 32)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    ctx = BackendContext(model_dir=tiny_model, artifacts_dir=tiny_model.parent / "ref-artifacts",
                         output_names=OUTPUTS, sample_batch=make_batch(MAX_BATCH, 48), max_batch_size=MAX_BATCH,
                         max_seq_len=MAX_SEQ)
    batches = [make_batch(b, s, seed=i) for i, (b, s) in enumerate(SHAPES)]
    _, outs = run("eager-fp32", ctx, batches)
    return batches, outs


# --------------------------------------------------------------------------- registry

def test_unknown_backend_lists_valid_names():
    with pytest.raises(UnknownBackendError) as e:
        get_spec("onnx-runtime-typo")
    msg = str(e.value)
    assert "onnx-runtime-typo" in msg
    for valid in ("eager-fp32", "onnxruntime", "tensorrt-fp16"):
        assert valid in msg
    with pytest.raises(UnknownBackendError):
        create("nope")


def test_every_registered_backend_declares_device_precision_and_parity_class():
    registered = {s.name: s for s in specs()}
    assert set(EXPECTED) <= set(registered), set(EXPECTED) - set(registered)
    for spec in registered.values():
        assert spec.device in ("cpu", "cuda"), spec.name
        assert spec.cls.precision in PRECISIONS, spec.name
        assert spec.cls.parity_class in ("fp32", "reduced"), spec.name
        # Anything below fp32 (TF32 aside) is compared with the reduced-precision tolerances.
        assert (spec.cls.parity_class == "fp32") == (spec.cls.precision in FP32_CLASS_PRECISIONS), spec.name
        backend = spec.create()
        assert backend.name == spec.name and backend.device == spec.device
    for name, (device, precision, parity) in EXPECTED.items():
        spec = registered[name]
        assert (spec.device, spec.cls.precision, spec.cls.parity_class) == (device, precision, parity), name
    assert names() == sorted(registered)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_variants_say_why_they_cannot_run_without_a_gpu():
    for spec in specs():
        reason = spec.unavailable_reason()
        if spec.device == "cuda":
            assert reason and isinstance(reason, str), spec.name
            if spec.name.startswith("tensorrt"):
                continue  # the missing package is reported first; see the next test
            assert "CUDA" in reason, (spec.name, reason)
        else:
            assert reason is None, (spec.name, reason)


def test_tensorrt_reports_the_missing_package():
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        reason = get_spec("tensorrt-fp16").unavailable_reason()
        assert reason == ("TensorRT backend needs the 'tensorrt' package "
                          "(pip install tensorrt --extra-index-url https://pypi.nvidia.com); not run")
    else:
        pytest.skip("tensorrt is installed")


# --------------------------------------------------------------------------- export checks

def test_validation_batches_cover_a_second_shape_with_padding():
    sample = make_batch(MAX_BATCH, 48, pad_rows=0)
    first, second = validation_batches(sample, MAX_BATCH, MAX_SEQ)
    assert first["input_ids"].shape == (MAX_BATCH, 48)
    b2, s2 = second["input_ids"].shape
    assert b2 != MAX_BATCH and s2 != 48 and b2 <= MAX_BATCH and s2 <= MAX_SEQ
    assert second["attention_mask"][-1].min() == 0 and second["attention_mask"][0].all()
    one = validation_batches(make_batch(1, 8), 1, 8)[1]
    assert one["input_ids"].shape[0] == 1 and one["input_ids"].shape[1] != 8


def test_shape_baked_export_fails_with_the_measured_difference():
    batches = [make_batch(2, 16), make_batch(3, 12)]
    refs = [{n: np.zeros(b["input_ids"].shape, np.float32) for n in OUTPUTS} for b in batches]

    def right_only_at_first_shape(batch):
        wrong = batch["input_ids"].shape != (2, 16)
        return {n: np.full(batch["input_ids"].shape, 1.0 if wrong else 0.0, np.float32) for n in OUTPUTS}

    with pytest.raises(OnnxExportError, match=r"3x12.*max\|diff\|.*1"):
        check_against_reference(right_only_at_first_shape, batches, refs, 1e-3, "test export")
    assert check_against_reference(right_only_at_first_shape, batches[:1], refs[:1], 1e-3, "x") == \
        {n: 0.0 for n in OUTPUTS}


def test_model_fingerprint_follows_content(tiny_model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert model_fingerprint(copy) == model_fingerprint(tiny_model)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["layer_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(copy) != model_fingerprint(tiny_model)


# --------------------------------------------------------------------------- CPU backends

def test_eager_fp32_cpu_shapes(reference):
    batches, outs = reference
    for (b, s), out in zip(SHAPES, outs):
        check_outputs(out, b, s)


def test_onnxruntime_matches_eager_and_fuses_attention(make_ctx, reference):
    batches, ref = reference
    ctx = make_ctx()
    backend, outs = run("onnxruntime", ctx, batches)
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        assert max_diff(out, r) < 1e-4, (b, s)
    info = backend.prepare_info
    assert_attention_fused(info)
    assert info["fused_SkipLayerNormalization"] >= LAYERS
    if _ort_fuses_transformers5_attention():
        assert info["onnx_exporter"] == "torchscript" and info["exporters_tried"] == f"torchscript:{LAYERS}"
    assert info["providers"].startswith("CPUExecutionProvider")
    assert info["validation_max_abs_diff"] < 1e-3
    assert not info["onnx_cache_hit"] and not info["optimized_cache_hit"]
    # A second prepare reuses both cached files (and still validates at the run's shapes).
    again, _ = run("onnxruntime", ctx, [])
    assert again.prepare_info["onnx_cache_hit"] and again.prepare_info["optimized_cache_hit"]


def test_onnxruntime_int8_is_close(make_ctx, reference):
    batches, ref = reference
    backend, outs = run("onnxruntime-int8", make_ctx(), batches)
    scale = max(float(np.abs(r[n]).max()) for r in ref for n in OUTPUTS)
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        # Dynamic int8 is lossy; on this model it stays within a few percent of the logit range.
        assert max_diff(out, r) < 0.1 * scale, (max_diff(out, r), scale)
    assert "QInt8" in backend.prepare_info["quantization"]
    assert_attention_fused(backend.prepare_info)


def test_torch_compile_cpu_pads_the_last_batch_instead_of_recompiling(make_ctx, reference):
    batches, ref = reference
    last = {n: a[:2] for n, a in batches[0].items()}  # smaller last batch at the run's sequence length
    backend, outs = run("torch-compile", make_ctx(), [batches[0], last])
    check_outputs(outs[0], MAX_BATCH, 48)
    check_outputs(outs[1], 2, 48)
    assert max_diff(outs[0], ref[0]) < 1e-4
    assert max(float(np.abs(outs[1][n] - ref[0][n][:2]).max()) for n in OUTPUTS) < 1e-4
    assert backend.prepare_info["compiled_shapes"] == 1
    assert backend.prepare_info["compile_mode"] == "default" and backend.prepare_info["dynamic"] == "False"


# --------------------------------------------------------------------------- GPU backends

def _gpu_run(name, make_ctx, batches):
    why = get_spec(name).unavailable_reason()
    if why:
        pytest.skip(why)
    return run(name, make_ctx("cuda"), batches)


@pytest.fixture(scope="module")
def cuda_reference(tiny_model, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    ctx = BackendContext(model_dir=tiny_model, artifacts_dir=tmp_path_factory.mktemp("cuda-ref"),
                         output_names=OUTPUTS, sample_batch=make_batch(MAX_BATCH, 48), max_batch_size=MAX_BATCH,
                         max_seq_len=MAX_SEQ, device="cuda")
    batches = [make_batch(b, s, seed=i) for i, (b, s) in enumerate(SHAPES)]
    _, outs = run("eager-fp32-cuda", ctx, batches)
    return batches, outs


@pytest.mark.gpu
@needs_gpu
def test_eager_fp32_cuda_matches_cpu_reference(reference, cuda_reference):
    for out, r in zip(cuda_reference[1], reference[1]):
        assert max_diff(out, r) < 1e-4


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name,atol", [
    ("eager-tf32", 0.02), ("eager-amp-fp16", 0.05), ("eager-fp16", 0.05), ("eager-bf16", 0.2),
    ("torch-compile-fp16", 0.05), ("torch-compile-fp16-cudagraphs", 0.05),
    ("torch-compile-fp16-max-autotune", 0.05),
    ("ort-cuda-fp32", 1e-3), ("ort-cuda-fp16", 0.05), ("ort-cuda-fp16-graph", 0.05),
    ("tensorrt-fp16", 0.05),
])
def test_gpu_backend_close_to_fp32_cuda(name, atol, make_ctx, cuda_reference):
    batches, ref = cuda_reference
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    backend, outs = _gpu_run(name, make_ctx, batches)
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        assert max_diff(out, r) < atol, (name, b, s, max_diff(out, r))
    if name.startswith("ort-cuda"):
        assert backend.prepare_info["providers"].startswith("CUDAExecutionProvider")
        assert_attention_fused(backend.prepare_info)
    if name == "eager-tf32":
        assert backend.prepare_info["tf32"] is True
    # Backends restore the process-wide TF32 switches they changed.
    assert torch.backends.cuda.matmul.allow_tf32 is tf32_before


def test_eager_bf16_cpu_runs(make_ctx, reference):
    backend, outs = run("eager-bf16-cpu", make_ctx(), reference[0])
    for (b, s), out, r in zip(SHAPES, outs, reference[1]):
        check_outputs(out, b, s)
        assert max_diff(out, r) < 0.2
    assert backend.prepare_info["weights_dtype"] == "bf16"
