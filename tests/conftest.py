import importlib.util
import os
import sys
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py imported as module ``name`` (registered in sys.modules first: dataclasses
    look their module up while the file executes)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)

# A generated SQuAD set small enough for whole CLI runs in seconds, and a tiny random BERT
# checkpoint to bench as a user's model (the run-folder, exit-code and path tests share them).
TINY_SYN = dict(seed=5, n_train_contexts=4, n_dev_contexts=3, questions_per_context=2, min_words=30, max_words=60,
                mean_words=40, long_context_fraction=0.0)


def tiny_squad_and_checkpoint(root):
    """(dev file, checkpoint folder) under ``root``: TINY_SYN's data in root/data, the model in root/ck."""
    from bertqa_bench.config import SyntheticConfig
    from bertqa_bench.model.families import build_checkpoint
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    _, dev = ensure_squad_files(root / "data", SyntheticConfig(**TINY_SYN))
    return dev, build_checkpoint("bert", root / "ck", seed=1, head_scale=30.0)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_suite(tmp_path):
    """Write a tiny suite YAML (tiny random BERT trained for a few steps on a tiny generated set)."""

    def make(backends=("eager-fp32", "ort-fp32"), **sections):
        raw = {
            "name": "tiny",
            "data": {"source": "synthetic", "data_dir": str(tmp_path / "data"), "max_seq_len": 96, "doc_stride": 48,
                     "max_query_len": 32,
                     "synthetic": {"seed": 3, "n_train_contexts": 12, "n_dev_contexts": 6, "questions_per_context": 3,
                                   "min_words": 40, "max_words": 160, "mean_words": 70,
                                   "long_context_fraction": 0.2}},
            "model": {"name": "tiny-qa", "base": "embedded:all-MiniLM-L6-v2", "random_init": True,
                      "config_overrides": dict(TINY_BERT)},
            "train": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "seed": 1},
            # rounds of a tiny model's passes are milliseconds: 2 to 4 of them
            "bench": {"backends": list(backends), "batch_size": 8, "warmup_batches": 1, "min_passes": 2,
                      "min_duration_s": 0, "max_rounds": 4},
            "models_dir": str(tmp_path / "models"),
            "results_dir": str(tmp_path / "results"),
            "cache_dir": str(tmp_path / "cache"),
        }
        for k, v in sections.items():
            if isinstance(v, dict):
                raw.setdefault(k, {}).update(v)
            else:
                raw[k] = v
        p = tmp_path / "tiny.yaml"
        p.write_text(yaml.safe_dump(raw))
        return p

    return make
