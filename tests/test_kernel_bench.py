"""scripts/kernel_bench.py's host side: the sequence lengths it reads from a bench run's own plan and
evaluation set (``--from-run``), which batches it samples, and its refusals of bad input before any
GPU work, and the arithmetic of its energy records. The timing itself needs a GPU and is not tested
here."""
import json
import sys

import numpy as np
import pytest
from conftest import load_script

from bertqa_bench.record.schedule import make_plan

@pytest.fixture(scope="module")
def kb():
    return load_script("kernel_bench")


def _run_folder(tmp_path, lengths, batching="packed", name="row-packed"):
    """A bench run folder as the runner leaves it: its plan under plans/, a worker job naming the plan
    where the run was made (another machine's path) and the cached evaluation set."""
    evalset = tmp_path / "cache" / "evalsets" / "squad-dev-x"
    evalset.mkdir(parents=True)
    seq = 32
    mask = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    np.save(evalset / "attention_mask.npy", mask)
    run = tmp_path / "run"
    plan = make_plan(np.asarray(lengths), batching=batching, batch_size=4, max_seq_len=seq, tokens_per_batch=40)
    plan.save(run / "plans" / f"{batching}-b4.npz")
    (run / "workers").mkdir(parents=True)
    job = {"variant": {"name": name, "batching": batching}, "evalset": str(evalset), "max_seq_len": seq,
           "plan": f"/root/elsewhere/results/run/plans/{batching}-b4.npz"}
    (run / "workers" / f"{name}.job.json").write_text(json.dumps(job))
    return run, plan


def test_plan_lengths_are_the_runs_batches_of_real_lengths(kb, tmp_path):
    lengths = [30, 3, 17, 8, 25, 1, 12, 30, 9, 22, 5]
    run, plan = _run_folder(tmp_path, lengths)
    got, max_seq_len = kb.plan_lengths(run)
    assert max_seq_len == 32
    assert len(got) == len(plan.batches) > 2
    for batch, lens in zip(plan.batches, got):
        assert lens == [lengths[i] for i in batch.rows]
    assert sorted(n for lens in got for n in lens) == sorted(lengths)  # every feature once, at its real length
    assert kb.plan_lengths(run, backend="row-packed") == (got, 32)


def test_plan_lengths_refuses_what_it_cannot_read_and_names_it(kb, tmp_path):
    run, _ = _run_folder(tmp_path, [5, 6, 7])
    with pytest.raises(SystemExit, match="no job for other-row; it has: row-packed"):
        kb.plan_lengths(run, backend="other-row")
    with pytest.raises(SystemExit, match="evaluation set .*give --evalset"):
        kb.plan_lengths(run, evalset=str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="has no workers"):
        kb.plan_lengths(tmp_path / "not-a-run")
    padded, _ = _run_folder(tmp_path / "p", [5, 6, 7], batching="padded", name="row-padded")
    with pytest.raises(SystemExit, match="ran no packed row; its rows: row-padded"):
        kb.plan_lengths(padded)
    short = tmp_path / "short"
    short.mkdir()
    np.save(short / "attention_mask.npy", np.ones((2, 32), np.int64))
    with pytest.raises(SystemExit, match="has 2 features, the plan 3"):
        kb.plan_lengths(run, evalset=str(short))
    np.save(short / "attention_mask.npy", np.ones((4, 32), np.int64))
    with pytest.raises(SystemExit, match="has 4 features, the plan 3"):
        kb.plan_lengths(run, evalset=str(short))
    job = run / "workers" / "row-packed.job.json"
    job.write_text(json.dumps({k: v for k, v in json.loads(job.read_text()).items() if k != "max_seq_len"}))
    with pytest.raises(SystemExit, match="row-packed.job.json has no max_seq_len"):
        kb.plan_lengths(run)


def test_the_batch_the_autotuner_times_comes_first_and_is_the_typical_one(kb):
    """The Triton autotuner tunes on its first call of a key and every later batch reuses that tile:
    the sampled batch of median mean length goes first (the lower median), the others keep their order."""
    batches = [[380] * 85, [300] * 100, [200] * 150, [120] * 256, [100] * 256]
    assert kb.typical_first(batches, [0, 1, 2, 3, 4]) == [2, 0, 1, 3, 4]
    assert kb.typical_first(batches, [0, 1, 3, 4]) == [3, 0, 1, 4]  # means 100, 120, 300, 380: the lower median
    assert kb.typical_first(batches, [4]) == [4]


def test_bad_arguments_are_refused_before_any_gpu_work(kb, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        kb.main(["--kernels", "triton,warp"])
    assert e.value.code == 2 and "unknown --kernels warp; valid: flash" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="has no workers"):
        kb.main(["--only", "attention", "--from-run", str(tmp_path / "missing")])
    # the tile sweep needs the attention kernel and its tuned tile to compare with
    with pytest.raises(SystemExit) as e:
        kb.main(["--tiles", "--only", "gemms"])
    assert e.value.code == 2 and "--tiles times the attention kernel's tiles: not with --only gemms" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        kb.main(["--tiles", "--kernels", "flash,cudnn"])
    assert e.value.code == 2 and "add triton-e4m3 to --kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        kb.main(["--only", "ffn_up_candidates", "--candidates", "8,0"])
    assert e.value.code == 2 and "each >= 1, not [8, 0]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        kb.main(["--only", "ffn_up", "--quack-tiles", "pingpong-128x192-c2x1,pingpong-256x128-c2x1"])
    assert e.value.code == 2 and "--quack-tiles: quack GEMM tile 'pingpong-256x128-c2x1'" in capsys.readouterr().err


def test_every_default_quack_tile_parses_and_every_gemm_has_an_epilogue(kb):
    from bertqa_bench.kernels.quack_gemm_gelu import parse_tile, tiles

    assert {parse_tile(t).spelled() for t in kb.QUACK_TILES} == set(kb.QUACK_TILES) <= set(tiles())
    # the four GEMMs' shapes at BERT-large: (N, K) and the output the next kernel reads
    hidden, _, ffn = kb.SHAPES["bert-large"]
    shapes = {name: (dims(hidden, ffn), epi, e4m3) for name, (dims, epi, e4m3) in kb.GEMM_EPILOGUES.items()}
    assert shapes == {"qkv": ((3072, 1024), "BIAS", True), "attn_out": ((1024, 1024), "BIAS", False),
                      "ffn_up": ((4096, 1024), "GELU_BIAS", True), "ffn_down": ((1024, 4096), "BIAS", False)}


def _tile(config, batch, us, **kw):
    return {"what": "attention-tile", "kernel": "triton-e4m3", "config": config, "plan_batch": batch,
            "within_bound": True, "graph_replay_equals_eager": True, "graph": {"us_median": us}, **kw}


def test_tiles_summary_compares_the_tuned_tile_with_each_batchs_best(kb):
    # three sampled batches of a 10-batch plan: tile "b" is best on the long batch 0, tile "a" on
    # the others; every other record kind is ignored
    recs = [_tile("a", 0, 30.0), _tile("a", 5, 10.0), _tile("a", 9, 10.0),
            _tile("b", 0, 20.0), _tile("b", 5, 12.0), _tile("b", 9, 13.0),
            {"what": "attention", "kernel": "triton-e4m3", "plan_batch": 0, "graph": {"us_median": 1.0}}]
    s = kb.tiles_summary(recs, "a", 10)
    assert s["sampled"] == [0, 5, 9] and s["failed"] == {} and "error" not in s
    assert s["pass_us_by_tile"] == {"a": 166.7, "b": 150.0}  # the mean of the three batches times 10
    assert s["tuned"] == "a" and s["tuned_pass_us"] == 166.7
    assert s["best_single"] == "b" and s["best_single_pass_us"] == 150.0
    assert s["best_by_batch"] == {0: "b", 5: "a", 9: "a"}
    assert s["per_batch_best_pass_us"] == 133.3  # (20 + 10 + 10) / 3 * 10: no single tile reaches it


def test_tiles_summary_counts_only_tiles_that_ran_right_everywhere_and_names_the_others(kb):
    recs = [_tile("a", 0, 30.0), _tile("a", 9, 10.0),
            _tile("fast-but-wrong", 0, 1.0, within_bound=False), _tile("fast-but-wrong", 9, 1.0),
            _tile("replay-differs", 0, 2.0, graph_replay_equals_eager=False), _tile("replay-differs", 9, 2.0),
            _tile("no-launch", 0, 0.0, error="OutOfResources: shared memory"), _tile("no-launch", 9, 3.0),
            _tile("one-batch-only", 0, 3.0)]
    s = kb.tiles_summary(recs, "a", 10)
    assert set(s["pass_us_by_tile"]) == {"a"} and s["best_single"] == "a"
    assert s["failed"] == {"fast-but-wrong": [0], "replay-differs": [0], "no-launch": [0], "one-batch-only": [9]}
    # the tuned tile among the failed ones, or none at all: said, not a silent None
    assert "not among the tiles counted" in kb.tiles_summary(recs, "fast-but-wrong", 10)["error"]
    assert kb.tiles_summary([], None, 10)["error"].startswith("no tile ran")


def test_pass_records_count_only_the_kernels_own_timed_records(kb):
    # the tile sweep's records carry the same kernel name; they and a failed record stay out
    recs = [{"what": "attention", "kernel": "triton-e4m3", "plan_batch": 0, "graph": {"us_median": 10.0}},
            {"what": "attention", "kernel": "triton-e4m3", "plan_batch": 5, "graph": {"us_median": 20.0}},
            {"what": "attention-tile", "kernel": "triton-e4m3", "plan_batch": 0, "graph": {"us_median": 999.0}},
            {"what": "attention", "kernel": "cudnn", "plan_batch": 0, "error": "RuntimeError: x"},
            {"what": "attention", "kernel": "flash", "plan_batch": 0, "graph": {"us_median": 30.0}}]
    out = {r["kernel"]: r for r in kb.pass_records(recs, 63)}
    assert set(out) == {"triton-e4m3", "flash"}
    assert out["triton-e4m3"]["sampled"] == 2 and out["triton-e4m3"]["mean_batch_us"] == 15.0
    assert out["triton-e4m3"]["pass_estimate_us"] == 945.0 and out["flash"]["pass_estimate_us"] == 1890.0


def test_an_energy_record_is_joules_over_calls_and_power_over_the_window(kb):
    # 2,000 calls in 1.6 s between counter reads 1,120,000 mJ apart: 560 mJ a call, 700 W, 800 us a call
    rec = kb.energy_record(5_000_000.0, 6_120_000.0, 10.0, 11.6, 2000, clocks_mhz=[1650, 1700, 1680])
    assert rec["mJ_per_call"] == pytest.approx(560.0) and rec["avg_power_w"] == pytest.approx(700.0)
    assert rec["us_per_call_sustained"] == pytest.approx(800.0) and rec["sm_clock_mhz_median"] == 1680
    assert kb.energy_record(0.0, 10.0, 0.0, 1.0, 10)["sm_clock_mhz_median"] is None


@pytest.mark.parametrize("args", [(5.0, 4.0, 1.0, 2.0, 10), (0.0, 1.0, 2.0, 2.0, 10), (0.0, 1.0, 0.0, 1.0, 0)])
def test_an_energy_record_refuses_a_counter_or_clock_that_went_backwards(kb, args):
    with pytest.raises(ValueError, match="energy_record"):
        kb.energy_record(*args)


def test_the_energy_window_holds_enough_calls(kb):
    assert kb.replays_for(1.0, 62.7) == int(1e6 / 62.7)  # a second of a 62.7 us kernel
    assert kb.replays_for(0.001, 500.0) == 100  # never fewer than 100 calls
    with pytest.raises(ValueError):
        kb.replays_for(1.0, 0.0)


def test_a_negative_energy_window_is_refused_before_any_gpu_work(kb, capsys):
    with pytest.raises(SystemExit):
        kb.main(["--energy-s", "-1"])
    assert "--energy-s is seconds" in capsys.readouterr().err


def test_the_int8_paths_give_the_gemm_within_int8_rounding(kb):
    # CPU tensors: the paths' arithmetic (cuBLASLt's IMMA kernel on CUDA, the same op on the CPU).
    # Each output is x8 w8^T sx sw + b; against the fp32 GEMM of the unrounded inputs its error is
    # the rounding of x and w to 127 levels: |dy| <= (K/2) (sx max|w| + sw max|x| + sx sw / 2),
    # well under 1 relative to |y| + 1 at these scales, and the three paths agree to fp16 rounding
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m, n, k = 32, 48, 64
    x, w = torch.randn(m, k), torch.randn(n, k) * k ** -0.5
    b = (torch.randn(n) * 0.1).half()
    sx, sw = float(x.abs().amax()) / 127, w.abs().amax(1) / 127
    x8 = (x / sx).round().clamp(-127, 127).to(torch.int8)
    w8 = (w / sw[:, None]).round().clamp(-127, 127).to(torch.int8)
    ref = x @ w.t() + b.float()
    outs = {}
    for label, (fn, dequantized) in kb.int8_gemm_paths(x8, w8, sx, sw, b).items():
        out = fn()
        outs[label] = out.float() if dequantized else out.float() * (sw * sx) + b.float()
    bound = (k / 2) * (sx * float(w.abs().max()) + float(sw.max()) * float(x.abs().max()) + sx * float(sw.max()) / 2)
    for label, got in outs.items():
        assert float((got - ref).abs().max()) <= bound, label
    first = next(iter(outs.values()))
    for got in outs.values():
        assert torch.allclose(got, first, rtol=2 ** -10, atol=2 ** -10 * 4)
