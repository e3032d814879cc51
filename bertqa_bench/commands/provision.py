"""A model to benchmark: the user's checkpoint as it is, or the suite's own fine-tuned model,
trained only when models/ lacks it or holds one of another recipe. Every command that needs a
model (bench, sweep, loadgen, profile, bench-ddp) gets it here."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..config import METRICS_FILE, SuiteConfig
from ..errors import ConfigError
from ..io import atomic_dir, atomic_write_json
from ..model.checkpoint import model_digest, model_family, resolve_checkpoint
from ..model.modeling import build_model, count_parameters, load_tokenizer
from ..model.weights_file import check_model_folder
from ..tasks import get_task
from ..training.recipe import model_is_trained, model_recipe, recipe_diff, recipe_fields
from ..training.train import train


@dataclass
class ModelInfo:
    dir: Path
    params: Optional[int]
    metrics: dict  # train_metrics.json
    dev_primary: Optional[float]  # the model's primary dev metric (e.g. F1) from training
    timing_only: bool
    note: str
    # a user's checkpoint (model.checkpoint): its name as given, digest and family; empty for the
    # suite's own models
    checkpoint: str = ""
    digest: str = ""
    family: str = "bert"
    # trained here without its dev evaluation: the bench's reference row (eager FP32 on the same
    # evaluation set, what that evaluation runs) gives its dev scores (scored_by_reference)
    dev_from_reference: bool = False

    def scored_by_reference(self, scores: dict, metric_names, primary: str, source: str) -> None:
        """The reference row's ``scores`` become this model's dev scores: here, in its note, and in
        its train_metrics.json (with ``dev_source``, so a later run reusing it shows them too)."""
        dev = {f"dev_{k}": float(v) for k, v in scores.items()}
        self.metrics = {**self.metrics, **dev, "dev_source": source}
        self.dev_primary, self.dev_from_reference = dev.get(f"dev_{primary}"), False
        self.note = trained_note(self.metrics, metric_names)
        atomic_write_json(self.dir / METRICS_FILE, self.metrics)


def trained_note(metrics: dict, metric_names) -> str:
    """A trained model's note: its dev scores, or where they will come from."""
    shown = [f"{m}={metrics[f'dev_{m}']:.2f}" for m in metric_names if f"dev_{m}" in metrics]
    if not shown:
        return "fine-tuned by bertqa-bench train; dev scores: not yet measured (a bench's reference row gives them)"
    return "fine-tuned by bertqa-bench train; dev " + ", ".join(shown)


def checkpoint_model(cfg: SuiteConfig, log: Callable[[str], None] = print) -> ModelInfo:
    """``model.checkpoint``: checked (checkpoint.py) and used as it is; nothing is trained."""
    ck = resolve_checkpoint(cfg.model.checkpoint, allow_pickle=cfg.model.allow_pickle)
    why = ck.position_reason(cfg.data.max_seq_len)
    if why:  # refused here, before any work: its reference would crash in its worker
        raise ConfigError(why)
    log(f"model: checkpoint {ck.name} ({ck.model_type}, {ck.weights}, {ck.digest}) from {ck.path}, "
        "benchmarked as it is (no training)")
    note = (f"checkpoint {ck.name} ({ck.model_type}, {ck.digest}), benchmarked as it is"
            + ("; weights unpickled (allow_pickle)" if ck.weights == "pickle" else ""))
    return ModelInfo(ck.path, count_parameters(ck.path), {}, None, False, note, checkpoint=ck.name,
                     digest=ck.digest, family=ck.model_type)


def ensure_model(cfg: SuiteConfig, log: Callable[[str], None] = print, tracker=None,
                 evaluate: bool = True) -> ModelInfo:
    """The suite's model, trained first if models/ lacks it; random-weight timing models are just built.
    A ``model.checkpoint`` is used as it is. ``evaluate`` False: a model trained here (or saved
    earlier without them) gets no dev evaluation, and says that its dev scores are to come
    (``dev_from_reference``: the bench's reference row repeats that evaluation exactly)."""
    if cfg.model.checkpoint:
        return checkpoint_model(cfg, log)
    task = get_task(cfg.task.name)
    model_dir = cfg.model_dir
    wanted = recipe_fields(cfg)
    recipe = model_recipe(cfg, wanted)
    saved_metrics = json.loads((model_dir / METRICS_FILE).read_text()) if model_is_trained(model_dir) else {}
    saved = saved_metrics.get("recipe")
    if saved == recipe:
        log(f"model: reusing {model_dir} (recipe {recipe})")
    elif cfg.model.timing_only:
        log(f"model: building {cfg.model.base} with random weights (timing only) in {model_dir}")
        model, _ = build_model(cfg.task.name, cfg.model.base, random_init=True,
                               config_overrides=cfg.model.config_overrides, seed=cfg.train.seed)
        with atomic_dir(model_dir) as tmp:
            model.save_pretrained(tmp)
            load_tokenizer(cfg.model.base).save_pretrained(tmp)
            atomic_write_json(tmp / METRICS_FILE, {"random_init": True, "note": "timing only", "recipe": recipe})
    else:
        if not saved_metrics:
            why = "not found"
        else:
            fields = saved_metrics.get("recipe_fields")
            why = f"was trained by another recipe ({saved} != {recipe}" + (
                f": {recipe_diff(fields, wanted)})" if fields else ")")
        log(f"model: {model_dir} {why}; fine-tuning {cfg.model.base} (suite {cfg.name})")
        train(cfg, log=log, tracker=tracker, evaluate=evaluate)

    check_model_folder(model_dir, hint=f"delete {model_dir} and the suite trains (or builds) it again")
    metrics = json.loads((model_dir / METRICS_FILE).read_text())
    primary = metrics.get(f"dev_{task.primary_metric}")
    note = ("random weights: timing only, accuracy columns not meaningful" if cfg.model.timing_only
            else trained_note(metrics, task.metric_names))
    return ModelInfo(model_dir, count_parameters(model_dir), metrics, primary, cfg.model.timing_only, note,
                     digest=model_digest(model_dir), family=model_family(model_dir),
                     dev_from_reference=primary is None and not cfg.model.timing_only)
