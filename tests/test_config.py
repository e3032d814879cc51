import pytest

from bertqa_bench.config import SuiteConfig, apply_overrides, load_suite
from bertqa_bench.errors import ConfigError


def test_shipped_suites_load():
    for name in ("default", "bert-base-squad", "ci"):
        cfg = load_suite(name)
        assert cfg.name == name
        assert cfg.bench.backends[0] == cfg.bench.reference


def test_reference_is_moved_first():
    cfg = SuiteConfig(bench={"backends": ["onnxruntime", "eager-fp32"], "reference": "eager-fp32"})
    assert cfg.bench.backends == ["eager-fp32", "onnxruntime"]
    cfg = SuiteConfig(bench={"backends": ["onnxruntime"]})
    assert cfg.bench.backends == ["eager-fp32", "onnxruntime"]


def test_overrides_parse_yaml_values():
    raw = apply_overrides({"bench": {"batch_size": 8}}, ["bench.batch_size=16", "data.max_seq_len=128",
                                                        "bench.backends=[eager-fp32, onnxruntime]"])
    assert raw["bench"]["batch_size"] == 16
    assert raw["data"]["max_seq_len"] == 128
    assert raw["bench"]["backends"] == ["eager-fp32", "onnxruntime"]
    cfg = load_suite("default", ["bench.batch_size=4"])
    assert cfg.bench.batch_size == 4


@pytest.mark.parametrize("raw, match", [
    ({"bench": {"batch_size": 0}}, "batch_size"),
    ({"bench": {"padding": "weird"}}, "padding"),
    ({"data": {"doc_stride": 500, "max_seq_len": 384}}, "doc_stride"),
    ({"data": {"source": "squad-json"}}, "dev_file"),
    ({"data": {"source": "nope"}}, "data.source"),
    ({"bench": {"warmup_batches": 0}}, "warm"),
    ({"bench": {"unknown_field": 1}}, "unknown field"),
    ({"parity": {"fp32": {"min_f1_ratio": 1.5, "min_agreement": 0.9}}}, "min_f1_ratio"),
    ({"model": {"timing_only": True}}, "timing_only"),
])
def test_invalid_configs_are_rejected_with_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        SuiteConfig(**raw)


def test_unknown_suite_lists_known_ones():
    with pytest.raises(ConfigError, match="default"):
        load_suite("no-such-suite")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_suite("default", ["bench.batch_size"])
