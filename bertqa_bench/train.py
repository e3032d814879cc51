"""Fine-tune the suite's model (the task's head on a pretrained or random encoder) and save it.

AdamW with a linear warmup/decay schedule, seeded, mixed precision on CUDA, and DDP when
launched by ``torchrun`` with several processes. Training features come from the evaluation-set
cache (built once, split "train"); the saved directory holds the model, the tokenizer and
``train_metrics.json`` with dev scores from the benchmark's own reference backend, batch
plan, postprocessing and scorer. ``ensure_model`` trains only when models/ lacks the model.
"""
from __future__ import annotations

import contextlib
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

from .config import ADDED_DEFAULTS, METRICS_FILE, SuiteConfig
from .envinfo import device_name
from .io import atomic_dir, atomic_write_json
from .modeling import build_model, count_parameters, load_tokenizer
from .tasks import Task, get_task



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def model_is_trained(model_dir: Path) -> bool:
    return (Path(model_dir) / METRICS_FILE).exists() and (Path(model_dir) / "config.json").exists()


# Fields that decide the evaluation only, not the trained weights: changing them keeps the model.
_EVAL_ONLY = {"dev_file", "max_eval_examples", "target_eval_features", "n_dev_contexts"}


# Training fields that decide how fast, not what is learned: the same global batch gives the same
# optimizer steps whether it is split into accumulation steps, processes or compiled kernels, so
# a model trained on 4 GPUs (grad_accum 1) serves a bench that declares grad_accum 4.
_HOW_FAST = {"num_threads", "compile", "grad_accum"}


def recipe_fields(cfg: SuiteConfig) -> dict:
    """What the trained weights depend on — model, training, training data and windowing, the
    task's options and the featurizing libraries — flattened to ``section.field`` keys."""
    import dataclasses

    import tokenizers
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
    import hashlib

    fields = recipe_fields(cfg) if fields is None else fields
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe_diff(saved: dict, wanted: dict, limit: int = 6) -> str:
    """``field: saved -> wanted`` for the fields that differ (the first ``limit``)."""
    keys = sorted(k for k in set(saved) | set(wanted) if saved.get(k, "<absent>") != wanted.get(k, "<absent>"))
    shown = [f"{k}: {saved.get(k, '<absent>')!r} -> {wanted.get(k, '<absent>')!r}" for k in keys[:limit]]
    return "; ".join(shown) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


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


def _optimizer(model, lr: float, weight_decay: float, fused: bool = False):
    # No decay on biases and LayerNorm weights, as in BERT's original recipe. fused: one kernel
    # for the whole update on CUDA instead of several per parameter tensor.
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in n or n.endswith(".bias") else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, fused=fused or None)


def train(cfg: SuiteConfig, *, log: Callable[[str], None] = print, tracker=None, evaluate: bool = True,
          command: str = "") -> dict:
    """Fine-tune per ``cfg`` and save to ``cfg.model_dir``. Returns the training metrics
    (``command``, the command line that ran it, is kept in them so every figure names its command).

    With a ``tracker``, rank 0 logs the training live to MLflow: the run starts now, gets loss and
    samples/s every few optimizer steps, and ends FINISHED when the model is saved, FAILED if
    training raises (tracking problems themselves never stop training)."""
    _, rank, _ = _dist_info()
    mlrun = tracker.training(cfg) if tracker is not None and rank == 0 else None
    try:
        return _train(cfg, log=log, mlrun=mlrun, evaluate=evaluate, command=command)
    except BaseException as e:
        if mlrun is not None:
            mlrun.fail(e)
        raise


def length_grouped_batches(lengths: np.ndarray, global_batch: int, rng: np.random.Generator,
                           group: int = 50) -> list[np.ndarray]:
    """One epoch of global batches: shuffle, sort within groups of ``group`` batches by length,
    cut, shuffle the batch order. Batches hold features of similar length, so trimming each to
    its longest feature removes most padding, while every epoch still sees a new random order."""
    perm = rng.permutation(len(lengths))
    batches = []
    for i in range(0, len(perm), global_batch * group):
        chunk = perm[i:i + global_batch * group]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[j:j + global_batch] for j in range(0, len(chunk), global_batch)]
    order = rng.permutation(len(batches))
    return [batches[k] for k in order]


def rank_micro_batches(rows: np.ndarray, lengths: np.ndarray, rank: int, world: int, accum: int) -> list[np.ndarray]:
    """This rank's share of a global batch, as ``accum`` micro-batches. Rows sorted by length are
    dealt out in turn, so every rank gets the same amount of work (no rank waits at all-reduce)."""
    mine = rows[np.argsort(lengths[rows], kind="stable")][rank::world]
    return [m for m in np.array_split(mine, accum) if len(m)]


class Prefetcher:
    """Builds the next micro-batches (trim, gather, pin) in a thread while the GPU works."""

    def __init__(self, make, items, depth: int = 4):
        import queue
        import threading

        self._q: "queue.Queue" = queue.Queue(maxsize=depth)
        self._err: list = []

        def work():
            try:
                for it in items:
                    self._q.put(make(it))
            except BaseException as e:  # noqa: BLE001 - re-raised in the training loop
                self._err.append(e)
            self._q.put(None)

        self._t = threading.Thread(target=work, daemon=True)
        self._t.start()

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is None:
                if self._err:
                    raise self._err[0]
                return
            yield item


def _train(cfg: SuiteConfig, *, log: Callable[[str], None], mlrun, evaluate: bool, command: str = "") -> dict:
    from transformers import get_linear_schedule_with_warmup

    from .evalset import load_evalset
    from .measure import UtilizationSampler
    from .progress import Progress

    t_all = time.perf_counter()
    tc = cfg.train
    world, rank, local_rank = _dist_info()
    cuda = torch.cuda.is_available()
    if world > 1:
        from .launcher import SAFE_ENV

        for k, v in SAFE_ENV.items():  # NVLink multicast off, here and in anything this starts
            os.environ.setdefault(k, v)
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)

    task = get_task(cfg.task.name)
    tokenizer = load_tokenizer(cfg.model.base)
    t0 = time.perf_counter()
    # Rank 0 builds the training set (and its cache entry); the others wait, then read the cache.
    if rank == 0:
        trainset = load_evalset(cfg, task, cfg.model.base, split="train", train=True, log=log)
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        trainset = load_evalset(cfg, task, cfg.model.base, split="train", train=True)
    features = trainset.features
    featurize_s = time.perf_counter() - t0
    labels = {k: np.asarray(v) for k, v in task.train_labels(features).items()}
    if tc.batch_size % (world * tc.grad_accum):
        raise ValueError(f"train.batch_size {tc.batch_size} (the global batch) must be divisible by "
                         f"{world} processes x {tc.grad_accum} accumulation steps")
    if rank == 0:
        log(f"train: {trainset.n_questions} questions -> {len(features)} features (seq {features.seq_len}) on "
            f"{world} x {device.type}; global batch {tc.batch_size} = {world} processes x {tc.grad_accum} steps x "
            f"{tc.batch_size // (world * tc.grad_accum)} rows")

    model, init_info = build_model(cfg.task.name, cfg.model.base, random_init=cfg.model.random_init,
                                   config_overrides=cfg.model.config_overrides, seed=tc.seed,
                                   grow_from=cfg.model.grow_from, grow_stack=cfg.model.grow_stack)
    model = model.to(device)
    model.train()
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
    step_fn = torch.compile(ddp_model, dynamic=True) if tc.compile else ddp_model

    # The global batch, not the per-process one, is the recipe: the same number of optimizer
    # steps with the same learning rate on 1, 2 or 4 GPUs, so they reach the same model.
    n = len(features)
    lengths = features.lengths()
    rng = np.random.default_rng(tc.seed)
    epochs = [length_grouped_batches(lengths, tc.batch_size, rng) for _ in range(max(1, math.ceil(tc.epochs)))]
    steps_per_epoch = max(1, n // tc.batch_size)
    total_steps = max(1, int(round(steps_per_epoch * tc.epochs)))
    optimizer = _optimizer(model, tc.learning_rate, tc.weight_decay, fused=device.type == "cuda")
    scheduler = get_linear_schedule_with_warmup(optimizer, int(tc.warmup_ratio * total_steps), total_steps)
    amp_dtype = _autocast_dtype(tc.mixed_precision, device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    def make(rows):
        # Trim to the longest feature (multiple of 8: tensor-core friendly shapes).
        trim = min(features.seq_len, int(-(-int(lengths[rows].max()) // 8) * 8))
        batch = {k: torch.from_numpy(v) for k, v in features.inputs(rows, trim_to=trim).items()}
        batch.update({k: torch.from_numpy(np.ascontiguousarray(v[rows])) for k, v in labels.items()})
        if device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return len(rows), int(lengths[rows].sum()), batch

    # Full global batches only (drop_last): the same steps whatever the process count, and every
    # process gets rows of every batch (else its all-reduce would wait forever).
    global_batches = [gb for ep in epochs for gb in ep if len(gb) == tc.batch_size][:total_steps]
    total_steps = len(global_batches)
    micro = [rank_micro_batches(gb, lengths, rank, world, tc.grad_accum) for gb in global_batches]
    log_every = max(1, total_steps // 200)
    step, seen, tokens, losses = 0, 0, 0, []
    if mlrun is not None:
        mlrun.plan(total_steps, {"world_size": world, "device": str(device), "global_batch": tc.batch_size})
    sampler = UtilizationSampler(device) if rank == 0 else None
    bar = Progress(total_steps, "train", enabled=rank == 0, unit="step")
    t_train = time.perf_counter()
    epoch_ends = []
    batches = iter(Prefetcher(make, (rows for ms in micro for rows in ms)))
    for ms in micro:
        loss_acc = None
        for i, _ in enumerate(ms):
            rows_n, n_tokens, batch = next(batches)
            batch = {key: t.to(device, non_blocking=True) for key, t in batch.items()}
            # DDP: all-reduce the gradients once, after the last micro-batch of the global batch.
            sync = contextlib.nullcontext() if world == 1 or i == len(ms) - 1 else ddp_model.no_sync()
            with sync:
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = step_fn(**batch).loss / len(ms)
                scaler.scale(loss).backward()
            seen, tokens = seen + rows_n, tokens + n_tokens
            loss_acc = loss.detach() if loss_acc is None else loss_acc + loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        if step % steps_per_epoch == 0:
            epoch_ends.append(time.perf_counter() - t_train)
        if step % log_every == 0 or step == total_steps:
            losses.append(float(loss_acc))  # one host sync every few steps, not every step
            bar.update(step - bar.n, postfix=f"loss={losses[-1]:.3f}")
            if mlrun is not None:
                mlrun.step(step, losses[-1], seen * world, total_steps, lr=scheduler.get_last_lr()[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    bar.close()
    train_s = time.perf_counter() - t_train
    util = sampler.stop() if sampler is not None else {}

    fields = recipe_fields(cfg)
    metrics = {
        "train_questions": trainset.n_questions, "train_features": n, "train_steps": total_steps,
        "train_samples_per_s": seen * world / train_s, "train_s": train_s, "featurize_s": featurize_s,
        "train_epoch_s": [round(b - a, 2) for a, b in zip([0.0] + epoch_ends, epoch_ends)],
        "train_tokens_per_s": tokens * world / train_s,
        "final_loss": float(np.mean(losses[-5:])) if losses else float("nan"), "device": str(device),
        "device_name": device_name(device.type), "command": command, "date": time.strftime("%Y-%m-%d"),
        "world_size": world, "global_batch": tc.batch_size, "grad_accum": tc.grad_accum, "compile": tc.compile,
        "seed": tc.seed, "base": cfg.model.base, "random_init": cfg.model.random_init, **util, **init_info,
        "recipe": model_recipe(cfg, fields), "recipe_fields": fields,
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
        if mlrun is not None:
            mlrun.finish(metrics, out)
    if world > 1:
        torch.distributed.destroy_process_group()
    return metrics


def evaluate_model(cfg: SuiteConfig, task: Task, model_dir: Path, device: torch.device, log) -> dict:
    """Dev scores with the benchmark's own reference backend, batch plan, postprocessing and
    scorer (in this process: the model was just trained here)."""
    from .backends.variants import VariantTable
    from .evalset import load_evalset
    from .schedule import make_plan, mask_padding
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
    mask_padding(outputs, evalset.features.attention_mask, task.token_outputs)
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
    # a user's checkpoint (model.checkpoint): its name as given, digest and family; empty for the
    # suite's own models
    checkpoint: str = ""
    digest: str = ""
    family: str = "bert"


def checkpoint_model(cfg: SuiteConfig, log: Callable[[str], None] = print) -> ModelInfo:
    """``model.checkpoint``: checked (checkpoint.py) and used as it is; nothing is trained."""
    from .checkpoint import resolve_checkpoint

    ck = resolve_checkpoint(cfg.model.checkpoint, allow_pickle=cfg.model.allow_pickle)
    log(f"model: checkpoint {ck.name} ({ck.model_type}, {ck.weights}, {ck.digest}) from {ck.path}, "
        "benchmarked as it is (no training)")
    note = (f"checkpoint {ck.name} ({ck.model_type}, {ck.digest}), benchmarked as it is"
            + ("; weights unpickled (allow_pickle)" if ck.weights == "pickle" else ""))
    return ModelInfo(ck.path, count_parameters(ck.path), {}, None, False, note, checkpoint=ck.name,
                     digest=ck.digest, family=ck.model_type)


def ensure_model(cfg: SuiteConfig, log: Callable[[str], None] = print, tracker=None) -> ModelInfo:
    """The suite's model, trained first if models/ lacks it; random-weight timing models are just built.
    A ``model.checkpoint`` is used as it is."""
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
        train(cfg, log=log, tracker=tracker)
    metrics = json.loads((model_dir / METRICS_FILE).read_text())
    primary = metrics.get(f"dev_{task.primary_metric}")
    if cfg.model.timing_only:
        note = "random weights: timing only, accuracy columns not meaningful"
    else:
        note = "fine-tuned by bertqa-bench train; dev " + ", ".join(
            f"{m}={metrics[f'dev_{m}']:.2f}" for m in task.metric_names if f"dev_{m}" in metrics)
    from .checkpoint import model_digest, model_family

    return ModelInfo(model_dir, count_parameters(model_dir), metrics, primary, cfg.model.timing_only, note,
                     digest=model_digest(model_dir), family=model_family(model_dir))
