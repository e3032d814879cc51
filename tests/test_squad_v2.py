"""SQuAD v2.0: reader, null-score postprocessing, the official v2.0 evaluator (against the
reimplementation in official_squad_v2.py, on adversarial cases), the score CLI, the generator,
and a bench on a generated v2.0 set writing the na-prob file."""
import json
import random

import numpy as np
import pytest

from bertqa_bench.cli import main
from bertqa_bench.config import SyntheticConfig
from bertqa_bench.errors import DatasetFormatError
from bertqa_bench.tasks.features import Features
from bertqa_bench.tasks.squad.metrics_v2 import evaluate_v2, score_v2_files
from bertqa_bench.tasks.squad.postprocess import postprocess_qa_v2
from bertqa_bench.tasks.squad.reader import validate_squad
from bertqa_bench.tasks.squad.synthetic import config_hash, generate_squad
from bertqa_bench.tasks.squad.types import Answer, QAExample
from official_squad_v2 import official_evaluate_v2

CTX = "Mara Venn founded the Hollin Company in 1874 in Ostrava."


def _v2(qas, version="v2.0"):
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": CTX, "qas": qas}]}]}


def _qa(qid, answers=(), impossible=None, plausible=None, question="Who?"):
    qa = {"id": qid, "question": question, "answers": [{"text": t, "answer_start": CTX.index(t)} for t in answers]}
    if impossible is not None:
        qa["is_impossible"] = impossible
    if plausible is not None:
        qa["plausible_answers"] = [{"text": t, "answer_start": CTX.index(t)} for t in plausible]
    return qa


# --- reader -------------------------------------------------------------------------------------

def test_reader_keeps_impossible_and_plausible_answers():
    ex = validate_squad(_v2([_qa("a", ["Mara Venn"], False), _qa("b", (), True, ["1874"])]), "f.json")
    assert [e.is_impossible for e in ex] == [False, True] and all(e.version_2 for e in ex)
    assert ex[1].answers == () and ex[1].plausible_answers == (Answer("1874", CTX.index("1874")),)


@pytest.mark.parametrize("qa, field, why", [
    (_qa("x", ["Mara Venn"], True), "answers", "plausible_answers"),
    (_qa("x", (), False), "answers", "is_impossible: true"),
    ({**_qa("x", ["Mara Venn"]), "is_impossible": "yes"}, "is_impossible", "expected bool"),
    ({**_qa("x", (), True), "plausible_answers": [{"text": "Venn", "answer_start": 0}]}, "answer_start", "not the answer"),
])
def test_reader_names_v2_mistakes(qa, field, why):
    with pytest.raises(DatasetFormatError, match=why) as e:
        validate_squad(_v2([qa]), "f.json")
    assert e.value.field == field and "id 'x'" in e.value.record


def test_v1_file_still_refuses_empty_answers():
    with pytest.raises(DatasetFormatError, match="v1.1 needs at least one answer"):
        validate_squad(_v2([_qa("x")], version="1.1"), "f.json")


# --- the evaluator against the official script --------------------------------------------------

def _dataset(cases):
    """cases: (qid, gold texts) -> a v2.0 'data' list (gold texts need not be in a context)."""
    return [{"title": "t", "paragraphs": [{"context": "", "qas": [
        {"id": q, "question": "?", "answers": [{"text": t, "answer_start": 0} for t in golds]}
        for q, golds in cases]}]}]


def _ours(cases, preds, na=None, thresh=1.0):
    return evaluate_v2(cases, preds, na, thresh)


ADVERSARIAL = [
    # (name, cases, predictions, na_probs)
    ("empty predictions everywhere", [("a", ["x y"]), ("b", []), ("c", ["The"])],
     {"a": "", "b": "", "c": ""}, None),
    ("unanswerable answered with its plausible span", [("a", []), ("b", ["1874"])],
     {"a": "1874", "b": "in 1874"}, {"a": 0.2, "b": 0.9}),
    # gold "the" normalizes to nothing: dropped, so only "" is right
    ("gold that normalizes to nothing", [("a", ["the", "an"]), ("b", ["a b", "the"])],
     {"a": "", "b": "b"}, None),
    ("ties in the threshold search", [("a", ["x"]), ("b", []), ("c", ["y"]), ("d", [])],
     {"a": "x", "b": "z", "c": "y", "d": ""}, {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.1}),
    ("threshold where nothing helps", [("a", []), ("b", [])], {"a": "p", "b": "q"}, {"a": 0.3, "b": 0.7}),
    ("negative and equal null odds", [("a", ["x"]), ("b", ["y z"]), ("c", [])],
     {"a": "x", "b": "y", "c": "w"}, {"a": -2.0, "b": -2.0, "c": -2.0}),
    ("prediction for an id not in the set", [("a", ["x"]), ("b", [])], {"a": "x", "b": "", "zz": "q"},
     {"a": 0.1, "b": 0.2, "zz": 0.0}),
]


@pytest.mark.parametrize("name, cases, preds, na", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
@pytest.mark.parametrize("thresh", [1.0, 0.4, 0.0, -5.0])
def test_scorer_matches_official_on_adversarial_cases(name, cases, preds, na, thresh):
    want = official_evaluate_v2(_dataset(cases), preds, na, thresh)
    got = _ours(cases, preds, na, thresh)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k


def test_scorer_matches_official_on_random_cases():
    rng = random.Random(7)
    words = ["alpha", "beta", "the", "a", "gamma", ".", "Delta!", ""]
    for trial in range(150):
        n = rng.randint(1, 12)
        cases = []
        for i in range(n):
            golds = [] if rng.random() < 0.4 else [" ".join(rng.choices(words, k=rng.randint(1, 3)))
                                                   for _ in range(rng.randint(1, 3))]
            cases.append((f"q{i}", golds))
        preds = {q: ("" if rng.random() < 0.3 else " ".join(rng.choices(words, k=rng.randint(1, 3)))) for q, _ in cases}
        # coarse probabilities: many ties
        na = {q: rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, 1.5]) for q in rng.sample(list(preds), len(preds))} \
            if trial % 3 else None
        thresh = rng.choice([1.0, 0.5, 0.0])
        want = official_evaluate_v2(_dataset(cases), preds, na, thresh)
        got = _ours(cases, preds, na, thresh)
        assert set(got) == set(want), trial
        for k, v in want.items():
            assert got[k] == pytest.approx(v), (trial, k)


# --- score CLI ----------------------------------------------------------------------------------

def test_score_cli_v2_with_na_prob_file(tmp_path, capsys):
    ds = _v2([_qa("a", ["Mara Venn"]), _qa("b", (), True, ["1874"]), _qa("c", ["Ostrava"])])
    (tmp_path / "dev.json").write_text(json.dumps(ds))
    preds = {"a": "Mara Venn", "b": "1874", "c": ""}
    na = {"a": 0.1, "b": 0.8, "c": 0.9}
    (tmp_path / "p.json").write_text(json.dumps(preds))
    (tmp_path / "na.json").write_text(json.dumps(na))
    for args, thresh in (([], 1.0), (["--na-prob-thresh", "0.5"], 0.5)):
        assert main(["score", str(tmp_path / "dev.json"), str(tmp_path / "p.json"), "--na-prob-file",
                     str(tmp_path / "na.json"), *args]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out == pytest.approx(official_evaluate_v2(ds["data"], preds, na, thresh))
        assert {"exact", "f1", "total", "HasAns_exact", "NoAns_f1", "best_exact", "best_f1_thresh"} <= set(out)
    # without the file: no best_* keys, as the official script
    assert main(["score", str(tmp_path / "dev.json"), str(tmp_path / "p.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "best_f1" not in out and out["total"] == 3 and out["NoAns_total"] == 1
    # a missing prediction or na-prob is a named error (the official script would crash)
    (tmp_path / "p2.json").write_text(json.dumps({"a": "x", "b": ""}))
    with pytest.raises(DatasetFormatError, match="missing"):
        score_v2_files(tmp_path / "dev.json", tmp_path / "p2.json")
    (tmp_path / "na2.json").write_text(json.dumps({"a": 0.1}))
    with pytest.raises(DatasetFormatError, match="no no-answer probability"):
        score_v2_files(tmp_path / "dev.json", tmp_path / "p.json", na_prob_file=tmp_path / "na2.json")


# --- postprocessing -----------------------------------------------------------------------------

def _features(n_windows_per_ex, seq=8):
    rows = [(e, w) for e, n in enumerate(n_windows_per_ex) for w in range(n)]
    n = len(rows)
    offsets = [[None, None] + [(2 * t, 2 * t + 1) for t in range(seq - 2)] for _ in rows]
    return Features(np.ones((n, seq), np.int64), np.ones((n, seq), np.int64), np.zeros((n, seq), np.int64),
                    np.array([e for e, _ in rows]), offsets=offsets)


def test_null_answer_chosen_by_score_difference():
    ctx = "a b c d e f g h i j k l"
    exs = [QAExample("e0", "q", ctx, version_2=True), QAExample("e1", "q", ctx, version_2=True)]
    f = _features([2, 1])
    start = np.full((3, 8), -5.0)
    end = np.full((3, 8), -5.0)
    # e0: window 0 null = 1+1 = 2, window 1 null = 0+0 = 0 (the minimum counts); best span 2.5+0.5 = 3
    start[0, 0], end[0, 0] = 1.0, 1.0
    start[1, 0], end[1, 0] = 0.0, 0.0
    start[1, 3], end[1, 4] = 2.5, 0.5
    # e1: null 4, best span 1
    start[2, 0], end[2, 0] = 2.0, 2.0
    start[2, 2], end[2, 2] = 0.5, 0.5
    p = postprocess_qa_v2(exs, f, start, end, n_best=5, max_answer_len=5)
    assert p["e0"] == ctx[2:5] and p["e1"] == ""  # tokens 3..4 -> chars (2,3)..(4,5)
    assert p.na_scores == pytest.approx({"e0": 0.0 - 3.0, "e1": 4.0 - 1.0})
    # the threshold moves the decision: a span must beat the null score by more than -threshold
    p = postprocess_qa_v2(exs, f, start, end, n_best=5, max_answer_len=5, null_score_diff_threshold=3.5)
    assert p["e1"] == ctx[0:1]
    p = postprocess_qa_v2(exs, f, start, end, n_best=5, max_answer_len=5, null_score_diff_threshold=-3.5)
    assert p["e0"] == ""


def test_agreement_counts_flips_to_and_from_no_answer():
    from bertqa_bench.tasks.squad.task import SquadTask

    t = SquadTask()
    ref = {"a": "", "b": "x", "c": "", "d": "y"}
    assert t.agreement({"a": "", "b": "", "c": "z", "d": "y"}, ref) == (2, 4)


# --- generator ----------------------------------------------------------------------------------

def test_generator_emits_v2_with_plausible_distractors():
    base = SyntheticConfig(n_dev_contexts=8, questions_per_context=3)
    v2 = SyntheticConfig(n_dev_contexts=8, questions_per_context=3, unanswerable=0.5)
    # the v1.1 output of a config is unchanged by the new knob
    assert config_hash(base) == config_hash(SyntheticConfig(n_dev_contexts=8, questions_per_context=3))
    assert generate_squad(8, base, 11)["version"] == "1.1"
    obj = generate_squad(8, v2, 11)
    assert obj["version"] == "v2.0"
    ex = validate_squad(obj, "gen")
    impossible = [e for e in ex if e.is_impossible]
    assert 0.25 * len(ex) <= len(impossible) <= 0.75 * len(ex)
    for e in impossible:
        assert e.plausible_answers and not e.answers
        # the plausible span is in the context; the entity the question asks about is not
        assert e.context[e.plausible_answers[0].answer_start:].startswith(e.plausible_answers[0].text)
    # the same questions as v1.1 where answerable (same stream of contexts and questions)
    v1 = validate_squad(generate_squad(8, base, 11), "gen1")
    same = [a for a, b in zip(v1, ex) if not b.is_impossible]
    assert all(a.question == b.question for a, b in zip(v1, ex) if not b.is_impossible) and same


# --- a bench on generated v2.0 data -------------------------------------------------------------

@pytest.mark.slow
def test_bench_on_v2_set_writes_na_probs_and_scores_officially(tmp_path, capsys):
    import yaml

    from bertqa_bench.model.families import build_checkpoint, corpus_from_squad
    from bertqa_bench.record.results import RunBundle
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    syn = dict(seed=4, n_train_contexts=4, n_dev_contexts=6, questions_per_context=3, min_words=30, max_words=80,
               mean_words=45, long_context_fraction=0.2, unanswerable=0.4)
    train, dev = ensure_squad_files(tmp_path / "data", SyntheticConfig(**syn))
    assert dev.name == "dev-v2.0.json"
    folder = build_checkpoint("roberta", tmp_path / "rob", texts=corpus_from_squad(train), vocab_size=300,
                              head_scale=30.0)
    raw = {"name": "v2", "data": {"source": "synthetic", "data_dir": str(tmp_path / "data"), "max_seq_len": 64,
                                  "doc_stride": 24, "max_query_len": 24, "synthetic": syn},
           # a null threshold that gives both answers and no-answers on a random head
           "task": {"name": "squad", "null_score_diff_threshold": 0.0},
           "bench": {"backends": ["eager-fp32", "onnxruntime"], "batch_size": 8, "warmup_batches": 1,
                     "min_passes": 1, "min_duration_s": 0, "isolation": "inprocess"},
           "variants": {"onnxruntime": {"base": "onnxruntime", "options": {"exporter": "torchscript"}}},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(raw))
    assert main(["bench", "--suite", str(tmp_path / "v2.yaml"), "--model", str(folder), "--no-mlflow",
                 "--no-progress"]) == 0
    run = sorted((tmp_path / "results").glob("*-v2"))[-1]
    rows = {r.backend: r for r in RunBundle.load(run).results}
    ref = rows["eager-fp32"]
    assert ref.ok and rows["onnxruntime"].parity == "pass"
    na_file = run / "predictions" / "eager-fp32.na_prob.json"
    preds = json.loads((run / "predictions" / "eager-fp32.json").read_text())
    na = json.loads(na_file.read_text())
    assert set(na) == set(preds)
    # every "" answer is a null decision (no-answer probability above 0.5, the threshold's), every text one is not
    assert all((preds[q] == "") == (na[q] > 0.5) for q in preds) and all(0 <= v <= 1 for v in na.values())
    capsys.readouterr()
    # the bench's scores are the official script's on the files it wrote
    assert main(["score", str(dev), str(run / "predictions" / "eager-fp32.json"), "--na-prob-file",
                 str(na_file)]) == 0
    cli = json.loads(capsys.readouterr().out)
    official = official_evaluate_v2(json.loads(dev.read_text())["data"], preds, na)
    assert cli == pytest.approx(official)
    assert ref.scores["f1"] == pytest.approx(official["f1"]) and ref.scores["exact_match"] == pytest.approx(official["exact"])
    # the v2.0 breakdown is in results.csv beside EM/F1
    import csv

    row = next(r for r in csv.DictReader((run / "results.csv").open()) if r["backend"] == "eager-fp32")
    for k in ("best_f1", "best_exact_thresh", "NoAns_exact", "HasAns_f1"):
        assert float(row[k]) == pytest.approx(official[k], rel=1e-5, abs=1e-6), k  # csv keeps 6 digits


def test_bench_model_with_a_v2_dev_file(tmp_path):
    """`bench --model FOLDER --dev-file dev-v2.0.json`: the user's path on their own v2.0 file."""
    import yaml

    from bertqa_bench.model.families import build_checkpoint
    from bertqa_bench.record.results import RunBundle

    dev = tmp_path / "dev-v2.0.json"
    dev.write_text(json.dumps(_v2([_qa("a", ["Mara Venn"], False, question="Who founded the Hollin Company?"),
                                   _qa("b", (), True, ["1874"], question="When was the Ostrava Guild founded?"),
                                   _qa("c", ["Ostrava"], False, question="Where was it founded?")])))
    folder = build_checkpoint("distilbert", tmp_path / "d", head_scale=30.0)
    raw = {"name": "mine", "data": {"max_seq_len": 48, "doc_stride": 16, "max_query_len": 16},
           "bench": {"backends": ["eager-fp32"], "batch_size": 4, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": "inprocess"},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    assert main(["bench", "--suite", str(tmp_path / "s.yaml"), "--model", str(folder), "--dev-file", str(dev),
                 "--no-mlflow", "--no-progress"]) == 0
    run = sorted((tmp_path / "results").glob("*-mine"))[-1]
    ref = RunBundle.load(run).results[0]
    assert ref.ok and ref.n_questions == 3 and ref.model_family == "distilbert"
    preds = json.loads((run / "predictions" / "eager-fp32.json").read_text())
    na = json.loads((run / "predictions" / "eager-fp32.na_prob.json").read_text())
    assert set(preds) == set(na) == {"a", "b", "c"}
    assert ref.scores["f1"] == pytest.approx(official_evaluate_v2(json.loads(dev.read_text())["data"], preds)["f1"])
