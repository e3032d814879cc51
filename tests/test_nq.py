"""Natural Questions task: reader, metric, windowing, postprocessing, generator, model."""
from __future__ import annotations

import os
import gzip
import json

import numpy as np
import pytest
import torch

from bertqa_bench.config import DataConfig, SuiteConfig, SyntheticConfig, TaskConfig
from bertqa_bench.tasks.features import Features
from bertqa_bench.errors import DatasetFormatError
from bertqa_bench.tasks.nq.features import LONG, SHORT, UNKNOWN, YES, build_contexts, featurize_nq
from bertqa_bench.tasks.nq.metrics import best_threshold, nq_evaluate, score_nq_files
from bertqa_bench.tasks.nq.postprocess import postprocess_nq
from bertqa_bench.tasks.nq.reader import Annotation, Candidate, NQExample, load_nq_jsonl
from bertqa_bench.tasks.nq.synthetic import ensure_nq_files
from bertqa_bench.tasks.nq.task import NQOptions, NQTask

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    from bertqa_bench.model.modeling import load_tokenizer

    return load_tokenizer("embedded:all-MiniLM-L6-v2")


# ----------------------------------------------------------------------------- reader

def _record(**over):
    rec = {
        "example_id": 17,
        "question_text": "who wrote it",
        "document_text": "<P> Anna Lee wrote it . </P> <P> more text </P>",
        "long_answer_candidates": [{"start_token": 0, "end_token": 7, "top_level": True},
                                   {"start_token": 7, "end_token": 11, "top_level": True}],
        "annotations": [{"long_answer": {"start_token": 0, "end_token": 7, "candidate_index": 0},
                         "short_answers": [{"start_token": 1, "end_token": 3}], "yes_no_answer": "NONE"}],
    }
    rec.update(over)
    return rec


def _write_jsonl(path, records, gz=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_reader_reads_plain_and_gz(tmp_path):
    recs = [_record(), _record(example_id="b", annotations=[])]
    for gz in (False, True):
        p = _write_jsonl(tmp_path / f"x{gz}.jsonl", recs, gz=gz)
        exs = load_nq_jsonl(p)
        assert [e.example_id for e in exs] == [17, "b"]
        assert exs[0].document_tokens[1:3] == ("Anna", "Lee")
        assert exs[0].annotations[0].short_answers == ((1, 3),)
        assert exs[0].candidates[1] == Candidate(7, 11, True)
        assert exs[1].annotations == ()


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("bad, field", [
    ("{not json", "(json)"),
    (_record(question_text=""), "question_text"),
    (_record(example_id=True), "example_id"),
    (_record(long_answer_candidates=[{"start_token": 0, "end_token": 99, "top_level": True}]),
     "long_answer_candidates[0].end_token"),
    (_record(annotations=[{"long_answer": {"start_token": 0, "end_token": 7, "candidate_index": 0},
                           "short_answers": [{"start_token": 1, "end_token": 40}], "yes_no_answer": "NONE"}]),
     "annotations[0].short_answers[0].end_token"),
    (_record(annotations=[{"long_answer": {"start_token": 0, "end_token": 7, "candidate_index": 1},
                           "short_answers": [], "yes_no_answer": "NONE"}]), "annotations[0].long_answer"),
    (_record(annotations=[{"long_answer": {"start_token": -1, "end_token": -1, "candidate_index": -1},
                           "short_answers": [], "yes_no_answer": "MAYBE"}]), "annotations[0].yes_no_answer"),
    (_record(example_id=17), "example_id"),  # duplicate of line 1
])
def test_reader_errors_name_file_line_field(tmp_path, gz, bad, field):
    p = _write_jsonl(tmp_path / "bad.jsonl.gz", [_record(), bad], gz=gz)
    with pytest.raises(DatasetFormatError) as ei:
        load_nq_jsonl(p)
    err = ei.value
    assert err.record == "line 2" and err.field == field and err.path == str(p)
    assert "line 2" in str(err) and field in str(err)


def test_reader_truncated_gz_is_a_format_error(tmp_path):
    p = _write_jsonl(tmp_path / "t.jsonl.gz", [_record(example_id=i) for i in range(50)], gz=True)
    p.write_bytes(p.read_bytes()[:-30])
    with pytest.raises(DatasetFormatError, match="corrupt or truncated"):
        load_nq_jsonl(p)


# ----------------------------------------------------------------------------- metric

def _ann(long=None, shorts=(), yn="NONE"):
    if long is None:
        return Annotation(short_answers=tuple(shorts), yes_no_answer=yn)
    return Annotation(long[0], long[1], 0, tuple(shorts), yn)


def _ex(ex_id, anns):
    return NQExample(ex_id, "q", tuple(["w"] * 100), (Candidate(0, 100, True),), tuple(anns))


def _pred(ex_id, long=None, long_score=0.0, shorts=(), short_score=0.0, yn="NONE"):
    span = lambda s: {"start_token": s[0], "end_token": s[1], "start_byte": -1, "end_byte": -1}  # noqa: E731
    return {"example_id": ex_id, "long_answer": span(long or (-1, -1)), "long_answer_score": long_score,
            "short_answers": [span(s) for s in shorts], "short_answers_score": short_score, "yes_no_answer": yn}


def _gold_set():
    return [
        # A: 3/5 long, 2/5 short -> gold long and short
        _ex("A", [_ann((10, 20), [(12, 13)]), _ann((10, 20), [(12, 13)]), _ann((10, 20)), _ann(), _ann()]),
        # B: only 1/5 annotators found a long answer -> no gold (5-way rule)
        _ex("B", [_ann((30, 40)), _ann(), _ann(), _ann(), _ann()]),
        # C: 2/2 annotations: long + YES (a yes/no is a short answer)
        _ex("C", [_ann((5, 9), yn="YES"), _ann((5, 9), yn="YES")]),
        # D: single null annotation
        _ex("D", [_ann()]),
        # E: 2/5 long with a two-span short answer
        _ex("E", [_ann((50, 60), [(51, 52), (54, 55)]), _ann((50, 60), [(51, 52), (54, 55)]), _ann(), _ann(), _ann()]),
    ]


def test_metric_hand_checked_thresholds_and_micro():
    preds = {"predictions": [
        _pred("A", (10, 20), 3.0, [(12, 13)], 2.0),  # long ok, short ok
        _pred("B", (30, 40), 1.0),  # long matches the lone annotator: still a false positive
        _pred("C", (5, 9), 0.5, yn="YES", short_score=0.5),  # long ok, YES ok
        _pred("D", (1, 4), 2.5, [(2, 3)], 2.5),  # answers where gold has none
        _pred("E", (50, 60), -1.0, [(51, 52)], 0.2),  # long ok; short is a subset of the gold set: wrong
    ]}
    r = nq_evaluate(_gold_set(), preds)
    # long, by score: A 3.0 (1/1 ok) D 2.5 (1/2) B 1.0 (1/3) C 0.5 (2/4) E -1.0 (3/5); gold = 3 (A, C, E)
    # F1 at each: .5, .4, .333, .571, .75 -> threshold -1.0, P 3/5, R 3/3
    assert r["long_threshold"] == -1.0
    assert r["long_precision"] == pytest.approx(60.0) and r["long_recall"] == pytest.approx(100.0)
    assert r["long_f1"] == pytest.approx(75.0)
    # short, by score: D 2.5 (0/1) A 2.0 (1/2) C 0.5 (2/3) E 0.2 (2/4) B null; gold = 3 (A, C, E)
    # F1: 0, .4, .667, .571 -> threshold 0.5, P = R = 2/3
    assert r["short_threshold"] == 0.5
    assert r["short_precision"] == pytest.approx(200 / 3) and r["short_recall"] == pytest.approx(200 / 3)
    assert r["short_f1"] == pytest.approx(200 / 3)
    assert r["long_n_gold"] == 3 and r["short_n_gold"] == 3
    # Kaggle micro at those thresholds: long TP 3 (A C E) FP 2 (B D) FN 0;
    # short TP 2 (A C) FP 1 (D) FN 1 (E scored below 0.5 -> null while gold exists)
    assert (r["micro_tp"], r["micro_fp"], r["micro_fn"]) == (5, 3, 1)
    assert r["micro_precision"] == pytest.approx(100 * 5 / 8)
    assert r["micro_recall"] == pytest.approx(100 * 5 / 6)
    assert r["micro_f1"] == pytest.approx(100 * 10 / 14)


def test_metric_yes_no_span_sets_and_missing_predictions():
    gold = _gold_set()
    preds = [
        _pred("C", (5, 9), 1.0, yn="NO", short_score=1.0),  # wrong yes/no
        _pred("E", (50, 60), 1.0, [(54, 55), (51, 52)], 1.0),  # same span set, other order: correct
    ]  # A, B, D have no prediction: null
    r = nq_evaluate(gold, preds)
    # long: C ok, E ok; gold A C E -> P 1, R 2/3
    assert r["long_precision"] == pytest.approx(100.0) and r["long_recall"] == pytest.approx(200 / 3)
    # short: E ok (1.0), C wrong (1.0, tied) -> one tie group: P 1/2, R 1/3
    assert r["short_precision"] == pytest.approx(50.0) and r["short_recall"] == pytest.approx(100 / 3)
    # a YES is correct for C
    assert nq_evaluate([gold[2]], [_pred("C", (5, 9), 1.0, yn="yes", short_score=1.0)])["short_f1"] == 100.0


def test_metric_warns_about_missing_predictions(capsys):
    gold = _gold_set()
    r = nq_evaluate(gold, [_pred("A", (10, 20), 3.0, [(12, 13)], 2.0), _pred("C")])
    err = capsys.readouterr().err
    assert "warning: 3 of 5 gold examples have no prediction; counted as null" in err
    assert r["long_recall"] == pytest.approx(100 / 3)  # still scored as nulls: A of A, C, E
    nq_evaluate(gold, [_pred(k) for k in "ABCDE"])
    assert "no prediction" not in capsys.readouterr().err


def test_metric_no_correct_prediction_puts_threshold_above_all_scores():
    r = nq_evaluate([_ex("D", [_ann()])], [_pred("D", (1, 2), 4.0, [(1, 2)], 3.0)])
    assert r["long_f1"] == 0.0 and r["long_threshold"] == 5.0 and r["short_threshold"] == 4.0
    assert (r["micro_tp"], r["micro_fp"], r["micro_fn"]) == (0, 0, 0)
    assert best_threshold([]) == (0.0, 0.0, 0.0, 0.0)


def test_metric_rejects_bad_predictions(tmp_path):
    gold = _gold_set()
    with pytest.raises(DatasetFormatError, match="not in the gold set"):
        nq_evaluate(gold, [_pred("Z", (1, 2), 1.0)])
    bad = _pred("A", (1, 2), 1.0)
    bad["long_answer"]["end_token"] = 1
    with pytest.raises(DatasetFormatError) as ei:
        nq_evaluate(gold, {"predictions": [_pred("C"), bad]})
    assert ei.value.record == "predictions[1]" and ei.value.field == "long_answer"
    no_score = _pred("A", (1, 2))
    del no_score["long_answer_score"]
    with pytest.raises(DatasetFormatError, match="long_answer_score"):
        nq_evaluate(gold, [no_score])


def test_score_nq_files(tmp_path):
    gold = _write_jsonl(tmp_path / "gold.jsonl", [_record(), _record(example_id=18, annotations=[
        {"long_answer": {"start_token": -1, "end_token": -1, "candidate_index": -1},
         "short_answers": [], "yes_no_answer": "NONE"}])])
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps({"predictions": [_pred(17, (0, 7), 1.0, [(1, 3)], 1.0), _pred(18)]}))
    # One annotation per example: the official evaluator (2 non-null annotations for a gold
    # answer, --long/short_non_null_threshold) finds no gold at all, so F1 is 0 ...
    r = score_nq_files(gold, preds)
    assert r["long_f1"] == 0.0 and r["long_n_gold"] == 0 and r["short_f1"] == 0.0
    # ... and with the thresholds at 1 (as for a one-annotation training file) it is 100.
    r = score_nq_files(gold, preds, long_non_null_threshold=1, short_non_null_threshold=1)
    assert r["long_f1"] == 100.0 and r["short_f1"] == 100.0 and r["micro_f1"] == 100.0
    preds.write_text('{"predictions": [')
    with pytest.raises(DatasetFormatError, match="not valid JSON"):
        score_nq_files(gold, preds)
    preds.write_text(json.dumps({"predictions": [{**_pred(17), "yes_no_answer": "maybe"}]}))
    with pytest.raises(DatasetFormatError) as ei:
        score_nq_files(gold, preds)
    assert ei.value.field == "yes_no_answer" and ei.value.path == str(preds)


# ----------------------------------------------------------------------------- features

_WORDS = ["red", "blue", "green", "house", "tree", "river", "stone", "bird", "road", "lake"]


def _long_example():
    p1 = [_WORDS[i % 10] for i in range(30)]
    p2 = [_WORDS[(i + 3) % 10] for i in range(30)]
    p2[7:9] = ["paris", "london"]
    tokens = ["<P>", *p1, "</P>", "<P>", *p2, "</P>"]  # P2 words are doc tokens 33..62
    assert tokens[40:42] == ["paris", "london"]
    cands = (Candidate(0, 32, True), Candidate(32, 64, True))
    return NQExample(1, "which cities", tuple(tokens), cands, (_ann((32, 64), [(40, 42)]),))


def test_context_maps_both_ways(tok):
    ex = _long_example()
    (ctx,) = build_contexts([ex], tok)
    assert len(ctx.piece_ids) == 62  # 60 single-piece words + 2 candidate markers
    assert (ctx.piece_to_doc == -1).sum() == 2
    for d, tkn in enumerate(ex.document_tokens):
        if tkn.startswith("<"):
            assert ctx.doc_to_piece_start[d] == -1
        else:
            assert ctx.piece_to_doc[ctx.doc_to_piece_start[d]] == d == ctx.piece_to_doc[ctx.doc_to_piece_end[d]]
    assert tok.convert_ids_to_tokens(int(ctx.piece_ids[0])) == "[unused0]"  # [Paragraph=1]
    assert tok.convert_ids_to_tokens(int(ctx.piece_ids[31])) == "[unused1]"  # [Paragraph=2]
    (plain,) = build_contexts([ex], tok, markers=False)
    assert len(plain.piece_ids) == 60


def test_windowing_answer_only_in_second_window(tok):
    ex = _long_example()
    kw = dict(max_seq_len=32, doc_stride=20, max_query_len=8)
    ev = featurize_nq([ex], tok, **kw)
    # question 2 pieces -> 32 - 2 - 3 = 25 context pieces a window; 62 pieces -> starts 0, 20, 40
    assert len(ev) == 3 and ev.input_ids.dtype == np.int64 and ev.example_index.tolist() == [0, 0, 0]
    assert ev.extra["token_to_doc"].shape == (3, 32)
    d = int(ev.extra["token_to_doc"][1, 4])  # first context position (after [CLS] q q [SEP])
    assert d >= 0 and ev.offsets[1][4] == (d, d + 1) and ev.offsets[1][0] is None and len(ev.offsets) == 3
    tr = featurize_nq([ex], tok, train=True, null_window_keep=1.0, **kw)
    assert tr.extra["answer_types"].tolist() == [UNKNOWN, SHORT, UNKNOWN]
    assert tr.start_positions[[0, 2]].tolist() == [0, 0] and tr.end_positions[[0, 2]].tolist() == [0, 0]
    s, e = int(tr.start_positions[1]), int(tr.end_positions[1])
    assert tr.extra["token_to_doc"][1, s] == 40 and tr.extra["token_to_doc"][1, e] == 41
    assert tok.convert_ids_to_tokens(tr.input_ids[1, s:e + 1].tolist()) == ["paris", "london"]
    assert tr.token_type_ids[1, s] == 1 and tr.attention_mask[1, e] == 1
    assert NQTask().train_labels(tr)["answer_types"].tolist() == [UNKNOWN, SHORT, UNKNOWN]
    # downsampling: no null windows kept at 0.0
    only = featurize_nq([ex], tok, train=True, null_window_keep=0.0, **kw)
    assert len(only) == 1 and only.extra["answer_types"].tolist() == [SHORT]

    # and back: logits peaking on the answer in window 2 give the right document tokens
    S = 32
    start = np.full((3, S), -5.0, np.float32)
    end = np.full((3, S), -5.0, np.float32)
    start[1, s], end[1, e] = 5.0, 5.0
    types = np.zeros((3, 5), np.float32)
    types[:, SHORT] = 1.0
    pred = postprocess_nq([ex], ev, start, end, types)["predictions"][0]
    assert pred["short_answers"] == [{"start_token": 40, "end_token": 42, "start_byte": -1, "end_byte": -1}]
    assert (pred["long_answer"]["start_token"], pred["long_answer"]["end_token"]) == (32, 64)  # containing P


# ----------------------------------------------------------------------------- postprocess

def _pp_case():
    tokens = ("<P>", "a", "b", "c", "</P>", "<Ul>", "<Li>", "x", "y", "</Li>", "<Li>", "z", "</Li>", "</Ul>")
    cands = (Candidate(0, 5, True), Candidate(5, 14, True), Candidate(6, 10, False), Candidate(10, 13, False))
    ex = NQExample(9, "q", tokens, cands, ())
    # positions: 0 CLS, 1 question, 2 SEP, 3 marker, 4-6 = a b c, 7 marker, 8-10 = x y z, 11 SEP
    t2d = np.array([[-1, -1, -1, -1, 1, 2, 3, -1, 7, 8, 11, -1]], np.int32)
    z = np.zeros((1, 12), np.int64)
    feats = Features(z, z + 1, z, np.zeros(1, np.int64), extra={"token_to_doc": t2d})
    start = np.full((1, 12), -10.0, np.float32)
    end = np.full((1, 12), -10.0, np.float32)
    start[0, 0] = end[0, 0] = 0.0  # null score 0
    start[0, 3] = end[0, 3] = 50.0  # markers are never answers
    return ex, feats, start, end


def _types(k):
    t = np.zeros((1, 5), np.float32)
    t[0, k] = 3.0
    return t


def _pp(ex, feats, start, end, types, **kw):
    return postprocess_nq([ex], feats, start, end, types, **kw)["predictions"][0]


def test_postprocess_best_span_is_short_answer_even_when_it_is_a_whole_candidate():
    ex, feats, start, end = _pp_case()
    start[0, 8], end[0, 9] = 4.0, 4.0  # x..y = the whole first <Li>, score 8: the best span
    end[0, 8] = 3.0  # x..x, score 7
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert [(s["start_token"], s["end_token"]) for s in p["short_answers"]] == [(7, 9)]
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (5, 14)  # the <Ul>, not the <Li>
    assert p["long_answer_score"] == p["short_answers_score"] == pytest.approx(8.0)
    assert p["yes_no_answer"] == "NONE" and p["long_answer"]["start_byte"] == -1 and p["example_id"] == 9
    json.dumps(p)  # plain Python types only

    start[0, 4], end[0, 6] = 6.0, 6.0  # a..c = the whole <P>, score 12
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert [(s["start_token"], s["end_token"]) for s in p["short_answers"]] == [(1, 4)]
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (0, 5)


def test_postprocess_max_answer_len_spares_whole_candidates_but_never_as_short():
    ex, feats, start, end = _pp_case()
    start[0, 4], end[0, 9] = 6.0, 6.0  # a..y (6 pieces, no candidate), score 12
    start[0, 8], end[0, 8] = 4.0, 4.0  # "x", score 8
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert [(s["start_token"], s["end_token"]) for s in p["short_answers"]] == [(1, 9)]
    assert p["long_answer"]["start_token"] == -1  # crosses two top-level candidates: no long answer
    p = _pp(ex, feats, start, end, _types(SHORT), max_answer_len=3)  # leaves x..y (score 10)
    assert [(s["start_token"], s["end_token"]) for s in p["short_answers"]] == [(7, 9)]
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (5, 14)
    # a..c is the whole <P> (3 pieces): kept past max_answer_len=2 as a long answer, with no short one
    end[0, 6] = 7.0  # a..c, score 13
    p = _pp(ex, feats, start, end, _types(SHORT), max_answer_len=2)
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (0, 5)
    assert p["long_answer_score"] == pytest.approx(13.0) and p["short_answers"] == []


def test_postprocess_falls_back_to_top_level_candidate_of_short():
    ex, feats, start, end = _pp_case()
    start[0, 9], end[0, 9] = 4.0, 4.0  # "y" alone: inside nested <Li> inside top-level <Ul>
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert [(s["start_token"], s["end_token"]) for s in p["short_answers"]] == [(8, 9)]
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (5, 14)  # the <Ul>, not the <Li>
    assert p["long_answer_score"] == p["short_answers_score"] == pytest.approx(8.0)


def test_postprocess_answer_type_head_decides_yes_no_and_long_only():
    ex, feats, start, end = _pp_case()
    start[0, 4], end[0, 6] = 6.0, 6.0  # whole <P>, score 12
    start[0, 5], end[0, 5] = 5.0, 5.0  # "b", score 10
    p = _pp(ex, feats, start, end, _types(YES))
    assert p["yes_no_answer"] == "YES" and p["short_answers"] == []
    assert p["short_answers_score"] == pytest.approx(12.0)
    assert (p["long_answer"]["start_token"], p["long_answer"]["end_token"]) == (0, 5)
    p = _pp(ex, feats, start, end, _types(LONG))
    assert p["yes_no_answer"] == "NONE" and p["short_answers"] == []
    assert p["long_answer"]["start_token"] == 0


def _nested_case(tokens, cands):
    """One window over ``tokens`` laid out as features do it: [CLS] q [SEP], then per top-level
    candidate a marker and its non-HTML tokens, then [SEP]; logits at -10, null score 0."""
    ex = NQExample("n", "q", tuple(tokens), tuple(Candidate(*c) for c in cands), ())
    row = [-1, -1, -1]
    for c in ex.candidates:
        if c.top_level:
            row += [-1] + [d for d in range(c.start_token, c.end_token) if not tokens[d].startswith("<")]
    row.append(-1)
    t2d = np.array([row], np.int32)
    z = np.zeros_like(t2d, dtype=np.int64)
    feats = Features(z, z + 1, z, np.zeros(1, np.int64), extra={"token_to_doc": t2d})
    start = np.full(t2d.shape, -10.0, np.float32)
    end = np.full(t2d.shape, -10.0, np.float32)
    start[0, 0] = end[0, 0] = 0.0
    pos = {d: i for i, d in enumerate(row) if d >= 0}  # document token -> sequence position
    return ex, feats, start, end, pos


def _spans(p):
    return ((p["long_answer"]["start_token"], p["long_answer"]["end_token"]),
            [(s["start_token"], s["end_token"]) for s in p["short_answers"]], p["yes_no_answer"])


#         0      1      2        3       4      5         6     7      8       9
_LIST = ["<Ul>", "<Li>", "Paris", "</Li>", "<Li>", "London", "is", "big", "</Li>", "</Ul>"]
_LIST_CANDS = [(0, 10, True), (1, 4, False), (4, 9, False)]


def test_postprocess_list_item_answer_is_short_with_top_level_list_as_long():
    ex, feats, start, end, pos = _nested_case(_LIST, _LIST_CANDS)
    start[0, pos[2]], end[0, pos[2]] = 9.0, 9.0  # "Paris", by far the best span (18)
    end[0, pos[5]] = 2.0  # "Paris </Li> <Li> London" (11): the old rule's cross-item short answer
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert _spans(p) == ((0, 10), [(2, 3)], "NONE")
    assert p["long_answer_score"] == p["short_answers_score"] == pytest.approx(18.0)


def test_postprocess_table_cell_answer_has_top_level_table_as_long():
    #         0          1       2       3       4        5       6      7       8       9       10
    tokens = ["<Table>", "<Tr>", "<Td>", "Paris", "</Td>", "</Tr>", "<Tr>", "<Td>", "Rome", "</Td>",
              "<Td>", "big", "</Td>", "</Tr>", "</Table>", "<P>", "it", "rains", "</P>"]
    #         11     12       13      14          15     16    17       18
    cands = [(0, 15, True), (1, 6, False), (6, 14, False), (15, 19, True)]
    ex, feats, start, end, pos = _nested_case(tokens, cands)
    start[0, pos[3]], end[0, pos[3]] = 8.0, 8.0  # "Paris": the cell, which is the whole first <Tr>
    end[0, pos[8]] = 3.0  # "Paris ... Rome", a cross-row span
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert _spans(p) == ((0, 15), [(3, 4)], "NONE")
    # a cell in a two-cell row, too
    start[0, pos[8]], end[0, pos[8]] = 9.0, 9.0
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert _spans(p) == ((0, 15), [(8, 9)], "NONE")


@pytest.mark.parametrize("a_type, yes_no", [(LONG, "NONE"), (YES, "YES")])
def test_postprocess_long_and_yes_no_answers_name_the_top_level_candidate(a_type, yes_no):
    ex, feats, start, end, pos = _nested_case(_LIST, _LIST_CANDS)
    start[0, pos[5]], end[0, pos[7]] = 6.0, 6.0  # the whole second <Li> "London is big" (12)
    end[0, pos[5]] = 5.0  # "London" (11)
    p = _pp(ex, feats, start, end, _types(a_type))
    assert _spans(p) == ((0, 10), [], yes_no)
    assert p["long_answer_score"] == pytest.approx(12.0)


def test_postprocess_empty_context_gives_null_prediction():
    ex, feats, start, end = _pp_case()
    feats.extra["token_to_doc"][:] = -1
    p = _pp(ex, feats, start, end, _types(SHORT))
    assert p["long_answer"]["start_token"] == -1 and p["short_answers"] == []


# ----------------------------------------------------------------------------- generator + task

_TINY = dict(seed=3, n_train_contexts=3, n_dev_contexts=4, questions_per_context=5, min_words=40, mean_words=70,
             max_words=120, long_context_fraction=0.0)


def test_generator_is_deterministic_and_realistic(tmp_path):
    cfg = SyntheticConfig(**_TINY)
    tr1, dev1 = ensure_nq_files(tmp_path / "a", cfg)
    tr2, dev2 = ensure_nq_files(tmp_path / "b", cfg)
    assert tr1.read_bytes() == tr2.read_bytes() and dev1.read_bytes() == dev2.read_bytes()
    assert tr1.parent.name == tr2.parent.name and tr1.parent.name.startswith("nq-synthetic-")
    assert tr1.read_bytes()[:2] == b"\x1f\x8b"
    assert ensure_nq_files(tmp_path / "a", SyntheticConfig(**{**_TINY, "seed": 4}))[0].parent != tr1.parent
    train, dev = load_nq_jsonl(tr1), load_nq_jsonl(dev1)
    assert len(train) == 15 and len(dev) == 20
    assert all(len(e.annotations) == 1 for e in train) and all(len(e.annotations) == 5 for e in dev)
    assert any(not c.top_level for c in train[0].candidates)
    anns = [a for e in train + dev for a in e.annotations]
    assert any(a.short_answers for a in anns) and any(a.yes_no_answer != "NONE" for a in anns)
    assert any(a.has_long and not a.has_short for a in anns) and any(not a.has_long for a in anns)
    # disagreement: some dev example whose annotators are not unanimous
    assert any(len(set(e.annotations)) > 1 for e in dev)


def test_task_end_to_end_with_fake_outputs(tmp_path, tok):
    from bertqa_bench.tasks import get_task

    cfg = SuiteConfig(data=DataConfig(source="nq-synthetic", data_dir=str(tmp_path), max_seq_len=128,
                                      doc_stride=64, max_eval_examples=6, synthetic=SyntheticConfig(**_TINY)),
                      task=TaskConfig("nq", NQOptions()))
    task = get_task("nq")
    assert isinstance(task, NQTask) and task.primary_metric == "micro_f1"
    dev = task.load_examples(cfg.data, "dev")
    assert len(dev) == 6
    feats = task.featurize(dev, tok, cfg.evalset_spec())
    rng = np.random.default_rng(0)
    outs = {"start_logits": rng.normal(size=feats.input_ids.shape).astype(np.float32),
            "end_logits": rng.normal(size=feats.input_ids.shape).astype(np.float32),
            "answer_type_logits": rng.normal(size=(len(feats), 5)).astype(np.float32)}
    preds = task.postprocess(dev, feats, outs, cfg.task.options)
    assert len(preds["predictions"]) == 6
    json.loads(json.dumps(preds))
    scores = task.score(dev, preds, cfg.task.options)
    assert set(task.metric_names) <= set(scores)
    assert task.agreement(preds, preds) == (6, 6)
    other = json.loads(json.dumps(preds))
    other["predictions"][0]["yes_no_answer"] = "NO" if preds["predictions"][0]["yes_no_answer"] != "NO" else "YES"
    assert task.agreement(other, preds) == (5, 6)
    tr = task.featurize(task.load_examples(cfg.data, "train"), tok, cfg.evalset_spec(), train=True)
    labels = task.train_labels(tr)
    assert set(labels) == {"start_positions", "end_positions", "answer_types"}
    assert all(len(v) == len(tr) for v in labels.values())


def test_suite_yaml_loads():
    from bertqa_bench.suite import load_suite

    s = load_suite("nq")
    assert s.task.name == "nq" and s.data.source == "nq-synthetic" and s.task.options.top_k == 5
    assert s.bench.backends == ["eager-fp32", "torch-compile-fp32", "ort-fp32"]


# ----------------------------------------------------------------------------- model

def test_model_outputs_and_loss(tmp_path):
    from transformers import BertConfig

    from bertqa_bench.model.modeling import load_inference_module
    from bertqa_bench.tasks.nq.model import NQ_OUTPUTS, BertJointForNaturalQuestions

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    model = BertJointForNaturalQuestions(cfg).eval()
    ids = torch.randint(0, 64, (3, 16))
    ones, zeros = torch.ones_like(ids), torch.zeros_like(ids)
    out = model(input_ids=ids, attention_mask=ones, token_type_ids=zeros, return_dict=True)
    assert out.loss is None
    assert [tuple(out[n].shape) for n in NQ_OUTPUTS] == [(3, 16), (3, 16), (3, 5)]
    model.train()
    out = model(input_ids=ids, attention_mask=ones, token_type_ids=zeros, start_positions=torch.tensor([0, 2, 5]),
                end_positions=torch.tensor([0, 3, 5]), answer_types=torch.tensor([UNKNOWN, SHORT, LONG]))
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.answer_type_outputs.weight.grad is not None
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertJointForNaturalQuestions"]
    module = load_inference_module(tmp_path, "nq")  # the task names its head: no guessing from the architecture
    assert module.names == NQ_OUTPUTS


# ----------------------------------------------------------------------------- metric vs a restated reference

def _predictions_from_annotations(records, seed):
    """Predictions copied from one random annotator per example (null for about a third), with random
    scores: right on some examples, wrong or null on others, so thresholds and gold rules matter."""
    rng = np.random.default_rng(seed)
    preds = []
    for rec in records:
        ann = rec["annotations"][int(rng.integers(len(rec["annotations"])))]
        null = {"start_token": -1, "end_token": -1}
        keep = rng.random() > 0.33
        preds.append({"example_id": rec["example_id"],
                      "long_answer": ann["long_answer"] if keep else null,
                      "long_answer_score": float(rng.normal()),
                      "short_answers": ann["short_answers"] if keep else [],
                      "short_answers_score": float(rng.normal()),
                      "yes_no_answer": ann["yes_no_answer"] if keep else "NONE"})
    return preds


def test_task_options_reach_the_metric_and_match_the_restated_official_rules(tmp_path):
    """NQTask.score with the suite's task options against tests/official_nq.py (which reads the raw
    files itself): each non-null threshold gives the reference's numbers, and changing it changes
    them — a task that ignored its options would score every threshold alike."""
    import official_nq

    from bertqa_bench.tasks import get_task

    task = get_task("nq")
    base = DataConfig(source="nq-synthetic", data_dir=str(tmp_path), max_seq_len=128, doc_stride=64,
                      synthetic=SyntheticConfig(**{**_TINY, "n_dev_contexts": 8}))
    dev = task.load_examples(base, "dev")
    records = official_nq.read_jsonl(task.data_files(base, "dev")[0])
    assert [str(r["example_id"]) for r in records] == [ex.key for ex in dev]
    preds = {"predictions": _predictions_from_annotations(records, seed=5)}
    seen = {}
    for long_t, short_t in [(1, 1), (2, 2), (3, 3), (1, 3), (3, 1)]:
        options = NQOptions(long_non_null_threshold=long_t, short_non_null_threshold=short_t)
        got = task.score(dev, preds, options)
        want = official_nq.nq_scores(records, preds["predictions"], long_non_null_threshold=long_t,
                                     short_non_null_threshold=short_t)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, abs=1e-9), (long_t, short_t, k)
        seen[(long_t, short_t)] = (got["long_f1"], got["short_f1"])
    # the generated dev set's annotators disagree, so the thresholds move both scores
    assert len({v[0] for v in seen.values()}) >= 2 and len({v[1] for v in seen.values()}) >= 2
    assert seen[(1, 3)][0] == seen[(1, 1)][0] and seen[(1, 3)][1] == seen[(3, 3)][1]  # each option its own score


@pytest.mark.parametrize("seed", range(4))
def test_metric_matches_the_restated_official_rules_on_the_hand_made_set(seed):
    import official_nq

    gold = _gold_set()
    records = [{"example_id": ex.example_id, "annotations": [
        {"long_answer": {"start_token": a.long_start, "end_token": a.long_end},
         "short_answers": [{"start_token": s, "end_token": e} for s, e in a.short_answers],
         "yes_no_answer": a.yes_no_answer} for a in ex.annotations]} for ex in gold]
    preds = _predictions_from_annotations(records, seed)
    for t in (1, 2):
        got = nq_evaluate(gold, preds, long_non_null_threshold=t, short_non_null_threshold=t)
        want = official_nq.nq_scores(records, preds, long_non_null_threshold=t, short_non_null_threshold=t)
        assert {k: got[k] for k in want} == pytest.approx(want)


def test_the_generated_set_is_the_same_in_every_process():
    """The generator draws from one seeded RNG in a fixed order: nothing may depend on the order a
    set of strings iterates in, which changes with each process's hash seed."""
    import subprocess
    import sys

    code = ("import hashlib, json; from bertqa_bench.tasks.nq.synthetic import generate_split; "
            "from bertqa_bench.config import SyntheticConfig; "
            "cfg = SyntheticConfig(seed=1, n_train_contexts=4, n_dev_contexts=12, questions_per_context=4, "
            "min_words=40, max_words=160, mean_words=80, long_context_fraction=0.2); "
            "print(hashlib.sha256(json.dumps(generate_split(cfg, 'dev'), sort_keys=True).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(digests) == 1, digests
