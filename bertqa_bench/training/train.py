"""Fine-tune the suite's model (the task's head on a pretrained or random encoder) and save it.

AdamW with a linear warmup/decay schedule, seeded, mixed precision on CUDA, and DDP when
launched by ``torchrun`` with several processes. Training features come from the evaluation-set
cache (built once, split "train"); the saved directory holds the model, the tokenizer and
``train_metrics.json`` with dev scores from the benchmark's own reference backend, batch
plan, postprocessing and scorer. ``commands/provision.py`` calls it only when models/ lacks the model.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from transformers import get_linear_schedule_with_warmup

from ..backends.variants import VariantTable
from ..config import METRICS_FILE, SuiteConfig
from ..data.evalset import load_evalset
from ..envinfo import device_name
from ..errors import TrainingCollapsedError
from ..io import atomic_dir, atomic_write_json
from ..measuring.launcher import SAFE_ENV
from ..measuring.measure import UtilizationSampler
from ..measuring.progress import Progress
from ..measuring.worker import Job, execute
from ..model.modeling import build_model, load_tokenizer
from ..record.schedule import make_plan, mask_padding
from ..tasks import Task, get_task
from .instrument import GcWatch, Prefetcher, StepProfiler, compiled_graphs, profile_window
from .loss_check import collapse
from .loss_readback import DeferredLoss
from .optimizer_step import make_adamw, optimizer_step
from .prepared_mask import PreparedMask, has_padding
from .recipe import model_recipe, recipe_fields
from .steps import (autocast_dtype, capture_layers, compile_blocks, compile_warmup, ddp_kwargs, ddp_settings, dist_info,
                    length_grouped_batches, masked_span_loss, model_mask, rank_micro_batches, register_comm_hook,
                    span_loss, trim_length, zero_grads_in_place)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def training_params(cfg: SuiteConfig) -> dict:
    """The training run's MLflow params: the recipe's sections, flat."""
    return {f"train.{k}": v for k, v in vars(cfg.train).items()} | {
        "model": cfg.model.name, "base": cfg.model.base, "task": cfg.task.name,
        "max_seq_len": cfg.data.max_seq_len, "doc_stride": cfg.data.doc_stride, "data": cfg.data.source}


def train(cfg: SuiteConfig, *, log: Callable[[str], None] = print, tracker=None, evaluate: bool = True,
          command: str = "") -> dict:
    """Fine-tune per ``cfg`` and save to ``cfg.model_dir``. Returns the training metrics
    (``command``, the command line that ran it, is kept in them so every figure names its command).

    With a ``tracker``, rank 0 logs the training live to MLflow: the run starts now, gets loss and
    samples/s every few optimizer steps, and ends FINISHED when the model is saved, FAILED if
    training raises (tracking problems themselves never stop training)."""
    _, rank, _ = dist_info()
    mlrun = (tracker.training(cfg.name, cfg.model.name, training_params(cfg), cfg.model_dir)
             if tracker is not None and rank == 0 else None)
    try:
        return _train(cfg, log=log, mlrun=mlrun, evaluate=evaluate, command=command)
    except BaseException as e:
        if mlrun is not None:
            mlrun.fail(e)
        raise
    finally:  # a bench that trained its model goes on to measure rows beside it: free the GPU's cache
        gc.collect()  # (captured graphs and compiled code hold their memory until collected)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _train(cfg: SuiteConfig, *, log: Callable[[str], None], mlrun, evaluate: bool, command: str = "") -> dict:
    """The stages of a training run: the process and device, the training set, the model, the
    batch plan, what is compiled or captured before the clock, the optimizer, the timed loop, the
    metrics, the saved model."""
    t_all = time.perf_counter()
    tc = cfg.train
    world, rank, local_rank, device = _init_process(tc)
    task = get_task(cfg.task.name)
    trainset, featurize_s = _load_trainset(cfg, task, world, rank, log)
    features = trainset.features
    if tc.batch_size % (world * tc.grad_accum):
        raise ValueError(f"train.batch_size {tc.batch_size} (the global batch) must be divisible by "
                         f"{world} processes x {tc.grad_accum} accumulation steps")
    if rank == 0:
        log(f"train: {trainset.n_questions} questions -> {len(features)} features (seq {features.seq_len}) on "
            f"{world} x {device.type}; global batch {tc.batch_size} = {world} processes x {tc.grad_accum} steps x "
            f"{tc.batch_size // (world * tc.grad_accum)} rows")
    model, init_info, compiled_blocks, loss_fn, n_buckets = _build(cfg, device, features.seq_len, rank, log)
    plan = BatchPlan(tc, features, task.train_labels(features), device, world, rank)
    amp_dtype = autocast_dtype(tc.mixed_precision, device)
    pre = _before_the_clock(tc, model, loss_fn, plan, amp_dtype, device, compiled_blocks, n_buckets, rank, log)
    step = _step_machinery(tc, model, pre, amp_dtype, device, world, local_rank, n_buckets, plan.total_steps)
    loop = _timed_loop(cfg, step, plan, pre, loss_fn, amp_dtype, device, world, rank, mlrun, log)
    every = loss_log_every(plan.total_steps)
    collapsed = _refuse_collapse(tc, loop["losses"], every, world, device, log)
    metrics = _metrics(cfg, trainset, featurize_s, plan, pre, step, loop, device, world, compiled_blocks, init_info,
                       command)
    # the logged losses as the collapse check saw them, so its rule can be checked on real curves
    metrics |= {"train_losses": [round(v, 4) for v in loop["losses"]], "train_loss_every": every,
                "train_collapsed": collapsed}
    _save(cfg, task, model, metrics, device, world, rank, evaluate, mlrun, t_all, log)
    return metrics


# the backend evaluate_model scores a freshly trained model with (a bench whose reference row is
# this one takes that row's scores instead of evaluating twice: commands/bench.py)
DEV_EVALUATOR = "eager-fp32"


def loss_log_every(total_steps: int) -> int:
    """Steps between two logged losses: ~200 points a run, whatever its length."""
    return max(1, total_steps // 200)


def _refuse_collapse(tc, losses: list, every: int, world: int, device, log) -> Optional[str]:
    """TrainingCollapsedError, before anything is saved, where the loss fell and climbed back
    (loss_check.py): a bench on that model would judge every row against answers that mean nothing.
    Every process decides alike (a collapse seen by one is one for all: none waits at the save's
    barrier for one that raised). With train.refuse_collapse false: the collapse as a note, saved."""
    c = collapse(losses)
    seen = c is not None
    if world > 1:
        flag = torch.tensor([int(seen)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        seen = bool(flag.item())
    if not seen:
        return None
    what = ("the loss collapsed in another process" if c is None else
            f"its loss fell from {c.first:.2f} to {c.best:.2f} (around step {(c.best_point + 1) * every}) and "
            f"climbed back to {c.final:.2f} by the end")
    if not tc.refuse_collapse:
        log(f"train: WARNING: the fine-tune collapsed ({what}); saved anyway (train.refuse_collapse: false): "
            "accuracy on this model judges nothing")
        return what
    raise TrainingCollapsedError(
        f"train: the fine-tune collapsed: {what}; a model like this answers almost nothing, so nothing was "
        f"saved. Train again with another seed (--set train.seed=N; this run: {tc.seed}) or a lower learning "
        f"rate (--set train.learning_rate=X; this run: {tc.learning_rate:g}); --set train.refuse_collapse=false "
        "saves it for timing only")


def _init_process(tc) -> tuple[int, int, int, torch.device]:
    """(world, rank, local rank, device): the process group when torchrun started several, the
    device, the thread count and the seeds."""
    world, rank, local_rank = dist_info()
    cuda = torch.cuda.is_available()
    if world > 1:
        for k, v in SAFE_ENV.items():  # NVLink multicast off, here and in anything this starts
            os.environ.setdefault(k, v)
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)
    return world, rank, local_rank, device


def _load_trainset(cfg: SuiteConfig, task: Task, world: int, rank: int, log) -> tuple:
    """Rank 0 builds the training set (and its cache entry); the others wait, then read the cache."""
    t0 = time.perf_counter()
    if rank == 0:
        trainset = load_evalset(cfg.evalset_spec(), task, cfg.model.base, split="train", train=True, log=log)
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        trainset = load_evalset(cfg.evalset_spec(), task, cfg.model.base, split="train", train=True)
    return trainset, time.perf_counter() - t0


def _build(cfg: SuiteConfig, device: torch.device, seq_len: int, rank: int, log) -> tuple:
    """(model on the device, its init facts, the blocks compiled one by one, the loss function,
    the number of length buckets or None)."""
    tc = cfg.train
    model, init_info = build_model(cfg.task.name, cfg.model.base, random_init=cfg.model.random_init,
                                   config_overrides=cfg.model.config_overrides, seed=tc.seed,
                                   grow_from=cfg.model.grow_from, grow_stack=cfg.model.grow_stack)
    model = model.to(device)
    model.train()
    n_buckets = -(-seq_len // tc.seq_bucket) if tc.seq_bucket else None
    compiled_blocks: list = []
    if tc.compile and n_buckets:
        # A bounded set of shapes: the rows per micro-batch are fixed (full global batches only,
        # divisible by processes x accumulation steps) and the length takes at most n_buckets
        # values, so each bucket is compiled once as a static graph (no dynamic-shape guards or
        # symbolic sizes); the recompile limit must let every bucket in.
        import torch._dynamo.config as dynamo_config  # only when compiling: a slow import

        limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), n_buckets + 8))
    if tc.graph_layers and device.type != "cuda":
        raise ValueError(f"train.graph_layers replays CUDA graphs: it needs a CUDA device (this run: {device.type})")
    if tc.compile and tc.compile_scope == "layers":
        compiled_blocks = compile_blocks(model, dynamic=not n_buckets)
        if rank == 0:
            log(f"train: compiled the {len(compiled_blocks)} blocks of {compiled_blocks[0].rsplit('.', 1)[0]} "
                f"({'static, one graph per length bucket' if n_buckets else 'dynamic shapes'})")
    loss_fn = None
    if tc.loss_mask_padding:
        loss_fn = torch.compile(masked_span_loss, dynamic=not n_buckets) if tc.compile else masked_span_loss
    return model, init_info, compiled_blocks, loss_fn, n_buckets


class BatchPlan:
    """The run's batches: length-grouped global batches of ``train.batch_size`` rows (the global
    batch, not the per-process one, is the recipe: the same optimizer steps at the same learning
    rate on 1, 2 or 4 GPUs, so they reach the same model), this process's micro-batches of each,
    and how a micro-batch becomes tensors (trimmed to its longest feature, pinned)."""

    def __init__(self, tc, features, labels: dict, device: torch.device, world: int, rank: int):
        self.tc, self.features, self.device = tc, features, device
        self.labels = {k: np.asarray(v) for k, v in labels.items()}
        self.label_keys = tuple(self.labels)
        self.lengths = features.lengths()
        self.shapes: set = set()
        rng = np.random.default_rng(tc.seed)
        epochs = [length_grouped_batches(self.lengths, tc.batch_size, rng) for _ in range(max(1, math.ceil(tc.epochs)))]
        self.steps_per_epoch = max(1, len(features) // tc.batch_size)
        total = max(1, int(round(self.steps_per_epoch * tc.epochs)))
        # Full global batches only (drop_last): the same steps whatever the process count, and every
        # process gets rows of every batch (else its all-reduce would wait forever).
        global_batches = [gb for ep in epochs for gb in ep if len(gb) == tc.batch_size][:total]
        self.total_steps = len(global_batches)
        self.micro = [rank_micro_batches(gb, self.lengths, rank, world, tc.grad_accum) for gb in global_batches]

    def shape(self, rows) -> tuple[int, int]:
        # Trim to the longest feature, rounded up to 8 (tensor-core friendly) or to train.seq_bucket.
        return len(rows), trim_length(int(self.lengths[rows].max()), self.features.seq_len, self.tc.seq_bucket)

    def make(self, rows):
        rows_n, trim = self.shape(rows)
        self.shapes.add((rows_n, trim))
        batch = {k: torch.from_numpy(v) for k, v in self.features.inputs(rows, trim_to=trim).items()}
        batch.update({k: torch.from_numpy(np.ascontiguousarray(v[rows])) for k, v in self.labels.items()})
        if self.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return len(rows), int(self.lengths[rows].sum()), batch

    def graph_key(self, rows) -> tuple[int, int, bool]:
        """One batch per shape, and per "no padding at all": HF's BERT then passes no attention
        mask, which is another graph (a bucket of full 384-token windows does this)."""
        rows_n, trim = self.shape(rows)
        return rows_n, trim, bool((self.lengths[rows] == trim).all())

    def kinds(self) -> list:
        return list({self.graph_key(rows): rows for ms in self.micro for rows in ms}.values())

    def rows(self):
        return (rows for ms in self.micro for rows in ms)


def _before_the_clock(tc, model, loss_fn, plan: BatchPlan, amp_dtype, device, compiled_blocks, n_buckets, rank,
                      log) -> dict:
    """What is compiled or captured before the timed loop: {prepared mask, prepare_s, warmed
    shapes, graphed layers}."""
    # train.no_host_sync: the encoder's mask from the lengths the host knows (prepared_mask.py).
    # A model compiled whole has no check to skip (dynamo traces it away and always builds the
    # mask): it keeps the 2-D mask, so its unpadded batches trace no second graph.
    whole = tc.compile and tc.compile_scope != "layers"
    prepared = PreparedMask(model) if tc.no_host_sync and not whole else None
    if prepared is not None and not prepared.active:
        prepared = None  # an encoder that builds its mask otherwise keeps the 2-D one
    prepare_s, warmed = 0.0, 0
    if tc.compile and tc.compile_warmup and compiled_blocks and n_buckets:
        # Before DDP wraps the model: a throwaway backward then runs no all-reduce, so each
        # process compiles its own shapes without waiting for the others'.
        prepare_s, warmed = compile_warmup(model, loss_fn, plan.label_keys, amp_dtype, device, plan.kinds(), plan.make,
                                           prepared)
        if rank == 0:
            log(f"train: compiled {warmed} micro-batch shapes before the clock in {prepare_s:.1f} s (prepare time)")
    graphed = None
    if tc.graph_layers:
        graphed, capture_s = capture_layers(model, loss_fn, plan.label_keys, amp_dtype, device, plan.kinds(),
                                            plan.make, prepared)
        prepare_s += capture_s
        if rank == 0:
            log(f"train: captured {graphed.info()['cuda_graphs']} CUDA graphs ({len(graphed.layers)} layers x "
                f"{len(graphed.graphs)} shapes, forward and backward) before the clock in {capture_s:.1f} s")
        # before DDP wraps the model: its gradient-as-bucket-view then adopts these
        zero_grads_in_place(model)
    return {"prepared": prepared, "prepare_s": prepare_s, "warmed": warmed, "graphed": graphed}


def _step_machinery(tc, model, pre: dict, amp_dtype, device, world, local_rank, n_buckets, total_steps) -> dict:
    """The model as the step runs it (DDP, compiled whole), the optimizer, its schedule, the
    gradient scaler and the optimizer step."""
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs(tc, device, local_rank))
        register_comm_hook(ddp_model, tc.ddp_comm_hook)
    step_fn = ddp_model
    if tc.compile and tc.compile_scope != "layers":
        step_fn = torch.compile(ddp_model, dynamic=not n_buckets)
    if tc.graph_optimizer_step and (device.type != "cuda" or amp_dtype == torch.float16):
        raise ValueError(f"train.graph_optimizer_step needs a CUDA device and BF16 or FP32 (this run: {device.type}, "
                         f"{amp_dtype or 'fp32'}): FP16's GradScaler decides on the host whether to step")
    # fused on the CPU too (torch's vectorized one-pass AdamW, the same update): the default for-loop
    # makes ~7 passes over every parameter, 102-113 ms of a ~450 ms step of the default suite's
    # MiniLM on 2 AMD EPYC cores against 33 ms fused (2026-12-03, cpu-2core-reproducibility.md)
    optimizer = make_adamw(model, tc.learning_rate, tc.weight_decay, fused=True, capturable=tc.graph_optimizer_step)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(tc.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    opt_step = optimizer_step(model.parameters(), optimizer, 1.0, graphed=tc.graph_optimizer_step, scaler=scaler,
                              zero_to_none=pre["graphed"] is None)
    return {"ddp_model": ddp_model, "step_fn": step_fn, "scheduler": scheduler, "scaler": scaler,
            "opt_step": opt_step}


def _micro_step(step: dict, batch, rows_n, n_tokens, pre, loss_fn, label_keys, amp_dtype, device, sync, n_micro):
    """One micro-batch's forward and backward; returns its loss (detached, divided by n_micro)."""
    padded = has_padding(rows_n, n_tokens, batch["input_ids"].shape[1])
    batch = {key: t.to(device, non_blocking=True) for key, t in batch.items()}
    with sync:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = span_loss(step["step_fn"], loss_fn, batch, label_keys,
                             model_mask(pre["prepared"], batch, padded)) / n_micro
        if step["scaler"].is_enabled():
            step["scaler"].scale(loss).backward()
        else:
            loss.backward()
    return loss.detach()


def _timed_loop(cfg, step: dict, plan: BatchPlan, pre: dict, loss_fn, amp_dtype, device, world, rank, mlrun,
                log) -> dict:
    """The timed loop over every global batch; returns what it measured."""
    tc, total_steps = cfg.train, plan.total_steps
    log_every = loss_log_every(total_steps)
    n_step, seen, tokens, losses, epoch_ends = 0, 0, 0, [], []
    if mlrun is not None:
        mlrun.plan(total_steps, {"world_size": world, "device": str(device), "global_batch": tc.batch_size})
    sampler = UtilizationSampler(device) if rank == 0 else None
    bar = Progress(total_steps, "train", enabled=rank == 0, unit="step")
    window = profile_window(total_steps, tc.profile_steps) if rank == 0 else None
    prof = StepProfiler(*window, cuda=device.type == "cuda") if window else None
    graphs_before = compiled_graphs()
    t_train = time.perf_counter()
    batches = iter(Prefetcher(plan.make, plan.rows()))
    gc_watch = GcWatch(manual=tc.manual_gc)  # right before the try that puts the collector back
    # No host sync inside a step: copies from pinned memory are non-blocking, clipping runs on the
    # device (foreach, no .item(), no error_if_nonfinite), the disabled GradScaler (BF16/FP32)
    # is skipped, fused AdamW and the scheduler take Python-float learning rates. With
    # train.no_host_sync (the default) the logged loss arrives one log step late from a pinned copy
    # (loss_readback.py) and the encoder's mask is built from host-known lengths, so transformers
    # does not ask the GPU whether the batch is padded (prepared_mask.py); off, both wait.
    readback = DeferredLoss(defer=tc.no_host_sync)

    def report(value: float, at: dict) -> None:
        losses.append(value)
        bar.update(at["step"] - bar.n, postfix=f"loss={value:.3f}")
        if mlrun is not None:  # samples/s between the clock readings of the points, not their logging
            mlrun.step(at["step"], value, at["samples"], total_steps, at_time=at["t"], lr=at["lr"])

    def phase(name):
        return prof.phase(name) if prof is not None else contextlib.nullcontext()

    try:
        for ms in plan.micro:
            if prof is not None:
                prof.begin(n_step)
            loss_acc = None
            with phase("forward_backward"):
                for i, _ in enumerate(ms):
                    rows_n, n_tokens, batch = next(batches)
                    # DDP: all-reduce the gradients once, after the last micro-batch of the global batch.
                    sync = contextlib.nullcontext() if world == 1 or i == len(ms) - 1 else step["ddp_model"].no_sync()
                    loss = _micro_step(step, batch, rows_n, n_tokens, pre, loss_fn, plan.label_keys, amp_dtype, device,
                                       sync, len(ms))
                    seen, tokens = seen + rows_n, tokens + n_tokens
                    loss_acc = loss if loss_acc is None else loss_acc + loss
            with phase("optimizer"):
                step["opt_step"]()
                step["scheduler"].step()
            n_step += 1
            if prof is not None:
                prof.end(n_step)
            if n_step % plan.steps_per_epoch == 0:
                if device.type == "cuda":
                    # the epoch's time is the GPU's: without per-step syncs the host may be steps ahead
                    torch.cuda.synchronize(device)
                epoch_ends.append(time.perf_counter() - t_train)
                gc_watch.epoch_end()
            if n_step % log_every == 0 or n_step == total_steps:
                for value, at in readback.push(loss_acc, step=n_step, samples=seen * world,
                                               lr=step["scheduler"].get_last_lr()[0], t=time.perf_counter()):
                    report(value, at)
        if device.type == "cuda":
            torch.cuda.synchronize()  # a CUDA or NCCL error often surfaces here: still inside the try
        end = time.perf_counter()  # the last step is done here (the GPU's queue drained)
        for value, at in readback.flush():  # the last point, read back late: it ends at `end`, not now
            report(value, {**at, "t": end} if at["step"] == total_steps else at)
    finally:
        gc_stats = gc_watch.stop()  # the collector as it was, whatever ended the loop
    bar.close()
    train_s = time.perf_counter() - t_train
    graphed = pre["graphed"]
    # the layer stacks the loop replayed from the graphs (one per micro-step when all are graphed)
    graph_info = {**graphed.info(), "graphed_micro_steps": graphed.replays} if graphed else {}
    if graphed is not None:
        graphed.uninstall()  # the graphs' memory goes before evaluation; the weights stay
    return {"train_s": train_s, "seen": seen, "tokens": tokens, "losses": losses, "epoch_ends": epoch_ends,
            "compiled_in_loop": compiled_graphs() - graphs_before, "graph_info": graph_info, "gc_stats": gc_stats,
            "util": sampler.stop() if sampler is not None else {}, "profiled": _write_profile(cfg, prof, log)}


def _write_profile(cfg, prof, log) -> dict:
    if prof is None or prof.prof is None or prof.active:
        return {}
    out_dir = Path(cfg.results_root) / "profiles" / f"{time.strftime('%Y%m%d-%H%M%S')}-train-{cfg.model.name}"
    profiled = prof.write(out_dir)
    profiled["overhead_s"] = prof.overhead_s  # inside train_s: starting/stopping the profiler
    log(f"train: profile of {prof.n} steps in {out_dir}: {profiled['step_ms']:.2f} ms/step"
        + (f", GPU idle {profiled['gpu_idle_fraction']:.1%}" if profiled["gpu_idle_fraction"] is not None else ""))
    return profiled


def _metrics(cfg, trainset, featurize_s, plan: BatchPlan, pre, step, loop, device, world, compiled_blocks, init_info,
             command) -> dict:
    tc, fields = cfg.train, recipe_fields(cfg)
    train_s, seen, losses, epoch_ends = loop["train_s"], loop["seen"], loop["losses"], loop["epoch_ends"]
    return {
        "train_questions": trainset.n_questions, "train_features": len(plan.features), "train_steps": plan.total_steps,
        "train_samples_per_s": seen * world / train_s, "train_s": train_s, "featurize_s": featurize_s,
        "train_epoch_s": [round(b - a, 2) for a, b in zip([0.0] + epoch_ends, epoch_ends)],
        "train_tokens_per_s": loop["tokens"] * world / train_s,
        "final_loss": float(np.mean(losses[-5:])) if losses else float("nan"), "device": str(device),
        "device_name": device_name(device.type), "command": command, "date": time.strftime("%Y-%m-%d"),
        "world_size": world, "global_batch": tc.batch_size, "grad_accum": tc.grad_accum, "compile": tc.compile,
        "compile_scope": tc.compile_scope if tc.compile else None, "compiled_blocks": len(compiled_blocks),
        "graph_layers": tc.graph_layers, **loop["graph_info"],
        # compile before the clock (train.compile_warmup): its cost, the shapes it compiled, and
        # the graphs dynamo still compiled inside the timed loop (0 when the warm-up covered all)
        "train_prepare_s": round(pre["prepare_s"], 3), "train_warmup_shapes": pre["warmed"],
        "compiled_graphs_in_loop": loop["compiled_in_loop"],
        "train_samples_per_s_with_prepare": seen * world / (train_s + pre["prepare_s"]),
        "seq_bucket": tc.seq_bucket, "loss_mask_padding": tc.loss_mask_padding,
        # the distinct lengths (and rows) of this process's micro-batches: the shapes a compiled step saw
        "train_lengths": sorted({t for _, t in plan.shapes}), "train_rows": sorted({r for r, _ in plan.shapes}),
        "ddp": ddp_settings(step["ddp_model"]) if world > 1 else None,  # as DDP runs them, read back
        # as configured, at every world size (the 1-GPU row of a series names it too); applies at world > 1
        "optimizer_step": step["opt_step"].kind, "ddp_comm_hook": tc.ddp_comm_hook,
        # no host sync in the step: the loss read late, and the mask built by the trainer (False
        # where the encoder does not build it with transformers' create_bidirectional_mask)
        "no_host_sync": tc.no_host_sync, "prepared_mask": pre["prepared"] is not None,
        **loop["gc_stats"],
        **({"profile": loop["profiled"]} if loop["profiled"] else {}),
        "seed": tc.seed, "base": cfg.model.base, "random_init": cfg.model.random_init, **loop["util"], **init_info,
        "recipe": model_recipe(cfg, fields), "recipe_fields": fields,
    }


def _save(cfg, task, model, metrics: dict, device, world, rank, evaluate, mlrun, t_all, log) -> None:
    """Rank 0 saves the model, its tokenizer and metrics (with the dev scores), swapped in whole,
    so an interrupted run never leaves a half-written model behind."""
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        out = Path(cfg.model_dir)
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            load_tokenizer(cfg.model.base).save_pretrained(tmp)
            if evaluate:
                metrics.update(evaluate_model(cfg, task, tmp, device, log))
            metrics["total_s"] = time.perf_counter() - t_all
            atomic_write_json(tmp / METRICS_FILE, metrics)
        log(f"train: saved {out} " + json.dumps({k: metrics[k] for k in metrics if k.startswith("dev_")}))
        if mlrun is not None:
            mlrun.finish(metrics, out)
    if world > 1:
        torch.distributed.destroy_process_group()


def evaluate_model(cfg: SuiteConfig, task: Task, model_dir: Path, device: torch.device, log) -> dict:
    """Dev scores with the benchmark's own reference backend, batch plan, postprocessing and
    scorer (in this process: the model was just trained here)."""
    evalset = load_evalset(cfg.evalset_spec(), task, str(model_dir), log=log)
    plan = make_plan(evalset.lengths(), batching="padded", batch_size=cfg.bench.batch_size,
                     max_seq_len=evalset.features.seq_len)
    variant = VariantTable.for_suite(cfg.variants, cfg.bench.device).get(DEV_EVALUATOR, device=device.type)
    job = Job(variant=variant.to_dict(), model_dir=str(model_dir), task=task.name,
              artifacts_dir=str(cfg.artifacts_root), evalset=str(evalset.path), plan="", outputs="", result="",
              output_names=list(task.output_names), token_outputs=list(task.token_outputs),
              max_seq_len=evalset.features.seq_len, warmup_batches=1)
    record, outputs = execute(job, plan=plan, inputs=evalset.features.inputs())
    if outputs is None:
        raise RuntimeError(f"evaluation with {variant.name} did not run: {record.get('error')}")
    mask_padding(outputs, evalset.features.attention_mask, task.token_outputs)
    predictions = task.postprocess(evalset.examples, evalset.features, outputs, cfg.task.options)
    scores = task.score(evalset.examples, predictions, cfg.task.options)
    return {f"dev_{k}": float(v) for k, v in scores.items()} | {"dev_questions": evalset.n_questions}


