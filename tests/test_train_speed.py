"""Training speed: length buckets, the padding-masked loss, DDP's options and the step profile."""
import copy
import json
import sys

import numpy as np
import pytest
import torch

from bertqa_bench.config import ConfigError, TrainConfig
from bertqa_bench.suite import load_suite
from bertqa_bench.training.steps import ddp_kwargs, ddp_settings, masked_span_loss, trim_length
from bertqa_bench.training.recipe import model_recipe, recipe_fields
from bertqa_bench.training.instrument import profile_window
from bertqa_bench.training.train import train

from conftest import TINY_BERT


def test_trim_length_rounds_to_8_by_default_and_to_buckets_when_set():
    assert [trim_length(n, 384) for n in (1, 8, 9, 200, 383, 384)] == [8, 8, 16, 200, 384, 384]
    assert [trim_length(n, 384, 64) for n in (1, 64, 65, 200, 321, 384)] == [64, 64, 128, 256, 384, 384]
    assert trim_length(100, 96, 64) == 96  # capped at the features' length, never past it
    # a bounded set of shapes: at most ceil(seq_len / bucket)
    assert len({trim_length(n, 384, 64) for n in range(1, 385)}) == 6
    assert len({trim_length(n, 384) for n in range(1, 385)}) == 48


def test_seq_bucket_turns_on_the_masked_loss_and_refuses_it_off():
    assert TrainConfig().loss_mask_padding is False and TrainConfig(seq_bucket=64).loss_mask_padding is True
    assert TrainConfig(loss_mask_padding=True).seq_bucket == 0
    with pytest.raises(ConfigError, match="loss_mask_padding"):
        TrainConfig(seq_bucket=64, loss_mask_padding=False)
    with pytest.raises(ConfigError):
        TrainConfig(ddp_bucket_cap_mb=0)


# Parameters whose true gradient is exactly zero (a constant added to every position's logit, or
# to every key's score, leaves the softmax as it was): float noise of 1e-10 there is all Adam sees,
# and it normalizes that into steps of ~0.1 x lr in either run. Every other weight is compared.
def _compared(name: str) -> bool:
    return not (name.endswith("qa_outputs.bias") or name.endswith(".key.bias"))


def _tiny_qa(seed=0):
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=100, max_position_embeddings=128, **TINY_BERT)
    return BertForQuestionAnswering(cfg).eval()  # eval: no dropout, so two forwards compare exactly


def _batch(seed=0, rows=6, seq=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, seq + 1, (rows,), generator=g)
    lengths[0] = seq  # the longest feature sets the unbucketed trim
    ids = torch.randint(5, 100, (rows, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    start = torch.stack([torch.randint(0, int(n), (1,), generator=g)[0] for n in lengths])
    end = torch.minimum(start + 3, lengths - 1)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "start_positions": start, "end_positions": end}


def _pad(batch, to):
    out = dict(batch)
    for k in ("input_ids", "attention_mask", "token_type_ids"):
        out[k] = torch.nn.functional.pad(batch[k], (0, to - batch[k].shape[1]))
    return out


def _loss(model, b, masked):
    inputs = {k: b[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    if not masked:
        return model(**inputs, start_positions=b["start_positions"], end_positions=b["end_positions"]).loss
    out = model(**inputs)
    return masked_span_loss(out.start_logits, out.end_logits, b["attention_mask"], b["start_positions"],
                            b["end_positions"])


@torch.no_grad()
def test_masked_loss_is_hf_loss_without_padding_and_does_not_see_padding():
    model = _tiny_qa()
    full = _batch()
    full["attention_mask"][:] = 1  # no padding anywhere: the masked loss is HF's loss
    assert float(_loss(model, full, True)) == pytest.approx(float(_loss(model, full, False)), abs=1e-6)

    b = _batch(1)
    short, long = _pad(b, 40), _pad(b, 64)  # trimmed to 8 vs to a 64-token bucket
    masked = float(_loss(model, short, True)), float(_loss(model, long, True))
    assert masked[0] == pytest.approx(masked[1], abs=1e-5)
    # HF's loss, by contrast, softmaxes over the padding positions too: more padding, another loss
    hf = float(_loss(model, short, False)), float(_loss(model, long, False))
    assert abs(hf[0] - hf[1]) > 1e-3


def _two_steps(b, results, dtype=torch.float32, lr=1e-3, eps=1e-8):
    """Two AdamW steps on the batches ``b`` trimmed to 40 and padded to 64 tokens."""
    for to in (40, 64):
        model = _tiny_qa(5).to(dtype).train()
        for m in model.modules():  # dropout off: the two runs must draw nothing at random
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
        losses, grads = [], []
        for batch in b:
            loss = _loss(model, _pad(batch, to), True)
            loss.backward()
            grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        results.append((losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}))


def test_bucketed_steps_train_the_same_model_as_unbucketed_ones():
    """Two AdamW steps on the same rows trimmed to 40 and padded to a 64-token bucket: the same
    losses, gradients and weights up to what float64 rounding allows (the attention and the loss
    both mask padding; had padding leaked in, the losses would differ by >1e-3, see above).

    Why float64, and where the bounds come from. Adam amplifies gradient rounding: its step
    lr * m/(sqrt(v)+eps) has derivative lr*eps/(|g|+eps)^2 <= lr/eps = 1e5 in a gradient near 0,
    so a gradient differing by one float32 rounding (~6e-8 here: the matmuls at 40 and at 64
    columns sum in other orders, and the order is the CPU kernel's choice; AVX2, AVX-512 and AMX
    kernels block differently) may move a weight by up to ~1e-2; it moved one by 4.8e-5 on an
    AMX Xeon against 7e-6 on an AMD EPYC. No float32 tolerance below the ~1e-3 (= lr) that a
    masking bug gives can hold on every CPU. In float64 (unit roundoff u = 2^-53 = 1.1e-16; no
    CPU has a reduced-precision float64 GEMM) two summation orders of n terms differ by at most
    2*gamma_n*S, gamma_n = n*u/(1-n*u), S the sum of the magnitudes summed. The longest reduction
    is a weight gradient over 6 rows x 64 tokens of 64-wide products (n <= 24,576, gamma_n <=
    2.8e-12) and S <= 1 (the loss is an average; every gradient element is below 1, asserted), so
    one reduction differs by <= 5.6e-12; G = 1e-10 allows that to compound through the backward
    pass's chain of ~10 reductions (2 layers x attention, FFN, LayerNorm) with room. Each of T=2
    updates depends on at most T gradients, each through a derivative <= 2*lr/eps (m and sqrt(v)
    are weighted averages of those gradients: |d/dg_s| <= lr*(a_s + sqrt(b_s))/eps), so weights
    differ by at most 2*T^2*(lr/eps)*G = 8e-5: below the masking bug's ~1e-3 on any CPU."""
    lr, eps, steps = 1e-3, 1e-8, 2
    b = [_batch(s) for s in (2, 3)]
    results = []
    _two_steps(b, results, dtype=torch.float64, lr=lr, eps=eps)
    (l8, g8, w8), (l64, g64, w64) = results
    grad_bound = 1e-10
    weight_bound = 2 * steps ** 2 * (lr / eps) * grad_bound
    assert l8 == pytest.approx(l64, abs=grad_bound)
    for a, c in zip(g8, g64):
        assert float(a.abs().max()) < 1.0  # S <= 1, as the bound assumes
        assert float((a - c).abs().max()) < grad_bound
    # every weight, the ones whose true gradient is 0 included: in float64 their rounding noise
    # (~1e-17) is far below eps, so Adam moves them by ~lr * 1e-9, not by ~lr
    worst = max(float((w8[k] - w64[k]).abs().max()) for k in w8)
    assert worst < weight_bound
    moved = max(float((w8[k] - _tiny_qa(5).to(torch.float64).state_dict()[k]).abs().max()) for k in w8)
    assert moved > 10 * weight_bound  # the steps did change the weights, more than the bound allows for noise


def test_training_with_buckets_reaches_the_same_model_through_the_trainer(tiny_suite, monkeypatch):
    """The whole trainer (make()'s trimming, the loss path): seq_bucket 32 against no buckets, both
    with the padding-masked loss, give the same weights up to numerics and the same recipe.
    Dropout is off here: its masks are drawn per element, so another shape draws other masks (as
    another grad_accum or process count does) and the models then agree in distribution only."""
    from safetensors.torch import load_file

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    no_dropout = {**TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": no_dropout})
    sets = ["train.loss_mask_padding=true"]
    a = load_suite(str(suite), sets + ["model.name=b8"])
    b = load_suite(str(suite), sets + ["model.name=b32", "train.seq_bucket=32"])
    ma = train(a, log=lambda m: None, evaluate=False)
    mb = train(b, log=lambda m: None, evaluate=False)
    same = [{k: v for k, v in m["recipe_fields"].items() if k != "model.name"} for m in (ma, mb)]
    assert same[0] == same[1] and ma["train_steps"] == mb["train_steps"] >= 2
    # 96 tokens / 32: 3 shapes at most, all buckets; unbucketed, the trims differed (more shapes)
    assert mb["seq_bucket"] == 32 and set(mb["train_lengths"]) <= {32, 64, 96}
    assert len(ma["train_lengths"]) > len(mb["train_lengths"]) and ma["train_rows"] == mb["train_rows"] == [8]
    wa, wb = load_file(a.model_dir / "model.safetensors"), load_file(b.model_dir / "model.safetensors")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa if _compared(k))
    assert worst < 1e-4, worst
    assert abs(ma["final_loss"] - mb["final_loss"]) < 1e-4


def test_new_options_leave_default_recipes_alone_and_only_the_loss_changes_them(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32"])
    base = load_suite(str(suite))
    fields = recipe_fields(base)
    assert not [k for k in fields if any(w in k for w in ("seq_bucket", "ddp_", "profile", "loss_mask"))]
    fast = load_suite(str(suite), ["train.ddp_bucket_cap_mb=5", "train.ddp_static_graph=true",
                                   "train.ddp_gradient_as_bucket_view=false", "train.profile_steps=3"])
    assert model_recipe(fast) == model_recipe(base)
    bucketed = recipe_fields(load_suite(str(suite), ["train.seq_bucket=64"]))
    assert {k: v for k, v in bucketed.items() if fields.get(k) != v} == {"train.loss_mask_padding": True}
    assert bucketed == recipe_fields(load_suite(str(suite), ["train.seq_bucket=32"]))  # same loss, same model


def test_ddp_options_reach_distributed_data_parallel(tmp_path):
    kw = ddp_kwargs(TrainConfig(), torch.device("cpu"), 0)
    assert kw == {"device_ids": None, "gradient_as_bucket_view": True, "static_graph": False}  # 25 MB: DDP's own
    tc = TrainConfig(ddp_bucket_cap_mb=5, ddp_static_graph=True, ddp_gradient_as_bucket_view=False)
    kw = ddp_kwargs(tc, torch.device("cpu"), 0)
    assert kw["bucket_cap_mb"] == 5.0 and kw["static_graph"] is True and kw["gradient_as_bucket_view"] is False
    assert ddp_kwargs(tc, torch.device("cuda", 3), 3)["device_ids"] == [3]

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        got = ddp_settings(torch.nn.parallel.DistributedDataParallel(model, **kw))
        assert got == {"bucket_cap_mb": 5.0, "static_graph": True, "gradient_as_bucket_view": False}
        default = ddp_settings(torch.nn.parallel.DistributedDataParallel(
            model, **ddp_kwargs(TrainConfig(), torch.device("cpu"), 0)))
        assert default == {"bucket_cap_mb": 25.0, "static_graph": False, "gradient_as_bucket_view": True}
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_train_with_the_ddp_options(tiny_suite):
    """torchrun, 2 CPU processes: the trainer builds DDP with the configured options (read back
    from the DDP object into train_metrics.json) around regionally compiled layers, and bucketed,
    padding-masked steps."""
    import subprocess

    from bertqa_bench.measuring.launcher import child_env

    suite = tiny_suite(backends=["eager-fp32"])
    cfg = load_suite(str(suite))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "bertqa_bench.cli", "train", "--suite", str(suite), "--no-mlflow",
                          "--set", "model.name=ddp-opts", "--set", "train.epochs=0.5",
                          "--set", "train.ddp_bucket_cap_mb=1", "--set", "train.ddp_static_graph=true",
                          "--set", "train.seq_bucket=32", "--set", "train.compile=true",
                          "--set", "train.ddp_comm_hook=fp16", "--set", "train.manual_gc=true"],
                         env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads((cfg.model_dir.parent / "ddp-opts" / "train_metrics.json").read_text())
    assert m["world_size"] == 2
    assert m["ddp"] == {"bucket_cap_mb": 1.0, "static_graph": True, "gradient_as_bucket_view": True}
    assert m["ddp_comm_hook"] == "fp16"  # gradients all-reduced in FP16 (DDP's fp16_compress_hook)
    assert m["seq_bucket"] == 32 and m["loss_mask_padding"] is True and set(m["train_lengths"]) <= {32, 64, 96}
    assert m["train_rows"] == [4]  # 8 rows of a global batch / 2 processes, every micro-step
    # DDP around the regionally compiled layers (DDP's own overlapped all-reduce, no DDPOptimizer)
    assert m["compile_scope"] == "layers" and m["compiled_blocks"] == 2
    # half an epoch under manual GC: no epoch end, so no collection at all inside the loop
    assert m["manual_gc"] is True and m["gc_collections_in_loop"] == 0


def test_profile_window_starts_half_way_and_fits():
    assert profile_window(100, 0) is None
    assert profile_window(100, 5) == (50, 5)
    assert profile_window(6, 5) == (1, 5)
    assert profile_window(3, 5) == (0, 3)


def test_profile_steps_write_the_kernel_table_step_time_and_phases(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32"])
    cfg = load_suite(str(suite), ["train.profile_steps=2", "train.epochs=0.5"])
    logs = []
    m = train(cfg, log=logs.append, evaluate=False)
    prof = m["profile"]
    out = cfg.results_root / "profiles"
    [d] = list(out.glob("*-train-tiny-qa"))
    assert prof["dir"] == str(d) and prof["steps"] == 2 and prof["step_ms"] > 0
    assert set(prof["phases_ms_per_step"]) == {"forward_backward", "optimizer"}
    assert prof["gpu_idle_fraction"] is None  # CPU: no GPU activity to measure
    table = (d / "kernels.md").read_text()
    assert "step time:" in table and "| operator (self CPU) | calls | total ms | % |" in table
    rows = [line for line in table.splitlines() if line.startswith("| aten::")]
    assert len(rows) >= 5
    saved = json.loads((d / "profile.json").read_text())
    assert saved["kernels"] and sum(k["pct"] for k in saved["kernels"]) <= 100 + 1e-6  # shares of the total
    assert all(0 <= k["pct"] <= 100 for k in saved["kernels"])
    assert (d / "trace.json").exists() and (d / "top_kernels.txt").exists()
    assert any("profile of 2 steps" in line for line in logs)
    saved_metrics = json.loads((cfg.model_dir / "train_metrics.json").read_text())
    assert saved_metrics["profile"]["step_ms"] == prof["step_ms"]


def test_top_kernels_and_phase_times_read_a_gpu_trace(tmp_path):
    from bertqa_bench.measuring.trace_tables import phase_times, top_kernels

    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 30},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 40, "dur": 30},
          {"ph": "X", "cat": "kernel", "name": "ncclAllReduce", "ts": 80, "dur": 40},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
          {"ph": "X", "cat": "user_annotation", "name": "train/optimizer", "ts": 0, "dur": 2000},
          {"ph": "X", "cat": "user_annotation", "name": "train/optimizer", "ts": 5000, "dur": 1000}]
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    rows = top_kernels(p)
    assert [(r["name"], r["calls"]) for r in rows] == [("gemm", 2), ("ncclAllReduce", 1)]
    assert rows[0]["total_ms"] == pytest.approx(0.06) and rows[0]["pct"] == pytest.approx(60.0)
    assert phase_times(p, "train/") == {"optimizer": pytest.approx(3.0)}
    assert np.isclose(sum(r["pct"] for r in rows), 100.0)


def test_cli_profile_steps_sets_train_profile_steps(tiny_suite, monkeypatch):
    import bertqa_bench.training.train as train_mod
    from bertqa_bench.cli import main

    got = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, **kw: got.append(cfg) or {})
    suite = tiny_suite(backends=["eager-fp32"])
    assert main(["train", "--suite", str(suite), "--no-mlflow", "--profile-steps", "4"]) == 0
    assert main(["train", "--suite", str(suite), "--no-mlflow", "--set", "train.profile_steps=2"]) == 0
    assert [c.train.profile_steps for c in got] == [4, 2]


def test_repeated_blocks_find_each_familys_layer_stack_and_only_that():
    from transformers import DistilBertConfig, DistilBertForQuestionAnswering

    from bertqa_bench.training.steps import compile_blocks, repeated_blocks

    bert = _tiny_qa()
    assert [n for n, _ in repeated_blocks(bert)] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    distil = DistilBertForQuestionAnswering(DistilBertConfig(vocab_size=100, dim=32, n_layers=3, n_heads=2,
                                                             hidden_dim=64, max_position_embeddings=64))
    assert [n for n, _ in repeated_blocks(distil)] == [f"distilbert.transformer.layer.{i}" for i in range(3)]
    # every block is compiled in place (Module.compile), not just named
    assert compile_blocks(bert, dynamic=False) == [n for n, _ in repeated_blocks(bert)]
    assert all(getattr(b, "_compiled_call_impl", None) is not None for _, b in repeated_blocks(bert))
    assert getattr(bert.bert.embeddings, "_compiled_call_impl", None) is None  # the rest stays eager
    mixed = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()]), torch.nn.Linear(2, 2))
    assert repeated_blocks(mixed) == []
    with pytest.raises(ValueError, match="compile_scope=model"):
        compile_blocks(mixed, dynamic=False)


def test_compile_scope_is_checked_and_is_not_part_of_the_recipe(tiny_suite):
    with pytest.raises(ConfigError, match="valid: layers, model"):
        TrainConfig(compile_scope="encoder")
    suite = tiny_suite(backends=["eager-fp32"])
    assert model_recipe(load_suite(str(suite), ["train.compile=true", "train.compile_scope=model"])) == \
        model_recipe(load_suite(str(suite)))


def test_regionally_compiled_training_reaches_the_eager_model(tiny_suite, monkeypatch):
    """train.compile with compile_scope=layers (each BertLayer compiled in place, one static graph
    per 32-token bucket) trains the same model as the eager step, up to the fused kernels' float
    rounding; the blocks are really compiled (dynamo compiled frames) and recorded."""
    import torch._dynamo
    from safetensors.torch import load_file

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    no_dropout = {**TINY_BERT, "num_hidden_layers": 3, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": no_dropout})
    sets = ["train.seq_bucket=32"]
    a = load_suite(str(suite), sets + ["model.name=eager"])
    b = load_suite(str(suite), sets + ["model.name=regional", "train.compile=true"])
    ma = train(a, log=lambda m: None, evaluate=False)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    mb = train(b, log=lambda m: None, evaluate=False)
    assert mb["compile_scope"] == "layers" and mb["compiled_blocks"] == 3 and ma["compiled_blocks"] == 0
    # the three layers share one graph per bucket shape (the loss adds its own): compiled per
    # layer, there would be at least 3 per shape
    graphs = counters["stats"]["unique_graphs"]
    print("UG", graphs, mb["train_lengths"])
    assert 0 < graphs < 3 * len(mb["train_lengths"]) + 1
    wa, wb = load_file(a.model_dir / "model.safetensors"), load_file(b.model_dir / "model.safetensors")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa if _compared(k))
    assert worst < 1e-3, worst
    assert abs(ma["final_loss"] - mb["final_loss"]) < 1e-3


def test_compiling_before_the_clock_trains_the_same_model_and_leaves_nothing_to_compile_in_the_loop(
        tiny_suite, monkeypatch):
    """train.compile_warmup (the default under compile + layers + seq_bucket): every micro-batch
    shape is compiled by a throwaway forward + backward before the clock, reported as prepare
    time. The weights come out bit-identical to the run that compiled inside its loop (no step
    taken, gradients dropped, the dropout RNG put back: dropout stays on here), and the timed loop
    compiles no graph; without the warm-up it compiles them all."""
    import torch._dynamo
    from safetensors.torch import load_file

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": {**TINY_BERT, "num_hidden_layers": 2}})
    sets = ["train.seq_bucket=32", "train.compile=true"]
    cold = load_suite(str(suite), sets + ["model.name=cold", "train.compile_warmup=false"])
    warm = load_suite(str(suite), sets + ["model.name=warm"])
    mc = train(cold, log=lambda m: None, evaluate=False)
    torch._dynamo.reset()
    logs: list = []
    mw = train(warm, log=logs.append, evaluate=False)
    assert mc["train_warmup_shapes"] == 0 and mc["train_prepare_s"] == 0 and mc["compiled_graphs_in_loop"] > 0
    # a shape per (rows, bucket) seen, and another where a batch has no padding at all (no mask)
    assert len(mw["train_lengths"]) * len(mw["train_rows"]) <= mw["train_warmup_shapes"] \
        <= 2 * len(mw["train_lengths"]) * len(mw["train_rows"])
    assert mw["train_prepare_s"] > 0 and mw["compiled_graphs_in_loop"] == 0
    assert any("before the clock" in line for line in logs)
    assert mw["train_samples_per_s_with_prepare"] < mw["train_samples_per_s"]
    wc, ww = load_file(cold.model_dir / "model.safetensors"), load_file(warm.model_dir / "model.safetensors")
    assert all(torch.equal(wc[k], ww[k]) for k in wc)
    assert mc["final_loss"] == mw["final_loss"]


def test_the_ddp_comm_hook_and_the_graphed_optimizer_step_are_checked_and_not_part_of_the_recipe(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32"])
    with pytest.raises(ConfigError, match="none, allreduce, bf16, fp16"):
        TrainConfig(ddp_comm_hook="int8")
    assert model_recipe(load_suite(str(suite), ["train.ddp_comm_hook=bf16", "train.graph_optimizer_step=true"])) == \
        model_recipe(load_suite(str(suite)))


def _hook_rank(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank: the same stack of Linears under DDP twice, with its built-in all-reduce and
    with the ``allreduce`` hook, gradients bucket views zeroed in place (as under
    ``train.graph_layers``). One backward each under the profiler; rank 0 saves both averaged
    gradients and how many per-tensor divisions each ran."""
    import os

    import torch.distributed as dist

    from bertqa_bench.training.steps import register_comm_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = {}
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        for hook in ("none", "allreduce"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)])
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            register_comm_hook(ddp, hook)
            ddp(x).square().sum().backward()  # the first backward: DDP settles its buckets
            model.zero_grad(set_to_none=False)
            with torch.profiler.profile() as prof:
                ddp(x).square().sum().backward()
            got[hook] = {"grads": [q.grad.clone() for q in model.parameters()],
                         "divs": sum(e.name == "aten::div_" for e in prof.events())}
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_the_allreduce_hook_gives_the_same_average_with_one_division_a_bucket(tmp_path):
    """``train.ddp_comm_hook: allreduce`` (DDP's allreduce_hook) on 2 gloo processes, gradients
    zeroed in place as under the graphed layers: bit for bit the gradients of DDP's built-in
    all-reduce, with one division per bucket instead of one per gradient (20 here)."""
    import torch.multiprocessing as mp

    from bertqa_bench.measuring.ddp import free_port

    out = tmp_path / "grads.pt"
    mp.spawn(_hook_rank, args=(2, free_port(), str(out)), nprocs=2)
    got = torch.load(out)
    assert got["none"]["divs"] >= 20 and got["allreduce"]["divs"] <= 2, (got["none"]["divs"], got["allreduce"]["divs"])
    for a, b in zip(got["none"]["grads"], got["allreduce"]["grads"]):
        assert torch.equal(a, b)
    assert TrainConfig(ddp_comm_hook="allreduce").ddp_comm_hook == "allreduce"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_graphed_optimizer_step_is_refused_without_a_gpu_with_the_reason(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32"])
    with pytest.raises(ValueError, match="needs a CUDA device and BF16 or FP32"):
        train(load_suite(str(suite), ["train.graph_optimizer_step=true", "model.name=g"]), log=lambda m: None,
              evaluate=False)


@pytest.mark.gpu
def test_the_graphed_optimizer_step_updates_the_weights_as_the_eager_one():
    """clip + fused AdamW + zeroing as one CUDA graph (captured at the third step, replayed after)
    against the eager step on the same model, gradients and schedule, with accumulation over two
    micro-steps: the same weights up to the learning rate's float32 rounding."""
    from transformers import get_linear_schedule_with_warmup

    from bertqa_bench.training.optimizer_step import make_adamw, optimizer_step

    torch.manual_seed(0)
    dev = torch.device("cuda")
    base = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                               torch.nn.Linear(128, 8)).to(dev)
    data = [(torch.randn(16, 64, device=dev), torch.randn(16, 8, device=dev)) for _ in range(8 * 2)]
    weights = []
    for graphed in (False, True):
        model = copy.deepcopy(base)
        opt = make_adamw(model, 1e-2, 0.01, fused=True, capturable=graphed)
        sched = get_linear_schedule_with_warmup(opt, 2, 8)
        step = optimizer_step(model.parameters(), opt, 1.0, graphed=graphed)
        for i in range(8):
            for x, y in data[2 * i:2 * i + 2]:
                (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            step()
            sched.step()
        assert step.kind == ("cuda-graph" if graphed else "eager")
        if graphed:
            assert step.graph is not None and step.calls == 8
        weights.append([p.detach().clone() for p in model.parameters()])
    moved = max(float((w - b).abs().max()) for w, b in zip(weights[0], base.parameters()))
    worst = max(float((a - b).abs().max()) for a, b in zip(*weights))
    assert moved > 1e-3 and worst < 1e-5 * max(1.0, moved), (moved, worst)


def test_gc_watch_counts_the_loops_collections_and_manual_gc_keeps_them_to_epoch_ends():
    """Off: the collector runs as Python decides, and every collection is counted and timed.
    Manual: nothing collects inside the loop but the epoch ends, what lived before is frozen,
    and the collector is put back as it was afterwards."""
    import gc

    from bertqa_bench.training.instrument import GcWatch

    assert gc.isenabled()
    w = GcWatch(manual=False)
    gc.collect()
    gc.collect(0)
    seen = w.stop()
    assert seen["manual_gc"] is False and seen["gc_collections_in_loop"] >= 2 and seen["gc_pause_s"] > 0
    w = GcWatch(manual=True)
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    junk = []
    for _ in range(50_000):  # far past the collector's thresholds: it would have run, were it on
        a, b = [], []
        a.append(b)
        b.append(a)
        junk.append(a)
    del junk
    w.epoch_end()
    w.epoch_end()
    seen = w.stop()
    assert seen == {"manual_gc": True, "gc_collections_in_loop": 2, "gc_pause_s": seen["gc_pause_s"]}
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_manual_gc_through_the_trainer_collects_once_per_epoch_and_leaves_the_recipe_alone(tiny_suite):
    import gc

    suite = tiny_suite(backends=["eager-fp32"])
    cfg = load_suite(str(suite), ["train.manual_gc=true", "model.name=mgc", "train.epochs=2"])
    assert model_recipe(cfg) == model_recipe(load_suite(str(suite), ["model.name=mgc", "train.epochs=2"]))
    m = train(cfg, log=lambda m: None, evaluate=False)
    assert m["manual_gc"] is True and m["gc_collections_in_loop"] == 2  # one per epoch end, no other
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_watch_puts_the_collector_back_once_and_leaves_an_earlier_freeze_alone():
    import gc

    from bertqa_bench.training.instrument import GcWatch

    gc.freeze()  # somebody else's freeze, before the loop
    before = gc.get_freeze_count()
    try:
        w = GcWatch(manual=True)
        w.stop()
        assert gc.isenabled() and gc.get_freeze_count() >= before > 0  # not thawed by us
        w.stop()  # a second stop (the finally after an error) changes nothing
        assert gc.isenabled() and gc.callbacks.count(w._callback) == 0
    finally:
        gc.unfreeze()


def test_graph_layers_is_checked_needs_buckets_and_is_not_part_of_the_recipe(tiny_suite):
    with pytest.raises(ConfigError, match="needs train.seq_bucket > 0"):
        TrainConfig(graph_layers=True)
    with pytest.raises(ConfigError, match="needs train.compile_scope=layers"):
        TrainConfig(graph_layers=True, seq_bucket=64, compile=True, compile_scope="model")
    assert TrainConfig(graph_layers=True, seq_bucket=64).graph_layers
    suite = tiny_suite(backends=["eager-fp32"])
    assert model_recipe(load_suite(str(suite), ["train.seq_bucket=32", "train.graph_layers=true"])) == \
        model_recipe(load_suite(str(suite), ["train.seq_bucket=32"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_graphed_layers_are_refused_without_a_gpu_with_the_reason(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32"])
    with pytest.raises(ValueError, match="replays CUDA graphs: it needs a CUDA device .this run: cpu."):
        train(load_suite(str(suite), ["train.seq_bucket=32", "train.graph_layers=true", "model.name=g"]),
              log=lambda m: None, evaluate=False)


def test_gradients_zeroed_in_place_keep_their_tensors_and_accumulate_there():
    """Under CUDA-graphed layers no gradient may become graph memory: every parameter gets its
    own zero gradient up front, autograd adds into it, and the optimizer step zeroes it in place
    (the same tensors after the step); the default step still sets them to None."""
    from bertqa_bench.training.optimizer_step import make_adamw, optimizer_step
    from bertqa_bench.training.steps import zero_grads_in_place

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model[1].weight.requires_grad_(False)
    n_trainable = sum(p.requires_grad for p in model.parameters())
    assert zero_grads_in_place(model) == n_trainable and zero_grads_in_place(model) == 0
    assert model[1].weight.grad is None
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(float(g.abs().sum()) == 0 for g in grads)
    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    assert all(p.grad is g for p, g in zip([p for p in model.parameters() if p.requires_grad], grads))
    before = [p.detach().clone() for p in model.parameters()]
    step = optimizer_step(model.parameters(), make_adamw(model, 1e-2, 0.0), 1.0, graphed=False, zero_to_none=False)
    step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # it stepped
    assert all(p.grad is g and float(g.abs().sum()) == 0
               for p, g in zip([p for p in model.parameters() if p.requires_grad], grads))
    model(x).pow(2).sum().backward()
    optimizer_step(model.parameters(), make_adamw(model, 1e-2, 0.0), 1.0, graphed=False)()
    assert all(p.grad is None for p in model.parameters())


def _graph_semantics_make(calls, samples, **_):
    """A CPU stand-in for make_graphed_callables that keeps what its graphs do to memory: the sample
    arguments are the static inputs, each call copies its inputs into them (a replay), the forward
    runs on the static inputs (so what it saves for backward aliases them), and the backward
    returns the gradients of the static inputs and the parameters, as the backward graph does."""
    out = []
    for call, static in zip(calls, samples):
        call(*static)  # the warm-up run
        layer, params = call.layer, tuple(call.parameters())

        def run(*xs, layer=layer):
            o = type(layer).forward(layer, *xs)  # the layer's own forward: install() does not reach it
            return o[0] if isinstance(o, tuple) else o

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs, static=static, run=run):
                for s_, x in zip(static, inputs[:len(static)]):
                    if s_.data_ptr() != x.data_ptr():
                        s_.data.copy_(x)
                with torch.enable_grad():
                    ctx.out = run(*static)
                return ctx.out.detach()

            @staticmethod
            def backward(ctx, grad, static=static, params=params):
                wanted = [t for t in static + params if t.requires_grad]
                got = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
                return tuple(next(got) if t.requires_grad else None for t in static + params)

        call.forward = lambda *xs, Replay=Replay, params=params: Replay.apply(*xs, *params)
        out.append(call)
    return out


def _qa_loss(model, batch):
    out = model(**{k: v for k, v in batch.items() if not k.endswith("positions")})
    return torch.nn.functional.cross_entropy(out.start_logits, batch["start_positions"]) + \
        torch.nn.functional.cross_entropy(out.end_logits, batch["end_positions"])


def _no_dropout_qa(layers=3):
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    return BertForQuestionAnswering(BertConfig(vocab_size=100, max_position_embeddings=128, **{
        **TINY_BERT, "num_hidden_layers": layers, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0})).train()  # train: as captured


def test_graphed_layers_give_every_parameter_the_ungraphed_gradient_under_graph_memory_semantics():
    """With static inputs that each replay overwrites and backward reads (the graphs' memory, on
    CPU), every parameter's gradient through the routed layers equals the plain model's, for two
    shapes captured and used alternately. With one static input shared by the layers, the first
    layers' weight gradients came from the last layer's input (found in review after an H100 run)."""
    from bertqa_bench.training.graphed_layers import GraphedLayers, first_layer_inputs
    from bertqa_bench.training.steps import repeated_blocks

    model = _no_dropout_qa()
    batches = [_batch(0, rows=4, seq=24), _batch(1, rows=4, seq=16), _batch(2, rows=4, seq=24)]

    def grads(batch):
        model.zero_grad(set_to_none=True)
        _qa_loss(model, batch).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = [grads(b) for b in batches]
    blocks = [b for _, b in repeated_blocks(model)]
    graphed = GraphedLayers(blocks, make=_graph_semantics_make)
    for b in batches[:2]:
        graphed.capture(*first_layer_inputs(model, blocks[0], lambda b=b: _qa_loss(model, b)))
    graphed.install()
    for b, w in zip(batches, want):
        got = grads(b)
        worst = max(float((got[n] - w[n]).norm() / w[n].norm().clamp_min(1e-12)) for n in w)
        assert worst < 1e-5, worst
    assert graphed.replays == 3


def test_graphed_layers_route_each_layer_to_its_shapes_graphs_and_keep_the_checkpoint_names():
    """The routing around the graphs, on CPU with the callables standing in for them: the first
    layer's inputs as the model builds them, one set per (shape, mask or not), the same logits as
    the plain model, the parameters' names untouched, and clear errors for a shape not captured
    or a call with more than hidden states and a mask."""
    from bertqa_bench.training.graphed_layers import GraphedLayers, first_layer_inputs
    from bertqa_bench.training.steps import repeated_blocks

    model = _no_dropout_qa(layers=2)
    names = sorted(model.state_dict())
    padded, full = _batch(0, rows=4, seq=24), _batch(1, rows=4, seq=16)
    full["attention_mask"] = torch.ones_like(full["attention_mask"])
    inputs = {k: v for k, v in padded.items() if not k.endswith("positions")}
    full_inputs = {k: v for k, v in full.items() if not k.endswith("positions")}
    with torch.no_grad():
        want, want_full = model(**inputs).start_logits, model(**full_inputs).start_logits
    blocks = [b for _, b in repeated_blocks(model)]
    made = []
    graphed = GraphedLayers(blocks, make=lambda c, s, **k: made.append(len(c)) or _graph_semantics_make(c, s))
    for batch in (inputs, full_inputs, inputs):
        hidden, mask = first_layer_inputs(model, blocks[0], lambda b=batch: model(**b))
        assert hidden.shape == (4, batch["input_ids"].shape[1], 32)
        graphed.capture(hidden, mask)
    assert made == [len(blocks), len(blocks)] and graphed.info() == {"graphed_layers": 2, "graphed_shapes": 2,
                                                                      "cuda_graphs": 8}
    graphed.install()
    with torch.no_grad():
        assert torch.equal(model(**inputs).start_logits, want)
        assert torch.equal(model(**full_inputs).start_logits, want_full)
    assert graphed.replays == 2 and sorted(model.state_dict()) == names
    other = _batch(2, rows=3, seq=24)
    with pytest.raises(RuntimeError, match=r"no graphs for hidden states \(3, 24, 32\) with a mask; captured"):
        model(**{k: v for k, v in other.items() if not k.endswith("positions")})
    with pytest.raises(RuntimeError, match=r"more than hidden states and a mask \(positional #3\)"):
        blocks[0](torch.zeros(4, 24, 32), None, torch.zeros(4, 5, 32))
    with pytest.raises(RuntimeError, match=r"more than hidden states and a mask \(encoder_attention_mask\)"):
        blocks[0](torch.zeros(4, 24, 32), None, encoder_attention_mask=torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match="captured before the layers are routed"):
        graphed.capture(torch.zeros(2, 8, 32), None)
    model.eval()  # captured in training mode (dropout): the graphs refuse to serve evaluation
    with pytest.raises(RuntimeError, match="serve training only"):
        model(**inputs)
    graphed.uninstall()  # the layers' own forward back, the graphs gone
    assert graphed.graphs == {} and all("forward" not in b.__dict__ for b in blocks)
    with torch.no_grad():
        model.train()
        assert torch.equal(model(**inputs).start_logits, want)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled,amp", [(False, None), (True, None), (True, torch.bfloat16)])
def test_cuda_graphed_layers_give_the_ungraphed_gradients_on_gpu(compiled, amp):
    """torch.cuda.make_graphed_callables under GraphedLayers: for two shapes captured into one pool
    and used alternately, every parameter's gradient (accumulated in place, as the trainer does)
    equals the ungraphed layers' on the same inputs: fp32 to float noise, bf16 autocast to
    its rounding. The shared static input this replaced was ~4% off on a tiny model's first
    layers (CPU emulation)."""
    from bertqa_bench.training.graphed_layers import GraphedLayers, first_layer_inputs
    from bertqa_bench.training.steps import compile_blocks, repeated_blocks, zero_grads_in_place

    model = _no_dropout_qa().cuda()
    if compiled:
        compile_blocks(model, dynamic=False)
    batches = [{k: v.cuda() for k, v in _batch(i, rows=4, seq=seq).items()} for i, seq in enumerate((24, 16, 24))]
    amp_on = amp is not None

    def loss(b):
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp_on, cache_enabled=False):
            return _qa_loss(model, b)

    def grads(b):
        model.zero_grad(set_to_none=False)
        loss(b).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    zero_grads_in_place(model)
    want = [grads(b) for b in batches]
    blocks = [b for _, b in repeated_blocks(model)]
    graphed = GraphedLayers(blocks)
    for b in batches[:2]:
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp_on, cache_enabled=False):
            graphed.capture(*first_layer_inputs(model, blocks[0], lambda b=b: _qa_loss(model, b)))
    graphed.install()
    tol = 1e-4 if amp is None else 1e-2
    for b, w in zip(batches, want):
        got = grads(b)
        worst = max(float((got[n] - w[n]).norm() / w[n].norm().clamp_min(1e-12)) for n in w)
        assert worst < tol, worst
    assert graphed.replays == 3 and graphed.info()["graphed_shapes"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphed_layers_train_the_model_of_the_ungraphed_step(tiny_suite, compiled):
    """train.graph_layers through the trainer on a GPU, end to end: every layer's forward and backward
    captured per shape before the clock and replayed at every micro-step (gradient accumulation
    over two), the weights near the ungraphed run's. A loose check (a few Adam steps move weights
    little whatever the gradients): the exact one is the gradient test above."""
    import torch._dynamo
    from safetensors.torch import load_file

    no_dropout = {**TINY_BERT, "num_hidden_layers": 3, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": no_dropout})
    sets = ["train.seq_bucket=32", "train.grad_accum=2", "train.mixed_precision=bf16", f"train.compile={compiled}"]
    a = load_suite(str(suite), sets + ["model.name=plain"])
    b = load_suite(str(suite), sets + ["model.name=graphed", "train.graph_layers=true"])
    ma = train(a, log=lambda m: None, evaluate=False)
    torch._dynamo.reset()
    mb = train(b, log=lambda m: None, evaluate=False)
    assert mb["graph_layers"] and mb["graphed_layers"] == 3 and mb["graphed_shapes"] >= len(mb["train_lengths"])
    assert mb["graphed_micro_steps"] == mb["train_steps"] * 2  # every micro-step replayed the graphs
    assert mb["train_prepare_s"] > 0
    wa, wb = load_file(a.model_dir / "model.safetensors"), load_file(b.model_dir / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if _compared(k))
    assert worst < 1e-2, worst
    assert abs(ma["final_loss"] - mb["final_loss"]) < 1e-2
