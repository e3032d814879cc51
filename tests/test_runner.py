"""Batch plans (order round trip, token budgets, padding rows), the timing loop and warm-up."""
import os
from pathlib import Path

import numpy as np
import pytest

from bertqa_bench.backends.base import Backend
from bertqa_bench.measuring.flops import bert_flops_per_sequence
from bertqa_bench.measuring.runner import Timing, materialize, timed_passes, warm_up
from bertqa_bench.record.schedule import PAD_LOGIT, Plan, batch_inputs, empty_outputs, make_plan, scatter

TOKEN = ("start_logits", "end_logits")


def _inputs(lengths, s=64):
    n = len(lengths)
    mask = np.zeros((n, s), dtype=np.int64)
    for i, l in enumerate(lengths):
        mask[i, :l] = 1
    ids = np.where(mask == 1, 100 + np.arange(n)[:, None], 0).astype(np.int64)  # row i holds token 100+i
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
            "example_index": np.arange(n)}


class Echo(Backend):
    """Returns, for every token, the row's id token (so outputs say which row they came from)."""

    def __init__(self, name="echo"):
        self.name, self.calls, self.shapes = name, 0, []
        self.prepare_info = {}

    def prepare(self, ctx):
        pass

    def predict(self, batch):
        self.calls += 1
        self.shapes.append(batch["input_ids"].shape)
        ids = batch["input_ids"].astype(np.float32)
        return {"start_logits": ids, "end_logits": -ids, "answer_type_logits": ids[:, :3]}


@pytest.mark.parametrize("batching", ["padded", "trimmed", "sorted"])
def test_every_feature_is_predicted_and_outputs_come_back_in_dataset_order(batching):
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 64, size=53)
    x = _inputs(lengths)
    plan = make_plan(lengths, batching=batching, batch_size=8, max_seq_len=64, seq_multiple=16)
    rows = np.concatenate([b.rows for b in plan.batches])
    assert sorted(rows.tolist()) == list(range(53))  # each feature exactly once
    for b in plan.batches:
        assert b.n_real <= b.shape[0] and int(lengths[b.rows].max()) <= b.shape[1]
    out, timing = timed_passes(Echo(), plan, materialize(x, plan), ("start_logits", "end_logits", "answer_type_logits"),
                               TOKEN, 64)
    for i, l in enumerate(lengths):
        assert np.all(out["start_logits"][i, :l] == 100 + i), i  # row i's own outputs, at row i
        assert out["answer_type_logits"][i, 0] == 100 + i
    assert timing.n_rows == 53


def test_padded_plan_is_dataset_order_at_one_shape_with_the_last_batch_padded():
    plan = make_plan(np.full(21, 5), batching="padded", batch_size=8, max_seq_len=32)
    assert [b.rows.tolist() for b in plan.batches] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 21))]
    assert plan.shapes == [(8, 32)]
    x = batch_inputs(_inputs([5] * 21, s=32), plan.batches[-1])
    assert x["input_ids"].shape == (8, 32)
    assert np.all(x["input_ids"][5:, 0] == x["input_ids"][0, 0])  # pad rows copy a real row, never zeros


def test_trimmed_rounds_each_batch_to_its_longest_feature():
    plan = make_plan(np.array([3, 9, 4, 30, 2, 2]), batching="trimmed", batch_size=3, max_seq_len=64, seq_multiple=8)
    assert [b.shape for b in plan.batches] == [(3, 16), (3, 32)]


def test_sorted_batches_hold_a_token_budget_per_length_bucket():
    lengths = np.array([10] * 40 + [60] * 10 + [120] * 5)
    plan = make_plan(lengths, batching="sorted", batch_size=4, max_seq_len=128, seq_multiple=32)
    budget = 4 * 128
    shapes = {b.shape for b in plan.batches}
    assert shapes == {(16, 32), (8, 64), (4, 128)}  # rows = budget // seq
    assert all(b.shape[0] * b.shape[1] <= budget for b in plan.batches)
    assert plan.batches[0].shape == (4, 128)  # longest first
    # sorted batching computes far fewer padding tokens than padded
    padded = make_plan(lengths, batching="padded", batch_size=4, max_seq_len=128)
    assert plan.computed_tokens <= 0.5 * padded.computed_tokens
    assert plan.real_tokens(lengths) == padded.real_tokens(lengths) == int(lengths.sum())


def test_tiling_repeats_features_to_a_target_size():
    plan = make_plan(np.array([3, 4, 5]), batching="padded", batch_size=2, max_seq_len=8, target_rows=7)
    rows = np.concatenate([b.rows for b in plan.batches]).tolist()
    assert rows == [0, 1, 2, 0, 1, 2, 0] and plan.n_rows == 7 and plan.n_features == 3


@pytest.mark.parametrize("batching", ["padded", "trimmed", "sorted", "packed"])
def test_plan_round_trips_through_its_file(tmp_path, batching):
    plan = make_plan(np.arange(1, 40), batching=batching, batch_size=4, max_seq_len=64, seq_multiple=16)
    back = Plan.load(plan.save(tmp_path / "plan.npz"))
    assert back.batching == batching and back.n_features == plan.n_features == 39
    assert [(b.rows.tolist(), b.shape) for b in back.batches] == [(b.rows.tolist(), b.shape) for b in plan.batches]


def test_scatter_leaves_positions_a_short_batch_never_computed_at_pad_logit():
    plan = make_plan(np.array([4, 4]), batching="trimmed", batch_size=2, max_seq_len=32, seq_multiple=8)
    out = {"start_logits": np.ones((2, 8), np.float32)}
    arrays = empty_outputs(out, 2, 32, TOKEN)
    scatter(arrays, plan.batches[0], out)
    assert np.all(arrays["start_logits"][:, :8] == 1) and np.all(arrays["start_logits"][:, 8:] == PAD_LOGIT)


def test_packed_batches_scatter_back_to_dataset_order():
    """The packed plan reorders rows by length and cuts each batch's token axis to its longest row:
    rows of different lengths, shuffled, with padding inside a batch and positions past its width.
    After scatter (and the padding mask the bench applies) every row holds exactly its own outputs
    at its own index — checked against arrays built directly from the lengths."""
    from bertqa_bench.record.schedule import mask_padding

    rng = np.random.default_rng(7)
    lengths = rng.permutation(np.array([3, 17, 5, 64, 9, 33, 2, 48, 12, 7, 26, 40, 4, 61, 19]))
    s = 64
    x = _inputs(lengths, s)
    plan = make_plan(lengths, batching="packed", batch_size=2, max_seq_len=s, tokens_per_batch=80)
    order = np.concatenate([b.rows for b in plan.batches])
    assert sorted(order.tolist()) == list(range(len(lengths))) and order.tolist() != sorted(order.tolist())
    assert any(b.shape[1] < s for b in plan.batches) and any(lengths[b.rows].min() < b.shape[1] for b in plan.batches)
    echo, outputs = Echo(), {}
    for b in plan.batches:
        out = echo.predict(batch_inputs(x, b))
        assert out["start_logits"].shape == b.shape
        if not outputs:
            outputs = empty_outputs(out, plan.n_features, s, TOKEN)
        scatter(outputs, b, out)
    mask_padding(outputs, x["attention_mask"], TOKEN)
    want_start = np.full((len(lengths), s), PAD_LOGIT, np.float32)
    for i, n in enumerate(lengths):
        want_start[i, :n] = 100 + i  # row i's id token, at row i, on its real tokens only
    np.testing.assert_array_equal(outputs["start_logits"], want_start)
    np.testing.assert_array_equal(outputs["end_logits"], np.where(want_start == PAD_LOGIT, PAD_LOGIT, -want_start))
    np.testing.assert_array_equal(outputs["answer_type_logits"][:, 0], 100 + np.arange(len(lengths)))


def test_warm_up_runs_every_shape_of_the_plan_before_timing():
    lengths = np.array([10] * 40 + [60] * 10 + [120] * 5)
    plan = make_plan(lengths, batching="sorted", batch_size=4, max_seq_len=128, seq_multiple=32)
    echo = Echo()
    n = warm_up(echo, plan, materialize(_inputs(lengths, 128), plan), 2)
    assert set(echo.shapes) == set(plan.shapes) and n == len(plan.shapes)
    echo2 = Echo()
    assert warm_up(echo2, plan, materialize(_inputs(lengths, 128), plan), 7) == 7


class SimulatedClock:
    """A clock that moves only when a backend works: each predict() takes exactly ``step_s``."""

    def __init__(self):
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now


class Ticking(Echo):
    def __init__(self, clock, step_s):
        super().__init__()
        self.clock, self.step_s = clock, step_s

    def predict(self, batch):
        self.clock.now += self.step_s
        return super().predict(batch)


# Steps of 1/32 s from a round start: every sum below is exact in binary floating point.
STEP = 0.03125
PASS = 3 * STEP  # 3 batches a pass


@pytest.mark.parametrize("min_passes, min_duration_s, want_passes", [
    (3, 0.0, 3),           # the passes decide
    (1, 0.2, 3),           # the duration decides: 0.094, 0.1875 (< 0.2), 0.281
    (5, 0.2, 5),           # both: the duration is met after 3 passes, the passes after 5
    (1, 2 * PASS, 2),      # a duration reached exactly is met: no extra pass
])
def test_timed_passes_repeat_until_both_minimums_are_met(min_passes, min_duration_s, want_passes):
    lengths = np.full(12, 5)
    plan = make_plan(lengths, batching="padded", batch_size=4, max_seq_len=8)
    batches = materialize(_inputs(lengths, 8), plan)
    clock = SimulatedClock()
    backend = Ticking(clock, step_s=STEP)
    _, t = timed_passes(backend, plan, batches, TOKEN, TOKEN, 8, min_passes=min_passes,
                        min_duration_s=min_duration_s, clock=clock)
    assert len(t.pass_s) == want_passes and backend.calls == 3 * want_passes
    assert t.pass_s == [PASS] * want_passes  # each pass timed from its first batch to its last
    assert t.batch_ms.tolist() == [STEP * 1e3] * (3 * want_passes)
    assert t.identical_passes and t.predict_s == PASS


def test_timing_summary_reports_the_median_pass_and_its_spread():
    t = Timing([1.0, 3.0, 2.0], np.array([10.0, 20.0, 30.0]), n_rows=100, n_batches=1, flops_computed=4e12,
               flops_real=2e12, identical_passes=True)
    s = t.summary()
    assert s["predict_s"] == 2.0 and s["predict_min_s"] == 1.0 and s["predict_max_s"] == 3.0
    assert s["features_per_s"] == 50.0 and s["achieved_tflops"] == 2.0 and s["real_tflops"] == 1.0
    assert s["predict_stdev_s"] == pytest.approx(1.0)


def test_bert_base_flops_match_the_design_figure():
    # BERT-base at 384 tokens is ~70.7 GFLOP per sequence (docs/design.md).
    assert abs(bert_flops_per_sequence(768, 12, 3072, 384) / 1e9 - 70.7) < 0.1


def test_progress_in_a_log_is_a_plain_line_every_few_seconds_not_one_per_update():
    import io

    from bertqa_bench.measuring.progress import Progress

    log = io.StringIO()  # not a terminal, like CI's captured output
    bar = Progress(10_000, "train", unit="step", every_s=3600, stream=log)
    for _ in range(10_000):
        bar.update(1, postfix="loss=1.0")
    bar.close()
    assert log.getvalue() == ""  # a short run stays quiet ...
    bar = Progress(100, "train", unit="step", every_s=0.0, stream=log)
    for _ in range(100):
        bar.update(1)
    assert 0 < log.getvalue().count("\n") <= 101 and "\r" not in log.getvalue()
    assert "train: 100/100 step" in log.getvalue()


def test_padding_positions_never_reach_postprocessing():
    from bertqa_bench.record.schedule import mask_padding

    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 0]])
    out = {"start_logits": np.arange(8, dtype=np.float32).reshape(2, 4), "answer_type_logits": np.ones((2, 3))}
    mask_padding(out, mask, ("start_logits",))
    assert out["start_logits"].tolist() == [[0, 1, PAD_LOGIT, PAD_LOGIT], [4, 5, 6, PAD_LOGIT]]
    assert np.all(out["answer_type_logits"] == 1)  # per-feature outputs are left alone


def test_packed_plan_fills_batches_with_a_budget_of_real_tokens():
    lengths = np.array([10] * 40 + [60] * 10 + [120] * 5)
    plan = make_plan(lengths, batching="packed", batch_size=4, max_seq_len=128)
    assert plan.n_features == len(lengths)
    rows = np.concatenate([b.rows for b in plan.batches])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for b in plan.batches:
        assert lengths[b.rows].sum() <= 4 * 128 or b.n_real == 1
        assert b.shape[0] == b.n_real and b.shape[1] >= lengths[b.rows].max()
    assert len(plan.batches) <= -(-int(lengths.sum()) // (4 * 128)) + 2  # nearly full batches


def test_gpu_idle_fraction_is_the_window_minus_the_union_of_kernels(tmp_path):
    import json

    from bertqa_bench.measuring.trace_tables import busy_time, gpu_idle_fraction

    assert busy_time([(0, 10), (5, 15), (20, 30)]) == 25
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5},
                             {"ph": "X", "cat": "kernel", "ts": 10, "dur": 30},
                             {"ph": "X", "cat": "kernel", "ts": 20, "dur": 30},  # overlaps the first
                             {"ph": "X", "cat": "gpu_memcpy", "ts": 80, "dur": 20}]}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace))
    idle = gpu_idle_fraction(p)
    assert idle["window_ms"] == 0.1 and idle["busy_ms"] == pytest.approx(0.06)
    assert idle["idle_fraction"] == pytest.approx(0.4)


def test_data_parallel_workers_take_the_gpus_the_parent_was_given(monkeypatch):
    from bertqa_bench.measuring.local_ranks import visible_gpus
    from bertqa_bench.errors import ConfigError

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(2) == ["0", "1"]
    # a share of a host: workers map into the parent's list, never onto someone else's GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus(2) == ["2", "3"] and visible_gpus(1) == ["2"]
    with pytest.raises(ConfigError, match="names only 2"):
        visible_gpus(4)


def test_a_content_keyed_cache_entry_finished_first_by_another_process_stays(tmp_path):
    from bertqa_bench.io import atomic_dir

    entry = tmp_path / "entry"
    with atomic_dir(entry, replace=False) as tmp:
        (tmp / "x").write_text("first")
        with atomic_dir(entry, replace=False) as other:  # a second process, finishing first
            (other / "x").write_text("second")
        held = open(entry / "x")  # a reader holds the entry open
    assert (entry / "x").read_text() == "second" and held.read() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # the loser's copy is gone
    with atomic_dir(entry) as tmp:  # a saved model: the new one replaces the old
        (tmp / "x").write_text("new")
    assert (entry / "x").read_text() == "new"


@pytest.mark.parametrize("replace", [False, True])
def test_a_cache_entry_another_process_renames_in_just_before_ours_does_not_fail(tmp_path, monkeypatch, replace):
    """The race CI hit: two benches started together both build one evaluation set, and the
    other's rename lands between this one's check and its rename (ENOTEMPTY)."""
    from bertqa_bench import io

    entry, real_replace, planted = tmp_path / "entry", os.replace, []

    def racing_replace(src, dst):
        if Path(dst) == entry and not planted:  # the other process finishes first, just now
            other = tmp_path / ".other"
            other.mkdir()
            (other / "x").write_text("other")
            real_replace(other, entry)
            planted.append(1)
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", racing_replace)
    with io.atomic_dir(entry, replace=replace) as tmp:
        (tmp / "x").write_text("ours")
    assert planted and (entry / "x").read_text() == ("ours" if replace else "other")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary left behind


def test_token_efficiency_is_real_over_computed_tokens():
    from bertqa_bench.record.schedule import make_plan

    lengths = np.array([10, 20, 30, 40, 90, 100, 110, 128])
    padded = make_plan(lengths, batching="padded", batch_size=4, max_seq_len=128)
    assert padded.token_efficiency(lengths) == pytest.approx(lengths.sum() / (8 * 128))
    srt = make_plan(lengths, batching="sorted", batch_size=4, max_seq_len=128, seq_multiple=32)
    # sorted batches keep a constant token count, padding the short buckets with repeated rows:
    # 4x128 + 5x96 + 8x64 + 16x32 = 2,016 tokens computed for 528 real ones
    assert [b.shape for b in srt.batches] == [(4, 128), (5, 96), (8, 64), (16, 32)]
    assert srt.token_efficiency(lengths) == pytest.approx(528 / 2016)
    assert make_plan(lengths, batching="packed", batch_size=4, max_seq_len=128,
                     tokens_per_batch=256).token_efficiency(lengths) == 1.0


class SimulatedDevice(Echo):
    """A backend with an accelerator of its own, on the simulated clock: ``submit`` costs the host
    ``host_s`` and queues the batch; the device computes batches one after another, ``device_s``
    each, starting each when both it is free and the batch was submitted; a waiter moves the clock
    to its batch's finish. It refuses what a real pipelined backend's buffers could not survive:
    more than ``depth`` batches outstanding, or waiters called out of submission order."""

    def __init__(self, clock, host_s, device_s, depth):
        super().__init__()
        self.clock, self.host_s, self.device_s, self.depth = clock, host_s, device_s, depth
        self.free_at, self.outstanding, self.events = clock.now, [], []

    def in_flight(self):
        return self.depth

    def submit(self, batch):
        if len(self.outstanding) >= self.depth:
            raise AssertionError(f"{len(self.outstanding) + 1} batches in flight, the backend keeps {self.depth}")
        self.clock.now += self.host_s
        self.free_at = finish = max(self.free_at, self.clock.now) + self.device_s
        out, k = Echo.predict(self, batch), self.calls
        self.outstanding.append(k)
        self.events.append(f"submit {k}")

        def wait():
            assert self.outstanding[0] == k, "collected out of submission order"
            self.outstanding.pop(0)
            self.clock.now = max(self.clock.now, finish)
            self.events.append(f"collect {k}")
            return out

        return wait

    def predict(self, batch):
        return self.submit(batch)()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_backend_that_keeps_batches_in_flight_gets_them_and_its_host_work_overlaps_the_device(depth):
    """The runner hands a pipelined backend batch i+1 before collecting batch i, so a pass takes
    host + n x device instead of n x (host + device); outputs land where the synchronous loop puts
    them, and each batch's latency runs from its submission to its collection."""
    lengths = np.arange(1, 17)
    plan = make_plan(lengths, batching="padded", batch_size=4, max_seq_len=16)  # 4 batches
    batches = materialize(_inputs(lengths, 16), plan)
    host, dev = STEP / 2, STEP  # the host's work per batch is half the device's
    clock = SimulatedClock()
    backend = SimulatedDevice(clock, host, dev, depth)
    out, t = timed_passes(backend, plan, batches, TOKEN, TOKEN, 16, min_passes=2, clock=clock)
    want_pass = 4 * (host + dev) if depth == 1 else host + 4 * dev
    assert t.pass_s == [want_pass, want_pass]
    if depth == 2:
        assert backend.events[:6] == ["submit 1", "submit 2", "collect 1", "submit 3", "collect 2", "submit 4"]
        # batch 1: its host work, then the device; batch 2 queues behind it (submitted at host,
        # computed from host + dev to host + 2 dev)
        assert t.batch_ms[:2].tolist() == [(host + dev) * 1e3, 2 * dev * 1e3]
    sync_out, _ = timed_passes(Echo(), plan, batches, TOKEN, TOKEN, 16)
    for k in TOKEN:
        np.testing.assert_array_equal(out[k], sync_out[k])


def test_warm_up_goes_through_the_in_flight_path_too():
    lengths = np.array([10] * 40 + [60] * 10 + [120] * 5)
    plan = make_plan(lengths, batching="sorted", batch_size=4, max_seq_len=128, seq_multiple=32)
    backend = SimulatedDevice(SimulatedClock(), STEP, STEP, 2)
    n = warm_up(backend, plan, materialize(_inputs(lengths, 128), plan), 6, TOKEN, TOKEN)
    assert n == 6 and backend.events[:3] == ["submit 1", "submit 2", "collect 1"]


def test_spread_takes_the_first_and_the_last_batch_and_spaces_the_rest():
    """``spread``: which batches of a plan stand for all of them (the runner's sample batches, the
    kernel bench's sampled ones)."""
    from bertqa_bench.record.schedule import spread

    got = spread(63, 8)
    assert got[0] == 0 and got[-1] == 62 and len(got) == 8 == len(set(got)) and got == sorted(got)
    gaps = np.diff(got)
    assert gaps.max() - gaps.min() <= 1
    assert spread(5, 0) == spread(5, 9) == [0, 1, 2, 3, 4]
    assert spread(10, 1) == [0]
    assert spread(1, 8) == [0]


def test_a_variant_of_a_larger_batch_size_scales_the_token_budget_and_the_row_cap_alike():
    # packed batches of short features: at the suite's batch size the token budget binds, at
    # four times it neither the budget nor the row cap may stay at the suite's values
    from bertqa_bench.config import BenchConfig
    from bertqa_bench.measuring.jobs import batch_budget

    b = BenchConfig(batch_size=32, batching="packed", tokens_per_batch=1000, max_batch_rows=8)
    assert batch_budget(b, 32) == (1000, 8)
    assert batch_budget(b, 128) == (4000, 32)
    assert batch_budget(BenchConfig(batch_size=32), 64) == (None, None)
    lengths = np.full(384, 100)
    small, large = (make_plan(lengths, batching="packed", batch_size=bs, max_seq_len=384,
                              tokens_per_batch=batch_budget(b, bs)[0], max_batch_rows=batch_budget(b, bs)[1])
                    for bs in (32, 128))
    assert max(x.shape[0] for x in small.batches) == 8  # the row cap binds: 800 of 1,000 tokens
    assert max(x.shape[0] for x in large.batches) == 32  # 4x the rows, 3,200 of 4,000 tokens
    assert len(large.batches) * 4 == len(small.batches)
