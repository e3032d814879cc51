"""scripts/gpu_session.py composes plans: ``A+B`` side by side (lane i sees only GPU i), ``A,B`` in
turn inside a lane, separate arguments one after another; an unknown plan lists the valid ones."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gs(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "scripts" / "gpu_session.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "gpus", lambda: 2)
    real = subprocess.run
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: real(["echo", "two test GPUs"], capture_output=True,
                                                                     text=True))

    def step(name):
        return lambda s: s.run(name, [sys.executable, "-c",
                                      "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'all'))"])

    for n in "abcd":
        mod.PLANS[n] = [step(n)]
    return mod


def test_lanes_see_their_own_gpu_and_run_in_order(gs, tmp_path):
    assert gs.main_run(["a+b,c", "d"], tmp_path) == 0
    seen = {n: (tmp_path / f"{n}.log").read_text().strip() for n in "abcd"}
    assert seen == {"a": "0", "b": "1", "c": "1", "d": "all"}
    log = (tmp_path / "driver.log").read_text().splitlines()
    # c follows b in lane 1; d starts only after both lanes are done
    text = "\n".join(log)
    assert text.index("[gpu1] end b") < text.index("[gpu1] start c") < text.index("lanes a+b,c done") < text.index(
        "start d")


def test_an_unknown_plan_is_refused_with_the_valid_ones(gs, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_session.py", "a+nope"])
    with pytest.raises(SystemExit):
        gs.main()
    err = capsys.readouterr().err
    assert "unknown plan 'nope'" in err and "loadgen-rest" in err


def test_more_lanes_than_gpus_are_refused_and_a_failing_lane_is_logged(gs, tmp_path):
    with pytest.raises(SystemExit, match="3 lanes need as many GPUs"):
        gs.main_run(["a+b+c"], tmp_path)

    def boom(s):
        raise RuntimeError("no such model")

    gs.PLANS["boom"] = [boom]
    assert gs.main_run(["boom+a"], tmp_path / "2") == 0
    log = (tmp_path / "2" / "driver.log").read_text()
    assert "[gpu0] lane failed: RuntimeError: no such model" in log and "[gpu1] end a: exit 0" in log


def test_lanes_that_need_one_model_train_it_once(gs, tmp_path, monkeypatch):
    """Two lanes calling train() for the same model: one trains while the other waits, then the
    waiting lane uses that model instead of training it again over the same folder."""
    import threading
    import time

    running, overlaps, calls = [0], [], []
    guard = threading.Lock()

    def fake_run(self, name, args, **kw):
        with guard:
            running[0] += 1
            overlaps.append(running[0])
            calls.append(name)
        time.sleep(0.2)
        with guard:
            running[0] -= 1
        return 0

    monkeypatch.setattr(gs.Session, "run", fake_run)
    s = gs.Session(tmp_path)
    gs.lanes(lambda: gs.train(s.on_gpu(0), 0.2), lambda: gs.train(s.on_gpu(1), 0.2), lambda: gs.train(s, 0.3))
    assert sorted(calls) == ["train-bert-base-grown-hard-a20", "train-bert-base-grown-hard-a30"]
    assert "trained by another lane of this session" in (tmp_path / "driver.log").read_text()
    assert max(overlaps) == 2  # the two different models did train side by side


def test_the_scale_out_plan_composes_commands_the_suite_accepts(gs, tmp_path, monkeypatch):
    """The reusable 4-GPU training plan: every command it would run names settings the suite knows
    (a misspelt or retired key fails here, not on a lent host), with the fastest recipe measured."""
    from bertqa_bench.suite import load_suite

    monkeypatch.setattr(gs, "gpus", lambda: 4)
    seen = []
    monkeypatch.setattr(gs.Session, "run", lambda self, name, args, **kw: seen.append((self.lane, name, args)))
    gs.step_scale_out(gs.Session(tmp_path))
    assert seen[0][1] == "gpu-tests-scale-out"  # the GPU tests of the recipe first
    seen = seen[1:]
    assert [(lane, name) for lane, name, _ in seen][-3:] == [("", "train-squad-r128-gpus4"),
                                                             ("", "train-squad-r128-gpus4-b"),
                                                             ("", "train-squad-r128-gpus1-alone")]
    assert sorted(lane for lane, *_ in seen[:2]) == ["[gpu0] ", "[gpu2,3] "]
    for _, name, args in seen:
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        assert "train.graph_layers=true" in sets and "train.ddp_comm_hook=allreduce" in sets, name
        load_suite(args[args.index("--suite") + 1], sets)  # raises on an unknown key
