import json

import pytest

from bertqa_bench.tasks.squad.metrics import (evaluate_dataset, exact_match_score, f1_score, load_predictions,
                                       metric_max_over_ground_truths, normalize_answer, score_files,
                                       squad_evaluate)
from bertqa_bench.tasks.squad.reader import write_squad_json
from bertqa_bench.tasks.squad.types import Answer, QAExample
from bertqa_bench.errors import DatasetFormatError


@pytest.mark.parametrize("raw, expected", [
    ("The Cat", "cat"),
    ("  a  quick,  brown fox! ", "quick brown fox"),
    ("An apple; the end.", "apple end"),
    ("theater", "theater"),  # articles only as whole words
    ("Anne and Thea", "anne and thea"),
    ("U.S.A.", "usa"),
    ("1,552", "1552"),
    ("the", ""),
    ("", ""),
    ("café – über", "café – über"),  # official punctuation is ASCII only
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_exact_match_ignores_case_punctuation_articles():
    assert exact_match_score("The Eiffel Tower.", "eiffel tower") == 1.0
    assert exact_match_score("Eiffel", "Eiffel Tower") == 0.0


def test_f1_partial_overlap_by_hand():
    # pred tokens: [eiffel, tower, in, paris]; gold: [eiffel, tower]; common 2
    # precision 2/4, recall 2/2 -> F1 = 2*0.5*1/1.5 = 2/3
    assert f1_score("the Eiffel Tower in Paris", "Eiffel Tower") == pytest.approx(2 / 3)
    # pred [new, york, city], gold [york, city, hall, new, york]: common {new:1, york:1, city:1} = 3
    # precision 3/3, recall 3/5 -> F1 = 2*1*0.6/1.6 = 0.75
    assert f1_score("New York City", "York City Hall, New York") == pytest.approx(0.75)
    # duplicates count with multiplicity: pred [york, york] vs gold [york]: common 1, p=1/2, r=1
    assert f1_score("York York", "York") == pytest.approx(2 / 3)
    assert f1_score("Paris", "London") == 0.0


def test_empty_strings_follow_official_script():
    assert exact_match_score("", "") == 1.0
    assert f1_score("", "") == 0.0  # no common tokens -> 0, as in evaluate-v1.1.py
    assert f1_score("", "Paris") == 0.0
    assert f1_score("the", "a") == 0.0  # both normalize to empty


def test_max_over_ground_truths():
    golds = ["Denver Broncos", "Broncos", "the Denver Broncos team"]
    assert metric_max_over_ground_truths(exact_match_score, "broncos", golds) == 1.0
    # best F1 is against "Denver Broncos": pred [denver], p=1, r=1/2 -> 2/3
    assert metric_max_over_ground_truths(f1_score, "Denver", golds) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        metric_max_over_ground_truths(f1_score, "x", [])


def _examples():
    ctx = "Marisa Okafor was born in Teluma in 1874."
    return [QAExample("q1", "Where was Marisa Okafor born?", ctx, (Answer("Teluma", 26),)),
            QAExample("q2", "When was Marisa Okafor born?", ctx, (Answer("1874", 36), Answer("in 1874", 33))),
            QAExample("q3", "Who was born in Teluma?", ctx, (Answer("Marisa Okafor", 0),))]


def test_squad_evaluate_missing_prediction_scores_zero():
    preds = {"q1": "Teluma", "q2": "in 1874 or so"}  # q3 unanswered
    # q1: EM 1, F1 1. q2: vs "1874": [in,1874,or,so] p=1/4 r=1 -> 0.4; vs "in 1874": p=2/4 r=1 -> 2/3. q3: 0
    result = squad_evaluate(_examples(), preds)
    assert result["exact_match"] == pytest.approx(100 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)


def test_squad_evaluate_perfect_and_empty():
    exs = _examples()
    assert squad_evaluate(exs, {e.id: e.answers[0].text for e in exs}) == {"exact_match": 100.0, "f1": 100.0}
    assert squad_evaluate(exs, {e.id: "" for e in exs}) == {"exact_match": 0.0, "f1": 0.0}
    assert squad_evaluate([], {}) == {"exact_match": 0.0, "f1": 0.0}


def _official_evaluate(dataset, predictions):
    """evaluate-v1.1.py's evaluate(), verbatim in structure, to check equivalence."""
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                ground_truths = list(map(lambda x: x["text"], qa["answers"]))
                prediction = predictions[qa["id"]]
                exact_match += metric_max_over_ground_truths(exact_match_score, prediction, ground_truths)
                f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def test_evaluate_dataset_matches_official_and_squad_evaluate():
    from bertqa_bench.tasks.squad.reader import examples_to_squad_json

    exs = _examples()
    dataset = examples_to_squad_json(exs)
    preds = {"q1": "in Teluma", "q2": "1874", "q3": "Okafor"}
    expected = _official_evaluate(dataset["data"], preds)
    assert evaluate_dataset(dataset, preds) == pytest.approx(expected)
    assert evaluate_dataset(dataset["data"], preds) == pytest.approx(expected)
    assert squad_evaluate(exs, preds) == pytest.approx(expected)
    assert expected["exact_match"] == pytest.approx(100 / 3)


def test_score_files(tmp_path):
    data = write_squad_json(_examples(), tmp_path / "dev.json")
    preds = tmp_path / "preds.json"
    preds.write_text(json.dumps({"q1": "Teluma", "q2": "1874", "extra": "x"}))
    result = score_files(data, preds)
    assert result["exact_match"] == pytest.approx(200 / 3)
    assert (result["n_questions"], result["n_answered"], result["n_unknown_ids"]) == (3, 2, 1)


@pytest.mark.parametrize("content, field", [
    ('["Teluma"]', "<predictions>"),
    ('{"q1": 3}', "q1"),
    ('{"q1": "Teluma",', "<json>"),
])
def test_bad_predictions_file_names_the_file(tmp_path, content, field):
    preds = tmp_path / "preds.json"
    preds.write_text(content)
    with pytest.raises(DatasetFormatError) as err:
        load_predictions(preds)
    assert str(preds) in str(err.value) and err.value.field == field


def test_score_files_validates_dataset(tmp_path):
    bad = tmp_path / "dev.json"
    bad.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "abc", "qas": [{"id": "q", "question": "?", "answers": [{"text": "x", "answer_start": 0}]}]}]}]}))
    preds = tmp_path / "p.json"
    preds.write_text("{}")
    with pytest.raises(DatasetFormatError, match="answer_start"):
        score_files(bad, preds)
