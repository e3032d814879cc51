"""The evaluation-set cache (evalset.py): what its key covers.

A stale entry would silently score the wrong features, so each input the features depend on is
changed once and must rebuild the set (a new entry, features built from the changed input),
while an unchanged suite, or a change to something the features do not depend on, reuses it.
"""
import json
import shutil

import numpy as np
import pytest

import bertqa_bench.tasks.base as task_base
from bertqa_bench.config import DataConfig, SuiteConfig, TaskConfig
from bertqa_bench.data.evalset import load_evalset
from bertqa_bench.tasks import get_task
from bertqa_bench.tasks.squad.reader import write_squad_json
from bertqa_bench.tasks.squad.types import Answer, QAExample

_CTX = ("Marisa Okafor was born in Teluma in 1874. She studied Painting in Verenna and later taught at the "
        "Academy of Teluma, where her students included Ivo Brandt and Lena Sauer.")


def _examples(question="Where was Marisa Okafor born?"):
    return [QAExample("q1", question, _CTX, (Answer("Teluma", 26),)),
            QAExample("q2", "Who studied in Verenna?", _CTX, (Answer("Marisa Okafor", 0),)),
            QAExample("q3", "When was she born?", _CTX, (Answer("1874", 36),))]


@pytest.fixture
def setup(tmp_path):
    """A squad-json dev file and a tokenizer folder of our own (copies we can change)."""
    from bertqa_bench.model.modeling import resolve_base

    src = resolve_base("embedded:all-MiniLM-L6-v2")
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(f"{src}/{name}", tok / name)
    dev = write_squad_json(_examples(), tmp_path / "dev.json")
    task = get_task("squad")

    def cfg(**data):
        d = dict(source="squad-json", dev_file=str(dev), train_file=str(dev), max_seq_len=48, doc_stride=16,
                 max_query_len=16)
        d.update(data)
        return SuiteConfig(data=DataConfig(**d), task=TaskConfig("squad", task.Options()),
                           cache_dir=str(tmp_path / "cache"))

    def load(c=None):
        return load_evalset((c or cfg()).evalset_spec(), task, str(tok))

    first = load()
    assert not first.cache_hit and len(first.features) > len(first.examples)  # the context spans windows
    return tok, dev, cfg, load, first


def _rebuilt(first, again):
    assert not again.cache_hit and again.key != first.key and again.path != first.path
    assert first.path.exists()  # the old entry stays for the old inputs


def test_unchanged_inputs_reuse_the_entry(setup):
    tok, dev, cfg, load, first = setup
    again = load()
    assert again.cache_hit and again.key == first.key and again.path == first.path
    np.testing.assert_array_equal(again.features.input_ids, first.features.input_ids)
    # nor does a setting the features do not depend on rebuild it
    assert load(cfg(max_train_examples=1)).cache_hit


def test_a_changed_tokenizer_file_rebuilds(setup):
    tok, dev, cfg, load, first = setup
    spec = json.loads((tok / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["born"], vocab["was"] = vocab["was"], vocab["born"]  # a re-numbered vocabulary: other ids
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    again = load()
    _rebuilt(first, again)
    assert not np.array_equal(again.features.input_ids, first.features.input_ids)


@pytest.mark.parametrize("name", ["vocab.txt", "tokenizer_config.json", "special_tokens_map.json"])
def test_any_tokenizer_file_is_part_of_the_key(setup, name):
    tok, dev, cfg, load, first = setup
    path = tok / name
    if name.endswith(".json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "edited_by_test": 1}))
    else:
        path.write_text(path.read_text() + "zzzedited\n")
    _rebuilt(first, load())


def test_a_changed_data_file_rebuilds(setup):
    tok, dev, cfg, load, first = setup
    write_squad_json(_examples("Where was the painter Marisa Okafor born?"), dev)  # same path, new content
    again = load()
    _rebuilt(first, again)
    assert again.examples[0].question.startswith("Where was the painter")


@pytest.mark.parametrize("field, value", [("max_seq_len", 64), ("doc_stride", 8), ("max_query_len", 8)])
def test_a_changed_windowing_setting_rebuilds(setup, field, value):
    tok, dev, cfg, load, first = setup
    again = load(cfg(**{field: value}))
    _rebuilt(first, again)
    # and the features are those of the new setting, not the old ones under a new name
    assert not np.array_equal(again.features.input_ids, first.features.input_ids)
    assert load(cfg(**{field: value})).cache_hit


def test_a_new_featurizer_version_rebuilds(setup, monkeypatch):
    tok, dev, cfg, load, first = setup
    monkeypatch.setattr(task_base, "FEATURIZER_VERSION", task_base.FEATURIZER_VERSION + 1)
    _rebuilt(first, load())
