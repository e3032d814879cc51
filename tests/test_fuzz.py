"""Property-based fuzzing of every file the suite reads (hypothesis; the ``dev`` extra).

Each reader gets valid documents (which must load) and mutated ones: fields dropped, renamed
or retyped, wrong nesting, nulls, huge/negative/non-finite numbers, duplicated records, then
optionally the bytes themselves broken (truncated, bad UTF-8, invalid JSON/YAML, deep nesting,
over-long integer literals, corrupt gzip). The properties:

* a malformed input raises the named error, never anything else: DatasetFormatError (with the
  file, a record and a field) for data and predictions files, a BenchError (ConfigError,
  UnknownBackendError) for suites — no KeyError/TypeError/AttributeError/RecursionError;
* nothing hangs (small examples; pytest-timeout fails a test that runs past its limit);
* the readers write nothing: after every call the temporary folder holds only the input;
* ``bertqa-bench score`` accepts whatever the official evaluate-v1.1.py accepts, with the same
  numbers, except where it deliberately refuses (documented below), and it accepts whatever the
  strict training reader accepts.
"""
from __future__ import annotations

import contextlib
import copy
import gzip
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import yaml

pytest.importorskip("hypothesis")  # the `dev` extra: pip install -e '.[dev]'

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bertqa_bench.config import BATCHINGS, SuiteConfig  # noqa: E402
from bertqa_bench.errors import BenchError, DatasetFormatError  # noqa: E402
from bertqa_bench.suite import load_suite  # noqa: E402
from bertqa_bench.tasks.nq.metrics import NQPrediction, parse_predictions  # noqa: E402
from bertqa_bench.tasks.nq.reader import NQExample, load_nq_jsonl  # noqa: E402
from bertqa_bench.tasks.squad.metrics import load_predictions, score_files  # noqa: E402
from bertqa_bench.tasks.squad.reader import load_squad_json  # noqa: E402
from official_squad import official_evaluate  # noqa: E402

# BERTQA_FUZZ_SCALE=20 runs twenty times the examples (a deeper local search; CI keeps it fast).
_SCALE = max(1, int(os.environ.get("BERTQA_FUZZ_SCALE", "1")))
pytestmark = pytest.mark.timeout(120 * _SCALE)  # a hang fails the test
# No per-example deadline: on a busy 2-core CI machine a 5,000-deep YAML document took 3.3 s to
# reject, and a clock-based verdict would fail there by chance. A hang still fails on the timeout.
FUZZ = settings(max_examples=150 * _SCALE, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])
VALID = settings(FUZZ, max_examples=60 * _SCALE)


# ----------------------------------------------------------------------------- helpers

@contextlib.contextmanager
def one_file(name: str, content: bytes):
    """A fresh folder holding only ``name``; afterwards it must still hold only that file."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(content)
        yield path
        assert sorted(os.listdir(d)) == [name], "a reader wrote files beside its input"


def named_error_or_result(fn, path):
    """Call fn(); a DatasetFormatError must name ``path``, a record and a field. Anything else propagates."""
    try:
        return fn()
    except DatasetFormatError as e:
        assert e.path == str(path), e
        assert e.record and e.field, e
        assert str(path) in str(e)
        return None


# Any JSON value, small, including the awkward ones.
NUMBERS = st.sampled_from([0, -1, 1, 2, -(2 ** 63), 2 ** 63, 10 ** 30, 10 ** 400, 1.5, -0.0, 1e308,
                           float("nan"), float("inf"), float("-inf"), True, False])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), NUMBERS,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(["", " ", "1.1", "NONE", "yes", "null", "-1", "eager-fp32"]))
JUNK = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=6)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


TREE_OPS = ("delete", "replace", "null", "number", "number", "wrap", "unwrap", "stringify", "empty", "duplicate",
            "rename")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mutate(data, doc, max_mutations: int = 3, values=JUNK):
    """Apply 1..max_mutations random structural mutations to a copy of ``doc`` (a JSON/YAML tree).

    "number" mostly hits a number already there (offsets, scores, sizes), so that extreme values
    (huge, negative, NaN, infinite, bool) land where a reader does arithmetic with them.
    """
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, max_mutations), label="mutations")):
        op = data.draw(st.sampled_from(TREE_OPS), label="op")
        paths = list(_paths(doc))
        if op == "number" and data.draw(st.integers(0, 3), label="numeric leaf") > 0:
            numeric = [p for p in paths if _is_number(_at(doc, p))]
            paths = numeric or paths
        path = data.draw(st.sampled_from(paths), label="path")
        value = doc
        for k in path:
            value = value[k]
        if op == "delete":
            new = _DELETE
        elif op == "replace":
            new = data.draw(values, label="value")
        elif op == "null":
            new = None
        elif op == "number":
            new = data.draw(NUMBERS, label="number")
        elif op == "wrap":
            new = [value]
        elif op == "unwrap":
            new = (next(iter(value.values())) if isinstance(value, dict) and value
                   else value[0] if isinstance(value, list) and value else value)
        elif op == "stringify":
            new = json.dumps(value, default=str) if not isinstance(value, str) else value + "x"
        elif op == "empty":
            new = type(value)() if isinstance(value, (dict, list, str)) else value
        elif op == "duplicate":
            new = _DUPLICATE
        else:  # rename
            new = _RENAME
        doc = _put(doc, path, new, copy.deepcopy(value))
    return doc


_DELETE, _DUPLICATE, _RENAME = object(), object(), object()


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _put(doc, path, new, old):
    if not path:
        return {} if new is _DELETE else [old, old] if new is _DUPLICATE else {"renamed": old} if new is _RENAME else new
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if new is _DELETE:
        del parent[key]
    elif new is _DUPLICATE:
        if isinstance(parent, list):
            parent.insert(key, old)
        else:
            parent[f"{key}_copy"] = old
    elif new is _RENAME:
        if isinstance(parent, dict):
            parent[f"{key}".upper() + "_"] = parent.pop(key)
        else:
            parent[key] = {"value": old}
    else:
        parent[key] = new
    return doc


BYTE_OPS = ("none", "none", "none", "truncate", "bad_utf8", "byte", "bom", "deep", "bigint", "empty", "nul")


def corrupt(data, raw: bytes, ops=BYTE_OPS) -> bytes:
    """Maybe break the serialized bytes."""
    op = data.draw(st.sampled_from(ops), label="byte op")
    pos = data.draw(st.integers(0, len(raw)), label="pos")
    if op == "truncate":
        return raw[:pos]
    if op == "bad_utf8":
        return raw[:pos] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80abc", b"\xf8\x88\x80\x80\x80"])) + raw[pos:]
    if op == "byte" and raw:
        i = min(pos, len(raw) - 1)
        return raw[:i] + bytes([data.draw(st.integers(0, 255), label="byte")]) + raw[i + 1:]
    if op == "bom":
        return b"\xef\xbb\xbf" + raw
    if op == "deep":
        depth = data.draw(st.sampled_from([50, 1000, 100_000]), label="depth")
        return data.draw(st.sampled_from([b"[", b'{"a":'])) * depth
    if op == "bigint":
        return raw[:pos] + b"9" * 5000 + raw[pos:]
    if op == "empty":
        return b""
    if op == "nul":
        return raw[:pos] + b"\x00" + raw[pos:]
    return raw


def dumps(obj) -> bytes:
    # allow_nan: json.loads reads NaN/Infinity, so files can hold them; ensure_ascii keeps lone surrogates writable
    return json.dumps(obj, allow_nan=True).encode()


# ----------------------------------------------------------------------------- SQuAD dataset files

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@st.composite
def squad_docs(draw):
    """A valid SQuAD v1.1 dict: every answer is the context slice at its answer_start, ids unique."""
    n = 0
    articles = []
    for _ in range(draw(st.integers(1, 2))):
        paragraphs = []
        for _ in range(draw(st.integers(1, 2))):
            context = draw(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                                   min_size=1, max_size=40))
            qas = []
            for _ in range(draw(st.integers(0, 3))):
                answers = []
                for _ in range(draw(st.integers(1, 3))):
                    start = draw(st.integers(0, len(context) - 1))
                    end = draw(st.integers(start + 1, len(context)))
                    answers.append({"text": context[start:end], "answer_start": start})
                n += 1
                qas.append({"id": draw(st.text(max_size=4)) + f"#{n}", "question": draw(TEXT), "answers": answers})
            paragraphs.append({"context": context, "qas": qas})
        articles.append({"title": draw(TEXT), "paragraphs": paragraphs})
    return {"version": "1.1", "data": articles}


def _squad_ids(doc):
    return [qa["id"] for a in doc["data"] for p in a["paragraphs"] for qa in p["qas"]]


@VALID
@given(squad_docs())
def test_valid_squad_files_load(doc):
    with one_file("dev.json", json.dumps(doc, ensure_ascii=False).encode("utf-8")) as path:
        examples = load_squad_json(path)
    assert [ex.id for ex in examples] == _squad_ids(doc)
    for ex in examples:
        for a in ex.answers:
            assert ex.context[a.answer_start:a.answer_start + len(a.text)] == a.text


@FUZZ
@given(squad_docs(), st.data())
def test_malformed_squad_files_raise_dataset_format_error(doc, data):
    raw = corrupt(data, dumps(mutate(data, doc)))
    with one_file("dev.json", raw) as path:
        examples = named_error_or_result(lambda: load_squad_json(path), path)
    if examples is not None:  # what loads is consistent
        assert len({ex.id for ex in examples}) == len(examples)
        for ex in examples:
            assert ex.answers and all(ex.context[a.answer_start:a.answer_start + len(a.text)] == a.text and a.text
                                      for a in ex.answers)


# ----------------------------------------------------------------------------- scoring (Task A)

class _OfficialFailed(Exception):
    pass


def official_v11(dataset_text: str, predictions_text: str) -> dict:
    """evaluate-v1.1.py's __main__ and evaluate(), statement for statement (stderr dropped)."""
    try:
        dataset_json = json.loads(dataset_text)
        if dataset_json["version"] != "1.1":
            _ = "Evaluation expects v-" + "1.1" + ", but got dataset with v-" + dataset_json["version"]
        dataset = dataset_json["data"]
        predictions = json.loads(predictions_text)
        return official_evaluate(dataset, predictions)
    except Exception as e:  # noqa: BLE001 - any crash means "the official script rejects this input"
        raise _OfficialFailed(repr(e)) from None


# Where `score` deliberately refuses what the official script would score: a container that is
# not a list but happens to iterate (an empty {} or ""); gold answers that are missing, not a
# list of objects, or without a string text (the official script reads them only for answered
# questions, so it skips them when unanswered); a predictions file that is not an object (the
# official script scores a list or string of ids as all-unanswered).
_DELIBERATE = (("data", "expected a list"), ("paragraphs", "expected a list"), ("qas", "expected a list"),
               ("answers", "expected a list"), ("answers", "missing"), ("<answer>", "expected an object"),
               ("text", "missing"), ("text", "expected str"), ("<predictions>", "expected a JSON object"))


def _score_quietly(dataset_path, predictions_path):
    lines: list[str] = []
    return score_files(dataset_path, predictions_path, warn=lines.append), lines


def _gold_texts(doc) -> dict:
    return {qa["id"]: [a["text"] for a in qa["answers"]] for a in doc["data"] for p in a["paragraphs"]
            for qa in p["qas"]}


@st.composite
def predictions_for(draw, doc):
    """Predictions for some of ``doc``'s questions: random text, or one of the question's gold
    answers (any of them, so "best over the golds" matters), as is or re-cased and punctuated
    (so normalization matters); random text alone almost never scores above 0."""
    ids = _squad_ids(doc) if isinstance(doc, dict) and isinstance(doc.get("data"), list) else []
    chosen = draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    golds = _gold_texts(doc) if ids else {}

    def prediction(qid):
        kind = draw(st.sampled_from(["text", "gold", "gold", "variant"]), label="prediction kind")
        if kind == "text" or not golds.get(qid):
            return draw(TEXT)
        gold = draw(st.sampled_from(golds[qid]), label="gold answer")
        if kind == "gold":
            return gold
        prefix, suffix = draw(st.sampled_from(["The ", "a ", "", " "])), draw(st.sampled_from([".", "!", "", " x"]))
        return prefix + gold.upper() + suffix

    preds = {qid: prediction(qid) for qid in chosen}
    preds.update(draw(st.dictionaries(st.text(max_size=5), TEXT, max_size=2)))
    return preds


@FUZZ
@given(squad_docs(), st.data())
def test_score_accepts_what_the_official_script_accepts(doc, data):
    mutated = mutate(data, doc) if data.draw(st.booleans(), label="mutate dataset") else doc
    preds = data.draw(predictions_for(doc), label="predictions")
    if data.draw(st.integers(0, 4), label="mutate predictions") == 0:
        preds = mutate(data, preds, max_mutations=2)
    dataset_raw = corrupt(data, dumps(mutated), ops=("none",) * 8 + ("truncate", "bad_utf8", "deep", "bigint"))
    preds_raw = dumps(preds)
    with tempfile.TemporaryDirectory() as d:
        dataset_path, preds_path = Path(d) / "dev.json", Path(d) / "preds.json"
        dataset_path.write_bytes(dataset_raw)
        preds_path.write_bytes(preds_raw)
        try:
            result, lines = _score_quietly(dataset_path, preds_path)
            error = None
        except DatasetFormatError as e:
            result, error = None, e
            assert e.path in (str(dataset_path), str(preds_path)) and e.record and e.field
        assert sorted(os.listdir(d)) == ["dev.json", "preds.json"]
    try:
        official = official_v11(dataset_raw.decode("utf-8"), preds_raw.decode("utf-8"))
    except (_OfficialFailed, UnicodeDecodeError):
        official = None
    if result is not None:
        for k in ("exact_match", "f1"):
            assert 0.0 <= result[k] <= 100.0
        assert result["n_questions"] >= 1 and 0 <= result["n_answered"] <= result["n_questions"]
        if official is not None:
            assert result["exact_match"] == pytest.approx(official["exact_match"])
            assert result["f1"] == pytest.approx(official["f1"])
    elif official is not None:  # the official script scored it; only the documented refusals may differ
        assert any(error.field == field and reason in error.reason for field, reason in _DELIBERATE), error


@VALID
@given(squad_docs(), st.data())
def test_score_accepts_everything_the_strict_reader_accepts(doc, data):
    preds = data.draw(predictions_for(doc))
    with tempfile.TemporaryDirectory() as d:
        dataset_path, preds_path = Path(d) / "dev.json", Path(d) / "preds.json"
        dataset_path.write_bytes(dumps(doc))
        preds_path.write_bytes(dumps(preds))
        examples = load_squad_json(dataset_path)
        if not examples:
            with pytest.raises(DatasetFormatError, match="no questions"):
                _score_quietly(dataset_path, preds_path)
            return
        result, lines = _score_quietly(dataset_path, preds_path)
    # the restated official evaluator (tests/official_squad.py), which shares no code with the
    # suite: comparing with squad_evaluate would compare score with its own scoring routine
    expected = official_evaluate(doc["data"], preds)
    assert result["exact_match"] == pytest.approx(expected["exact_match"])
    assert result["f1"] == pytest.approx(expected["f1"])
    assert not [line for line in lines if line.startswith("warning:")]  # nothing to tolerate in a valid file
    assert sum(line.startswith("Unanswered question") for line in lines) == sum(ex.id not in preds for ex in examples)


# ----------------------------------------------------------------------------- SQuAD predictions files

@FUZZ
@given(st.dictionaries(st.text(max_size=6), TEXT, max_size=4), st.data())
def test_squad_predictions_files(preds, data):
    if data.draw(st.booleans(), label="mutate"):
        preds = mutate(data, preds)
    raw = corrupt(data, dumps(preds))
    with one_file("preds.json", raw) as path:
        loaded = named_error_or_result(lambda: load_predictions(path), path)
    if loaded is not None:
        assert isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items())
        if raw == dumps(preds) and isinstance(preds, dict) and all(isinstance(v, str) for v in preds.values()):
            assert loaded == preds


# ----------------------------------------------------------------------------- NQ simplified jsonl

TOKEN = st.text(alphabet="abcXYZ<>/P=1é", min_size=1, max_size=5)


@st.composite
def nq_records(draw):
    records = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 10))
        tokens = draw(st.lists(TOKEN, min_size=n, max_size=n))

        def span():
            s = draw(st.integers(0, n - 1))
            return s, draw(st.integers(s + 1, n))

        cands = []
        for _ in range(draw(st.integers(0, 3))):
            s, e = span()
            cands.append({"start_token": s, "end_token": e, "top_level": draw(st.booleans())})
        annotations = []
        for _ in range(draw(st.integers(0, 3))):
            if cands and draw(st.booleans()):
                ci = draw(st.integers(0, len(cands) - 1))
                la = {"start_token": cands[ci]["start_token"], "end_token": cands[ci]["end_token"],
                      "candidate_index": ci}
            else:
                la = {"start_token": -1, "end_token": -1, "candidate_index": -1}
            shorts = [dict(zip(("start_token", "end_token"), span())) for _ in range(draw(st.integers(0, 2)))]
            annotations.append({"long_answer": la, "short_answers": shorts,
                                "yes_no_answer": draw(st.sampled_from(["NONE", "YES", "NO", "yes"]))})
        rec = {"example_id": i if draw(st.booleans()) else f"ex-{i}",
               "question_text": draw(st.text(alphabet="abc? ", max_size=8)) + "q",
               "document_text": " ".join(tokens), "long_answer_candidates": cands}
        if annotations or draw(st.booleans()):
            rec["annotations"] = annotations
        records.append(rec)
    return records


def _jsonl(records, blank_lines=False) -> bytes:
    lines = [dumps(r) for r in records] if isinstance(records, list) else [dumps(records)]
    sep = b"\n\n" if blank_lines else b"\n"
    return sep.join(lines) + b"\n"


@VALID
@given(nq_records(), st.booleans(), st.booleans())
def test_valid_nq_files_load_plain_and_gz(records, gz, blank_lines):
    raw = _jsonl(records, blank_lines)
    with one_file("dev.jsonl.gz" if gz else "dev.jsonl", gzip.compress(raw) if gz else raw) as path:
        examples = load_nq_jsonl(path)
    assert [ex.example_id for ex in examples] == [r["example_id"] for r in records]
    for ex, rec in zip(examples, records):
        assert len(ex.candidates) == len(rec["long_answer_candidates"])
        assert len(ex.annotations) == len(rec.get("annotations", []))


@FUZZ
@given(nq_records(), st.booleans(), st.data())
def test_malformed_nq_files_raise_dataset_format_error(records, gz, data):
    records = mutate(data, records)
    raw = _jsonl(records)
    line_op = data.draw(st.sampled_from(["none", "none", "garbage_line", "repeat_line", "crlf"]), label="line op")
    lines = raw.split(b"\n")
    k = data.draw(st.integers(0, len(lines) - 1), label="line")
    if line_op == "garbage_line":
        lines.insert(k, data.draw(st.sampled_from([b"[]", b"null", b"{", b"\x85", b"\t", b"1", b'"x"', b"{}"])))
    elif line_op == "repeat_line":
        lines.insert(k, lines[k])
    raw = (b"\r\n" if line_op == "crlf" else b"\n").join(lines)
    raw = corrupt(data, raw)
    if gz:
        raw = gzip.compress(raw)
        gz_op = data.draw(st.sampled_from(["none", "none", "truncate", "flip", "trailing"]), label="gz op")
        pos = data.draw(st.integers(0, len(raw) - 1), label="gz pos")
        if gz_op == "truncate":
            raw = raw[:max(pos, 2)]
        elif gz_op == "flip":
            raw = raw[:pos] + bytes([raw[pos] ^ 0xFF]) + raw[pos + 1:]
        elif gz_op == "trailing":
            raw = raw + b"garbage"
    with one_file("dev.jsonl.gz" if gz else "dev.jsonl", raw) as path:
        examples = named_error_or_result(lambda: load_nq_jsonl(path), path)
    if examples is not None:
        assert examples and len({ex.key for ex in examples}) == len(examples)
        for ex in examples:
            assert isinstance(ex, NQExample) and ex.question and ex.document_tokens
            n = len(ex.document_tokens)
            assert all(0 <= c.start_token < c.end_token <= n for c in ex.candidates)
            for a in ex.annotations:
                assert a.long_start == -1 or 0 <= a.long_start < a.long_end <= n
                assert all(0 <= s < e <= n for s, e in a.short_answers)


# ----------------------------------------------------------------------------- NQ predictions

@st.composite
def nq_predictions(draw):
    entries = []
    for i in range(draw(st.integers(0, 3))):
        def span(null_ok=True):
            if null_ok and draw(st.booleans()):
                return {"start_token": -1, "end_token": -1}
            s = draw(st.integers(0, 50))
            return {"start_token": s, "end_token": s + draw(st.integers(1, 5))}

        score = st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-100, 100)
        entry = {"example_id": i if draw(st.booleans()) else f"ex-{i}", "long_answer": span(),
                 "long_answer_score": draw(score), "short_answers": [span(False) for _ in range(draw(st.integers(0, 2)))],
                 "short_answers_score": draw(score), "yes_no_answer": draw(st.sampled_from(["NONE", "YES", "no"]))}
        entries.append(entry)
    return {"predictions": entries} if draw(st.booleans()) else entries


@FUZZ
@given(nq_predictions(), st.data())
def test_nq_predictions(preds, data):
    valid = not data.draw(st.booleans(), label="mutate")
    obj = preds if valid else mutate(data, preds)
    source = "fuzz-preds.json"
    try:
        parsed = parse_predictions(obj, source)
    except DatasetFormatError as e:
        assert not valid, e
        assert e.path == source and e.record and e.field
        return
    for key, p in parsed.items():
        assert isinstance(p, NQPrediction) and key == str(p.example_id)
        assert math.isfinite(p.long_score) and math.isfinite(p.short_score)
        assert p.long_span is None or 0 <= p.long_span[0] < p.long_span[1]
        assert all(0 <= s < e for s, e in p.short_spans)
    if valid:
        entries = preds["predictions"] if isinstance(preds, dict) else preds
        assert len(parsed) == len(entries)


# ----------------------------------------------------------------------------- suite YAML

def _suite_raw() -> dict:
    return {
        "name": "fuzz",
        "description": "fuzzed",
        "data": {"source": "synthetic", "data_dir": "data", "max_seq_len": 96, "doc_stride": 48, "max_query_len": 32,
                 "synthetic": {"seed": 3, "n_train_contexts": 12, "n_dev_contexts": 6, "questions_per_context": 3,
                               "min_words": 40, "max_words": 160, "mean_words": 70, "long_context_fraction": 0.2}},
        "task": {"name": "squad", "n_best": 20},
        "model": {"name": "tiny-qa", "base": "embedded:all-MiniLM-L6-v2", "random_init": True,
                  "config_overrides": {"hidden_size": 32, "num_hidden_layers": 2}},
        "train": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "seed": 1, "mixed_precision": "no"},
        "bench": {"backends": ["eager-fp32", "ort-fp32", "my-ort"], "reference": "eager-fp32", "batch_size": 8,
                  "batching": "padded", "warmup_batches": 1, "min_passes": 2, "min_duration_s": 0, "timeout_s": 60.0},
        "parity": {"fp32": {"min_f1_ratio": 0.999, "min_agreement": 0.99},
                   "overrides": {"ort-fp32": {"min_f1_ratio": 0.9, "min_agreement": 0.9}}},
        "variants": {"my-ort": {"base": "ort-fp32", "options": {"opt_level": 2}},
                     "my-torch": {"implementation": "torch", "device": "cpu", "options": {"weights": "bf16"}}},
    }


# Values a suite is likely to be wrong with (no ':' in strings: no arbitrary import paths).
YAML_VALUES = st.one_of(
    JUNK.filter(lambda v: ":" not in json.dumps(v, default=str)),
    st.sampled_from(["eager-fp32", "ort-fp32", "onnxruntime", "nope", "1e-4", "8e-5", "yes", "no", "squad", "nq", "squad-json",
                     "torch", "onnxruntime-int8", "sorted", "cuda", "bf16", "default", "ci", "nq-jsonl",
                     "nope.module:Cls", ".:x", "a..b:C", "os:path", [], {}]))


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    # import the task and backend modules once (seconds: torch, transformers), before any example runs
    from bertqa_bench.backends.variants import default_table
    from bertqa_bench.tasks import TASKS, get_task

    for name in TASKS:
        get_task(name)
    default_table()


def _load_suite_file(raw_bytes: bytes, name="fuzz.yaml"):
    """load_suite on a file holding raw_bytes (@SELF@ becomes the file's own path): a config or a BenchError."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(raw_bytes.replace(b"@SELF@", str(path).encode()))
        try:
            return load_suite(str(path))
        except BenchError as e:  # ConfigError, UnknownBackendError: reported without a traceback
            assert str(e)
            return None
        finally:
            assert sorted(os.listdir(d)) == [name], "load_suite wrote files beside the suite"


@VALID
@given(st.lists(st.sampled_from(["eager-fp32", "ort-fp32", "ort-int8", "torch-compile-fp32", "my-ort",
                                 "my-torch", "eager-bf16", "openvino-int8-sorted"]), min_size=1, max_size=4, unique=True),
       st.sampled_from(BATCHINGS), st.integers(1, 256), st.sampled_from(["squad", "nq"]))
def test_valid_suites_load(backends, batching, batch_size, task):
    raw = _suite_raw()
    raw["bench"].update(backends=backends, batching=batching, batch_size=batch_size, reference=backends[-1])
    if task == "nq":
        raw["task"] = "nq"
        raw["data"]["source"] = "nq-synthetic"
    cfg = _load_suite_file(yaml.safe_dump(raw).encode())
    assert isinstance(cfg, SuiteConfig), "a valid suite failed to load"
    assert_sound(cfg)
    assert cfg.bench.backends[0] == backends[-1] and sorted(cfg.bench.backends) == sorted(backends)
    assert cfg.task.name == task and cfg.bench.batching == batching


EXTENDS = st.sampled_from(["default", "ci", "nope", "", ["default", "nq"], ["gpu-backends"], 5, None, True,
                           [None], [["default"]], {"a": 1}, "x" * 300, "fuzz", "@SELF@", ["default", "@SELF@"]])


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def assert_sound(cfg) -> None:
    """What a loaded suite promises everything downstream, restated here rather than taken from the
    validators: a config that loads with any of this broken would crash (or mislead) a run later."""
    from bertqa_bench.backends.variants import VariantTable
    from bertqa_bench.tasks import TASKS

    assert isinstance(cfg, SuiteConfig)
    b, d, t = cfg.bench, cfg.data, cfg.train
    assert b.backends and all(isinstance(n, str) for n in b.backends)
    assert b.backends[0] == b.reference and b.reference not in b.backends[1:]  # the reference runs first, once
    assert len(VariantTable.for_suite(cfg.variants, cfg.bench.device).require(b.backends)) == len(b.backends)  # every name resolves
    assert b.batching in BATCHINGS and b.batch_size >= 1 and b.warmup_batches >= 1 and b.min_passes >= 1
    assert _finite_number(b.timeout_s) and b.timeout_s > 0 and b.seq_multiple >= 1
    assert _finite_number(b.min_duration_s) and b.min_duration_s >= 0
    for v in cfg.variants.values():
        assert v.timeout_s is None or (_finite_number(v.timeout_s) and v.timeout_s > 0)
    assert d.max_seq_len >= 32 and 0 < d.doc_stride < d.max_seq_len and 0 < d.max_query_len < d.max_seq_len
    assert _finite_number(t.learning_rate) and t.learning_rate > 0 and t.epochs > 0 and t.batch_size > 0
    for tol in [cfg.parity.fp32, cfg.parity.reduced, *cfg.parity.overrides.values()]:
        assert 0.0 <= tol.min_f1_ratio <= 1.0 and 0.0 <= tol.min_agreement <= 1.0
    # counts a run slices or plans by: null or at least one (0 or negative would drop work silently)
    for v in (d.max_eval_examples, d.max_train_examples, d.target_eval_features, b.tokens_per_batch,
              b.max_batch_rows, b.num_threads, t.num_threads):
        assert v is None or v >= 1
    assert t.grad_accum >= 1 and 0 <= t.warmup_ratio <= 1
    assert cfg.parity.expected_tolerance >= 0
    assert cfg.parity.expected_tolerance_questions is None or cfg.parity.expected_tolerance_questions >= 0
    assert cfg.task.name in TASKS


@FUZZ
@given(st.data())
def test_malformed_suites_raise_config_errors(data):
    raw = mutate(data, _suite_raw(), max_mutations=4, values=YAML_VALUES)
    if data.draw(st.integers(0, 3), label="extends") == 0 and isinstance(raw, dict):
        raw["extends"] = data.draw(EXTENDS, label="extends value")
    try:
        text = yaml.safe_dump(raw, allow_unicode=data.draw(st.booleans()))
    except yaml.YAMLError:
        return
    cfg = _load_suite_file(text.encode("utf-8", "surrogatepass"))  # a config or a BenchError, nothing else
    if cfg is not None:
        assert_sound(cfg)


YAML_TEXTS = st.one_of(
    st.text(max_size=60),
    st.sampled_from([
        "", "---\n", "- 1\n- 2\n", "just a string", "a: 1\n---\nb: 2\n", "\tdata: {}\n", "data: {source: [}\n",
        "[" * 5000, "{a: " * 3000, "x: " + "9" * 5000, "bench:\n  batch_size: " + "9" * 5000,
        "data: !!python/object/apply:os.system ['true']\n", "a: &a [*a]\n", "data: &a {synthetic: *a}\n",
        "bench: &b {backends: [*b]}\n", "? [1, 2]\n: x\n", "1: 2\nnull: 3\n", "data: 2024-01-01\n",
        "bench: {backends: [eager-fp32], timeout_s: .nan}\n", "parity: {fp32: {min_f1_ratio: .inf, min_agreement: 1}}\n",
        "model: {config_overrides: &c {x: *c}}\n", "extends: [default, default]\n", "variants:\n",
        "variants: {1: {base: eager-fp32}}\nbench: {backends: [nope]}\n",
    ]),
)


@FUZZ
@given(YAML_TEXTS, st.data())
def test_malformed_suite_text_raises_config_errors(text, data):
    raw = corrupt(data, text.encode("utf-8", "surrogatepass"),
                  ops=("none", "none", "truncate", "bad_utf8", "byte", "bom", "nul", "bigint"))
    cfg = _load_suite_file(raw)
    if cfg is not None:
        assert_sound(cfg)


# ----------------------------------------------------------------------------- what fuzzing found
# Each of these crashed with something other than the named error before it was fixed; kept as
# plain examples so they are checked on every run, whatever hypothesis happens to draw.

_DEEP_JSON = b"[" * 100_000
_BIG_INT_JSON = b'{"version": "1.1", "data": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("raw", [_DEEP_JSON, _BIG_INT_JSON, b'{"a": ' * 50_000], ids=["deep", "bigint", "deep-obj"])
@pytest.mark.parametrize("reader", ["squad", "score", "predictions", "nq", "nq-gz"])
def test_found_json_that_json_loads_rejects_without_json_decode_error(raw, reader):
    # json.loads raises RecursionError (deep nesting) and ValueError (integers over 4300 digits)
    name = {"nq": "dev.jsonl", "nq-gz": "dev.jsonl.gz"}.get(reader, "dev.json")
    content = gzip.compress(raw) if reader == "nq-gz" else raw
    with one_file(name, content) as path:
        fn = {"squad": lambda: load_squad_json(path), "predictions": lambda: load_predictions(path),
              "score": lambda: score_files(path, path, warn=lambda _: None),
              "nq": lambda: load_nq_jsonl(path), "nq-gz": lambda: load_nq_jsonl(path)}[reader]
        with pytest.raises(DatasetFormatError) as err:
            fn()
    assert err.value.path == str(path) and err.value.field


def test_found_empty_prediction_id_gave_a_blank_field(tmp_path):
    path = tmp_path / "preds.json"
    path.write_text('{"": null}')
    with pytest.raises(DatasetFormatError) as err:
        load_predictions(path)
    assert err.value.field == "''" and err.value.record == "predictions['']"


@pytest.mark.parametrize("score", [10 ** 400, float("inf"), float("-inf"), float("nan")])
def test_found_nq_prediction_scores_must_be_finite(score):
    # 10**400 raised OverflowError in float(); Infinity was accepted and came out as a threshold
    entry = {"example_id": 1, "long_answer": {"start_token": 0, "end_token": 2}, "long_answer_score": score}
    with pytest.raises(DatasetFormatError, match="finite") as err:
        parse_predictions([entry], "p.json")
    assert err.value.field == "long_answer_score"


@pytest.mark.parametrize("text", [
    "extends: 5\n", "extends: true\n", "extends: [5]\n", "extends: [null]\n", "extends: {a: 1}\n",
    "extends: " + "x" * 300 + "\n",                     # OSError: file name too long
    "data:\n", "bench: null\n", "task: [1]\n", "data: [1]\n", "variants: [1]\n", "variants: abc\n",
    "parity: {overrides: {x: 5}}\n",
    "parity: {overrides: {x: {min_f1_ratio: abc, min_agreement: 1}}}\n",
    "1: 2\nfoo: 3\n", "null: 1\nfoo: 2\n",              # TypeError sorting int/None with str keys
    "bench: {backends: [[1]]}\n", "bench: {backends: 5}\n", "bench: {backends: [{a: 1}]}\n",
    "data: {synthetic: 5}\n", "parity: {fp32: 5}\n", "model: {config_overrides: 5}\n",  # crashed later
    "variants: {x: {implementation: '.:x'}}\nbench: {backends: [x]}\n",          # importlib TypeError
    "variants: {x: {implementation: 'a..b:C'}}\nbench: {backends: [x]}\n",
    "variants: {1: {base: eager-fp32}}\nbench: {backends: [nope]}\n",             # sorted() of int and str names
    "[" * 5000 + "\n", "x: " + "9" * 5000 + "\n",        # RecursionError, ValueError from PyYAML
    "data: {synthetic: {long_context_fraction: " + "1" * 400 + "}}\n",  # OverflowError in float()
    "train: {learning_rate: " + "1" * 400 + "}\n",
    # loaded, with a limit that never kills a hung child (NaN passes `timeout_s <= 0`)
    "bench: {backends: [eager-fp32], timeout_s: .nan}\n", "bench: {backends: [eager-fp32], min_duration_s: .nan}\n",
    "variants: {x: {base: eager-fp32, timeout_s: .nan}}\nbench: {backends: [x]}\n",
])
def test_found_suites_that_crashed(text):
    with one_file("fuzz.yaml", text.encode()) as path:
        with pytest.raises(BenchError):
            load_suite(str(path))


@pytest.mark.parametrize("text", ["parity: {overrides: null}\n", "variants: null\n", "variants:\n"])
def test_found_null_mappings_mean_empty(text):
    # `parity.overrides: null` was an AttributeError; null now means "none", as `variants:` already did
    with one_file("fuzz.yaml", text.encode()) as path:
        cfg = load_suite(str(path))
    assert cfg.parity.overrides == {} and cfg.variants == {}


def test_suite_extending_itself_is_a_config_error():
    assert _load_suite_file(b"extends: [default, '@SELF@']\n") is None


def test_found_suite_that_is_not_utf8():
    with one_file("fuzz.yaml", b"name: caf\xe9\n") as path:
        with pytest.raises(BenchError, match="UTF-8"):
            load_suite(str(path))


def test_suite_named_yaml_that_is_a_folder_is_not_a_suite(tmp_path):
    (tmp_path / "x.yaml").mkdir()
    with pytest.raises(BenchError):
        load_suite(str(tmp_path / "x.yaml"))
