import numpy as np
import pytest

from bertqa_bench.tasks.squad.features import answer_token_span, tokenize_examples, truncate_questions
from bertqa_bench.tasks.squad.types import Answer, QAExample
from bertqa_bench.model.modeling import load_tokenizer

FILLER = "The old harbour was busy with boats and traders from many distant towns. "


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:all-MiniLM-L6-v2")


def _deep_example(n_filler=40, qid="deep"):
    """An answer near the end of a context far longer than one 384-token window."""
    context = FILLER * n_filler + "Marisa Okafor was born in Teluma in 1874."
    start = context.index("Teluma")
    return QAExample(qid, "Where was Marisa Okafor born?", context, (Answer("Teluma", start),))


def _short_example(qid="short"):
    context = "The Selka River is 412 kilometres long."
    return QAExample(qid, "How long is the Selka River?", context, (Answer("412 kilometres", 19),))


def _span_text(ex, feats, i):
    offs = feats.offsets[i]
    return ex.context[offs[feats.start_positions[i]][0]:offs[feats.end_positions[i]][1]]


@pytest.mark.parametrize("max_seq_len, stride", [(384, 128), (64, 16)])
def test_answer_only_in_later_window_is_found(tok, max_seq_len, stride):
    ex = _deep_example()
    feats = tokenize_examples([ex], tok, max_seq_len=max_seq_len, doc_stride=stride, train=True)
    assert len(feats) > 1
    holding = np.flatnonzero(feats.start_positions > 0)
    assert len(holding) >= 1 and holding.min() > 0  # not in the first window
    for i in holding:
        assert _span_text(ex, feats, i) == "Teluma"
        assert feats.end_positions[i] >= feats.start_positions[i]
    # windows without the whole answer point at [CLS]
    others = np.setdiff1d(np.arange(len(feats)), holding)
    assert (feats.start_positions[others] == 0).all() and (feats.end_positions[others] == 0).all()


def test_windows_overlap_by_stride_tokens(tok):
    ex = _deep_example()
    feats = tokenize_examples([ex], tok, max_seq_len=64, doc_stride=16)

    def ctx_spans(i):
        return [o for o in feats.offsets[i] if o is not None]

    for i in range(len(feats) - 1):
        a, b = ctx_spans(i), ctx_spans(i + 1)
        assert a[-16:] == b[:16]  # HF stride = shared tokens between neighbours
    # together the windows cover the whole context
    assert ctx_spans(0)[0][0] == 0 and ctx_spans(len(feats) - 1)[-1][1] == len(ex.context)


def test_layout_dtypes_and_offsets(tok):
    exs = [_short_example("s0"), _deep_example(qid="d1"), _short_example("s2")]
    feats = tokenize_examples(exs, tok, max_seq_len=64, doc_stride=16)
    n_deep = len(tokenize_examples([exs[1]], tok, max_seq_len=64, doc_stride=16))
    assert feats.example_index.tolist() == [0] + [1] * n_deep + [2]
    for name in ("input_ids", "attention_mask", "token_type_ids", "example_index"):
        assert getattr(feats, name).dtype == np.int64
    assert feats.input_ids.shape == feats.token_type_ids.shape == (len(feats), 64)
    assert feats.start_positions is None

    row, offs = feats.input_ids[0], feats.offsets[0]
    n_q = len(tok(exs[0].question, add_special_tokens=False)["input_ids"])
    assert row[0] == tok.cls_token_id and row[n_q + 1] == tok.sep_token_id
    assert all(o is None for o in offs[:n_q + 2])  # [CLS], question, [SEP]
    assert (feats.token_type_ids[0, :n_q + 2] == 0).all() and feats.token_type_ids[0, n_q + 2] == 1
    real = int(feats.attention_mask[0].sum())
    assert all(o is None for o in offs[real - 1:])  # final [SEP] and padding
    assert (feats.input_ids[0, real:] == tok.pad_token_id).all()
    ctx = [o for o in offs if o is not None]
    assert ctx[0][0] == 0 and ctx[-1][1] == len(exs[0].context)
    assert all(a[1] <= b[0] for a, b in zip(ctx, ctx[1:]))  # in order, non-overlapping
    assert [exs[0].context[s:e] for s, e in ctx[:4]] == ["The", "Se", "lka", "River"]  # wordpieces


def test_train_positions_single_window(tok):
    ex = _short_example()
    feats = tokenize_examples([ex], tok, train=True)
    assert len(feats) == 1 and _span_text(ex, feats, 0) == "412 kilometres"


def test_question_truncated_to_max_query_len(tok):
    q = "Which " + "very " * 100 + "long question is this?"
    ex = QAExample("q", q, "Short context here.", (Answer("Short", 0),))
    feats = tokenize_examples([ex], tok, max_seq_len=128, doc_stride=32, max_query_len=20)
    first_ctx = next(t for t, o in enumerate(feats.offsets[0]) if o is not None)
    assert first_ctx == 20 + 2  # [CLS] + 20 question tokens + [SEP]
    assert truncate_questions(["a b c d"], tok, 2) == ["a b"]


def test_tiny_window_caps_question_to_leave_room_for_stride(tok):
    ex = QAExample("q", "word " * 80 + "?", FILLER * 3, (Answer("The", 0),))
    feats = tokenize_examples([ex], tok, max_seq_len=64, doc_stride=16, max_query_len=64)
    n_ctx = [sum(o is not None for o in offs) for offs in feats.offsets]
    assert min(n_ctx[:-1]) > 16  # every window advances through the context


def test_answer_token_span_rules():
    offsets = [None, None, (0, 3), (4, 9), (10, 15), None]
    assert answer_token_span(offsets, 4, 9) == (3, 3)
    assert answer_token_span(offsets, 4, 15) == (3, 4)
    assert answer_token_span(offsets, 12, 15) == (4, 4)  # answer starting mid-token
    assert answer_token_span(offsets, 10, 20) == (0, 0)  # runs past the window
    assert answer_token_span([None, None], 0, 1) == (0, 0)


def test_empty_input(tok):
    feats = tokenize_examples([], tok, max_seq_len=64, doc_stride=16, train=True)
    assert len(feats) == 0 and feats.input_ids.shape == (0, 64) and feats.offsets == []
