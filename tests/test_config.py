import pytest

from bertqa_bench.config import SuiteConfig, build
from bertqa_bench.errors import ConfigError, UnknownBackendError
from bertqa_bench.suite import apply_overrides, load_suite, suite_names


def test_shipped_suites_load():
    for name in suite_names():
        cfg = load_suite(name)
        assert cfg.name == name
        assert cfg.bench.backends[0] == cfg.bench.reference


def test_gpu_suites_share_one_backend_list():
    lists = {n: load_suite(n).bench.backends for n in ("gpu-backends", "gpu-timing", "gpu-parity", "bert-base-squad")}
    assert len({tuple(v) for v in lists.values()}) == 1
    # gpu-parity takes the default suite's data and the GPU list: extends is a list, merged left to right
    cfg = load_suite("gpu-parity")
    assert cfg.data.synthetic.seed == load_suite("default").data.synthetic.seed and cfg.data.max_seq_len == 384


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
    cfg = load_suite("default", ["bench.batch_size=4", "task.n_best=5"])
    assert cfg.bench.batch_size == 4 and cfg.task.options.n_best == 5


@pytest.mark.parametrize("raw, match", [
    ({"bench": {"batch_size": 0}}, "batch_size"),
    ({"bench": {"batching": "weird"}}, "batching"),
    ({"data": {"doc_stride": 500, "max_seq_len": 384}}, "doc_stride"),
    ({"data": {"source": "squad-json"}}, "dev_file"),
    ({"data": {"source": "nope"}}, "data.source"),
    ({"bench": {"warmup_batches": 0}}, "warm"),
    ({"bench": {"min_passes": 0}}, "min_passes"),
    ({"bench": {"unknown_field": 1}}, "unknown field"),
    ({"bench": {"batch_size": "sixteen"}}, "bench.batch_size must be int"),
    ({"parity": {"fp32": {"min_f1_ratio": 1.5, "min_agreement": 0.9}}}, "min_f1_ratio"),
    ({"model": {"timing_only": True}}, "timing_only"),
    ({"variants": {"x": {"options": {}}}}, "exactly one of 'base'"),
    ({"loadgen": {"offline_qps_hint": 0}}, "loadgen.offline_qps_hint must be positive"),
])
def test_invalid_configs_are_rejected_with_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        build(SuiteConfig, raw, "suite")


def test_task_options_are_the_tasks_own_and_checked():
    with pytest.raises(ConfigError, match="unknown field.*n_bset.*valid: max_answer_len, n_best"):
        load_suite("default", ["task.n_bset=3"])
    with pytest.raises(ConfigError, match="not a source of task 'nq'"):
        load_suite("default", ["task.name=nq"])
    with pytest.raises(ConfigError, match="unknown task 'nqq'"):
        load_suite("nq", ["task.name=nqq"])
    assert load_suite("nq").task.options.long_non_null_threshold == 2


def test_unknown_backend_in_a_suite_fails_at_load_with_the_valid_names():
    with pytest.raises(UnknownBackendError, match=r"onnx-runtime.*valid backends: .*ort-int8\+static"):
        load_suite("default", ["bench.backends=[eager-fp32, onnx-runtime]"])


def test_unknown_suite_lists_known_ones():
    with pytest.raises(ConfigError, match="default"):
        load_suite("no-such-suite")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_suite("default", ["bench.batch_size"])


def test_a_set_error_names_the_set_not_the_suite_file():
    from bertqa_bench.errors import ConfigError
    from bertqa_bench.suite import load_suite

    with pytest.raises(ConfigError) as e:
        load_suite("default", ["bench.batch_size=abc"])
    assert str(e.value) == "--set bench.batch_size=abc: bench.batch_size must be int, not 'abc'"
    with pytest.raises(ConfigError) as e:
        load_suite("default", ["bench.batch_sise=3"])
    assert str(e.value).startswith("--set bench.batch_sise=3: bench: unknown field(s) batch_sise; valid: ")
    with pytest.raises(ConfigError) as e:  # a field the suite file itself got wrong still names the file
        load_suite("default", ["bench.warmup_batches=2"] + ["data.max_seq_len=x"])
    assert str(e.value).startswith("--set data.max_seq_len=x: data.max_seq_len must be int")
