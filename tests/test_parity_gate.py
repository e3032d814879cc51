"""The parity gate's expected-scores file (commands/parity_gate.py, benchmarks/expected/<suite>.csv).

``run_parity_check`` runs the bench and then compares each backend's scores with the committed
file. The bench itself is tested end to end elsewhere; here it is replaced by a stand-in that
returns given results, so the file handling — reading it back, the questions -> points tolerance,
``--update-expected`` writing what the next run then passes — is checked in milliseconds.
(The PASS/FAIL/INCONCLUSIVE rule of ``parity.verdict`` has tests of its own.)
"""
import csv
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

import bertqa_bench.commands.parity_gate as gate
from bertqa_bench.config import ParityConfig, SuiteConfig
from bertqa_bench.record.results import BackendResult
from bertqa_bench.suite import load_suite

N_QUESTIONS = 400  # the ci suite's dev set: one question is 0.25 points
TOLERANCE_Q = 4
BACKENDS = ("eager-fp32", "torch-compile-fp32", "ort-fp32")


@dataclass
class FakeBench:
    """What run_parity_check reads of run_bench's outcome."""

    scores: dict
    calls: list = field(default_factory=list)

    def __call__(self, cfg, **kw):
        self.calls.append(kw)
        results = [BackendResult(name, status="ok", precision="fp32", parity_class="fp32", parity="pass",
                                 scores=dict(self.scores[name])) for name in self.scores]
        return SimpleNamespace(results=results, problems=[], evalset=SimpleNamespace(n_questions=N_QUESTIONS),
                               bundle=SimpleNamespace(meta=SimpleNamespace(timing_only=False)),
                               run_dir=Path("results/fake"))


def _cfg(tmp_path) -> SuiteConfig:
    return SuiteConfig(name="gate", parity=ParityConfig(expected_file=str(tmp_path / "expected.csv"),
                                                        expected_tolerance_questions=TOLERANCE_Q))


def _scores(em=55.5, f1=60.25, **shifts):
    return {b: {"exact_match": em + shifts.get(b, 0.0), "f1": f1 + shifts.get(b, 0.0)} for b in BACKENDS}


def _write_expected(path, scores):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["backend", "precision", "exact_match", "f1"])
        for b, s in scores.items():
            w.writerow([b, "fp32", s["exact_match"], s["f1"]])


def _gate(monkeypatch, cfg, scores, **kw):
    bench = FakeBench(scores)
    monkeypatch.setattr(gate, "run_bench", bench)
    ok = gate.run_parity_check(cfg, progress=False, log=lambda *_: None, **kw)
    assert bench.calls and bench.calls[0]["check_determinism"] is True  # the gate runs the reference twice
    return ok


def test_the_committed_ci_file_reads_back_with_a_row_per_gated_backend():
    cfg = load_suite("ci")
    rows = gate.read_expected(gate.expected_path(cfg))
    assert gate.expected_path(cfg).name == "ci.csv"
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == set(cfg.bench.backends)
    for r in rows:
        for metric in ("exact_match", "f1"):
            assert 0.0 < float(r[metric]) <= 100.0
    # 400 dev questions, so the tolerance of 4 questions is 1 point
    assert cfg.parity.expected_tolerance_questions == TOLERANCE_Q
    assert gate.expected_tolerance(cfg, SimpleNamespace(n_questions=N_QUESTIONS)) == pytest.approx(1.0)


def test_expected_file_round_trip(tmp_path):
    path = tmp_path / "expected.csv"
    _write_expected(path, _scores())
    rows = gate.read_expected(path)
    assert [r["backend"] for r in rows] == list(BACKENDS)
    assert float(rows[1]["f1"]) == 60.25 and rows[0]["precision"] == "fp32"
    assert gate.read_expected(tmp_path / "missing.csv") == []


@pytest.mark.parametrize("questions, passes", [(0, True), (TOLERANCE_Q - 1, True), (TOLERANCE_Q, True),
                                               (TOLERANCE_Q + 1, False), (-(TOLERANCE_Q + 1), False)])
def test_a_drift_past_the_tolerance_in_questions_fails(tmp_path, monkeypatch, capsys, questions, passes):
    """Scores that moved by ``questions`` questions (100/400 points each) on one backend."""
    cfg = _cfg(tmp_path)
    expected = _scores(em=50.0, f1=60.0)
    _write_expected(cfg.parity.expected_file, expected)
    moved = _scores(em=50.0, f1=60.0, **{"ort-fp32": questions * 100.0 / N_QUESTIONS})
    assert _gate(monkeypatch, cfg, moved) is passes
    err = capsys.readouterr().err
    if not passes:
        assert "ort-fp32: exact_match" in err and "vs expected 50.00" in err and "--update-expected" in err
        assert "eager-fp32:" not in err  # only the backend that moved is named


def test_update_expected_writes_what_the_next_run_passes(tmp_path, monkeypatch, capsys):
    cfg = _cfg(tmp_path)
    path = Path(cfg.parity.expected_file)
    _write_expected(path, _scores(em=10.0, f1=10.0))  # stale: the next run would fail against it
    new = _scores(em=57.25, f1=61.4321)
    assert _gate(monkeypatch, cfg, new) is False
    assert _gate(monkeypatch, cfg, new, update_expected=True) is True
    rows = {r["backend"]: r for r in gate.read_expected(path)}
    assert set(rows) == set(BACKENDS)
    assert {b: (float(r["exact_match"]), float(r["f1"])) for b, r in rows.items()} == \
        {b: (s["exact_match"], s["f1"]) for b, s in new.items()}
    capsys.readouterr()
    assert _gate(monkeypatch, cfg, new) is True
    # and it is a real gate afterwards: one question past the tolerance fails
    assert _gate(monkeypatch, cfg, _scores(em=57.25, f1=61.4321,
                                           **{"eager-fp32": (TOLERANCE_Q + 1) * 100.0 / N_QUESTIONS})) is False


def test_without_an_expected_file_the_gate_says_how_to_make_one(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    logs = []
    bench = FakeBench(_scores())
    monkeypatch.setattr(gate, "run_bench", bench)
    assert gate.run_parity_check(cfg, progress=False, log=logs.append) is True
    assert any("--update-expected" in m and "expected.csv" in m for m in logs)


def test_an_expected_file_under_the_old_backend_names_still_gates(tmp_path, monkeypatch, capsys):
    """An expected file written before the catalogue's names (torch-compile, onnxruntime) is read
    under the new ones: the same rows are compared, and a drift is still caught."""
    cfg = _cfg(tmp_path)
    old = {"eager-fp32": "eager-fp32", "torch-compile-fp32": "torch-compile", "ort-fp32": "onnxruntime"}
    _write_expected(cfg.parity.expected_file, {old[b]: s for b, s in _scores(em=50.0, f1=60.0).items()})
    assert _gate(monkeypatch, cfg, _scores(em=50.0, f1=60.0)) is True
    moved = _scores(em=50.0, f1=60.0, **{"ort-fp32": (TOLERANCE_Q + 1) * 100.0 / N_QUESTIONS})
    assert _gate(monkeypatch, cfg, moved) is False
    assert "ort-fp32: exact_match" in capsys.readouterr().err
