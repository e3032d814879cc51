import os

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


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
            "bench": {"backends": list(backends), "batch_size": 8, "warmup_batches": 1, "min_passes": 2,
                      "min_duration_s": 0},
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
