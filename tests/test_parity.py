import numpy as np
import pytest

from bertqa_bench.config import ParityConfig, Tolerance
from bertqa_bench.record.parity import (argmax_agreement, check_expected, compare, determinism, logit_diffs, tolerance_for,
                                 verdict, wilson_interval)
from bertqa_bench.record.results import BackendResult

rng = np.random.default_rng(0)


def _outputs(n=6, s=10):
    return {"start_logits": rng.normal(size=(n, s)).astype(np.float32),
            "end_logits": rng.normal(size=(n, s)).astype(np.float32)}


def _mask(n=6, s=10, real=7):
    m = np.zeros((n, s), dtype=np.int64)
    m[:, :real] = 1
    return m


def test_padding_is_excluded_from_logit_diffs():
    ref, mask = _outputs(), _mask()
    out = {k: v.copy() for k, v in ref.items()}
    out["start_logits"][:, 8] += 100.0  # a padding position
    mx, mean = logit_diffs(ref, out, mask)
    assert mx == 0.0 and mean == 0.0
    out["start_logits"][2, 3] += 0.5  # a real token
    mx, _ = logit_diffs(ref, out, mask)
    assert mx == pytest.approx(0.5, abs=1e-6)


def test_non_finite_logits_fail_parity():
    ref, mask = _outputs(), _mask()
    out = {k: v.copy() for k, v in ref.items()}
    out["end_logits"][0, 0] = np.nan
    p = compare(parity_class="fp32", tolerance=Tolerance(0.999, 0.99), primary_metric="f1",
                ref_scores={"exact_match": 50.0, "f1": 60.0}, scores={"exact_match": 50.0, "f1": 60.0},
                agreement=(6, 6), ref_outputs=ref, outputs=out, attention_mask=mask)
    assert not p.passed and "non-finite" in p.failures[0]


def test_argmax_agreement_ignores_padding():
    ref = np.array([[1.0, 5.0, 0.0, 9.0]], dtype=np.float32)
    out = np.array([[1.0, 5.0, 0.0, -9.0]], dtype=np.float32)
    mask = np.array([[1, 1, 1, 0]])
    assert argmax_agreement(ref, out, mask) == 1.0
    out2 = np.array([[6.0, 5.0, 0.0, 9.0]], dtype=np.float32)
    assert argmax_agreement(ref, out2, mask) == 0.0


def test_tolerances_by_class_and_override():
    cfg = ParityConfig(overrides={"onnxruntime-int8": {"min_f1_ratio": 0.95, "min_agreement": 0.9}})
    assert tolerance_for(cfg, "eager-fp16", "reduced").min_f1_ratio == 0.99
    assert tolerance_for(cfg, "onnxruntime", "fp32").min_agreement == 0.99
    assert tolerance_for(cfg, "onnxruntime-int8", "reduced").min_f1_ratio == 0.95


@pytest.mark.parametrize("f1, agreement, cls, passed", [
    (80.0, 1.0, "fp32", True),
    (79.95, 0.995, "fp32", True),      # 99.94% of F1, 99.5% agreement
    (79.8, 1.0, "fp32", False),        # 99.75% < 99.9%
    (80.0, 0.985, "fp32", False),      # agreement below 99%
    (79.3, 0.975, "reduced", True),    # 99.1%, 97.5%
    (79.1, 0.99, "reduced", False),    # 98.9% < 99%
    (80.0, 0.96, "reduced", False),
])
def test_compare_applies_the_stated_tolerances(f1, agreement, cls, passed):
    ref = _outputs()
    cfg = ParityConfig()
    p = compare(parity_class=cls, tolerance=tolerance_for(cfg, "b", cls), primary_metric="f1",
                ref_scores={"exact_match": 70.0, "f1": 80.0}, scores={"exact_match": 70.0, "f1": f1},
                agreement=(round(agreement * 200), 200), ref_outputs=ref, outputs=ref, attention_mask=_mask())
    assert p.passed is passed
    assert p.metric_deltas["f1"] == pytest.approx(f1 - 80.0)
    r = BackendResult("b")
    r.apply_parity(p)
    row = r.to_row()
    assert row["parity"] == ("pass" if passed else "FAIL")
    assert row["f1_delta"] == pytest.approx(f1 - 80.0)
    assert row["n_agree"] == round(agreement * 200) and row["n_compared"] == 200


def test_determinism_report():
    a = _outputs()
    b = {k: v.copy() for k, v in a.items()}
    mask = _mask()
    assert determinism(a, b, mask, {"q": "x"}, {"q": "x"})["deterministic"]
    b["start_logits"][0, 0] += 1e-3
    d = determinism(a, b, mask, {"q": "x"}, {"q": "x"})
    assert not d["deterministic"] and d["identical_answers"]


def test_expected_scores_check():
    rows = [BackendResult("eager-fp32", scores={"exact_match": 60.0, "f1": 70.0}),
            BackendResult("onnxruntime", scores={"exact_match": 58.0, "f1": 70.2})]
    expected = [{"backend": "eager-fp32", "exact_match": "60.1", "f1": "70.0"},
                {"backend": "onnxruntime", "exact_match": "60.0", "f1": "70.0"}]
    fails = check_expected(rows, expected, ("exact_match", "f1"), 0.5)
    assert len(fails) == 1 and fails[0].startswith("onnxruntime: exact_match")


def test_wilson_interval_brackets_the_share_and_narrows_with_n():
    lo, hi = wilson_interval(195, 200)
    assert lo < 0.975 < hi
    assert hi - lo > wilson_interval(1950, 2000)[1] - wilson_interval(1950, 2000)[0]
    assert wilson_interval(200, 200)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)


def test_agreement_within_noise_is_flagged():
    # 97.5% agreement on 200 questions: the 97% tolerance is inside the 95% interval.
    ref = _outputs()
    p = compare(parity_class="reduced", tolerance=Tolerance(0.99, 0.97), primary_metric="f1",
                ref_scores={"f1": 80.0}, scores={"f1": 80.0}, agreement=(195, 200), ref_outputs=ref, outputs=ref,
                attention_mask=_mask())
    assert p.passed and p.within_noise
    p = compare(parity_class="reduced", tolerance=Tolerance(0.99, 0.97), primary_metric="f1",
                ref_scores={"f1": 80.0}, scores={"f1": 80.0}, agreement=(1990, 2000), ref_outputs=ref,
                outputs=ref, attention_mask=_mask())
    assert p.passed and not p.within_noise


def _r(name, status="ok", parity="pass", error=""):
    return BackendResult(name, status=status, parity=parity, error=error,
                         parity_failures="agreement low" if parity == "FAIL" else "")


def test_one_verdict_rule_for_every_caller():
    ref = _r("eager-fp32")
    assert verdict([ref, _r("b")], "eager-fp32").status == "PASS"
    assert verdict([ref, _r("b", parity="FAIL")], "eager-fp32").status == "FAIL"
    # a crashed backend fails the run (it used to pass bench and fail the gate)
    v = verdict([ref, _r("b", status="failed", parity="", error="SIGSEGV")], "eager-fp32")
    assert v.status == "FAIL" and "SIGSEGV" in v.reasons[0]
    # a backend that cannot run on this machine is reported, not failed
    assert verdict([ref, _r("c", status="not run", parity="")], "eager-fp32").status == "PASS"
    assert verdict([_r("eager-fp32", status="failed", parity="")], "eager-fp32").status == "NO REFERENCE"
    assert verdict([ref], "eager-fp32", timing_only=True).status == "N/A"
    assert verdict([ref], "eager-fp32", problems=["reference not deterministic"]).status == "FAIL"
