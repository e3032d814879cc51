"""Fine-tune the suite's model (the task's head on a pretrained or random encoder) and save it.

AdamW with a linear warmup/decay schedule, seeded, mixed precision on CUDA, and DDP when
launched by ``torchrun`` with several processes. Training features come from the evaluation-set
cache (built once, split "train"); the saved directory holds the model, the tokenizer and
``train_metrics.json`` with dev scores from the benchmark's own reference backend, batch
plan, postprocessing and scorer. ``ensure_model`` trains only when models/ lacks the model.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .config import SuiteConfig
from .io import atomic_dir, atomic_write_json
from .modeling import build_model, count_parameters, load_tokenizer
from .tasks import Task, get_task

METRICS_FILE = "train_metrics.json"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def model_is_trained(model_dir: Path) -> bool:
    return (Path(model_dir) / METRICS_FILE).exists() and (Path(model_dir) / "config.json").exists()


def _dist_info() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return world, rank, local


def _autocast_dtype(mode: str, device: torch.device) -> Optional[torch.dtype]:
    if mode == "no" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "bf16":
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else None


def _optimizer(model, lr: float, weight_decay: float):
    # No decay on biases and LayerNorm weights, as in BERT's original recipe.
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in n or n.endswith(".bias") else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def train(cfg: SuiteConfig, *, log: Callable[[str], None] = print, tracker=None, evaluate: bool = True) -> dict:
    """Fine-tune per ``cfg`` and save to ``cfg.model_dir``. Returns the training metrics."""
    from transformers import get_linear_schedule_with_warmup

    t_all = time.perf_counter()
    tc = cfg.train
    world, rank, local_rank = _dist_info()
    if world > 1:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)

    from .evalset import load_evalset

    task = get_task(cfg.task.name)
    tokenizer = load_tokenizer(cfg.model.base)
    t0 = time.perf_counter()
    trainset = load_evalset(cfg, task, cfg.model.base, split="train", train=True, log=log if rank == 0 else None)
    features = trainset.features
    featurize_s = time.perf_counter() - t0
    labels = task.train_labels(features)
    if rank == 0:
        log(f"train: {trainset.n_questions} questions -> {len(features)} features "
            f"(seq {features.seq_len}) on {device}")

    model = build_model(cfg.task.name, cfg.model.base, random_init=cfg.model.random_init,
                        config_overrides=cfg.model.config_overrides, seed=tc.seed).to(device)
    model.train()
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)

    n = len(features)
    steps_per_epoch = math.ceil(n / (tc.batch_size * world * tc.grad_accum))
    total_steps = max(1, int(round(steps_per_epoch * tc.epochs)))
    optimizer = _optimizer(model, tc.learning_rate, tc.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(tc.warmup_ratio * total_steps), total_steps)
    amp_dtype = _autocast_dtype(tc.mixed_precision, device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    lengths = features.lengths()
    gen = torch.Generator().manual_seed(tc.seed)
    step, seen, losses = 0, 0, []
    t_train = time.perf_counter()
    from .progress import Progress

    bar = Progress(total_steps, "train", enabled=rank == 0, unit="step")
    while step < total_steps:
        order = torch.randperm(n, generator=gen).numpy()
        order = order[rank::world]  # each DDP rank gets a disjoint shard of the same permutation
        micro = tc.batch_size
        for i in range(0, len(order) - micro + 1 if len(order) >= micro else 1, micro):
            rows = np.sort(order[i:i + micro])
            # Trim each batch to its longest feature: most windows are far shorter than max_seq_len,
            # and padding costs the same compute as real tokens.
            trim = min(features.seq_len, int(-(-int(lengths[rows].max()) // 8) * 8))
            batch = {k: torch.from_numpy(v).to(device) for k, v in features.inputs(rows, trim_to=trim).items()}
            batch.update({k: torch.from_numpy(np.asarray(v)[rows]).to(device) for k, v in labels.items()})
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = ddp_model(**batch).loss / tc.grad_accum
            scaler.scale(loss).backward()
            seen += len(rows)
            if (i // micro + 1) % tc.grad_accum:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item() * tc.grad_accum)
            step += 1
            bar.update(1, postfix=f"loss={np.mean(losses[-20:]):.3f}")
            if step >= total_steps:
                break
    bar.close()
    train_s = time.perf_counter() - t_train

    metrics = {
        "train_questions": trainset.n_questions, "train_features": n, "train_steps": total_steps,
        "train_samples_per_s": seen * world / train_s, "train_s": train_s, "featurize_s": featurize_s,
        "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"), "device": str(device),
        "world_size": world, "seed": tc.seed, "base": cfg.model.base, "random_init": cfg.model.random_init,
    }
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        out = Path(cfg.model_dir)
        # Swapped in whole, so an interrupted run never leaves a half-written model behind.
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if evaluate:
                metrics.update(evaluate_model(cfg, task, tmp, device, log))
            metrics["total_s"] = time.perf_counter() - t_all
            atomic_write_json(tmp / METRICS_FILE, metrics)
        log(f"train: saved {out} " + json.dumps({k: metrics[k] for k in metrics if k.startswith("dev_")}))
        if tracker is not None:
            tracker.log_training(cfg, metrics, out)
    if world > 1:
        torch.distributed.destroy_process_group()
    return metrics


def evaluate_model(cfg: SuiteConfig, task: Task, model_dir: Path, device: torch.device, log) -> dict:
    """Dev scores with the benchmark's own reference backend, batch plan, postprocessing and
    scorer (in this process: the model was just trained here)."""
    from .backends.variants import VariantTable
    from .evalset import load_evalset
    from .schedule import make_plan
    from .worker import Job, execute

    evalset = load_evalset(cfg, task, str(model_dir), log=log)
    plan = make_plan(evalset.lengths(), batching="padded", batch_size=cfg.bench.batch_size,
                     max_seq_len=evalset.features.seq_len)
    variant = VariantTable.for_suite(cfg).get("eager-fp32-cuda" if device.type == "cuda" else "eager-fp32")
    job = Job(variant=variant.to_dict(), model_dir=str(model_dir), task=task.name,
              artifacts_dir=str(cfg.artifacts_root), evalset=str(evalset.path), plan="", outputs="", result="",
              output_names=list(task.output_names), token_outputs=list(task.token_outputs),
              max_seq_len=evalset.features.seq_len, warmup_batches=1)
    record, outputs = execute(job, plan=plan, inputs=evalset.features.inputs())
    if outputs is None:
        raise RuntimeError(f"evaluation with {variant.name} did not run: {record.get('error')}")
    predictions = task.postprocess(evalset.examples, evalset.features, outputs, cfg)
    scores = task.score(evalset.examples, predictions, cfg)
    return {f"dev_{k}": float(v) for k, v in scores.items()} | {"dev_questions": evalset.n_questions}


@dataclass
class ModelInfo:
    dir: Path
    params: Optional[int]
    metrics: dict  # train_metrics.json
    dev_primary: Optional[float]  # the model's primary dev metric (e.g. F1) from training
    timing_only: bool
    note: str


def ensure_model(cfg: SuiteConfig, log: Callable[[str], None] = print, tracker=None) -> ModelInfo:
    """The suite's model, trained first if models/ lacks it; random-weight timing models are just built."""
    task = get_task(cfg.task.name)
    model_dir = cfg.model_dir
    if model_is_trained(model_dir):
        log(f"model: reusing {model_dir}")
    elif cfg.model.timing_only:
        log(f"model: building {cfg.model.base} with random weights (timing only) in {model_dir}")
        model = build_model(cfg.task.name, cfg.model.base, random_init=True,
                            config_overrides=cfg.model.config_overrides, seed=cfg.train.seed)
        with atomic_dir(model_dir) as tmp:
            model.save_pretrained(tmp)
            load_tokenizer(cfg.model.base).save_pretrained(tmp)
            atomic_write_json(tmp / METRICS_FILE, {"random_init": True, "note": "timing only"})
    else:
        log(f"model: {model_dir} not found, fine-tuning {cfg.model.base} (suite {cfg.name})")
        train(cfg, log=log, tracker=tracker)
    metrics = json.loads((model_dir / METRICS_FILE).read_text())
    primary = metrics.get(f"dev_{task.primary_metric}")
    if cfg.model.timing_only:
        note = "random weights: timing only, accuracy columns not meaningful"
    else:
        note = "fine-tuned by bertqa-bench train; dev " + ", ".join(
            f"{k[4:]}={v:.2f}" for k, v in metrics.items() if k.startswith("dev_") and k != "dev_questions")
    return ModelInfo(model_dir, count_parameters(model_dir), metrics, primary, cfg.model.timing_only, note)
