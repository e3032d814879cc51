"""SQuAD v2.0 na_prob files the official evaluator reads as the suite decides: probabilities
(sigmoid of the null-score difference minus the suite's threshold), so `score --na-prob-file` at
its defaults reproduces results.csv, best_* included; checked against the independent v2.0
reference (official_squad_v2.py), at a threshold where raw differences would not."""
import csv
import json
import math

import numpy as np
import pytest
import yaml

from bertqa_bench.cli import main
from bertqa_bench.config import SyntheticConfig
from bertqa_bench.tasks.features import Features
from bertqa_bench.tasks.squad.postprocess import na_probability, postprocess_qa_v2
from bertqa_bench.tasks.squad.types import QAExample
from official_squad_v2 import official_evaluate_v2

KEYS = ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "best_exact", "best_exact_thresh",
        "best_f1", "best_f1_thresh")
CSV_KEY = {"exact": "exact_match"}


def test_na_probability_is_monotone_half_at_the_threshold_and_never_above_one():
    xs = [-800.0, -40.0, -3.0, -1e-9, 0.0, 1e-9, 0.5, 2.0, 30.0, 800.0]
    ps = [na_probability(x, 0.5) for x in xs]
    assert all(0.0 <= p <= 1.0 for p in ps) and ps == sorted(ps)
    assert na_probability(2.5, 2.5) == 0.5 and na_probability(3.0, 2.5) > 0.5 > na_probability(2.0, 2.5)
    assert na_probability(1.7, 0.2) == pytest.approx(1 / (1 + math.exp(-1.5)), rel=1e-15)


def _features(n_ex, seq=8):
    offsets = [[None, None] + [(2 * t, 2 * t + 1) for t in range(seq - 2)] for _ in range(n_ex)]
    return Features(np.ones((n_ex, seq), np.int64), np.ones((n_ex, seq), np.int64), np.zeros((n_ex, seq), np.int64),
                    np.arange(n_ex), offsets=offsets)


def test_the_written_probabilities_keep_every_decision_of_the_suite_at_any_threshold():
    """Hand-made logits whose null-score differences straddle 1.0: at threshold 2.5 the suite
    answers text where the difference is 1.5 or 2.0, which a raw-difference file turns into ""."""
    from bertqa_bench.tasks.squad.task import SquadTask

    ctx = "a b c d e f g h i j k l"
    diffs = [-3.0, 0.5, 1.5, 2.0, 3.0, 6.0]  # null - best span, per question
    exs = [QAExample(f"q{i}", "q", ctx, version_2=True) for i in range(len(diffs))]
    start, end = np.full((len(diffs), 8), -5.0), np.full((len(diffs), 8), -5.0)
    for i, d in enumerate(diffs):
        start[i, 3], end[i, 4] = 1.0, 1.0  # the best span scores 2
        start[i, 0] = end[i, 0] = (2.0 + d) / 2  # the null scores 2 + d
    p = postprocess_qa_v2(exs, _features(len(diffs)), start, end, n_best=5, max_answer_len=5,
                          null_score_diff_threshold=2.5)
    assert p.na_scores == pytest.approx({f"q{i}": d for i, d in enumerate(diffs)})
    assert [p[f"q{i}"] == "" for i in range(len(diffs))] == [False, False, False, False, True, True]
    assert all((p[q] == "") == (p.na_probs[q] > 0.5) for q in p)
    # golds: q0..q3 answerable with the span the suite finds, q4 answerable, q5 not
    span = ctx[2:5]
    data = [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": f"q{i}", "question": "q", "answers": [] if i == 5 else [{"text": span, "answer_start": 2}]}
        for i in range(len(diffs))]}]}]
    official = official_evaluate_v2(data, dict(p), SquadTask().side_files(p)["na_prob"])
    plain = official_evaluate_v2(data, dict(p))  # what results.csv's exact/F1 are: the answers as given
    for k in ("exact", "f1", "HasAns_exact", "NoAns_exact"):
        assert official[k] == pytest.approx(plain[k]), k
    # the raw differences (the old file) read as probabilities: 1.5 and 2.0 pass 1.0, two answers lost
    raw = official_evaluate_v2(data, dict(p), dict(p.na_scores))
    assert raw["exact"] < plain["exact"]


SYN = dict(seed=4, n_train_contexts=4, n_dev_contexts=8, questions_per_context=3, min_words=30, max_words=80,
           mean_words=45, long_context_fraction=0.2, unanswerable=0.4)


def _bench(tmp_path, folder, threshold, run_id):
    raw = {"name": "v2", "data": {"source": "synthetic", "data_dir": str(tmp_path / "data"), "max_seq_len": 64,
                                  "doc_stride": 24, "max_query_len": 24, "synthetic": SYN},
           "task": {"name": "squad", "null_score_diff_threshold": threshold},
           "bench": {"backends": ["eager-fp32"], "batch_size": 8, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": "inprocess"},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(raw))
    assert main(["bench", "--suite", str(tmp_path / "v2.yaml"), "--model", str(folder), "--no-mlflow",
                 "--no-progress", "--run-id", run_id]) == 0
    return tmp_path / "results" / run_id


def test_score_with_the_suites_own_na_prob_file_equals_results_csv(tmp_path, capsys):
    """A bench on a generated v2.0 set at a threshold that lets differences above 1 answer: the
    official evaluator (the CLI and the independent reference) on the files the bench wrote gives
    results.csv's exact, F1, HasAns, NoAns and best_* at its defaults."""
    from bertqa_bench.model.families import build_checkpoint
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    from safetensors.torch import load_file, save_file

    from bertqa_bench.model.modeling import load_tokenizer

    train, dev = ensure_squad_files(tmp_path / "data", SyntheticConfig(**SYN))
    folder = build_checkpoint("bert", tmp_path / "m", seed=3, head_scale=30.0)
    # A random head's null score ([CLS]: one start+end pair) loses to the best of many spans by
    # ~5-11 logits everywhere. The [CLS] embedding along the head's weights gives a model that
    # scores "no answer" high (differences ~12-18), as a model trained on v2.0 does on many questions.
    w = load_file(folder / "model.safetensors")
    head = w["qa_outputs.weight"].sum(0)
    w["bert.embeddings.word_embeddings.weight"][load_tokenizer(str(folder)).cls_token_id] = head / head.norm()
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    first = _bench(tmp_path, folder, 0.0, "t0")
    na0 = json.loads((first / "predictions" / "eager-fp32.na_prob.json").read_text())
    diffs = sorted(math.log(p / (1 - p)) for p in na0.values() if 0 < p < 1)  # the differences, back
    assert len(diffs) == len(na0) and diffs[len(diffs) // 2] > 1.0, diffs  # the case a raw file got wrong
    threshold = float(np.median(diffs))  # half the questions answer text, with differences above 1
    run = _bench(tmp_path, folder, threshold, "tk")
    preds = json.loads((run / "predictions" / "eager-fp32.json").read_text())
    na = json.loads((run / "predictions" / "eager-fp32.na_prob.json").read_text())
    assert any(preds[q] and na0[q] > 1 / (1 + math.exp(-1.0)) for q in preds)  # a text answer, difference > 1
    capsys.readouterr()
    assert main(["score", str(dev), str(run / "predictions" / "eager-fp32.json"), "--na-prob-file",
                 str(run / "predictions" / "eager-fp32.na_prob.json")]) == 0
    cli = json.loads(capsys.readouterr().out)
    data = json.loads(dev.read_text())["data"]
    official = official_evaluate_v2(data, preds, na)
    row = next(r for r in csv.DictReader((run / "results.csv").open()) if r["backend"] == "eager-fp32")
    for k in KEYS:
        assert cli[k] == pytest.approx(official[k], rel=1e-12), k
        assert float(row[CSV_KEY.get(k, k)]) == pytest.approx(official[k], rel=1e-5, abs=1e-6), k  # 6 digits
    assert official["NoAns_total"] > 0 and official["HasAns_total"] > 0
