"""The exit codes a script acts on (bertqa_bench/exit_codes.py, README "Exit codes"): real runs
for PASS, FAIL (a backend crashed) and NO REFERENCE (the reference crashed), every verdict through
the CLI, the opt-out flag, and an internal error's own code."""
import sys
from types import SimpleNamespace

import pytest
import yaml

from conftest import TINY_SYN, tiny_squad_and_checkpoint
from bertqa_bench import exit_codes
from bertqa_bench.cli import build_parser, main

PLUGINS = "tests.backend_plugins"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    _, ck = tiny_squad_and_checkpoint(root)
    return root, ck


def _suite(root, backends, reference="eager-fp32"):
    raw = {"name": "exit",
           "data": {"source": "synthetic", "data_dir": str(root / "data"), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(TINY_SYN)},
           "bench": {"backends": backends, "reference": reference, "batch_size": 8, "warmup_batches": 1,
                     "min_passes": 1, "min_duration_s": 0, "isolation": "inprocess"},
           "variants": {"exploding": {"implementation": f"{PLUGINS}:Exploding", "device": "cpu"}},
           "models_dir": str(root / "models"), "results_dir": str(root / "results"), "cache_dir": str(root / "cache")}
    p = root / f"exit-{'-'.join(backends)}-{reference}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _bench(setup, backends, *extra, reference="eager-fp32"):
    root, ck = setup
    return main(["bench", "--suite", str(_suite(root, backends, reference)), "--model", str(ck), "--no-progress",
                 "--no-mlflow", *extra])


def test_a_passing_run_exits_0(setup):
    assert _bench(setup, ["eager-fp32"]) == exit_codes.OK == 0


def test_a_failing_run_exits_1_unless_told_not_to_fail(setup, capsys):
    assert _bench(setup, ["eager-fp32", "exploding"]) == exit_codes.VERDICT_FAILED == 1
    assert "exit 1: verdict FAIL" in capsys.readouterr().err
    assert _bench(setup, ["eager-fp32", "exploding"], "--no-fail-on-verdict") == 0


def test_a_run_without_its_reference_is_never_exit_0(setup, capsys):
    """The reference crashed: nothing could be judged, so neither a pass nor a report."""
    for extra in ((), ("--no-fail-on-verdict",)):
        assert _bench(setup, ["exploding", "eager-fp32"], *extra, reference="exploding") == exit_codes.NO_REFERENCE == 3
        assert "exit 3: the reference did not run" in capsys.readouterr().err


@pytest.mark.parametrize("status,code,report_only", [("PASS", 0, 0), ("N/A", 0, 0), ("FAIL", 1, 0),
                                                     ("INCONCLUSIVE", 1, 0), ("NO REFERENCE", 3, 3)])
def test_every_verdict_has_its_documented_code(status, code, report_only, setup, monkeypatch, tmp_path):
    from bertqa_bench.commands import bench
    from bertqa_bench.record.parity import Verdict

    from bertqa_bench import cli

    out = SimpleNamespace(summary="", run_dir=tmp_path, verdict=Verdict(status, []), results=[], bundle=None)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: out)
    monkeypatch.setattr(cli, "console_summary", lambda bundle: "")
    assert _bench(setup, ["eager-fp32"]) == code
    assert _bench(setup, ["eager-fp32"], "--no-fail-on-verdict") == report_only
    assert f"  {code}    " in exit_codes.EPILOG  # each code is documented in --help


def test_help_lists_the_exit_codes_and_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "NO REFERENCE" in out and "--no-fail-on-verdict" in out


def test_an_unexpected_exception_is_exit_4_with_its_traceback(monkeypatch, capsys):
    from bertqa_bench import cli

    def broken(a):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(sys, "argv", ["bertqa-bench", "backends"])
    monkeypatch.setattr(cli, "cmd_backends", broken)
    assert main(["backends"]) == exit_codes.INTERNAL_ERROR == 4
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err and "internal error" in err
