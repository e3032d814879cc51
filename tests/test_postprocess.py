import numpy as np
import pytest

from bertqa_bench.tasks.squad.postprocess import best_spans, nbest_for_example, postprocess_qa
from bertqa_bench.tasks.features import Features
from bertqa_bench.tasks.squad.types import Answer, QAExample

CONTEXT = "alpha beta gamma delta epsilon"
#          0     6    11    17    23
NEG = -10.0


def _features(offsets_rows, example_index):
    n, s = len(offsets_rows), len(offsets_rows[0])
    z = np.zeros((n, s), dtype=np.int64)
    return Features(input_ids=z, attention_mask=z, token_type_ids=z,
                    example_index=np.asarray(example_index, dtype=np.int64), offsets=offsets_rows)


# Two overlapping windows over CONTEXT: [CLS] q [SEP] ctx ctx ctx [SEP]
W0 = [None, None, None, (0, 5), (6, 10), (11, 16), None]
W1 = [None, None, None, (11, 16), (17, 22), (23, 30), None]
EXAMPLE = QAExample("q1", "Which letters?", CONTEXT, (Answer("delta", 17),))


def _logits(n=2, s=7):
    return np.full((n, s), NEG), np.full((n, s), NEG)


def test_best_span_across_windows():
    feats = _features([W0, W1], [0, 0])
    start, end = _logits()
    start[0, 3], end[0, 4] = 2.0, 2.0  # "alpha beta" scores 4 in window 0
    start[1, 4], end[1, 5] = 3.0, 2.5  # "delta epsilon" scores 5.5 in window 1
    assert postprocess_qa([EXAMPLE], feats, start, end) == {"q1": "delta epsilon"}
    start[0, 3] = 4.0  # now window 0 wins
    assert postprocess_qa([EXAMPLE], feats, start, end) == {"q1": "alpha beta"}


def test_invalid_spans_are_skipped():
    feats = _features([W0], [0])
    start, end = _logits(1)
    start[0, 1], end[0, 1] = 9.0, 9.0  # question token: no offsets
    start[0, 0], end[0, 6] = 8.0, 8.0  # [CLS] / [SEP]
    start[0, 5], end[0, 3] = 7.0, 7.0  # end before start
    start[0, 4], end[0, 4] = 1.0, 1.0  # the only valid pair left: "beta"
    assert postprocess_qa([EXAMPLE], feats, start, end, n_best=7) == {"q1": "beta"}


def test_max_answer_len_in_tokens():
    feats = _features([W0], [0])
    start, end = _logits(1)
    start[0, 3], end[0, 5] = 5.0, 5.0  # "alpha beta gamma": 3 tokens
    end[0, 4] = 1.0  # "alpha beta": 2 tokens, lower score
    assert postprocess_qa([EXAMPLE], feats, start, end, max_answer_len=3)["q1"] == "alpha beta gamma"
    assert postprocess_qa([EXAMPLE], feats, start, end, max_answer_len=2)["q1"] == "alpha beta"
    assert postprocess_qa([EXAMPLE], feats, start, end, max_answer_len=1)["q1"] == "alpha"


def test_n_best_limits_candidates_before_filtering():
    feats = _features([W0], [0])
    start, end = _logits(1)
    start[0, :3] = [6.0, 5.0, 4.0]  # top-3 starts are all non-context tokens
    start[0, 4] = 3.0
    end[0, 4] = 3.0
    end[0, :3] = [6.0, 5.0, 4.0]
    assert postprocess_qa([EXAMPLE], feats, start, end, n_best=3) == {"q1": ""}
    assert postprocess_qa([EXAMPLE], feats, start, end, n_best=4) == {"q1": "beta"}


def test_examples_without_windows_or_valid_spans_get_empty_string():
    feats = _features([W0, W1], [0, 0])
    other = QAExample("q2", "?", CONTEXT, (Answer("alpha", 0),))
    start, end = _logits()
    start[0, 3], end[0, 3] = 1.0, 1.0
    assert postprocess_qa([EXAMPLE, other], feats, start, end) == {"q1": "alpha", "q2": ""}
    start[:], end[:] = NEG, NEG
    end[:, 3] = 5.0
    start[:, 5] = 5.0  # every high pair has end < start, the rest of the pairs are ranked too low
    assert postprocess_qa([EXAMPLE], feats, start, end, n_best=1) == {"q1": ""}


def test_nan_window_does_not_hide_a_real_answer():
    feats = _features([W0, W1], [0, 0])
    start, end = _logits()
    start[0, :] = np.nan
    start[1, 4], end[1, 4] = 1.0, 1.0
    assert postprocess_qa([EXAMPLE], feats, start, end) == {"q1": "delta"}


def test_ties_go_to_the_earlier_window():
    feats = _features([W0, W1], [0, 0])
    start, end = _logits()
    start[0, 5], end[0, 5] = 1.0, 1.0  # "gamma" in window 0
    start[1, 3], end[1, 3] = 1.0, 1.0  # the same "gamma" in window 1, same score
    start[1, 5], end[1, 5] = 1.0, 1.0  # "epsilon" in window 1, same score
    assert postprocess_qa([EXAMPLE], feats, start, end)["q1"] == "gamma"


def test_shape_mismatch_is_an_error():
    feats = _features([W0, W1], [0, 0])
    with pytest.raises(ValueError):
        postprocess_qa([EXAMPLE], feats, np.zeros((1, 7)), np.zeros((1, 7)))


def test_vectorized_matches_loop_and_answer_is_context_slice():
    from bertqa_bench.tasks.squad.features import tokenize_examples
    from bertqa_bench.model.modeling import load_tokenizer

    tok = load_tokenizer("embedded:all-MiniLM-L6-v2")
    contexts = ["Marisa Okafor was born in Teluma in 1874. " * k + "She worked as a glass engraver."
                for k in range(1, 13)]
    exs = [QAExample(f"e{i}", "Where was Marisa Okafor born?", c, (Answer("Marisa", 0),))
           for i, c in enumerate(contexts)]
    feats = tokenize_examples(exs, tok, max_seq_len=48, doc_stride=12)
    rng = np.random.default_rng(0)
    start = rng.normal(size=feats.input_ids.shape).astype(np.float32)
    end = rng.normal(size=feats.input_ids.shape).astype(np.float32)
    preds = postprocess_qa(exs, feats, start, end, n_best=8, max_answer_len=6)
    answered = 0
    for i, ex in enumerate(exs):
        nbest = nbest_for_example(exs, feats, start, end, i, n_best=8, max_answer_len=6)
        assert len(nbest) <= 8
        assert [c["score"] for c in nbest] == sorted((c["score"] for c in nbest), reverse=True)
        if not nbest:
            assert preds[ex.id] == ""
            continue
        answered += 1
        top = nbest[0]
        assert preds[ex.id] == top["text"] != ""
        offs = feats.offsets[top["feature"]]
        assert top["text"] == ex.context[offs[top["start"]][0]:offs[top["end"]][1]]
        assert top["text"] in ex.context
    assert answered >= len(exs) // 2
    scores, s_idx, e_idx = best_spans(feats, start, end, n_best=8, max_answer_len=6)
    ok = np.isfinite(scores)
    assert ok.any() and (e_idx[ok] >= s_idx[ok]).all() and (e_idx[ok] - s_idx[ok] < 6).all()
