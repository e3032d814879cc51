"""Parity with its uncertainty: the paired bootstrap, `within noise`, and the run verdict."""
import numpy as np
import pytest

from bertqa_bench.config import Tolerance
from bertqa_bench.record.parity import (Verdict, compare, paired_bootstrap, questions_to_decide_agreement, verdict,
                                 wilson_interval)
from bertqa_bench.record.results import BackendResult
from bertqa_bench.tasks.nq.task import NQTask
from bertqa_bench.tasks.squad.task import SquadTask

SQUAD = SquadTask()
FP32 = Tolerance(0.999, 0.99)
REDUCED = Tolerance(0.99, 0.97)


def _questions(n=200, seed=0):
    """Per-question (EM, F1) of a reference that gets ~90% right."""
    rng = np.random.default_rng(seed)
    em = (rng.random(n) < 0.9).astype(float)
    f1 = np.where(em == 1, 1.0, rng.uniform(0.0, 0.6, n))
    return np.stack([em, f1], axis=1)


def _judge(ref_q, out_q, tolerance, agree=None):
    n = len(ref_q)
    scores = lambda q: {k: float(v) for k, v in SQUAD.metrics_from_sums(q.sum(axis=0), n).items()}  # noqa: E731
    same = int(np.sum(np.all(ref_q == out_q, axis=1))) if agree is None else agree
    logits = {"start_logits": np.zeros((n, 4), np.float32), "end_logits": np.zeros((n, 4), np.float32)}
    return compare(parity_class="x", tolerance=tolerance, primary_metric="f1", ref_scores=scores(ref_q),
                   scores=scores(out_q), agreement=(same, n), ref_outputs=logits, outputs=logits,
                   attention_mask=np.ones((n, 4), np.int64), question_scores=(ref_q, out_q),
                   metrics_from_sums=SQUAD.metrics_from_sums)


def test_identical_predictions_give_zero_width_intervals_and_a_decided_verdict():
    q = _questions(500)
    p = _judge(q, q.copy(), FP32)
    assert p.status == "pass"
    assert p.delta_ci == {"exact_match": (0.0, 0.0), "f1": (0.0, 0.0)}
    assert (p.ratio_ci_low, p.ratio_ci_high) == (1.0, 1.0)
    # 500 identical answers: the agreement's Wilson interval clears 99%, so nothing is in doubt
    assert p.agreement_ci_low > 0.99 and not p.verdict_within_noise and p.questions_to_decide is None


def test_one_flipped_question_among_200_is_a_failure_within_noise_with_a_question_estimate():
    ref = _questions(200)
    out = ref.copy()
    right = int(np.flatnonzero(ref[:, 0] == 1)[0])
    out[right] = (0.0, 0.0)  # one right answer becomes wrong
    p = _judge(ref, out, FP32)
    # the point rule: F1 is ~99.4% of the reference, under 99.9%: FAIL, exactly as before
    assert p.status == "FAIL" and p.primary_ratio < 0.999
    # but a resample without that question shows no drop: the interval straddles the tolerance
    assert p.ratio_ci_low < 0.999 <= p.ratio_ci_high == 1.0
    assert p.verdict_within_noise and p.questions_to_decide and p.questions_to_decide > 200
    lo, hi = p.delta_ci["f1"]
    assert lo < 0 and hi == 0.0
    # ...and the run whose only failure it is is INCONCLUSIVE, which a gate does not pass
    r = BackendResult("b", parity_class="fp32")
    r.apply_parity(p)
    ref_row = BackendResult("ref", status="ok")
    v = verdict([ref_row, r], "ref")
    assert v.status == "INCONCLUSIVE" and not v.ok and "within noise" in str(v)


def test_a_large_real_drop_is_a_decided_failure():
    ref = _questions(200)
    out = ref.copy()
    right = np.flatnonzero(ref[:, 0] == 1)[:30]
    out[right] = (0.0, 0.0)  # 30 answers lost: F1 falls ~15 points
    p = _judge(ref, out, REDUCED)
    assert p.status == "FAIL" and not p.verdict_within_noise
    assert p.ratio_ci_high < 0.99 and p.delta_ci["f1"][1] < 0
    r = BackendResult("b", parity_class="int8")
    r.apply_parity(p)
    assert verdict([BackendResult("ref"), r], "ref").status == "FAIL"


def test_bootstrap_interval_covers_the_point_and_is_seeded():
    ref = _questions(300, seed=1)
    out = _questions(300, seed=2)
    a = paired_bootstrap(ref, out, SQUAD.metrics_from_sums, "f1")
    b = paired_bootstrap(ref, out, SQUAD.metrics_from_sums, "f1")
    assert a == b  # same run, same intervals
    point = 100 * (out[:, 1].mean() - ref[:, 1].mean())
    lo, hi = a.delta_ci["f1"]
    assert lo < point < hi
    # paired: with the same questions on both sides, the interval is narrower than unpaired ones
    # would be; a reference against itself shifted by a constant has a zero-width delta interval
    c = paired_bootstrap(ref, np.clip(ref, 0, 1), SQUAD.metrics_from_sums, "f1")
    assert c.delta_ci["f1"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        paired_bootstrap(ref, out[:10], SQUAD.metrics_from_sums, "f1")


def test_a_pass_within_noise_is_labelled_but_the_run_still_passes():
    ref = _questions(200)
    p = _judge(ref, ref.copy(), FP32)  # 200/200 agree: Wilson's low end is 98.1%, under 99%
    assert p.status == "pass" and p.verdict_within_noise and "agreement" in p.decided_by
    assert p.questions_to_decide == questions_to_decide_agreement(1.0, 0.99, 200) > 200
    low, _ = wilson_interval(p.questions_to_decide, p.questions_to_decide)
    assert low >= 0.99  # that many identical answers would decide it
    r = BackendResult("b")
    r.apply_parity(p)
    assert verdict([BackendResult("ref"), r], "ref").status == "PASS"


def test_run_verdict_rules():
    ref = BackendResult("ref")
    noisy = BackendResult("noisy", parity="FAIL", parity_failures="f1 a bit low", parity_within_noise=True)
    decided = BackendResult("decided", parity="FAIL", parity_failures="f1 far too low", parity_within_noise=False)
    crashed = BackendResult("crashed", status="failed", error="SIGSEGV")
    absent = BackendResult("absent", status="not run", error="needs CUDA")
    assert verdict([ref, absent], "ref").status == "PASS"
    assert verdict([ref, noisy, absent], "ref").status == "INCONCLUSIVE"
    assert verdict([ref, noisy, decided], "ref").status == "FAIL"
    assert verdict([ref, noisy, crashed], "ref").status == "FAIL"
    assert verdict([ref, noisy], "ref", problems=["drifted from expected"]).status == "FAIL"
    assert verdict([noisy], "ref").status == "NO REFERENCE"
    assert not Verdict("INCONCLUSIVE").ok and not Verdict("FAIL").ok and Verdict("PASS").ok


def test_interval_columns_round_trip_through_results_csv():
    ref = _questions(200)
    out = ref.copy()
    out[0] = (0.0, 0.0) if ref[0, 0] else (1.0, 1.0)
    r = BackendResult("b", parity_class="fp32")
    r.apply_parity(_judge(ref, out, FP32))
    row = {k: ("" if v is None else str(v)) for k, v in r.to_row().items()}
    back = BackendResult.from_row(row, ["exact_match", "f1"])
    assert back.delta_ci["f1"] == pytest.approx(r.delta_ci["f1"])
    assert back.primary_ratio_low == pytest.approx(r.primary_ratio_low)
    assert back.parity_within_noise == r.parity_within_noise and back.questions_to_decide == r.questions_to_decide


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nq_question_scores_reproduce_its_metrics(tmp_path, seed):
    """The NQ decomposition gives back nq_evaluate's long/short/micro F1 exactly, so the bootstrap
    resamples the metric the table reports (random logits: every kind of right and wrong)."""
    from bertqa_bench.config import DataConfig, SuiteConfig, SyntheticConfig, TaskConfig
    from bertqa_bench.model.modeling import load_tokenizer
    from bertqa_bench.tasks.nq.task import NQOptions

    tiny = dict(seed=3, n_train_contexts=3, n_dev_contexts=6, questions_per_context=5, min_words=40,
                mean_words=70, max_words=120, long_context_fraction=0.0)
    cfg = SuiteConfig(data=DataConfig(source="nq-synthetic", data_dir=str(tmp_path), max_seq_len=128, doc_stride=64,
                                      synthetic=SyntheticConfig(**tiny)),
                      task=TaskConfig("nq", NQOptions(long_non_null_threshold=1, short_non_null_threshold=1)))
    task = NQTask()
    dev = task.load_examples(cfg.data, "dev")
    feats = task.featurize(dev, load_tokenizer("embedded:all-MiniLM-L6-v2"), cfg.evalset_spec())
    rng = np.random.default_rng(seed)
    outs = {"start_logits": rng.normal(size=feats.input_ids.shape).astype(np.float32),
            "end_logits": rng.normal(size=feats.input_ids.shape).astype(np.float32),
            "answer_type_logits": rng.normal(size=(len(feats), 5)).astype(np.float32)}
    options = cfg.task.options
    preds = task.postprocess(dev, feats, outs, options)
    scores = task.score(dev, preds, options)
    q = task.question_scores(dev, preds, options)
    assert q.shape == (len(dev), 8)
    back = task.metrics_from_sums(q.sum(axis=0), len(dev))
    for m in task.metric_names:
        assert float(back[m]) == pytest.approx(scores[m], abs=1e-9), m


def test_a_failure_is_within_noise_only_if_every_broken_rule_is():
    """Seven flipped answers among 200: agreement (96.5%) misses 97% within its interval, but the
    F1 drop (~4%) is decided. One decided broken rule decides the failure."""
    ref = _questions(200)
    out = ref.copy()
    out[np.flatnonzero(ref[:, 0] == 1)[:7]] = (0.0, 0.0)
    p = _judge(ref, out, REDUCED)
    assert p.status == "FAIL" and len(p.failures) == 2  # both rules broken
    assert p.agreement_ci_low < 0.97 <= p.agreement_ci_high  # agreement: within noise
    assert p.ratio_ci_high < 0.99  # the F1 ratio: decided
    assert not p.verdict_within_noise and p.questions_to_decide is None
