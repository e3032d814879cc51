"""Backends on a tiny random BERT: the variant table's contract, CPU parity, availability reasons, GPU parity.

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

from bertqa_bench.backends import BackendContext, default_table
from bertqa_bench.backends.exported.onnx_export import (OnnxExportError, check_against_reference, in_row_chunks,
                                               model_fingerprint, torch_reference, validation_batches)
from bertqa_bench.errors import ConfigError, UnknownBackendError

OUTPUTS = ("start_logits", "end_logits")
LAYERS = 2
MAX_BATCH, MAX_SEQ = 4, 64
PRECISIONS = {"fp32", "tf32", "amp-fp16", "fp16", "bf16", "int8", "fp8"}
FP32_CLASS_PRECISIONS = {"fp32", "tf32"}  # TF32 keeps fp32 storage/accumulation: FP32-class tolerances
# (name, device) -> (precision, parity class): the catalogue, and a few research rows (experiments.yaml)
EXPECTED = {
    ("eager-fp32", "cpu"): ("fp32", "fp32"),
    ("eager-bf16", "cpu"): ("bf16", "reduced"),
    ("torch-compile-fp32", "cpu"): ("fp32", "fp32"),
    ("ort-fp32", "cpu"): ("fp32", "fp32"),
    ("ort-int8", "cpu"): ("int8", "reduced"),
    ("openvino-fp32", "cpu"): ("fp32", "fp32"),
    ("openvino-bf16", "cpu"): ("bf16", "reduced"),
    ("openvino-int8", "cpu"): ("int8", "reduced"),
    ("openvino-int8-sorted", "cpu"): ("int8", "reduced"),
    ("eager-fp32", "cuda"): ("fp32", "fp32"),
    ("eager-tf32", "cuda"): ("tf32", "fp32"),
    ("eager-fp16", "cuda"): ("fp16", "reduced"),
    ("eager-bf16", "cuda"): ("bf16", "reduced"),
    ("torch-compile-fp16-graph", "cuda"): ("fp16", "reduced"),
    ("torch-compile-fp16-packed", "cuda"): ("fp16", "reduced"),
    ("torch-compile-fp8-graph", "cuda"): ("fp8", "reduced"),
    ("torch-compile-fp8-graph-packed", "cuda"): ("fp8", "reduced"),
    ("ort-fp16-graph", "cuda"): ("fp16", "reduced"),
    ("tensorrt-fp16", "cuda"): ("fp16", "reduced"),
    ("eager-fp16+autocast", "cuda"): ("amp-fp16", "reduced"),
    ("torch-compile-fp16+max-autotune", "cuda"): ("fp16", "reduced"),
    ("torch-compile-fp16-graph+cudagraph-trees", "cuda"): ("fp16", "reduced"),
    ("ort-int8+static", "cpu"): ("int8", "reduced"),
    ("ort-int8-sorted+static", "cpu"): ("int8", "reduced"),
    ("ort-fp32+cuda-ep", "cuda"): ("fp32", "fp32"),
    ("ort-fp16+cuda-ep", "cuda"): ("fp16", "reduced"),
    ("torch-compile-fp8-graph+first-recipe", "cuda"): ("fp8", "reduced"),
    ("eager-fp16-packed", "cuda"): ("fp16", "reduced"),
    ("eager-fp8-packed", "cuda"): ("fp8", "reduced"),
    ("torch-compile-fp8-packed", "cuda"): ("fp8", "reduced"),
}
TABLE = default_table()

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


# Two shapes that differ in batch and sequence length: the second is also a "last, smaller batch".
SHAPES = [(MAX_BATCH, 48), (3, 32)]


def context(model_dir: Path, artifacts: Path, shapes=SHAPES) -> BackendContext:
    return BackendContext(model_dir=model_dir, task="squad", artifacts_dir=artifacts, output_names=OUTPUTS,
                          sample_batches=(make_batch(MAX_BATCH, 48),), shapes=tuple(shapes),
                          max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)


@pytest.fixture()
def make_ctx(tiny_model, tmp_path):
    def _make(artifacts: Path | None = None, shapes=SHAPES) -> BackendContext:
        return context(tiny_model, artifacts or tmp_path / "artifacts", shapes)

    return _make


def run(name, ctx: BackendContext, batches):
    """Prepare the variant (a built-in's name, or a Variant), predict ``batches``, close."""
    backend = (TABLE.get(name) if isinstance(name, str) else name).create()
    backend.prepare(ctx)
    try:
        return backend, [backend.predict(b) for b in batches]
    finally:
        backend.close()


def max_diff(a, b) -> float:
    return max(float(np.abs(a[n] - b[n]).max()) for n in OUTPUTS)


def assert_real_tokens_match(batches, outs, refs, atol: float = 1e-4) -> None:
    """Padding-free outputs equal the padded reference wherever the mask says a token is real."""
    for b, out, r in zip(batches, outs, refs):
        real = b["attention_mask"].astype(bool)
        for n in OUTPUTS:
            assert np.abs(out[n] - r[n])[real].max() < atol, n


def check_outputs(out, b: int, s: int) -> None:
    assert set(out) == set(OUTPUTS)
    for n in OUTPUTS:
        assert out[n].shape == (b, s) and out[n].dtype == np.float32, (n, out[n].shape, out[n].dtype)
        assert np.isfinite(out[n]).all()


@pytest.fixture(scope="module")
def reference(tiny_model):
    ctx = context(tiny_model, tiny_model.parent / "ref-artifacts")
    batches = [make_batch(b, s, seed=i) for i, (b, s) in enumerate(SHAPES)]
    _, outs = run("eager-fp32", ctx, batches)
    return batches, outs


# --------------------------------------------------------------------------- registry

def test_unknown_backend_lists_valid_names():
    with pytest.raises(UnknownBackendError) as e:
        TABLE.get("onnx-runtime-typo")
    msg = str(e.value)
    assert "onnx-runtime-typo" in msg
    for valid in ("eager-fp32", "ort-fp32", "tensorrt-fp16", "torch-compile-fp8-graph-packed+ffn8"):
        assert valid in msg


def test_every_variant_declares_device_precision_and_parity_class():
    variants = {(v.name, v.device): v for v in TABLE.all()}
    assert set(EXPECTED) <= set(variants), set(EXPECTED) - set(variants)
    for v in variants.values():
        assert v.device in ("cpu", "cuda"), v.name
        assert v.precision in PRECISIONS, v.name
        # Anything below fp32 (TF32 aside) is compared with the reduced-precision tolerances.
        assert (v.parity_class == "fp32") == (v.precision in FP32_CLASS_PRECISIONS), v.name
        backend = v.create()
        assert backend.name == v.name and backend.device == v.device
    for (name, device), (precision, parity) in EXPECTED.items():
        v = variants[name, device]
        assert (v.device, v.precision, v.parity_class) == (device, precision, parity), name
    assert TABLE.names() == sorted({name for name, _ in variants})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_variants_say_why_they_cannot_run_without_a_gpu():
    for v in TABLE.all():
        reason = v.unavailable_reason()
        if v.device == "cuda":
            assert reason and isinstance(reason, str), v.name
            if v.name.startswith("tensorrt"):
                continue  # the missing package is reported first; see the next test
            assert "CUDA" in reason, (v.name, reason)
        else:
            assert reason is None, (v.name, reason)


def test_tensorrt_reports_the_missing_package():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        reason = TABLE.get("tensorrt-fp16").unavailable_reason()
        assert reason == ("TensorRT backend needs the 'tensorrt' package "
                          "(pip install tensorrt --extra-index-url https://pypi.nvidia.com); not run")
    else:
        pytest.skip("tensorrt is installed")


# --------------------------------------------------------------------------- export checks

def test_validation_batches_cover_the_run_shapes_and_one_more_with_padding():
    sample = make_batch(MAX_BATCH, 48, pad_rows=0)
    batches = validation_batches(sample, MAX_BATCH, MAX_SEQ, shapes=[(MAX_BATCH, 48), (2, 16), (3, 32), (1, 8)])
    # the run's shapes first (at most three: largest, middle, shortest), then an off-plan shape
    assert [b["input_ids"].shape for b in batches[:-1]] == [(MAX_BATCH, 48), (2, 16), (1, 8)]
    for b in batches[:-1]:
        assert b["input_ids"][:, 0].min() > 0  # real rows, never zeros
    first, second = batches[0], batches[-1]
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


def test_cpu_checks_run_in_chunks_of_rows_with_the_whole_batch_answers(tiny_model):
    """The export checks' host memory is bounded by chunking rows; BERT rows are independent, so
    the chunked reference is the whole batch's."""
    from bertqa_bench.model.modeling import load_inference_module

    module = load_inference_module(tiny_model, "squad", attn_implementation="eager", dtype=torch.float32).eval()
    batch = make_batch(7, 24, pad_rows=2)
    whole = torch_reference(module, [batch], OUTPUTS, rows=7)[0]
    chunked = torch_reference(module, [batch], OUTPUTS, rows=3)[0]  # 3 + 3 + 1 rows
    for n in OUTPUTS:
        assert chunked[n].shape == whole[n].shape == (7, 24)
        np.testing.assert_allclose(chunked[n], whole[n], atol=1e-5)
    seen = []

    def run(b):
        seen.append(b["input_ids"].shape[0])
        return {n: b["input_ids"].astype(np.float32) for n in OUTPUTS}

    out = in_row_chunks(run, rows=3)(batch)
    assert seen == [3, 3, 1] and (out["start_logits"] == batch["input_ids"]).all()


def test_export_traces_a_few_rows_without_autograd_and_validates_at_the_run_shapes(tiny_model, tmp_path,
                                                                                    monkeypatch):
    """The exporter's trace held autograd's saved activations of the whole sample batch (77.7 GiB of
    host memory at 256 x 384 on the H100 host): it traces EXPORT_ROWS rows with grad off, and the
    graph still validates at the run's larger batch."""
    from bertqa_bench.backends.exported import onnx_export

    traced = []
    real_export = torch.onnx.export

    def spy(module, example, *args, **kwargs):
        traced.append((tuple(example[0].shape), torch.is_grad_enabled()))
        return real_export(module, example, *args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", spy)
    sample = make_batch(MAX_BATCH + 4, 40, pad_rows=2)
    e = onnx_export.export_onnx(tiny_model, "squad", tmp_path, OUTPUTS, sample, max_batch_size=MAX_BATCH + 4,
                                max_seq_len=MAX_SEQ, shapes=[(MAX_BATCH + 4, 40), (2, 16)])
    assert traced and traced[0] == ((onnx_export.EXPORT_ROWS, 40), False)
    assert e.batches[0]["input_ids"].shape == (MAX_BATCH + 4, 40)  # validated at the run's batch
    assert max(e.max_abs_diff.values()) < onnx_export.FP32_ATOL


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
    backend, outs = run("ort-fp32", ctx, batches)
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
    again, _ = run("ort-fp32", ctx, [])
    assert again.prepare_info["onnx_cache_hit"] and again.prepare_info["optimized_cache_hit"]


def test_onnxruntime_int8_is_close(make_ctx, reference):
    batches, ref = reference
    backend, outs = run("ort-int8", make_ctx(), batches)
    scale = max(float(np.abs(r[n]).max()) for r in ref for n in OUTPUTS)
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        # Dynamic int8 is lossy; on this model it stays within a few percent of the logit range.
        assert max_diff(out, r) < 0.1 * scale, (max_diff(out, r), scale)
    assert "QInt8" in backend.prepare_info["quantization"]
    assert_attention_fused(backend.prepare_info)
    # 7-bit weights exactly where the CPU's u8 x s8 GEMM can saturate its 16-bit pair sums (no VNNI)
    from bertqa_bench.backends.exported.ort_static import cpu_features, reduce_range_on

    assert backend.prepare_info["reduce_range"] == reduce_range_on("auto", cpu_features())


def test_dynamic_int8_reduce_range_follows_the_cpu_unless_set():
    from bertqa_bench.backends.exported.ort_static import reduce_range_on
    from bertqa_bench.backends.variants import make_variant
    from bertqa_bench.errors import ConfigError

    avx2, vnni, arm = {"vnni": False, "machine": "x86_64"}, {"vnni": True, "machine": "x86_64"}, {"machine": "aarch64"}
    assert reduce_range_on("auto", avx2) and not reduce_range_on("auto", vnni) and not reduce_range_on("auto", arm)
    assert reduce_range_on("true", vnni) and not reduce_range_on("false", avx2)
    assert make_variant("x", "onnxruntime", "cpu", {"graph": "int8", "reduce_range": "TRUE"}).options.reduce_range == "true"
    with pytest.raises(ConfigError, match="reduce_range 'seven' is not one of auto, true, false"):
        make_variant("x", "onnxruntime", "cpu", {"graph": "int8", "reduce_range": "seven"})


def test_torch_compile_cpu_compiles_every_run_shape_in_prepare_and_never_while_predicting(make_ctx, reference):
    from torch._dynamo.utils import counters

    batches, ref = reference
    backend = TABLE.get("torch-compile-fp32").create()
    backend.prepare(make_ctx())
    try:
        graphs = counters["stats"]["unique_graphs"]
        outs = [backend.predict(b) for b in batches + batches]
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation at the run's shapes
    finally:
        backend.close()
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        assert max_diff(out, r) < 1e-4
    assert backend.prepare_info["prepared_shapes"] == 2 and backend.prepare_info["compile_mode"] == "default"


# --------------------------------------------------------------------------- GPU backends

def _gpu_run(name, make_ctx, batches):
    why = TABLE.get(name).unavailable_reason()
    if why:
        pytest.skip(why)
    return run(name, make_ctx(), batches)


@pytest.fixture(scope="module")
def cuda_reference(tiny_model, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    ctx = context(tiny_model, tmp_path_factory.mktemp("cuda-ref"))
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
    ("torch-compile-fp16-max-autotune", 0.05), ("torch-compile-fp16-graph", 0.05),
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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["eager-fp16-packed", "torch-compile-fp16-packed", "eager-fp16-packed-graph"])
def test_gpu_packed_fp16_matches_fp32_cuda_on_real_tokens(name, make_ctx, cuda_reference):
    """The padding-free FP16 encoder (eager, and compiled with a dynamic token count) on the GPU:
    its logits on real tokens stay within FP16's error of the padded FP32 model's."""
    batches, ref = cuda_reference
    backend, outs = _gpu_run(name, make_ctx, batches)
    assert backend.prepare_info["packed"] is True
    if name.endswith("-graph"):  # one CUDA graph per bucket up to the largest shape's tokens
        assert backend.prepare_info["token_bucket_graphs"] == backend.prepare_info["token_buckets"] >= 1
    for (b, s), out in zip(SHAPES, outs):
        check_outputs(out, b, s)
    assert_real_tokens_match(batches, outs, ref, atol=0.05)


def test_eager_bf16_cpu_runs(make_ctx, reference):
    backend, outs = run("eager-bf16", make_ctx(), reference[0])
    for (b, s), out, r in zip(SHAPES, outs, reference[1]):
        check_outputs(out, b, s)
        assert max_diff(out, r) < 0.2
    assert backend.prepare_info["weights_dtype"] == "bf16"


def test_packed_padding_free_encoder_matches_the_padded_model_on_real_tokens(make_ctx, reference):
    from bertqa_bench.backends import make_variant

    batches, ref = reference
    v = make_variant("packed-cpu", "torch", "cpu", {"packed": True})
    assert v.backend_class.batching_reason(v.options, "packed") is None
    assert TABLE.get("eager-fp32").backend_class.batching_reason(TABLE.get("eager-fp32").options, "packed")
    backend, outs = run(v, make_ctx(), batches)
    assert backend.prepare_info["packed"] is True
    assert_real_tokens_match(batches, outs, ref)


def test_packed_encoder_under_torch_compile_with_a_dynamic_token_count(make_ctx, reference):
    """torch.compile of the padding-free model: the packing breaks the graph, the encoder compiles
    with a dynamic token count, so batches of other token counts reuse it and give the padded
    model's logits on real tokens."""
    from bertqa_bench.backends import make_variant

    batches, ref = reference
    v = make_variant("packed-compile-cpu", "torch", "cpu", {"packed": True, "compile": "default", "dynamic": True})
    backend, outs = run(v, make_ctx(), batches)
    assert backend.prepare_info["packed"] is True and backend.prepare_info["compile"] == "default"
    assert_real_tokens_match(batches, outs, ref)


def test_packed_refuses_cuda_graphs_with_the_reason():
    from bertqa_bench.backends import make_variant
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="no whole-model CUDA graphs.*token_bucket"):
        make_variant("packed-graphs", "torch", "cuda", {"packed": True, "weights": "fp16", "compile": "default",
                                                        "cuda_graph": "manual"})
    with pytest.raises(ConfigError, match="token_bucket 64: .*packed: true"):
        make_variant("bucket-unpacked", "torch", "cuda", {"weights": "fp16", "token_bucket": 64})


def test_token_buckets_fill_the_length_vector_with_dummy_sequences_of_1_to_max_len_tokens():
    from bertqa_bench.backends.transforms.packed_encoder import TokenBuckets

    tb = TokenBuckets(None, bucket=16, max_len=6, max_rows=4, max_tokens=40)
    assert tb.min_dummies == 4 and tb.cu_len == 4 + 4 + 1  # 15 extra tokens over >= 4 sequences of <= 6
    assert tb.sizes == [16, 32, 48, 64]  # up to 40 tokens + 8 dummy sequences
    cu = torch.tensor([0, 5, 9, 20], dtype=torch.int32)  # 3 real sequences, 20 tokens, 5 dummies to add
    size = tb.size_for(20, 3)
    full = tb.bucket_cu(cu, 20, size).tolist()
    assert size == 32 and full[:4] == [0, 5, 9, 20] and full[-1] == 32 and len(full) == tb.cu_len
    # every batch shape: dummies of 1..max_len tokens, ending at the bucket's size
    for rows in range(1, 5):
        for t in range(rows, 41):
            size = tb.size_for(t, rows)
            cu = torch.tensor([0] + [t * (i + 1) // rows for i in range(rows)], dtype=torch.int32)
            dummies = np.diff(tb.bucket_cu(cu, t, size).numpy()[rows:])
            assert size in tb.sizes and dummies.min() >= 1 and dummies.max() <= 6, (t, rows, dummies)
    with pytest.raises(ValueError, match="60 real tokens is outside the prepared buckets \\(16..64"):
        tb.size_for(60, 2)
    with pytest.raises(ValueError, match="5 rows is more than the prepared 4"):
        tb.size_for(20, 5)


def test_token_buckets_with_empty_dummies_keep_a_batch_in_the_bucket_of_its_real_tokens():
    """``empty_dummies`` (an attention kernel that takes empty sequences): a batch takes the bucket
    that holds its real tokens, the dummies split the rest (0 to max_len tokens each, the vector
    ending at the bucket's size), and the largest bucket is the largest batch's, not that plus a
    token for each dummy."""
    from bertqa_bench.backends.transforms.packed_encoder import TokenBuckets

    tb = TokenBuckets(None, bucket=16, max_len=6, max_rows=4, max_tokens=40, empty_dummies=True)
    assert tb.cu_len == 4 + 4 + 1 and tb.sizes == [16, 32, 48]
    assert tb.size_for(32, 3) == 32 and tb.size_for(33, 3) == 48  # one-token dummies: 48 and 48
    assert TokenBuckets(None, bucket=16, max_len=6, max_rows=4, max_tokens=40).size_for(32, 3) == 48
    for rows in range(1, 5):
        for t in range(rows, 41):
            size = tb.size_for(t, rows)
            assert size == -(-t // 16) * 16, (t, rows, size)
            cu = torch.tensor([0] + [t * (i + 1) // rows for i in range(rows)], dtype=torch.int32)
            full = tb.bucket_cu(cu, t, size).numpy()
            dummies = np.diff(full[rows:])
            assert full[-1] == size and len(full) == tb.cu_len, (t, rows)
            assert dummies.min() >= 0 and dummies.max() <= 6, (t, rows, dummies)


def test_empty_dummy_sequences_leave_the_real_tokens_logits_as_the_padded_model_gives():
    """The packed encoder with the Triton kernel's contract (``takes_empty_sequences``; off CUDA its
    per-sequence SDPA loop skips an empty sequence) on buckets whose dummies may be empty: the
    padded model's logits on every real token, batches that fill whole buckets included."""
    import copy

    from transformers import BertConfig, BertForQuestionAnswering

    from bertqa_bench.backends.transforms.packed_encoder import TokenBuckets, encoder_of, pack_model

    torch.manual_seed(0)
    m = BertForQuestionAnswering(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=128)).eval()
    packed = pack_model(copy.deepcopy(m), attention="triton")
    enc = encoder_of(packed)
    assert enc.takes_empty_sequences and not encoder_of(pack_model(copy.deepcopy(m))).takes_empty_sequences
    tb = TokenBuckets(enc.encode, bucket=16, max_len=40, max_rows=4, max_tokens=160, empty_dummies=True).attach(enc)
    for rows, seq, pad_rows in ((4, 40, 0), (4, 40, 3), (2, 16, 0)):  # 160 and 32 real tokens: whole buckets
        x = {k: torch.from_numpy(v) for k, v in make_batch(rows, seq, pad_rows=pad_rows).items()}
        real = x["attention_mask"].bool()
        t = int(real.sum())
        assert tb.size_for(t, rows) == -(-t // 16) * 16
        with torch.no_grad():
            padded, got = m(**x), packed(**x)
        for n in OUTPUTS:
            assert (got[n] - padded[n])[real].abs().max() < 1e-5, (n, rows, seq, pad_rows)


@pytest.mark.parametrize("compile_mode", ["none", "default"])
def test_packed_token_buckets_give_the_padded_models_logits_on_real_tokens(make_ctx, reference, compile_mode):
    """The bucketed path (dummy sequences up to a multiple of the bucket; on CUDA one graph per
    bucket) computes what the exact-count path computes on every real token."""
    from bertqa_bench.backends import make_variant

    batches, ref = reference
    v = make_variant("packed-bucket-cpu", "torch", "cpu", {"packed": True, "token_bucket": 16, "compile": compile_mode})
    backend, outs = run(v, make_ctx(), batches)
    info = backend.prepare_info
    # buckets up to the largest shape's rows x seq (4 x 48 = 192 tokens) plus dummy sequences;
    # graphs only on CUDA
    assert info["token_bucket"] == 16 and info["token_buckets"] >= 12 and info["token_bucket_graphs"] == 0
    assert_real_tokens_match(batches, outs, ref)


@pytest.mark.parametrize("compile_mode", ["none", "default"])
def test_head_first_runs_the_qa_head_before_the_scatter_and_gives_the_same_logits(make_ctx, reference, compile_mode):
    """``head_first``: the QA head inside the bucketed encoder (and its graphs on CUDA) gives the
    padded model's logits on real tokens, as the hidden-state scatter does."""
    from bertqa_bench.backends import make_variant

    batches, ref = reference
    v = make_variant("packed-head-cpu", "torch", "cpu", {"packed": True, "token_bucket": 16, "head_first": True,
                                                         "compile": compile_mode})
    backend, outs = run(v, make_ctx(), batches)
    assert backend.prepare_info["head_first"] is True
    for (b, s), out in zip(SHAPES, outs):
        check_outputs(out, b, s)
    assert_real_tokens_match(batches, outs, ref)


def test_head_first_gives_every_position_what_the_hidden_state_scatter_gives():
    """Padding positions too: the head of a zero hidden state (its bias), as the task model's head
    gives on the zeros the hidden-state scatter leaves there. The bias is made non-zero (a fresh
    head's is zero, which would hide a zero fill)."""
    import copy

    from transformers import BertConfig, BertForQuestionAnswering

    from bertqa_bench.backends.transforms.packed_encoder import pack_model

    torch.manual_seed(0)
    m = BertForQuestionAnswering(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=128)).eval()
    with torch.no_grad():
        m.qa_outputs.bias.copy_(torch.tensor([0.7, -1.3]))
    x = {k: torch.from_numpy(v) for k, v in make_batch(4, 40, pad_rows=3).items()}
    with torch.no_grad():
        padded = m(**x)
        scattered = pack_model(copy.deepcopy(m))(**x)
        first = pack_model(copy.deepcopy(m), head_first=True)(**x)
    real = x["attention_mask"].bool()
    assert (~real).any()
    for n in OUTPUTS:
        assert (first[n] - scattered[n]).abs().max() < 1e-5, n
        assert (first[n] - padded[n])[real].abs().max() < 1e-5, n
    assert torch.equal(first["start_logits"][~real], torch.full_like(first["start_logits"][~real], 0.7))


def test_head_first_refuses_a_pooled_head_and_an_unpacked_model_with_the_reason(tmp_path):
    """A model whose pooler reads the scattered hidden states (NQ's answer-type head) cannot take
    its head before the scatter: the row is unavailable ("not run", named), before any work."""
    from transformers import BertConfig

    from bertqa_bench.backends import make_variant
    from bertqa_bench.backends.transforms.packed_encoder import pack_model
    from bertqa_bench.errors import BackendUnavailableError
    from bertqa_bench.tasks.nq.model import BertJointForNaturalQuestions

    nq = BertJointForNaturalQuestions(BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=64,
                                                 max_position_embeddings=128))
    with pytest.raises(ValueError, match="pooler, which reads the scattered hidden states"):
        pack_model(nq, head_first=True)
    nq.save_pretrained(tmp_path / "nq")
    ctx = BackendContext(model_dir=tmp_path / "nq", task="nq", artifacts_dir=tmp_path / "artifacts",
                         output_names=("start_logits", "end_logits", "answer_type_logits"),
                         sample_batches=(make_batch(MAX_BATCH, 48),), shapes=tuple(SHAPES), max_batch_size=MAX_BATCH,
                         max_seq_len=MAX_SEQ)
    backend = make_variant("head-nq", "torch", "cpu", {"packed": True, "head_first": True}).create()
    with pytest.raises(BackendUnavailableError, match="head-nq: this encoder has a pooler"):
        backend.prepare(ctx)
    backend.close()
    with pytest.raises(ConfigError, match="head_first .* needs packed: true"):
        make_variant("head-unpacked", "torch", "cpu", {"head_first": True})


@pytest.mark.gpu
@needs_gpu
def test_gpu_head_first_gives_the_scatter_paths_logits_at_every_position(make_ctx):
    """On the GPU, through the token buckets' CUDA graphs and host packing: the head inside the
    graph gives what the hidden-state scatter path gives, at every position (padding included)."""
    from bertqa_bench.backends import make_variant

    batches = [make_batch(b, s, seed=i, pad_rows=2) for i, (b, s) in enumerate(SHAPES)]
    opts = {"weights": "fp16", "packed": True, "token_bucket": 64, "host_pack": True}
    _, scattered = run(make_variant("scatter", "torch", "cuda", opts), make_ctx(), batches)
    backend, first = run(make_variant("first", "torch", "cuda", {**opts, "head_first": True}), make_ctx(), batches)
    assert backend.prepare_info["head_first"] is True and backend.prepare_info["token_bucket_graphs"] >= 1
    for a, b in zip(first, scattered):
        for n in OUTPUTS:  # the same encoder kernels; the head's fp16 GEMM may round its output 1 ulp apart
            np.testing.assert_allclose(a[n], b[n], rtol=2e-3, atol=2e-3, err_msg=n)


def test_packed_encoder_keeps_the_nq_answer_type_head(tmp_path):
    from transformers import BertConfig

    from bertqa_bench.backends.transforms.packed_encoder import pack_model
    from bertqa_bench.tasks.nq.model import BertJointForNaturalQuestions

    torch.manual_seed(0)
    m = BertJointForNaturalQuestions(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128,
                                                max_position_embeddings=128)).eval()
    b = make_batch(4, 40, pad_rows=3)
    x = {k: torch.from_numpy(v) for k, v in b.items()}
    with torch.no_grad():
        ref = m(**x)
        import copy

        out = pack_model(copy.deepcopy(m))(**x)
    real = x["attention_mask"].bool()
    assert (out["start_logits"] - ref["start_logits"])[real].abs().max() < 1e-5
    assert (out["answer_type_logits"] - ref["answer_type_logits"]).abs().max() < 1e-5


# --------------------------------------------------------------------------- ONNX Runtime static INT8 (QDQ)

def _static_variant(name="static-test", **static):
    from bertqa_bench.backends.variants import make_variant

    return make_variant(name, "onnxruntime", "cpu", {"graph": "int8-static", "int8_static": static})


def _real_logit_error(outs, refs, batches) -> float:
    """Worst |Δ logit| on real tokens (padding positions carry the mask's -inf-like values)."""
    worst = 0.0
    for b, out, r in zip(batches, outs, refs):
        real = b["attention_mask"].astype(bool)
        for n in OUTPUTS:
            worst = max(worst, float(np.abs(out[n] - r[n])[real].max()))
    return worst


def assert_answers_agree(batches, outs, refs, share: float = 0.75) -> None:
    """The argmax start/end token over real tokens equals fp32's on at least ``share`` of each batch's rows."""
    for b, out, r in zip(batches, outs, refs):
        real = b["attention_mask"].astype(bool)
        for n in OUTPUTS:
            got = np.where(real, out[n], -np.inf).argmax(1)
            want = np.where(real, r[n], -np.inf).argmax(1)
            assert (got == want).mean() >= share, (n, got, want)


def _calibration_ctx(tiny_model, artifacts, batches):
    return BackendContext(model_dir=tiny_model, task="squad", artifacts_dir=artifacts, output_names=OUTPUTS,
                          sample_batches=tuple(batches), shapes=tuple(SHAPES), max_batch_size=MAX_BATCH,
                          max_seq_len=MAX_SEQ)


def test_onnxruntime_int8_static_builds_calibrated_qdq_and_stays_close(tiny_model, tmp_path, reference):
    import onnx

    batches, ref = reference
    calib = [make_batch(MAX_BATCH, 48, seed=10 + i) for i in range(3)]
    backend, outs = run("onnxruntime-int8-static", _calibration_ctx(tiny_model, tmp_path / "a", calib), batches)
    info = backend.prepare_info
    assert info["graph_precision"] == "int8-static" and "static QDQ, U8S8" in info["quantization"]
    assert info["calibration_batches"] == 3 and info["calibration_rows"] == 3 * MAX_BATCH
    # Q, K, V, attention output and the two FFN GEMMs of each layer; the QA head kept in fp32.
    assert info["quantized_nodes"] == 6 * LAYERS, info
    assert "qa_outputs" in info["kept_fp32"] and "[head]" in info["kept_fp32"]
    assert "cpu_flags" in info and "cpu_vnni" in info
    graph = onnx.load(str(Path(tmp_path / "a" / "onnx") / info["model_file"])).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") >= LAYERS * 4 and "DequantizeLinear" in ops
    assert "Attention" not in ops  # unfused on purpose: Q/K/V are plain MatMuls the QDQ quantizer covers
    scale = max(float(np.abs(r[n]).max()) for r in ref for n in OUTPUTS)
    err = _real_logit_error(outs, ref, batches)
    for (b, s), out in zip(SHAPES, outs):
        check_outputs(out, b, s)
    # Bound: 5% of the logit range on real tokens (measured 0.23 of 14.6, 1.6%, with onnxruntime
    # 1.32). A quantization with wrong activation scales (next test: 9.8, 67%) is far past it.
    assert err < 0.05 * scale, (err, scale)
    # And the answers agree: the argmax start/end token over real tokens equals fp32's on most rows.
    assert_answers_agree(batches, outs, ref)


def test_onnxruntime_int8_static_bound_fails_for_a_wrongly_scaled_calibration(tiny_model, tmp_path, reference):
    """The bound above can fail: activation ranges calibrated on the wrong data (padding-only tokens:
    [CLS] then id 0, mask 0) and cut at their 50th percentile are far too narrow, so real
    activations clip. Measured: calibrated 0.18, wrong scales 9.8, bound 0.73 (5% of 14.6)."""
    batches, ref = reference
    junk = make_batch(MAX_BATCH, 48, seed=3)
    junk["input_ids"][:, 1:] = 0
    junk["attention_mask"][:, 1:] = 0
    junk["token_type_ids"][:] = 0
    calib = [make_batch(MAX_BATCH, 48, 11)]
    _, good = run(_static_variant("good"), _calibration_ctx(tiny_model, tmp_path / "g", calib), batches)
    _, bad = run(_static_variant("bad", calibrate_method="percentile", percentile=50.0),
                 _calibration_ctx(tiny_model, tmp_path / "b", [junk]), batches)
    scale = max(float(np.abs(r[n]).max()) for r in ref for n in OUTPUTS)
    e_good, e_bad = _real_logit_error(good, ref, batches), _real_logit_error(bad, ref, batches)
    assert e_good < 0.05 * scale <= e_bad, (e_good, e_bad, scale)


def test_onnxruntime_int8_static_options_validate_and_change_the_cache_key(tiny_model, tmp_path):
    from bertqa_bench.backends.exported.ort_static import Int8StaticOptions, cpu_features, layer_of
    from bertqa_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="minmax, entropy, percentile"):
        _static_variant(calibrate_method="kl")
    with pytest.raises(ConfigError, match="uint8, int8"):
        _static_variant(activation_type="fp8")
    with pytest.raises(ConfigError, match="unknown field.*valid:.*calibrate_method"):
        _static_variant(calibration_method="minmax")
    with pytest.raises(ConfigError, match="needs graph: int8-static"):
        from bertqa_bench.backends.variants import make_variant
        make_variant("x", "onnxruntime", "cpu", {"graph": "int8", "int8_static": {}})
    assert layer_of("/model/bert/encoder/layer.11/output/dense/MatMul") == 11
    assert layer_of("/model/qa_outputs/MatMul") is None
    assert Int8StaticOptions(reduce_range="auto").reduce_range_for({"vnni": False, "machine": "x86_64"})
    assert not Int8StaticOptions(reduce_range="auto").reduce_range_for({"vnni": True, "machine": "x86_64"})
    assert isinstance(cpu_features()["vnni"], bool)

    calib = [make_batch(MAX_BATCH, 48, seed=21)]
    files = {}
    for name, static, data in (("base", {}, calib), ("entropy", {"calibrate_method": "entropy"}, calib),
                               ("keep0", {"keep_layers": "0"}, calib),
                               ("otherdata", {}, [make_batch(MAX_BATCH, 48, seed=22)])):
        b, _ = run(_static_variant(name, **static), _calibration_ctx(tiny_model, tmp_path / "c", data), [])
        files[name] = b.prepare_info["model_file"]
        assert not b.prepare_info["optimized_cache_hit"], name
        if name == "keep0":
            assert b.prepare_info["quantized_nodes"] == 6 * (LAYERS - 1)
            assert "[keep_layers (0)]" in b.prepare_info["kept_fp32"]
    assert len(set(files.values())) == 4, files
    again, _ = run(_static_variant("base"), _calibration_ctx(tiny_model, tmp_path / "c", calib), [])
    assert again.prepare_info["optimized_cache_hit"] and again.prepare_info["model_file"] == files["base"]


# --------------------------------------------------------------------------- OpenVINO (CPU)

def test_openvino_fp32_reproduces_pytorch_and_reports_what_it_compiled(tiny_model, tmp_path, reference):
    batches, ref = reference
    backend, outs = run("openvino-fp32", _calibration_ctx(tiny_model, tmp_path / "a", [make_batch(MAX_BATCH, 48)]), batches)
    info = backend.prepare_info
    assert info["inference_precision"] == "f32" and info["validation_max_abs_diff"] < 1e-3
    assert info["num_threads"] == torch.get_num_threads() and "cpu_flags" in info
    for (b, s), out, r in zip(SHAPES, outs, ref):
        check_outputs(out, b, s)
        assert max_diff(out, r) < 1e-3


def test_openvino_int8_is_calibrated_keeps_the_head_fp32_stays_close_and_is_cached(tiny_model, tmp_path, reference):
    """NNCF's static INT8: FakeQuantize ops on the encoder, the QA head's GEMM named as kept fp32,
    the logits within the bound the ONNX Runtime static INT8 test uses (5% of the logit range on
    real tokens) and the same argmax answers on most rows; a second prepare reuses the IR."""
    batches, ref = reference
    calib = [make_batch(MAX_BATCH, 48, seed=10 + i) for i in range(3)]
    ctx = _calibration_ctx(tiny_model, tmp_path / "a", calib)
    backend, outs = run("openvino-int8", ctx, batches)
    info = backend.prepare_info
    assert info["inference_precision"] == "f32"  # the ops left in floating point
    assert info["calibration_batches"] == 3 and info["calibration_rows"] == 3 * MAX_BATCH
    assert info["fake_quantize_ops"] >= 4 * LAYERS and info["ir_cache_hit"] is False
    assert "qa_outputs" in info["kept_fp32"] or "MatMul" in info["kept_fp32"], info["kept_fp32"]
    scale = max(float(np.abs(r[n]).max()) for r in ref for n in OUTPUTS)
    err = _real_logit_error(outs, ref, batches)
    assert err < 0.05 * scale, (err, scale)
    assert_answers_agree(batches, outs, ref)
    again, outs2 = run("openvino-int8", ctx, batches)
    assert again.prepare_info["ir_cache_hit"] is True
    assert all(max_diff(a, b) == 0 for a, b in zip(outs, outs2))


def test_openvino_options_are_checked_and_a_missing_package_names_what_to_install(monkeypatch):
    import sys

    from bertqa_bench.backends.exported.openvino import OvOptions
    from bertqa_bench.backends.variants import make_variant

    with pytest.raises(ConfigError, match="fp32, bf16, int8"):
        OvOptions(precision="int4")
    with pytest.raises(ConfigError, match="needs precision: int8"):
        OvOptions(precision="fp32", int8={"calibration_batches": 2})
    with pytest.raises(ConfigError, match="calibration_batches"):
        make_variant("x", "openvino", "cpu", {"precision": "int8", "int8": {"calibration_batches": 0}})
    assert "CPU only" in make_variant("x", "openvino", "cuda", {}).unavailable_reason()
    monkeypatch.setitem(sys.modules, "nncf", None)
    assert "pip install nncf" in TABLE.get("openvino-int8").unavailable_reason()
    assert TABLE.get("openvino-fp32").unavailable_reason() is None  # fp32 needs no nncf
    monkeypatch.setitem(sys.modules, "openvino", None)
    assert "pip install openvino" in TABLE.get("openvino-fp32").unavailable_reason()
