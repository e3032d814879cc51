import numpy as np

from bertqa_bench.bench import overall_verdict, tile_features
from bertqa_bench.data.types import Features
from bertqa_bench.flops import bert_flops_per_sequence
from bertqa_bench.runner import make_batches


def _features(lengths, s=32):
    n = len(lengths)
    mask = np.zeros((n, s), dtype=np.int64)
    for i, l in enumerate(lengths):
        mask[i, :l] = 1
    ids = np.where(mask == 1, 7, 0).astype(np.int64)
    return Features(ids, mask, np.zeros_like(ids), np.arange(n), [[None] * s for _ in range(n)])


def test_batches_cover_every_feature_once():
    f = _features([5] * 21)
    bs = make_batches(f, 8, "max_length")
    assert [(b.rows.start, b.rows.stop) for b in bs] == [(0, 8), (8, 16), (16, 21)]
    assert all(b.seq_len == 32 for b in bs)


def test_longest_padding_trims_to_multiple_of_8():
    f = _features([3, 9, 4, 30, 2, 2])
    bs = make_batches(f, 3, "longest")
    assert [b.seq_len for b in bs] == [16, 32]
    inputs = f.inputs(bs[0].rows, trim_to=bs[0].seq_len)
    assert inputs["input_ids"].shape == (3, 16)


def test_tile_features_repeats_in_order():
    f = _features([3, 4, 5])
    t = tile_features(f, 7)
    assert len(t) == 7
    assert list(t.example_index) == [0, 1, 2, 0, 1, 2, 0]
    assert tile_features(f, 2) is f


def test_bert_base_flops_match_the_design_figure():
    # BERT-base at 384 tokens is ~70.7 GFLOP per sequence (DESIGN.md).
    assert abs(bert_flops_per_sequence(768, 12, 3072, 384) / 1e9 - 70.7) < 0.1


def test_overall_verdict():
    ok = {"backend": "eager-fp32", "status": "ok", "parity": "pass"}
    assert overall_verdict([ok, {"backend": "b", "status": "ok", "parity": "pass"}], "eager-fp32") == "PASS"
    assert overall_verdict([ok, {"backend": "b", "status": "ok", "parity": "FAIL"}], "eager-fp32") == "FAIL"
    assert overall_verdict([{"backend": "eager-fp32", "status": "failed"}], "eager-fp32") == "NO REFERENCE"
