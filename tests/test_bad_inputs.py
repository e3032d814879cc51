"""Bad checkpoints and data files: a one-line error naming the file and what is wrong, exit 2,
before any work (nothing written to results/ or cache/); a damaged model the suite made is
named the same way."""
import json
import shutil

import pytest
import yaml

from bertqa_bench.cli import main
from bertqa_bench.config import SyntheticConfig
from bertqa_bench.model.checkpoint import resolve_checkpoint
from bertqa_bench.model.weights_file import ModelFileError

SYN = dict(seed=5, n_train_contexts=4, n_dev_contexts=3, questions_per_context=2, min_words=30, max_words=60,
           mean_words=40, long_context_fraction=0.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    d = tmp_path_factory.mktemp("baddata")
    train, dev = ensure_squad_files(d, SyntheticConfig(**SYN))
    return d, train, dev


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    from bertqa_bench.model.families import build_checkpoint

    return build_checkpoint("bert", tmp_path_factory.mktemp("ck") / "bert", seed=1, head_scale=30.0)


@pytest.fixture
def checkpoint(good_checkpoint, tmp_path):
    """A fresh copy of the good checkpoint, for one test to damage."""
    return shutil.copytree(good_checkpoint, tmp_path / "my-model")


def _suite(tmp_path, corpus):
    d, _, _ = corpus
    raw = {"name": "bad",
           "data": {"source": "synthetic", "data_dir": str(d), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(SYN)},
           "bench": {"backends": ["eager-fp32"], "batch_size": 8, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": "inprocess"},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _refused(capsys, tmp_path, argv, *phrases):
    """``bench argv`` exits 2 with one error line holding every phrase; nothing in results/ or cache/."""
    rc = main(["bench", "--no-progress", "--no-mlflow", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    line = err.splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in err, err
    for p in phrases:
        assert p in line, (p, line)
    for d in ("results", "cache"):
        left = [p for p in (tmp_path / d).rglob("*")] if (tmp_path / d).exists() else []
        assert not left, f"{d}/ holds {left}"
    return line


def _weights(folder):
    return folder / "model.safetensors"


def test_an_empty_weights_file_is_named(checkpoint, corpus, tmp_path, capsys):
    _weights(checkpoint).write_bytes(b"")
    _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint)],
             str(_weights(checkpoint)), "empty file (0 bytes)")


def test_a_corrupt_header_is_named(checkpoint, corpus, tmp_path, capsys):
    data = bytearray(_weights(checkpoint).read_bytes())
    data[8:12] = b"\xff\xfe\xfd\xfc"  # the JSON header's first bytes: not UTF-8 any more
    _weights(checkpoint).write_bytes(bytes(data))
    _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint)],
             str(_weights(checkpoint)), "damaged header")


def test_truncated_weights_say_how_much_is_missing(checkpoint, corpus, tmp_path, capsys):
    data = _weights(checkpoint).read_bytes()
    _weights(checkpoint).write_bytes(data[:-1000])
    line = _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint)],
                    str(_weights(checkpoint)), "truncated", "1,000 bytes of weights missing")
    assert f"{len(data):,}" in line


def test_a_header_length_past_the_end_is_named(checkpoint):
    data = _weights(checkpoint).read_bytes()
    _weights(checkpoint).write_bytes(data[:40])
    with pytest.raises(ModelFileError, match="only 32 bytes follow"):
        resolve_checkpoint(str(checkpoint))


def _rewrite(folder, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(_weights(folder))
    change(tensors)
    save_file(tensors, _weights(folder), metadata={"format": "pt"})


def test_a_qa_head_without_two_outputs_is_refused(checkpoint, corpus, tmp_path, capsys):
    import torch

    def three_outputs(t):
        w, b = t["qa_outputs.weight"], t["qa_outputs.bias"]
        t["qa_outputs.weight"] = torch.cat([w, w[:1]])
        t["qa_outputs.bias"] = torch.cat([b, b[:1]])

    _rewrite(checkpoint, three_outputs)
    _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint)],
             str(_weights(checkpoint)), "qa_outputs.weight has 3 outputs", "span head has 2")


def test_a_tokenizer_larger_than_the_embeddings_is_refused(checkpoint, corpus, tmp_path, capsys):
    """Another model's tokenizer (an ALBERT model with a BERT vocabulary): ids past the embedding
    matrix would index outside it in every backend."""
    key = "bert.embeddings.word_embeddings.weight"
    rows = {}

    def fewer_rows(t):
        rows["n"] = t[key].shape[0]
        t[key] = t[key][:100].clone()

    _rewrite(checkpoint, fewer_rows)
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
    _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint)],
             str(checkpoint), f"tokenizer has {rows['n']:,} tokens", "embedding matrix has 100 rows")


def test_an_empty_dev_set_is_refused_and_nothing_is_cached(checkpoint, corpus, tmp_path, capsys):
    dev = tmp_path / "empty-dev.json"
    dev.write_text(json.dumps({"version": "1.1", "data": []}))
    _refused(capsys, tmp_path, ["--suite", str(_suite(tmp_path, corpus)), "--model", str(checkpoint),
                                "--dev-file", str(dev)], str(dev), "no questions")


def test_a_stale_empty_cache_entry_is_not_reused(checkpoint, corpus, tmp_path):
    """An empty evaluation set an older version cached is dropped, and the data refused as empty."""
    from bertqa_bench.data.evalset import evalset_key, load_evalset
    from bertqa_bench.errors import BenchError
    from bertqa_bench.suite import load_suite
    from bertqa_bench.tasks import get_task

    dev = tmp_path / "empty-dev.json"
    dev.write_text(json.dumps({"version": "1.1", "data": []}))
    cfg = load_suite(str(_suite(tmp_path, corpus)), ["data.source=squad-json", f"data.dev_file={json.dumps(str(dev))}"])
    task = get_task(cfg.task.name)
    key = evalset_key(cfg.evalset_spec(), task, str(checkpoint), "dev", False)
    stale = cfg.cache_root / "evalsets" / f"{task.name}-dev-{key}"
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text(json.dumps({"key": key, "n_questions": 0, "n_features": 0, "build_s": 0}))
    with pytest.raises(BenchError, match="no questions"):
        load_evalset(cfg.evalset_spec(), task, str(checkpoint))
    assert not stale.exists()


def test_a_damaged_model_the_suite_made_is_named_with_how_to_rebuild_it(tmp_path):
    from bertqa_bench.model.weights_file import check_model_folder

    folder = tmp_path / "models" / "tiny-qa"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"model.safetensors: empty file .*; delete .*tiny-qa"):
        check_model_folder(folder, hint=f"delete {folder} and the suite trains (or builds) it again")
