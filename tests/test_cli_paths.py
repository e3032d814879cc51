"""Where the user stands: command-line file arguments relative to the current directory, --help
saying where outputs go, a timeout naming the setting that applied, a resume taking its suite
from the run it resumes."""
import json

import pytest
import yaml

from conftest import TINY_SYN, tiny_squad_and_checkpoint
from bertqa_bench import exit_codes
from bertqa_bench.cli import build_parser, main
from bertqa_bench.record.results import RunBundle

PLUGINS = "tests.backend_plugins"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    dev, ck = tiny_squad_and_checkpoint(root)
    return root, ck, dev


def _suite(setup, tmp_path, **bench):
    root, _, _ = setup
    raw = {"name": "here",
           "data": {"source": "synthetic", "data_dir": str(root / "data"), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(TINY_SYN)},
           "bench": {"backends": ["eager-fp32"], "batch_size": 8, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": "inprocess", **bench},
           "variants": {"hang": {"implementation": f"{PLUGINS}:Hang", "device": "cpu", "timeout_s": 4}},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    p = tmp_path / "here.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_a_relative_dev_file_is_read_from_the_current_directory(setup, tmp_path, monkeypatch, capsys):
    _, ck, dev = setup
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    (cwd / "my-dev.json").write_text(dev.read_text())
    monkeypatch.chdir(cwd)
    suite = _suite(setup, tmp_path)
    assert main(["bench", "--suite", str(suite), "--model", str(ck), "--dev-file", "my-dev.json", "--no-mlflow",
                 "--no-progress", "--run-id", "rel"]) == 0
    bundle = RunBundle.load(tmp_path / "results" / "rel")
    assert bundle.config()["data"]["dev_file"] == str(cwd / "my-dev.json")
    n = sum(len(p["qas"]) for a in json.loads(dev.read_text())["data"] for p in a["paragraphs"])
    assert bundle.meta.n_questions == n > 0
    capsys.readouterr()
    assert main(["bench", "--suite", str(suite), "--model", str(ck), "--dev-file", "missing.json", "--no-mlflow",
                 "--no-progress"]) == exit_codes.BAD_INPUT
    assert f"--dev-file missing.json: no such file ({cwd / 'missing.json'})" in capsys.readouterr().err


def test_help_says_where_outputs_go(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "results_dir/<run-id>/" in out and "cache_dir/" in out and "models_dir/<name>/" in out
    assert "relative to the project root" in out and "to the current directory" in out


def test_a_timeout_names_the_setting_that_applied(setup, tmp_path):
    """The hang variant's own timeout_s (4 s) kills it, not bench.timeout_s (600 s), and says so."""
    _, ck, _ = setup
    suite = _suite(setup, tmp_path, backends=["eager-fp32", "hang"], isolation="process", timeout_s=600)
    assert main(["bench", "--suite", str(suite), "--model", str(ck), "--no-mlflow", "--no-progress",
                 "--run-id", "t"]) == exit_codes.VERDICT_FAILED
    row = {r.backend: r for r in RunBundle.load(tmp_path / "results" / "t").results}["hang"]
    assert row.status == "failed" and row.error.startswith(
        "timed out after 4 s (variant hang's own timeout_s, not bench.timeout_s); killed"), row.error


def test_the_limit_object_names_its_setting_through_a_data_parallel_failure():
    import pickle

    from bertqa_bench.measuring.local_ranks import first_failure
    from bertqa_bench.measuring.launcher import TimeLimit, time_limit
    from bertqa_bench.backends.variants import VariantTable

    table = VariantTable.for_suite()
    ref = table.get("eager-fp32")
    assert time_limit(ref, 1800).setting == "bench.timeout_s" and float(time_limit(ref, 1800)) == 1800.0
    limit = pickle.loads(pickle.dumps(TimeLimit(15, "variant x's own timeout_s, not bench.timeout_s")))
    recs = [{"status": "failed", "timed_out": True, "phase": "timed passes"},
            {"status": "failed", "timed_out": True, "phase": "prepare+warm-up"}]
    assert first_failure(recs, 2, limit)["error"] == (
        "data-parallel rank 1 of 2: timed out after 15 s in prepare+warm-up (variant x's own timeout_s, not "
        "bench.timeout_s); every rank killed")


def test_resume_with_set_compares_against_the_runs_own_suite(setup, tmp_path, capsys):
    """`--resume RUN --set x=y` without --suite: the run's own config with that one change, so the
    refusal names the one real difference (it compared with the default suite: ~25 of them)."""
    _, ck, _ = setup
    suite = _suite(setup, tmp_path)
    assert main(["bench", "--suite", str(suite), "--model", str(ck), "--no-mlflow", "--no-progress",
                 "--run-id", "r"]) == 0
    run = tmp_path / "results" / "r"
    capsys.readouterr()
    assert main(["bench", "--resume", str(run), "--set", "bench.batch_size=4", "--no-mlflow",
                 "--no-progress"]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert "differs in bench.batch_size: 8 -> 4." in err and "more)" not in err, err
    # the same value as the run's: nothing differs, and the resume goes on (nothing left to run)
    assert main(["bench", "--resume", str(run), "--set", "bench.batch_size=8", "--no-mlflow",
                 "--no-progress"]) == 0
