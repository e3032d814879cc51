"""Timings that say when not to trust them (bertqa_bench/measuring/machine_state.py): a CPU bench
beside a bounded CPU hog has its rows marked in the table, results.csv, MLflow and the summary;
the default thread plan never exceeds the cores the process may use; the rules themselves."""
import csv
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import yaml

from bertqa_bench.cli import main
from bertqa_bench.config import SyntheticConfig
from bertqa_bench.measuring import machine_state
from bertqa_bench.measuring.machine_state import judge, usable_cores
from bertqa_bench.record.results import RunBundle

SYN = dict(seed=5, n_train_contexts=4, n_dev_contexts=3, questions_per_context=2, min_words=30, max_words=60,
           mean_words=40, long_context_fraction=0.0)


# --- the thread plan ---------------------------------------------------------------------------

@pytest.mark.parametrize("affinity,quota,want", [({0}, None, 1), ({0, 1, 2, 3}, None, 4), ({0, 1, 2, 3}, 2.0, 2),
                                                 ({0, 1}, 8.0, 2), ({0, 1, 2}, 1.5, 1)])
def test_usable_cores_is_the_affinity_capped_by_a_cgroup_quota(affinity, quota, want, monkeypatch):
    monkeypatch.setattr(machine_state.os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(machine_state, "_cgroup_quota_cores", lambda: quota)
    assert usable_cores() == want


@pytest.mark.parametrize("affinity", [{0}, {0, 1}, set(range(os.cpu_count() or 1))])
def test_the_default_thread_plan_never_exceeds_the_cores_the_process_may_use(affinity, monkeypatch):
    """Every CPU job (bench worker, LoadGen) sets torch's threads, which ONNX Runtime and OpenVINO
    take too, from load_job: without bench.num_threads, the usable cores, never more."""
    import torch

    from bertqa_bench.measuring.job_setup import load_job
    from bertqa_bench.measuring.worker import Job

    monkeypatch.setattr(machine_state.os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(machine_state, "_cgroup_quota_cores", lambda: None)
    before = torch.get_num_threads()
    try:
        for variant in ("eager-fp32", "onnxruntime", "openvino"):
            from bertqa_bench.backends.variants import VariantTable

            v = VariantTable.for_suite().get(variant)
            job = Job(variant=v.to_dict(), model_dir="", task="squad", artifacts_dir="", evalset="", plan="",
                      outputs="", result="", output_names=[], token_outputs=[], max_seq_len=8)
            torch.set_num_threads(64)  # whatever came before must not leak into the plan
            load_job(job, plan=object(), inputs={})
            assert torch.get_num_threads() == len(affinity) == usable_cores(), variant
    finally:
        torch.set_num_threads(before)


# --- the rules ---------------------------------------------------------------------------------

def test_judge_marks_oversubscribed_cores_and_keeps_a_quiet_machine():
    quiet = {"other_cpu_cores": 0.04, "threads": 2, "usable_cores": 2, "load_avg_1m": 2.1}
    assert judge(quiet) == (True, "")
    busy = {"other_cpu_cores": 1.63, "threads": 2, "usable_cores": 2, "load_avg_1m": 3.9}
    ok, note = judge(busy)
    assert ok is False and note == "unreliable (other processes used 1.6 of the 2 cores, load 3.9)"
    # one thread on two cores leaves room for one other busy core, not for two
    assert judge({"other_cpu_cores": 0.9, "threads": 1, "usable_cores": 2})[0] is True
    assert judge({"other_cpu_cores": 1.5, "threads": 1, "usable_cores": 2})[0] is False
    assert judge({"other_cpu_cores": 0.0, "threads": 4, "usable_cores": 2}) == (False, "unreliable (4 threads on 2 cores)")
    assert judge({"other_cpu_cores": 0.0, "threads": 2, "usable_cores": 2, "cpu_steal_pct": 12.0})[0] is False
    # a GPU row's host thread: CPU use elsewhere matters only past the free cores; a throttled or shared GPU always
    assert judge({"other_cpu_cores": 0.9, "threads": 2, "usable_cores": 2}, demand=1)[0] is True
    assert judge({"other_cpu_cores": 0.0, "threads": 2, "usable_cores": 2, "gpu_throttle": "HW thermal"},
                 demand=1) == (False, "unreliable (GPU clocks held down (HW thermal))")
    assert judge({"other_cpu_cores": 0.0, "threads": 2, "usable_cores": 2, "gpu_other_processes": 1}, demand=1)[0] is False
    assert judge({}) == (None, "")  # nothing readable: nothing claimed


def test_a_timed_region_measures_other_processes_demand_on_its_cores():
    """One busy process beside an idle sampler on the same cores: ~1 core of other demand."""
    state = machine_state.MachineState(threads=1)
    stop = mp.Event()
    hog = mp.Process(target=_spin, args=(stop, time.time() + 30, sorted(os.sched_getaffinity(0))))
    hog.start()
    try:
        time.sleep(0.3)
        state.start()
        time.sleep(1.0)
        v = state.stop()
    finally:
        stop.set()
        hog.join(5)
        if hog.is_alive():
            hog.kill()
    assert 0.7 <= v["other_cpu_cores"] <= usable_cores() + 0.05, v
    assert v["usable_cores"] == usable_cores() and v["threads"] == 1 and v["timed_wall_s"] >= 1.0


# --- a bench beside a CPU hog ---------------------------------------------------------------------

def _spin(stop, deadline, cpus):
    """A bounded busy loop: stops when told, or at ``deadline`` whatever happens to the test."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass
    while not stop.is_set() and time.time() < deadline:
        for _ in range(100_000):
            pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from bertqa_bench.model.families import build_checkpoint
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    root = tmp_path_factory.mktemp("busy")
    ensure_squad_files(root / "data", SyntheticConfig(**SYN))
    return root, build_checkpoint("bert", root / "ck", seed=1, head_scale=30.0)


def test_a_cpu_bench_beside_a_cpu_hog_has_its_rows_marked(setup, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from bertqa_bench.reporting.tracking import default_tracking_uri

    root, ck = setup
    raw = {"name": "busy",
           "data": {"source": "synthetic", "data_dir": str(root / "data"), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(SYN)},
           # a second of timed passes each, in a block: long enough for /proc/stat's 10 ms ticks (a
           # round's one pass of this tiny model is a few of them)
           "bench": {"backends": ["eager-fp32", "onnxruntime"], "batch_size": 8, "warmup_batches": 1,
                     "min_passes": 2, "min_duration_s": 1.0, "isolation": "inprocess", "timing": "block"},
           "variants": {"onnxruntime": {"base": "onnxruntime", "options": {"exporter": "torchscript"}}},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "busy.yaml").write_text(yaml.safe_dump(raw))
    cpus = sorted(os.sched_getaffinity(0))
    stop = mp.Event()
    hogs = [mp.Process(target=_spin, args=(stop, time.time() + 120, cpus)) for _ in cpus]  # one per core
    for h in hogs:
        h.start()
    try:
        time.sleep(0.5)
        rc = main(["bench", "--suite", str(tmp_path / "busy.yaml"), "--model", str(ck), "--no-progress",
                   "--run-id", "busy"])
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
            if h.is_alive():
                h.kill()
    assert rc == 0
    out = capsys.readouterr().out
    run = tmp_path / "results" / "busy"
    rows = {r.backend: r for r in RunBundle.load(run).results}
    for r in rows.values():
        assert r.ok and r.timing_reliable is False, (r.backend, r.timing_note, r.other_cpu_cores)
        assert r.timing_note.startswith("unreliable (other processes used ") and f"of the {usable_cores()} cores" in r.timing_note
        assert r.other_cpu_cores >= 0.5 and r.threads == usable_cores() and r.usable_cores == usable_cores()
    # results.csv, the table and the summary, the CLI's own line, MLflow
    csv_rows = {r["backend"]: r for r in csv.DictReader((run / "results.csv").open())}
    assert csv_rows["onnxruntime"]["timing_reliable"] in ("False", "false") and csv_rows["onnxruntime"]["timing_note"]
    summary = (run / "summary.md").read_text()
    table_row = next(line for line in summary.splitlines() if line.startswith("| onnxruntime |"))
    assert table_row.count("⚠") == 2  # its time, and its speedup
    assert "⚠ Timing unreliable: 2 of 2 rows" in summary and "every speedup (the reference is one of them)" in summary
    assert "- `eager-fp32`: timing: unreliable (other processes used" in summary
    assert f"- Threads: every CPU backend computed on {usable_cores()} thread" in summary
    assert "timing: unreliable for 2 of 2 rows" in out
    client = MlflowClient(default_tracking_uri(tmp_path / "results"))
    runs = client.search_runs([client.get_experiment_by_name("bertqa-busy").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("kind") == "bench")
    assert parent.data.tags["timing"] == "unreliable: eager-fp32, onnxruntime timed on a busy machine"
    for child in (r for r in runs if r.data.tags.get("kind") == "backend"):
        assert child.data.tags["timing"].startswith("unreliable (other processes used")


def test_gpu_state_reads_clocks_throttle_reasons_and_other_processes_from_nvml():
    """NVML as nvidia-ml-py exposes it (a stand-in: no GPU here): the SM clock against its maximum,
    only the throttle reasons that slow a measurement, and the GPU's other processes."""
    from types import SimpleNamespace

    from bertqa_bench.measuring.machine_state import gpu_state

    nvml = SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlDeviceGetClockInfo=lambda h, c: 1410, nvmlDeviceGetMaxClockInfo=lambda h, c: 1980,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4 | 0x40,  # SW power cap (normal) + HW thermal
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=os.getpid()), SimpleNamespace(pid=1)])
    v = gpu_state(nvml, object())
    assert v == {"gpu_sm_clock_mhz": 1410.0, "gpu_sm_clock_max_mhz": 1980.0, "gpu_throttle": "HW thermal",
                 "gpu_other_processes": 1}
    calm = SimpleNamespace(**{**vars(nvml), "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
                              "nvmlDeviceGetComputeRunningProcesses": lambda h: []})
    v = gpu_state(calm, object())
    assert v["gpu_throttle"] == "" and v["gpu_other_processes"] == 0
    assert judge({"other_cpu_cores": 0.0, "threads": 16, "usable_cores": 16, **v}, demand=1) == (True, "")


def test_a_recommendation_names_the_rows_timed_on_a_busy_machine():
    from bertqa_bench.record.results import BackendResult
    from bertqa_bench.reporting.recommend import recommend

    def row(name, speedup, reliable, cls="fp32"):
        return BackendResult(backend=name, precision="fp32", parity_class=cls, speedup=speedup, parity="pass",
                             parity_within_noise=False, predict_min_s=1 / speedup, predict_max_s=1 / speedup,
                             speedup_low=0.99 * speedup, speedup_high=1.01 * speedup,
                             n_features=10, timing_reliable=reliable)

    quiet = recommend([row("eager-fp32", 1.0, True), row("onnxruntime", 2.0, True)], "eager-fp32")
    assert quiet.best.backend == "onnxruntime" and not quiet.busy and "busy" not in quiet.text()
    assert not quiet.headline().endswith("(timing unreliable)")
    busy = recommend([row("eager-fp32", 1.0, False), row("onnxruntime", 32.9, True), row("openvino", 2.5, None)],
                     "eager-fp32")
    assert busy.best.backend == "onnxruntime" and busy.busy == ("eager-fp32",)
    assert "- ⚠ Timed on a busy machine: eager-fp32; this ranking by speed may not hold" in busy.text()
    assert busy.headline().endswith("(timing unreliable)") and busy.tags()["recommendation"] == busy.headline()


def test_the_benchs_own_processes_are_not_other_users_of_the_gpu(monkeypatch):
    """In rounds the other rows' workers hold CUDA contexts while one row is timed, and the bench
    itself holds one when it trained the model in the same run (seen on the H200: every row was
    marked ⚠ '1 other process' after an in-run training): the bench that launched the worker
    (named by BERTQA_PARENT_PID) and every process descended from it are this run's own, never
    'another process on the GPU'. A process the launcher did not start owns only its children:
    whatever started it may be using the GPU."""
    import subprocess
    import sys

    from bertqa_bench.measuring.interrupt import PARENT_ENV
    from bertqa_bench.measuring.machine_state import same_run

    parent = os.getppid()
    grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.delenv(PARENT_ENV, raising=False)  # not started by the launcher
        assert same_run(child.pid) and not same_run(parent)
        monkeypatch.setenv(PARENT_ENV, str(parent))  # a worker the bench launched
        assert same_run(parent) and same_run(child.pid)  # the bench, and what descends from it
        assert all(not same_run(p) for p in (grandparent, 1) if p != parent)  # above the bench
        monkeypatch.setenv(PARENT_ENV, str(parent + 1))  # another process's name: not our parent
        assert not same_run(parent)
    finally:
        child.kill()
        child.wait()
    assert not same_run(2 ** 22 + 12345)  # no such process
