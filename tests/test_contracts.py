"""What a plug-in declares is validated and honoured; what a backend returns is checked."""
import os

import numpy as np
import pytest

from bertqa_bench.commands.bench import run_bench
from bertqa_bench.errors import ConfigError
from bertqa_bench.record.results import RunBundle
from bertqa_bench.measuring.runner import ContractError, check_contract
from bertqa_bench.suite import load_suite

PLUGINS = "tests.backend_plugins"


def _dist(site, entries: dict):
    dist = site / "contracts-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: contracts\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[bertqa_bench.backends]\n" + "".join(
        f"{k} = {v}\n" for k, v in entries.items()))


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _dist(site, {"declared": f"{PLUGINS}:Declared", "misdeclared": f"{PLUGINS}:Misdeclared"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def test_a_plugin_variant_with_an_unknown_key_fails_naming_the_valid_ones(plugins, tiny_suite):
    from bertqa_bench.backends.variants import VariantTable

    table = VariantTable.for_suite()  # the other backends stay usable
    assert "eager-fp32" in table.names() and "misdeclared" in table.broken()
    with pytest.raises(ConfigError, match=r"unknown field\(s\) timout_s; valid: .*timeout_s"):
        load_suite(str(tiny_suite(backends=["eager-fp32", "misdeclared"])))


@pytest.mark.slow
def test_a_plugin_variants_timeout_is_honoured(plugins, tiny_suite):
    """The plug-in says timeout_s: 3; the suite-wide limit (here 600 s) must not apply."""
    suite = tiny_suite(backends=["eager-fp32", "declared-hang"],
                       bench={"backends": ["eager-fp32", "declared-hang"], "batch_size": 8, "warmup_batches": 1,
                              "min_passes": 1, "min_duration_s": 0, "timeout_s": 600})
    out = run_bench(load_suite(str(suite)), progress=False)
    rows = {r.backend: r for r in RunBundle.load(out.run_dir).results}
    assert rows["declared-hang"].status == "failed"
    assert "timed out after 3 s (variant declared-hang's own timeout_s, not bench.timeout_s)" in rows["declared-hang"].error


@pytest.mark.slow
def test_a_backend_returning_the_wrong_shape_fails_with_the_contract_it_broke(tiny_suite):
    suite = tiny_suite(backends=["eager-fp32", "wrong-shape"],
                       variants={"wrong-shape": {"implementation": f"{PLUGINS}:WrongShape", "device": "cpu"}},
                       bench={"backends": ["eager-fp32", "wrong-shape"], "batch_size": 8, "warmup_batches": 1,
                              "min_passes": 1, "min_duration_s": 0, "isolation": "inprocess"})
    out = run_bench(load_suite(str(suite)), progress=False)
    rows = {r.backend: r for r in out.results}
    assert rows["eager-fp32"].ok
    bad = rows["wrong-shape"]
    assert bad.status == "failed"
    assert "backend wrong-shape returned start_logits of shape (8, 95); expected (8, 96)" in bad.error


def _batch(rows=4, seq=6):
    mask = np.ones((rows, seq), np.int64)
    mask[:, -2:] = 0
    return {"input_ids": np.zeros((rows, seq), np.int64), "attention_mask": mask}


@pytest.mark.parametrize("out, message", [
    ({"start_logits": np.zeros((4, 6), np.float32)}, "returned no end_logits"),
    ({"start_logits": np.zeros((4, 6), np.float32), "end_logits": np.zeros((4, 5), np.float32)},
     r"end_logits of shape \(4, 5\); expected \(4, 6\)"),
    ({"start_logits": np.zeros((4, 6), np.int32), "end_logits": np.zeros((4, 6), np.float32)},
     "start_logits of dtype int32"),
    ({"start_logits": np.full((4, 6), np.nan, np.float32), "end_logits": np.zeros((4, 6), np.float32)},
     "16 non-finite value"),
    ([np.zeros((4, 6))], "returned list"),
])
def test_check_contract_names_the_rule(out, message):
    with pytest.raises(ContractError, match=message):
        check_contract("b", out, _batch(), ("start_logits", "end_logits"), ("start_logits", "end_logits"))


def test_check_contract_allows_anything_on_padding():
    start = np.zeros((4, 6), np.float32)
    start[:, -2:] = -np.inf  # padding: masked out before anything reads it
    check_contract("b", {"start_logits": start, "end_logits": start.copy()}, _batch(),
                   ("start_logits", "end_logits"), ("start_logits", "end_logits"))


def test_the_gate_fails_on_an_inconclusive_run(monkeypatch, tiny_suite, tmp_path, capsys):
    """`make parity-check` must be decided: an INCONCLUSIVE run exits non-zero, with why."""
    from types import SimpleNamespace

    from bertqa_bench import cli
    from bertqa_bench.commands import parity_gate as parity_check
    from bertqa_bench.record.results import BackendResult, RunMeta

    ref = BackendResult("eager-fp32", scores={"exact_match": 90.0, "f1": 92.0})
    noisy = BackendResult("onnxruntime", parity="FAIL", parity_failures="f1 92.00 is 99.80% of reference",
                          parity_within_noise=True, questions_to_decide=4200, scores={"exact_match": 90.0, "f1": 91.8})
    fake = SimpleNamespace(results=[ref, noisy], problems=[], evalset=SimpleNamespace(n_questions=200),
                           bundle=SimpleNamespace(meta=RunMeta("tiny", "r", "squad", [], "f1", "eager-fp32")),
                           run_dir=tmp_path)
    monkeypatch.setattr(parity_check, "run_bench", lambda *a, **k: fake)
    suite = tiny_suite(backends=["eager-fp32", "ort-fp32"])
    rc = cli.main(["parity", "--suite", str(suite), "--no-mlflow", "--no-progress",
                   "--set", f"parity.expected_file={tmp_path / 'none.csv'}"])
    err = capsys.readouterr()
    assert rc == 1
    assert "PARITY CHECK FAILED (INCONCLUSIVE)" in err.err and "~4,200 questions would decide it" in err.err
    noisy.parity_within_noise = False  # the same failure, decided: FAIL
    rc = cli.main(["parity", "--suite", str(suite), "--no-mlflow", "--no-progress",
                   "--set", f"parity.expected_file={tmp_path / 'none.csv'}"])
    assert rc == 1 and "PARITY CHECK FAILED (FAIL)" in capsys.readouterr().err


def test_outputs_written_into_reused_memory_break_the_contract():
    from bertqa_bench.measuring.runner import check_owned

    buf = np.zeros((4, 8), dtype=np.float32)
    check_owned("fresh", {"start_logits": buf.copy()}, {"start_logits": buf.copy()})
    with pytest.raises(ContractError, match="same memory as the previous batch's start_logits"):
        check_owned("reuser", {"start_logits": buf[:2]}, {"start_logits": buf[:3]})
