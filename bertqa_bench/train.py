"""Fine-tune a BERT QA model (SQuAD span head, or the NQ BERT-joint head) and save it to models/<name>/.

AdamW with a linear warmup/decay schedule, seeded, mixed precision on CUDA, and DDP when
launched by ``torchrun`` with several processes. The saved directory holds the model, the
tokenizer and ``train_metrics.json`` (dev EM/F1 from the same postprocessing and scorer the
benchmark uses).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .config import SuiteConfig
from .modeling import build_model, load_tokenizer
from .tasks import get_task

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

    task = get_task(cfg.model.task)
    tokenizer = load_tokenizer(cfg.model.base)
    t0 = time.perf_counter()
    train_examples = task.load_examples(cfg, "train")
    features = task.featurize(train_examples, tokenizer, cfg, train=True)
    featurize_s = time.perf_counter() - t0
    labels = {"start_positions": features.start_positions, "end_positions": features.end_positions}
    if hasattr(task, "train_labels"):
        labels.update(task.train_labels(features))
    if rank == 0:
        log(f"train: {len(train_examples)} questions -> {len(features)} features "
            f"(seq {features.seq_len}) in {featurize_s:.1f}s on {device}")

    model = build_model(cfg.model.task, cfg.model.base, random_init=cfg.model.random_init,
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
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, desc="train", disable=rank != 0, unit="step")
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
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
            if step >= total_steps:
                break
    bar.close()
    train_s = time.perf_counter() - t_train

    metrics = {
        "train_questions": len(train_examples), "train_features": n, "train_steps": total_steps,
        "train_samples_per_s": seen * world / train_s, "train_s": train_s, "featurize_s": featurize_s,
        "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"), "device": str(device),
        "world_size": world, "seed": tc.seed, "base": cfg.model.base, "random_init": cfg.model.random_init,
    }
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        out = Path(cfg.model_dir)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if evaluate:
            metrics.update(_evaluate(cfg, task, tmp, device, log))
        metrics["total_s"] = time.perf_counter() - t_all
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
        # Swap in atomically so an interrupted run never leaves a half-written model behind.
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        log(f"train: saved {out} " + json.dumps({k: metrics[k] for k in metrics if k.startswith("dev_")}))
        if tracker is not None:
            tracker.log_training(cfg, metrics, out)
    if world > 1:
        torch.distributed.destroy_process_group()
    return metrics


def _evaluate(cfg: SuiteConfig, task, model_dir: Path, device: torch.device, log) -> dict:
    """Dev-set scores with the benchmark's own eager backend, postprocessing and scorer."""
    from .runner import run_backend

    tokenizer = load_tokenizer(str(model_dir))
    examples = task.load_examples(cfg, "dev")
    features = task.featurize(examples, tokenizer, cfg)
    name = "eager-fp32-cuda" if device.type == "cuda" else "eager-fp32"
    outputs = run_backend(name, model_dir, features, task.output_names, cfg, progress=False).outputs
    predictions = task.postprocess(examples, features, outputs, cfg)
    scores = task.score(examples, predictions)
    return {f"dev_{k}": float(v) for k, v in scores.items()} | {"dev_questions": len(examples)}
