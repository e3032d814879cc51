"""The scaling table: efficiency only within one host and recipe, rows read from what runs saved."""
import json

import pytest

from bertqa_bench.errors import BenchError
from bertqa_bench.record.results import BackendResult, RunBundle, RunMeta
from bertqa_bench.reporting.scaling import (ScalingRow, commands_from_log, load_rows, markdown, train_row,
                                            with_efficiency)


def _metrics(world, sps, *, name="m", accum=1, global_batch=64, lr=1e-4, **extra):
    return {"world_size": world, "global_batch": global_batch, "grad_accum": accum, "train_samples_per_s": sps,
            "train_features": 1000, "train_steps": 30, "train_s": 1000 / sps, "dev_f1": 80.0 + world / 10,
            "dev_exact_match": 70.0, "device_name": "GPU-X",
            "recipe_fields": {"model.name": name, "train.batch_size": global_batch, "train.learning_rate": lr},
            **extra}


def test_rows_of_one_recipe_form_one_series_whatever_the_model_is_called():
    a = train_row(_metrics(1, 100.0, name="a", accum=4), host="h")
    b = train_row(_metrics(4, 360.0, name="b", accum=1), host="h")
    c = train_row(_metrics(1, 100.0, name="c", lr=2e-4), host="h")
    assert a.series == b.series != c.series
    assert a.rows_per_gpu == b.rows_per_gpu == 16  # 64 = 1 x 4 x 16 = 4 x 1 x 16


def test_the_last_epoch_has_its_own_rate_and_efficiency_and_compiled_runs_their_own_series():
    """A compiled run pays its compilation in the first epoch: the last epoch's rate is taken
    apart (samples of one epoch over its time), with its own efficiency; compiled and eager runs
    of one recipe are not compared."""
    one = _metrics(1, 100.0, accum=4, train_epoch_s=[7.0, 3.0], compile=True, compile_scope="layers", seq_bucket=64)
    four = _metrics(4, 250.0, accum=1, train_epoch_s=[3.0, 1.0], compile=True, compile_scope="layers", seq_bucket=64)
    eager = _metrics(4, 300.0, accum=1, train_epoch_s=[2.0, 1.3])
    rows = with_efficiency([train_row(m, host="h") for m in (one, four, eager)])
    assert rows[0].series == rows[1].series != rows[2].series
    assert "compiled (layers), 64-token buckets" in rows[0].series
    # 1000 samples over 2 epochs: 500 in the last one, in 3 s (1 GPU) and 1 s (4 GPUs)
    assert rows[0].last_epoch_samples_per_s == pytest.approx(500 / 3.0)
    assert rows[1].last_epoch_samples_per_s == pytest.approx(500 / 1.0)
    assert rows[1].efficiency == pytest.approx(250 / 400)
    assert rows[1].last_epoch_efficiency == pytest.approx(500 / (4 * 500 / 3.0))
    assert rows[2].efficiency is None and rows[2].last_epoch_efficiency is None  # no 1-GPU row of its own
    assert train_row(_metrics(1, 100.0), host="h").last_epoch_samples_per_s is None  # one epoch: nothing apart


def test_a_run_that_compiled_before_its_clock_shows_the_prepare_time_and_is_its_own_series():
    cold = _metrics(1, 100.0, accum=4, train_epoch_s=[7.0, 3.0], compile=True, compile_scope="layers", seq_bucket=64)
    warm = {**cold, "train_prepare_s": 41.5, "train_warmup_shapes": 5}
    rc, rw = train_row(cold, host="h"), train_row(warm, host="h")
    assert rc.series != rw.series and "compiled before the clock" in rw.series
    assert rc.prepare_s is None and rw.prepare_s == 41.5
    md = markdown([rc, rw], "t")
    assert "| prepare (s) |" in md and "| 41.5 |" in md


def test_a_ddp_setting_off_its_default_makes_its_own_series():
    """DDP's static graph (or other buckets) read back from the run: such a 4-GPU run is not a point
    of the default series (host H's static-graph run once landed in the control's table)."""
    ddp = {"bucket_cap_mb": 25.0, "static_graph": False, "gradient_as_bucket_view": True}
    control = train_row(_metrics(4, 300.0, ddp=ddp), host="h")
    static = train_row(_metrics(4, 290.0, ddp={**ddp, "static_graph": True}), host="h")
    big = train_row(_metrics(4, 290.0, ddp={**ddp, "bucket_cap_mb": 100.0}), host="h")
    copied = train_row(_metrics(4, 290.0, ddp={**ddp, "gradient_as_bucket_view": False}), host="h")
    one = train_row(_metrics(1, 80.0, accum=4), host="h")
    assert one.series == control.series
    assert len({control.series, static.series, big.series, copied.series}) == 4
    assert "DDP static graph" in static.series and "100 MB buckets" in big.series
    manual = train_row(_metrics(1, 80.0, accum=4, manual_gc=True), host="h")
    assert manual.series != one.series and "manual GC" in manual.series
    graphed = train_row(_metrics(1, 80.0, accum=4, graph_layers=True), host="h")
    assert graphed.series not in (one.series, manual.series) and "layers as CUDA graphs" in graphed.series
    # train.no_host_sync (on since it existed): runs before it synced, so they are another series
    free = train_row(_metrics(1, 80.0, accum=4, graph_layers=True, no_host_sync=True), host="h")
    assert free.series == graphed.series + ", no host sync"
    assert train_row(_metrics(1, 80.0, accum=4, graph_layers=True, no_host_sync=False), host="h").series == graphed.series


def test_a_ddp_only_setting_scales_against_the_one_gpu_run_without_it():
    """One process builds no DDP, so a comm hook (or DDP's buckets) changes nothing there: the
    hook's multi-GPU rows are their own series but scale against the 1-GPU row without the hook
    (host L's 4-GPU hook runs had no efficiency at all before), and a 1-GPU run that asked for
    the hook is a point of the series without it. The efficiency is never borrowed across hosts
    or from another recipe."""
    ddp = {"bucket_cap_mb": 25.0, "static_graph": False, "gradient_as_bucket_view": True}
    graphed = dict(graph_layers=True)
    one = train_row(_metrics(1, 100.0, accum=4, **graphed), host="h")
    one_asking = train_row(_metrics(1, 101.0, accum=4, ddp_comm_hook="allreduce", **graphed), host="h")
    four = train_row(_metrics(4, 360.0, ddp=ddp, **graphed), host="h")
    hook = train_row(_metrics(4, 364.0, ddp=ddp, ddp_comm_hook="allreduce", **graphed), host="h")
    static = train_row(_metrics(4, 350.0, ddp={**ddp, "static_graph": True}, **graphed), host="h")
    elsewhere = train_row(_metrics(4, 390.0, ddp=ddp, ddp_comm_hook="allreduce", **graphed), host="g")
    other_recipe = train_row(_metrics(4, 364.0, lr=2e-4, ddp=ddp, ddp_comm_hook="allreduce", **graphed), host="h")
    assert one_asking.series == one.series and not one.baseline_series
    assert hook.series != four.series and "all-reduce hook" in hook.series
    assert hook.baseline_series == static.baseline_series == four.series and not four.baseline_series
    rows = with_efficiency([one, four, hook, static, elsewhere, other_recipe])
    assert [r.efficiency for r in rows[1:4]] == [pytest.approx(0.9), pytest.approx(0.91), pytest.approx(0.875)]
    assert rows[4].efficiency is None and rows[5].efficiency is None
    md = markdown(rows, "t")
    hook_section = md.split("all-reduce hook (one division a bucket), layers as CUDA graphs — h")[1].split("## ")[0]
    assert f"against the 1-GPU row of *{four.series}* on h" in hook_section and "| 91.0% |" in hook_section
    assert "against the 1-GPU row" not in md.split("## ")[1]  # a series with its own 1-GPU row says nothing


def test_efficiency_is_taken_against_the_one_gpu_row_of_the_same_host_and_series():
    rows = [ScalingRow("train", 1, "X", "A", "s", 100.0), ScalingRow("train", 2, "X", "A", "s", 180.0),
            ScalingRow("train", 1, "X", "B", "s", 50.0), ScalingRow("train", 4, "X", "B", "s", 150.0),
            ScalingRow("train", 2, "X", "A", "other recipe", 190.0)]
    eff = [r.efficiency for r in with_efficiency(rows)]
    assert eff[:4] == [pytest.approx(1.0), pytest.approx(0.9), pytest.approx(1.0), pytest.approx(0.75)]
    assert eff[4] is None  # no 1-GPU row in its series: no efficiency rather than a cross-recipe ratio


def test_of_several_one_gpu_rows_the_fastest_is_the_denominator():
    rows = [ScalingRow("train", 1, "X", "A", "s", 100.0), ScalingRow("train", 1, "X", "A", "s", 98.0),
            ScalingRow("train", 4, "X", "A", "s", 360.0)]
    out = with_efficiency(rows)
    assert [r.efficiency for r in out] == [pytest.approx(1.0), pytest.approx(0.98), pytest.approx(0.9)]
    # the same whichever order the runs are listed in
    assert [r.efficiency for r in with_efficiency(rows[::-1])] == [pytest.approx(0.9), pytest.approx(0.98),
                                                                   pytest.approx(1.0)]
    assert "against the fastest of this series' 1-GPU rows" in markdown(out, "t")
    assert "fastest" not in markdown(with_efficiency([rows[0], rows[2]]), "t")
    # a row without a rate is never the denominator, wherever it is listed
    for odd in (float("nan"), None, 0.0):
        bad = ScalingRow("train", 1, "X", "A", "s", odd)
        for order in ([bad, *rows], [*rows, bad]):
            four = [r for r in with_efficiency(order) if r.n_gpus == 4][0]
            assert four.efficiency == pytest.approx(0.9)


def test_a_borrowed_baseline_with_several_one_gpu_rows_says_the_fastest_was_taken():
    one = ScalingRow("train", 1, "X", "A", "graphed", 100.0)
    other = ScalingRow("train", 1, "X", "A", "graphed", 95.0)
    hook = ScalingRow("train", 4, "X", "A", "graphed + hook", 360.0, baseline_series="graphed")
    out = with_efficiency([other, hook, one])
    assert out[1].efficiency == pytest.approx(0.9)
    hook_section = markdown(out, "t").split("graphed + hook — A")[1]
    assert "against the fastest 1-GPU row of *graphed* on A" in hook_section
    single = markdown(with_efficiency([one, hook]), "t").split("graphed + hook — A")[1]
    assert "against the 1-GPU row of *graphed* on A" in single


def test_prediction_rows_come_from_a_data_parallel_bundle(tmp_path):
    meta = RunMeta(suite="s", run_id="r", task="squad", metric_names=["exact_match", "f1"], primary_metric="f1",
                   reference="eager", command="bertqa-bench sweep --devices 1,2", date="2026-11-26",
                   device_name="GPU-X")
    b = RunBundle.create(tmp_path, meta, {}, {})
    for name, n, fps in (("eager", 1, 900.0), ("eager@b64-sorted", 1, 1000.0), ("eager@b64-sorted-x2", 2, 1900.0)):
        b.add(BackendResult(backend=name, batching="sorted" if "sorted" in name else "padded", batch_size=64,
                            precision="fp16", n_devices=n, features_per_s=fps, device_name="GPU-X",
                            scores={"exact_match": 70.0, "f1": 80.0}, parity="pass"))
    b.add(BackendResult(backend="broken-x2", status="failed", n_devices=2, error="boom"))
    rows = load_rows([f"host:{b.dir}"])
    # the padded reference has no 2-GPU partner: not a scaling series; the failed row is skipped
    assert [(r.n_gpus, r.samples_per_s) for r in rows] == [(1, 1000.0), (2, 1900.0)]
    assert rows[1].efficiency == pytest.approx(0.95) and rows[1].command == meta.command
    assert rows[1].dev_f1 == 80.0 and rows[1].job == "predict" and rows[1].parity == "pass"


def test_bad_sources_name_the_file_and_field(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    m = _metrics(1, 100.0)
    del m["train_samples_per_s"]
    (d / "train_metrics.json").write_text(json.dumps(m))
    with pytest.raises(BenchError, match=r"model/train_metrics.json: field 'train_samples_per_s' is missing"):
        load_rows([str(d)])
    with pytest.raises(BenchError, match="neither a model folder"):
        load_rows([str(tmp_path)])
    old = _metrics(1, 100.0)
    del old["device_name"]
    (d / "train_metrics.json").write_text(json.dumps(old))
    with pytest.raises(BenchError, match="pass --card"):
        load_rows([str(d)])
    assert load_rows([str(d)], card="GPU-Y")[0].card == "GPU-Y"


def test_commands_are_recovered_from_a_session_log_for_older_metrics():
    log = ("09:21:37 start train-g128: torch.distributed.run --standalone --nproc_per_node=1 -m bertqa_bench.cli "
           "train --suite s --set model.name=m-g128 --set train.batch_size=128\n"
           "09:22:59 start bench: bertqa_bench.cli bench --suite s --set model.name=m\n")
    cmds = commands_from_log(log)
    assert cmds["m-g128"].startswith("torchrun --standalone --nproc_per_node=1 -m bertqa_bench.cli train")
    assert cmds["m"] == "bertqa-bench bench --suite s --set model.name=m"
