import copy
import json
import os
from pathlib import Path

import pytest

from bertqa_bench.tasks.squad.reader import examples_to_squad_json, load_squad_hf, load_squad_json, write_squad_json
from bertqa_bench.tasks.squad.types import Answer, QAExample
from bertqa_bench.errors import DatasetFormatError, MissingDependencyError

CTX1 = "Marisa Okafor was born in Teluma in 1874. She worked as a glass engraver."
CTX2 = "The Selka River is 412 kilometres long."
CTX3 = "Teluma is the capital of Varnesse Province."


def _valid() -> dict:
    return {"version": "1.1", "data": [
        {"title": "Marisa Okafor", "paragraphs": [
            {"context": CTX1, "qas": [
                {"id": "a1", "question": "Where was Marisa Okafor born?",
                 "answers": [{"text": "Teluma", "answer_start": 26}, {"text": "in Teluma", "answer_start": 23}]},
                {"id": "a2", "question": "What did Marisa Okafor work as?",
                 "answers": [{"text": "glass engraver", "answer_start": 58}]}]},
            {"context": CTX2, "qas": [
                {"id": "a3", "question": "How long is the Selka River?",
                 "answers": [{"text": "412 kilometres", "answer_start": 19}]}]}]},
        {"title": "Teluma", "paragraphs": [
            {"context": CTX3, "qas": [
                {"id": "b1", "question": "What is the capital of Varnesse Province?",
                 "answers": [{"text": "Teluma", "answer_start": 0}]}]}]}]}


def _write(tmp_path, obj, name="dev.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj, indent=1))
    return path


def test_load_valid_file(tmp_path):
    examples = load_squad_json(_write(tmp_path, _valid()))
    assert [e.id for e in examples] == ["a1", "a2", "a3", "b1"]
    assert examples[0] == QAExample("a1", "Where was Marisa Okafor born?", CTX1,
                                    (Answer("Teluma", 26), Answer("in Teluma", 23)), "Marisa Okafor")
    assert examples[3].title == "Teluma" and examples[2].context == CTX2


def test_round_trip_write_load(tmp_path):
    examples = load_squad_json(_write(tmp_path, _valid()))
    out = write_squad_json(examples, tmp_path / "sub" / "copy.json")
    assert load_squad_json(out) == examples
    # grouping by (title, context) restores the original structure exactly
    assert json.loads(out.read_text()) == _valid()
    assert examples_to_squad_json(examples) == _valid()


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch):
    path = write_squad_json(_valid(), tmp_path / "d.json")
    before = path.read_bytes()

    def boom(self, data):
        self.open("wb").write(data[:10])  # half a file, then the disk fills up
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", boom)
    with pytest.raises(OSError):
        write_squad_json(_valid(), path)
    assert path.read_bytes() == before  # the old file is intact
    assert os.listdir(tmp_path) == ["d.json"]


def _mutate(fn):
    obj = copy.deepcopy(_valid())
    fn(obj)
    return obj


def _qa(obj, a=0, p=0, q=0):
    return obj["data"][a]["paragraphs"][p]["qas"][q]


BAD_CASES = {
    "top-level list": ([1, 2], "<top level>", "<root>"),
    "missing data": ({"version": "1.1"}, "<top level>", "data"),
    "data not list": ({"data": {"x": 1}}, "<top level>", "data"),
    "article not object": (_mutate(lambda o: o["data"].__setitem__(1, "oops")), "data[1]", "<article>"),
    "missing paragraphs": (_mutate(lambda o: o["data"][1].pop("paragraphs")), "data[1]", "paragraphs"),
    "paragraphs wrong type": (_mutate(lambda o: o["data"][0].__setitem__("paragraphs", "x")), "data[0]",
                              "paragraphs"),
    "title wrong type": (_mutate(lambda o: o["data"][0].__setitem__("title", 5)), "data[0]", "title"),
    "missing context": (_mutate(lambda o: o["data"][0]["paragraphs"][1].pop("context")),
                        "data[0].paragraphs[1]", "context"),
    "context wrong type": (_mutate(lambda o: o["data"][0]["paragraphs"][1].__setitem__("context", None)),
                           "data[0].paragraphs[1]", "context"),
    "missing qas": (_mutate(lambda o: o["data"][1]["paragraphs"][0].pop("qas")), "data[1].paragraphs[0]", "qas"),
    "missing id": (_mutate(lambda o: _qa(o, q=1).pop("id")), "data[0].paragraphs[0].qas[1]", "id"),
    "id wrong type": (_mutate(lambda o: _qa(o, q=1).__setitem__("id", 7)), "data[0].paragraphs[0].qas[1]", "id"),
    "missing question": (_mutate(lambda o: _qa(o, q=1).pop("question")),
                         "data[0].paragraphs[0].qas[1] (id 'a2')", "question"),
    "missing answers": (_mutate(lambda o: _qa(o, a=1).pop("answers")),
                        "data[1].paragraphs[0].qas[0] (id 'b1')", "answers"),
    "empty answers": (_mutate(lambda o: _qa(o, a=1).__setitem__("answers", [])),
                      "data[1].paragraphs[0].qas[0] (id 'b1')", "answers"),
    "missing text": (_mutate(lambda o: _qa(o)["answers"][1].pop("text")),
                     "data[0].paragraphs[0].qas[0] (id 'a1').answers[1]", "text"),
    "missing answer_start": (_mutate(lambda o: _qa(o, p=1)["answers"][0].pop("answer_start")),
                             "data[0].paragraphs[1].qas[0] (id 'a3').answers[0]", "answer_start"),
    "answer_start string": (_mutate(lambda o: _qa(o, p=1)["answers"][0].__setitem__("answer_start", "19")),
                            "data[0].paragraphs[1].qas[0] (id 'a3').answers[0]", "answer_start"),
    "answer_start bool": (_mutate(lambda o: _qa(o, a=1)["answers"][0].__setitem__("answer_start", False)),
                          "data[1].paragraphs[0].qas[0] (id 'b1').answers[0]", "answer_start"),
    "answer_start negative": (_mutate(lambda o: _qa(o, p=1)["answers"][0].__setitem__("answer_start", -1)),
                              "data[0].paragraphs[1].qas[0] (id 'a3').answers[0]", "answer_start"),
    "answer_start past end": (_mutate(lambda o: _qa(o, p=1)["answers"][0].__setitem__("answer_start", 30)),
                              "data[0].paragraphs[1].qas[0] (id 'a3').answers[0]", "answer_start"),
    "text mismatch": (_mutate(lambda o: _qa(o, q=1)["answers"][0].__setitem__("answer_start", 57)),
                      "data[0].paragraphs[0].qas[1] (id 'a2').answers[0]", "answer_start"),
    "duplicate id": (_mutate(lambda o: _qa(o, a=1).__setitem__("id", "a2")),
                     "data[1].paragraphs[0].qas[0] (id 'a2')", "id"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_malformed_file_names_file_record_and_field(tmp_path, case):
    obj, record, field = BAD_CASES[case]
    path = _write(tmp_path, obj)
    with pytest.raises(DatasetFormatError) as err:
        load_squad_json(path)
    msg = str(err.value)
    assert str(path) in msg and record in msg and f"'{field}'" in msg, msg
    assert (err.value.record, err.value.field) == (record, field)


def test_error_in_last_record_fails_the_whole_file(tmp_path):
    # Three valid questions come first; the loader must still fail as a whole (no partial list of
    # the questions before the flaw), and name the last record as the one at fault.
    valid = load_squad_json(_write(tmp_path, _valid(), "valid.json"))
    obj = _mutate(lambda o: _qa(o, a=1)["answers"][0].__setitem__("text", "Varnesse"))
    path = _write(tmp_path, obj)
    with pytest.raises(DatasetFormatError) as err:
        load_squad_json(path)
    assert err.value.record.startswith("data[1].paragraphs[0].qas[0]") and err.value.path == str(path)
    assert err.value.field in ("answer_start", "text"), err.value
    assert [ex.id for ex in valid][-1] in err.value.record  # the flawed question is the file's last


def test_duplicate_id_message_points_to_first_use(tmp_path):
    path = _write(tmp_path, BAD_CASES["duplicate id"][0])
    with pytest.raises(DatasetFormatError, match=r"first used at data\[0\]\.paragraphs\[0\]\.qas\[1\]"):
        load_squad_json(path)


def test_bad_json_reports_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"version": "1.1",\n "data": [\n  {"title": "x",, }\n]}')
    with pytest.raises(DatasetFormatError) as err:
        load_squad_json(path)
    assert str(path) in str(err.value)
    assert "line 3 column" in str(err.value)


def test_text_mismatch_shows_what_the_context_holds(tmp_path):
    path = _write(tmp_path, BAD_CASES["text mismatch"][0])
    with pytest.raises(DatasetFormatError, match="' glass engrave'"):
        load_squad_json(path)


def test_hf_loader_without_datasets_names_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(MissingDependencyError, match="datasets"):
        load_squad_hf("squad", "validation")


def test_hf_loader_converts_rows(monkeypatch):
    import sys
    import types

    rows = [{"id": "x1", "title": "T", "context": CTX3, "question": "Capital?",
             "answers": {"text": ["Teluma"], "answer_start": [0]}}]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, split: rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_squad_hf() == [QAExample("x1", "Capital?", CTX3, (Answer("Teluma", 0),), "T")]
    rows[0]["answers"]["answer_start"] = [3]
    with pytest.raises(DatasetFormatError, match="answer_start"):
        load_squad_hf()
