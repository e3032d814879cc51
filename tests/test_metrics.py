import contextlib
import io
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import official_squad as official
from bertqa_bench.tasks.squad.metrics import (evaluate_dataset, exact_match_score, f1_score, load_predictions,
                                       metric_max_over_ground_truths, normalize_answer, score_files,
                                       squad_evaluate)
from bertqa_bench.tasks.squad.reader import write_squad_json
from bertqa_bench.tasks.squad.types import Answer, QAExample
from bertqa_bench.errors import DatasetFormatError
from official_squad import official_evaluate


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


# --- the suite's scorer against the restated official one (tests/official_squad.py), on strings
# built to hit what normalization does: articles as whole words and inside words, ASCII
# punctuation glued to them, non-ASCII punctuation and letters (which the official script keeps),
# case that changes length when lowered, and every kind of whitespace.
_PIECES = st.sampled_from([
    "a", "an", "the", "The", "A", "AN", "THE", "theater", "ant", "bathe", "Anne", "apple", "Paris", "1,552",
    "U.S.A.", "e.g.", ".", ",", "-", "'", '"', "(", ")", "!", "?", ";", ":", "/", "_", "$",
    " ", "  ", "\t", "\n", "\u00a0", "\u2003", "\u3000", "–", "—", "«", "»", "¿", "café", "über", "İ", "ß",
    "Σ", "ﬁ", "東京", "e\u0301", "٣",
])
SQUADISH = st.one_of(st.lists(_PIECES, max_size=12).map("".join),
                     st.lists(st.one_of(_PIECES, st.text(max_size=3)), max_size=8).map("".join),
                     st.text(max_size=20))
PROPERTY = settings(max_examples=300, deadline=None, database=None)


@PROPERTY
@given(SQUADISH)
@example("a.b")        # punctuation removed before articles: "ab"; the other order gives "b"
@example("the. cat")
@example("theater an-the")
@example("İstanbul THE")
def test_normalize_answer_is_the_official_one(text):
    assert normalize_answer(text) == official.normalize_answer(text)


@PROPERTY
@given(SQUADISH, SQUADISH)
@example("York York", "York York city")  # token counts, not sets: 2 common tokens, not 1
@example("the cat cat", "cat cat")
@example("a.b", "b")
@example("the the cat", "cat the")
def test_em_and_f1_are_the_official_ones(prediction, gold):
    assert exact_match_score(prediction, gold) == float(official.exact_match_score(prediction, gold))
    assert f1_score(prediction, gold) == pytest.approx(official.f1_score(prediction, gold), abs=1e-12)


@PROPERTY
@given(st.lists(st.tuples(SQUADISH, st.lists(SQUADISH, min_size=1, max_size=3), st.booleans()), min_size=1,
                max_size=6))
def test_dataset_scores_are_the_official_ones(questions):
    data = [{"title": "t", "paragraphs": [{"context": "c", "qas": [
        {"id": f"q{i}", "question": "?", "answers": [{"text": g, "answer_start": 0} for g in golds]}
        for i, (_, golds, _) in enumerate(questions)]}]}]
    preds = {f"q{i}": p for i, (p, _, answered) in enumerate(questions) if answered}
    assert evaluate_dataset({"data": data}, preds) == pytest.approx(official.official_evaluate(data, preds))


def test_score_files_matches_the_official_evaluator_on_every_gold_answer(tmp_path):
    """A file whose questions have several gold answers, predicted by each of them in turn (and by
    variants of them): ``bertqa-bench score`` takes the best over all golds, as the official script
    does — a scorer that looked at the first gold only would agree on the first round alone."""
    data = [{"title": "t", "paragraphs": [{"context": _CTX, "qas": [
        {"id": "q1", "question": "When?", "answers": [{"text": "1874", "answer_start": 36},
                                                      {"text": "in 1874", "answer_start": 33}]},
        {"id": "q2", "question": "Who?", "answers": [{"text": "Okafor", "answer_start": 7},
                                                     {"text": "Marisa Okafor", "answer_start": 0},
                                                     {"text": "Marisa", "answer_start": 0}]}]}]}]
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({"version": "1.1", "data": data}))
    rounds = [{"q1": "1874", "q2": "Okafor"}, {"q1": "in 1874", "q2": "Marisa Okafor"},
              {"q1": "In 1874.", "q2": "marisa"}, {"q1": "born in 1874", "q2": "the Marisa Okafor family"}]
    for preds in rounds:
        result, _ = _score(tmp_path, path, preds)
        want = official.official_evaluate(data, preds)
        assert (result["exact_match"], result["f1"]) == pytest.approx((want["exact_match"], want["f1"])), preds
    assert official.official_evaluate(data, rounds[1]) == {"exact_match": 100.0, "f1": 100.0}


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


def test_evaluate_dataset_matches_official_and_squad_evaluate():
    from bertqa_bench.tasks.squad.reader import examples_to_squad_json

    exs = _examples()
    dataset = examples_to_squad_json(exs)
    preds = {"q1": "in Teluma", "q2": "1874", "q3": "Okafor"}
    expected = official_evaluate(dataset["data"], preds)
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


# --- score_files accepts what evaluate-v1.1.py accepts -------------------------------------------

_CTX = "Marisa Okafor was born in Teluma in 1874."


def _qa(qid, *answers, question="Where?", **extra):
    return {"id": qid, "question": question, "answers": [dict(a) for a in answers], **extra}


def _write_dataset(tmp_path, qas, context=_CTX, **top):
    paragraph = {"qas": qas} if context is None else {"context": context, "qas": qas}
    obj = {"version": "1.1", "data": [{"title": "t", "paragraphs": [paragraph]}], **top}
    if top.get("version", "1.1") is None:
        del obj["version"]
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(obj))
    return path, obj


def _score(tmp_path, dataset, preds):
    p = tmp_path / "preds.json"
    p.write_text(preds if isinstance(preds, str) else json.dumps(preds))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        result = score_files(dataset, p)
    return result, err.getvalue().splitlines()


def _official(obj, preds):
    return official_evaluate(obj["data"], preds)


def test_score_tolerates_misaligned_answer_start_with_a_warning(tmp_path):
    data, obj = _write_dataset(tmp_path, [
        _qa("q1", {"text": "Teluma", "answer_start": 3}),           # wrong offset
        _qa("q2", {"text": "1874", "answer_start": 999}),           # out of range
        _qa("q3", {"text": "Marisa Okafor", "answer_start": 0})])   # fine
    preds = {"q1": "Teluma", "q2": "in 1874", "q3": "Okafor"}
    result, lines = _score(tmp_path, data, preds)
    assert result["exact_match"] == pytest.approx(_official(obj, preds)["exact_match"]) == pytest.approx(100 / 3)
    assert result["f1"] == pytest.approx(_official(obj, preds)["f1"])
    assert result["n_questions"] == 3 and result["n_answered"] == 3
    warning = "\n".join(lines)
    assert "dev.json" in warning and "tolerated 2 answer(s) whose answer_start does not match the context" in warning
    assert "'q1' answers[0]" in warning and "'q2' answers[0]" in warning and "'q3'" not in warning


def test_score_tolerates_empty_answer_text(tmp_path):
    data, obj = _write_dataset(tmp_path, [_qa("q1", {"text": "", "answer_start": 0}, {"text": "Teluma", "answer_start": 26}),
                                          _qa("q2", {"text": "", "answer_start": 0})])
    preds = {"q1": "Teluma", "q2": ""}
    result, lines = _score(tmp_path, data, preds)
    # the official quirk: "" vs "" is an exact match with F1 0
    assert result == {**_official(obj, preds), "n_questions": 2, "n_answered": 2, "n_unknown_ids": 0}
    assert result["exact_match"] == 100.0 and result["f1"] == pytest.approx(50.0)
    assert any("2 empty answer text(s)" in line and "'q1' answers[0]" in line for line in lines)


def test_score_counts_duplicate_ids_like_the_official_script(tmp_path):
    # evaluate-v1.1.py loops over the qas, not over a dict of ids: each occurrence counts in the
    # total and is scored against its own answers with the one prediction for that id.
    data, obj = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26}),
                                          _qa("q1", {"text": "1874", "answer_start": 36}),
                                          _qa("q2", {"text": "1874", "answer_start": 36})])
    preds = {"q1": "Teluma", "q2": "1874"}
    result, lines = _score(tmp_path, data, preds)
    assert result["exact_match"] == pytest.approx(_official(obj, preds)["exact_match"]) == pytest.approx(200 / 3)
    assert (result["n_questions"], result["n_answered"]) == (3, 3)
    assert any("1 duplicate question id(s)" in line and "'q1'" in line for line in lines)


def test_score_tolerates_missing_question_answer_start_and_context(tmp_path):
    qas = [{"id": "q1", "answers": [{"text": "Teluma"}]},                            # no question, no answer_start
           _qa("q2", {"text": "1874", "answer_start": "36"}, question=None)]        # start a string, question null
    data, obj = _write_dataset(tmp_path, qas, context=None)
    preds = {"q1": "Teluma", "q2": "1874"}
    result, lines = _score(tmp_path, data, preds)
    assert result["exact_match"] == 100.0 and result["n_questions"] == 2
    warning = "\n".join(lines)
    assert "2 question(s) without a string 'question'" in warning
    assert "2 answer(s) without an integer 'answer_start'" in warning
    assert "1 paragraph(s) without a string 'context'" in warning


def test_score_question_without_gold_answers(tmp_path):
    data, obj = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26}), _qa("q2")])
    # unanswered: the official script gives it 0 and goes on
    result, lines = _score(tmp_path, data, {"q1": "Teluma"})
    assert result["exact_match"] == pytest.approx(50.0)
    assert any("1 question(s) with no gold answers and no prediction" in line for line in lines)
    # answered: the official script crashes on max([]); here the record is named
    with pytest.raises(DatasetFormatError) as err:
        _score(tmp_path, data, {"q1": "Teluma", "q2": "x"})
    assert err.value.field == "answers" and "qas[1] (id 'q2')" in err.value.record


def test_score_prints_the_official_unanswered_message(tmp_path, capsys):
    data, _ = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26}),
                                        _qa("q2", {"text": "1874", "answer_start": 36})])
    preds = tmp_path / "preds.json"
    preds.write_text(json.dumps({"q1": "Teluma"}))
    result = score_files(data, preds)  # default: stderr
    assert result["exact_match"] == pytest.approx(50.0) and result["n_answered"] == 1
    err = capsys.readouterr().err
    assert "Unanswered question q2 will receive score 0.\n" in err and "q1" not in err


def test_score_warns_about_the_version_like_the_official_script(tmp_path):
    data, _ = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26})], version="2.0")
    _, lines = _score(tmp_path, data, {"q1": "Teluma"})
    assert lines == ["Evaluation expects v-1.1, but got dataset with v-2.0"]
    data, _ = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26})], version=None)
    result, lines = _score(tmp_path, data, {"q1": "Teluma"})  # the official script raises KeyError here
    assert result["exact_match"] == 100.0 and "no 'version' field" in lines[0]


def test_score_tolerates_unused_non_string_predictions_and_duplicate_keys(tmp_path):
    data, _ = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 26})])
    # json.load keeps the last of duplicate keys; a value for an id not in the dataset is never read
    result, lines = _score(tmp_path, data, '{"q1": "Paris", "q1": "Teluma", "meta": {"model": 1}}')
    assert result["exact_match"] == 100.0 and result["n_unknown_ids"] == 1
    warning = "\n".join(lines)
    assert "1 id(s) given more than once in the predictions file" in warning and "'q1'" in warning
    assert "1 prediction(s) for ids not in the dataset whose value is not a string" in warning
    with pytest.raises(DatasetFormatError) as err:
        _score(tmp_path, data, {"q1": ["Teluma"]})
    assert err.value.field == "q1" and "preds.json" in err.value.path


@pytest.mark.parametrize("qas", [[], None])
def test_score_dataset_with_no_questions_is_an_error(tmp_path, qas):
    if qas is None:
        path = tmp_path / "dev.json"
        path.write_text(json.dumps({"version": "1.1", "data": []}))
    else:
        path, _ = _write_dataset(tmp_path, qas)
    with pytest.raises(DatasetFormatError, match="no questions") as err:
        _score(tmp_path, path, {"q1": "x"})
    assert err.value.path == str(path) and err.value.field == "data"


@pytest.mark.parametrize("obj, record, field", [
    ([], "<top level>", "<root>"),
    ({"version": "1.1"}, "<top level>", "data"),
    ({"data": [{"title": "t"}]}, "data[0]", "paragraphs"),
    ({"data": [{"paragraphs": [{"context": "c"}]}]}, "data[0].paragraphs[0]", "qas"),
    ({"data": [{"paragraphs": [{"qas": ["q1"]}]}]}, "data[0].paragraphs[0].qas[0]", "<qa>"),
    ({"data": [{"paragraphs": [{"qas": [{"answers": [{"text": "x"}]}]}]}]}, "data[0].paragraphs[0].qas[0]", "id"),
    ({"data": [{"paragraphs": [{"qas": [{"id": 7, "answers": []}]}]}]}, "data[0].paragraphs[0].qas[0]", "id"),
    ({"data": [{"paragraphs": [{"qas": [{"id": "q1"}]}]}]}, "data[0].paragraphs[0].qas[0] (id 'q1')", "answers"),
    ({"data": [{"paragraphs": [{"qas": [{"id": "q1", "answers": {"text": "x"}}]}]}]},
     "data[0].paragraphs[0].qas[0] (id 'q1')", "answers"),
    ({"data": [{"paragraphs": [{"qas": [{"id": "q1", "answers": [{"answer_start": 0}]}]}]}]},
     "data[0].paragraphs[0].qas[0] (id 'q1').answers[0]", "text"),
    ({"data": [{"paragraphs": [{"qas": [{"id": "q1", "answers": [{"text": 5}]}]}]}]},
     "data[0].paragraphs[0].qas[0] (id 'q1').answers[0]", "text"),
])
def test_score_unscoreable_dataset_names_file_record_and_field(tmp_path, obj, record, field):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(DatasetFormatError) as err:
        _score(tmp_path, path, {})
    assert (err.value.path, err.value.record, err.value.field) == (str(path), record, field)


def test_score_dataset_not_json(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text('{"data": [')
    with pytest.raises(DatasetFormatError) as err:
        _score(tmp_path, path, {})
    assert err.value.field == "<json>" and err.value.path == str(path)


def test_training_reader_stays_strict_where_scoring_tolerates(tmp_path):
    from bertqa_bench.tasks.squad.reader import load_squad_json

    data, _ = _write_dataset(tmp_path, [_qa("q1", {"text": "Teluma", "answer_start": 3})])
    assert _score(tmp_path, data, {"q1": "Teluma"})[0]["exact_match"] == 100.0
    with pytest.raises(DatasetFormatError, match="answer_start"):
        load_squad_json(data)
