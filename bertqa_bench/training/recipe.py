"""What defines a trained model: the suite fields that change its weights (its recipe), saved
beside it and compared before reuse; fields that only change speed or evaluation are left out."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Optional

import tokenizers

from ..config import ADDED_DEFAULTS, METRICS_FILE, SuiteConfig


def model_is_trained(model_dir: Path) -> bool:
    return (Path(model_dir) / METRICS_FILE).exists() and (Path(model_dir) / "config.json").exists()


# Fields that decide the evaluation only, not the trained weights: changing them keeps the model.
_EVAL_ONLY = {"dev_file", "max_eval_examples", "target_eval_features", "n_dev_contexts"}


# Training fields that decide how fast, not what is learned: the same global batch gives the same
# optimizer steps whether it is split into accumulation steps, processes or compiled kernels, so
# a model trained on 4 GPUs (grad_accum 1) serves a bench that declares grad_accum 4.
# seq_bucket only pads micro-batches further: with the padding masked out of attention and of the
# loss (loss_mask_padding, which seq_bucket requires and which is in the recipe) the model is the
# same up to numerics. DDP's options decide when gradients travel, not their sum; profile_steps
# only watches.
_HOW_FAST = {"num_threads", "compile", "compile_scope", "graph_layers", "compile_warmup", "grad_accum", "seq_bucket",
             "ddp_bucket_cap_mb", "ddp_static_graph", "ddp_gradient_as_bucket_view", "ddp_comm_hook",
             "graph_optimizer_step", "manual_gc", "no_host_sync", "profile_steps",
             "refuse_collapse"}  # the last: what is done with weights made, not how they are made


def recipe_fields(cfg: SuiteConfig) -> dict:
    """What the trained weights depend on — model, training, training data and windowing, the
    task's options and the featurizing libraries — flattened to ``section.field`` keys."""
    import transformers

    opts = cfg.task.options
    parts = {"model": dataclasses.asdict(cfg.model),
             "train": {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _HOW_FAST},
             "data": dataclasses.asdict(cfg.data), "task": {"name": cfg.task.name},
             "task_options": dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) else dict(opts or {}),
             "libraries": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}}
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in _EVAL_ONLY:
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)

    walk("", parts)
    # fields added later, at their defaults, leave the recipe as it was: models trained before
    # they existed are still found (not retrained)
    return {k: v for k, v in flat.items() if k not in ADDED_DEFAULTS or ADDED_DEFAULTS[k] != v}


def model_recipe(cfg: SuiteConfig, fields: Optional[dict] = None) -> str:
    """The recipe's hash (of ``fields`` when the caller has them already). A saved model whose
    recipe differs is retrained (the log names the fields that differ), so a changed suite never
    silently reuses a stale model, and an unchanged one is trained once per machine."""
    fields = recipe_fields(cfg) if fields is None else fields
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe_diff(saved: dict, wanted: dict, limit: int = 6) -> str:
    """``field: saved -> wanted`` for the fields that differ (the first ``limit``)."""
    keys = sorted(k for k in set(saved) | set(wanted) if saved.get(k, "<absent>") != wanted.get(k, "<absent>"))
    shown = [f"{k}: {saved.get(k, '<absent>')!r} -> {wanted.get(k, '<absent>')!r}" for k in keys[:limit]]
    return "; ".join(shown) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")
