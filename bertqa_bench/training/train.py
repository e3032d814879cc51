"""Fine-tune the suite's model (the task's head on a pretrained or random encoder) and save it.

AdamW with a linear warmup/decay schedule, seeded, mixed precision on CUDA, and DDP when
launched by ``torchrun`` with several processes. Training features come from the evaluation-set
cache (built once, split "train"); the saved directory holds the model, the tokenizer and
``train_metrics.json`` with dev scores from the benchmark's own reference backend, batch
plan, postprocessing and scorer. ``ensure_model`` trains only when models/ lacks the model.
"""
from __future__ import annotations

import contextlib
import gc
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

from ..config import ADDED_DEFAULTS, METRICS_FILE, SuiteConfig
from ..envinfo import device_name
from ..io import atomic_dir, atomic_write_json
from ..model.modeling import build_model, count_parameters, load_tokenizer
from ..tasks import Task, get_task
from .loss_readback import DeferredLoss
from .optimizer_step import make_adamw, optimizer_step
from .prepared_mask import PreparedMask, has_padding



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
# seq_bucket only pads micro-batches further: with the padding masked out of attention and of the
# loss (loss_mask_padding, which seq_bucket requires and which is in the recipe) the model is the
# same up to numerics. DDP's options decide when gradients travel, not their sum; profile_steps
# only watches.
_HOW_FAST = {"num_threads", "compile", "compile_scope", "graph_layers", "compile_warmup", "grad_accum", "seq_bucket",
             "ddp_bucket_cap_mb", "ddp_static_graph", "ddp_gradient_as_bucket_view", "ddp_comm_hook",
             "graph_optimizer_step", "manual_gc", "no_host_sync", "profile_steps"}


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


def trim_length(longest: int, seq_len: int, bucket: int = 0) -> int:
    """The length a micro-batch is trimmed to: its longest feature rounded up to a multiple of
    ``bucket`` (0: of 8, tensor-core friendly), never past the features' ``seq_len``. With a
    bucket, training sees at most ceil(seq_len / bucket) shapes."""
    m = bucket if bucket > 0 else 8
    return min(int(seq_len), -(-int(longest) // m) * m)


def ddp_kwargs(tc, device: torch.device, local_rank: int) -> dict:
    """DistributedDataParallel's keyword arguments from ``train.ddp_*`` (config.py says what each
    does). ``bucket_cap_mb`` is passed only when set, so None keeps DDP's own default (25 MB)."""
    kw = {"device_ids": [local_rank] if device.type == "cuda" else None,
          "gradient_as_bucket_view": bool(tc.ddp_gradient_as_bucket_view), "static_graph": bool(tc.ddp_static_graph)}
    if tc.ddp_bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = float(tc.ddp_bucket_cap_mb)
    return kw


def register_comm_hook(ddp_model, name: str) -> None:
    """train.ddp_comm_hook: DDP's own hooks: its FP32 all-reduce with one division a bucket
    (``allreduce``), or compressed (gradients cast for the all-reduce, then back); "none" keeps
    DDP's built-in FP32 all-reduce, which divides each gradient on its own."""
    if name == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(None, {"allreduce": default_hooks.allreduce_hook,
                                        "bf16": default_hooks.bf16_compress_hook,
                                        "fp16": default_hooks.fp16_compress_hook}[name])


def ddp_settings(ddp_model) -> dict:
    """What the DistributedDataParallel object really runs with (read back from it, not from the
    config), for train_metrics.json."""
    return {"bucket_cap_mb": ddp_model.bucket_bytes_cap / 2**20, "static_graph": bool(ddp_model.static_graph),
            "gradient_as_bucket_view": bool(ddp_model.gradient_as_bucket_view)}


def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated layer stack: the children of its largest ModuleList whose children
    all share one class (BERT's ``encoder.layer``, DistilBERT's ``transformer.layer``, ...), with
    their names. Empty when the model has none."""
    best: list = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 and len({type(c) for c in mod}) == 1 \
                and len(mod) > len(best):
            best = [(f"{name}.{i}", c) for i, c in enumerate(mod)]
    return best


def compile_blocks(model: torch.nn.Module, dynamic: bool, **options) -> list[str]:
    """Regional compilation: compile each of the model's repeated blocks in place (the blocks
    share the compiled code, so a new shape is traced once, not once per layer); the rest of the
    model stays eager. Returns the compiled blocks' names; raises when there are none."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"train.compile_scope=layers: {type(model).__name__} has no repeated layer stack "
                         f"(a ModuleList of one block class); use train.compile_scope=model")
    for _, block in blocks:
        block.compile(dynamic=dynamic, **options)
    return [n for n, _ in blocks]


def masked_span_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, attention_mask: torch.Tensor,
                     start_positions: torch.Tensor, end_positions: torch.Tensor,
                     answer_type_logits: Optional[torch.Tensor] = None,
                     answer_types: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The models' own QA loss (HF's: mean of the start and end cross-entropies, out-of-range
    positions ignored; NQ's: plus the answer-type cross-entropy, over 3) with the padding
    positions' logits masked out of the softmax, in FP32. Padding then adds exactly nothing to the
    loss, so trimming a batch to 200 or to 256 tokens trains the same model up to numerics."""
    import torch.nn.functional as F

    pad = attention_mask == 0
    ignored = start_logits.size(1)

    def ce(logits, pos):
        logits = logits.float().masked_fill(pad, torch.finfo(torch.float32).min)
        return F.cross_entropy(logits, pos.view(-1).clamp(0, ignored), ignore_index=ignored)

    loss = ce(start_logits, start_positions) + ce(end_logits, end_positions)
    if answer_type_logits is not None and answer_types is not None:
        return (loss + F.cross_entropy(answer_type_logits.float(), answer_types.view(-1))) / 3
    return loss / 2


def profile_window(total_steps: int, n: int) -> Optional[tuple[int, int]]:
    """(first step, steps) to profile: ``n`` optimizer steps from half-way through training (after
    the first of 2 epochs every length bucket has been compiled and the allocator is warm), moved
    earlier when training is too short; None when off."""
    if n <= 0 or total_steps <= 0:
        return None
    n = min(n, total_steps)
    return min(total_steps - n, total_steps // 2), n


class StepProfiler:
    """torch.profiler over a window of optimizer steps (rank 0 only): CPU activity, and CUDA on a
    GPU. ``phase(name)`` marks the loop's parts (forward+backward, optimizer) in the trace, and is
    free outside the window. The tables are written after training (``write``), so the profiled
    run's own throughput pays only for the window's recording, not for the analysis."""

    def __init__(self, start: int, n: int, cuda: bool):
        self.start, self.n, self.cuda = start, n, cuda
        self.prof = None
        self.active = False
        self.t0 = self.wall_s = 0.0
        self.overhead_s = 0.0  # profiler start/stop on the host inside the timed loop

    def begin(self, step: int) -> None:
        if step != self.start or self.prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        t = time.perf_counter()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts, record_shapes=False)
        self.prof.__enter__()
        if self.cuda:
            torch.cuda.synchronize()  # one sync at each edge of the window: step time = wall / n
        self.active = True
        self.t0 = time.perf_counter()
        self.overhead_s += self.t0 - t

    def end(self, step: int) -> None:
        if not self.active or step != self.start + self.n:
            return
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        self.wall_s = t - self.t0
        self.prof.__exit__(None, None, None)
        self.active = False
        self.overhead_s += time.perf_counter() - t

    def phase(self, name: str):
        from torch.profiler import record_function

        return record_function(f"train/{name}") if self.active else contextlib.nullcontext()

    def write(self, out: Path, top: int = 25) -> dict:
        """trace.json, top_kernels.{txt,csv} (profile.py's tables), kernels.md (kernel name,
        calls, total ms, % of the window) and profile.json (step time, GPU idle fraction, time
        per phase on the host)."""
        from ..measuring.trace_tables import phase_times, top_kernels, write_profile

        res = write_profile(self.prof, out, self.cuda, top=top)
        kernels = top_kernels(res["trace"], top=top) if self.cuda else []
        what = "kernel" if kernels else "operator (self CPU)"
        if not kernels:  # CPU: operators by self CPU time stand in for kernels
            total = sum(r["self_cpu_us"] for r in res["all_rows"]) or 1.0
            kernels = [{"name": r["name"], "calls": r["calls"], "total_ms": r["self_cpu_us"] / 1e3,
                        "pct": 100.0 * r["self_cpu_us"] / total} for r in res["rows"]]
        step_ms = 1e3 * self.wall_s / self.n
        idle = res["gpu_idle"]
        summary = {"dir": str(out), "steps": self.n, "first_step": self.start, "window_s": self.wall_s,
                   "step_ms": step_ms, "gpu_idle_fraction": idle["idle_fraction"] if idle else None,
                   "gpu_busy_ms": idle["busy_ms"] if idle else None,
                   "phases_ms_per_step": {k: v / self.n for k, v in phase_times(res["trace"], "train/").items()},
                   "top": kernels[:10]}
        lines = [f"# Training profile: {self.n} optimizer steps from step {self.start}", "",
                 f"- step time: {step_ms:.2f} ms (wall time of the window / {self.n}, synchronized at its edges)"]
        if idle:
            lines.append(f"- GPU idle: {idle['idle_fraction']:.1%} of {idle['window_ms']:.1f} ms "
                         f"(busy {idle['busy_ms']:.1f} ms: kernels, copies)")
        lines += [f"- host time per step in {k}: {v:.2f} ms" for k, v in summary["phases_ms_per_step"].items()]
        lines += ["", f"| {what} | calls | total ms | % |", "|---|---:|---:|---:|"]
        lines += [f"| {k['name'][:120].replace('|', '/')} | {k['calls']} | {k['total_ms']:.3f} | {k['pct']:.1f} |"
                  for k in kernels]
        (out / "kernels.md").write_text("\n".join(lines) + "\n")
        atomic_write_json(out / "profile.json", summary | {"kernels": kernels})
        return summary


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


_KEEP = object()


def span_loss(step_fn, loss_fn, batch: dict, label_keys: tuple, model_mask=_KEEP) -> torch.Tensor:
    """One micro-batch's loss: the model's own (HF's, ``loss_fn`` None), or the padding-masked
    ``loss_fn`` over the model's logits (the labels are not passed to the model then).
    ``model_mask``: the attention mask the model gets instead of the batch's 2-D one (a prepared
    mask or None, prepared_mask.py); the loss keeps the 2-D one."""
    inputs = batch if loss_fn is None else {k: v for k, v in batch.items() if k not in label_keys}
    if model_mask is not _KEEP:
        inputs = {**inputs, "attention_mask": model_mask}
    if loss_fn is None:
        return step_fn(**inputs).loss
    out = step_fn(**inputs)
    return loss_fn(out.start_logits, out.end_logits, batch["attention_mask"], batch["start_positions"],
                   batch["end_positions"], getattr(out, "answer_type_logits", None), batch.get("answer_types"))


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class GcWatch:
    """Python's garbage collections inside the timed loop: counted and timed (``gc.callbacks``)
    always; with ``manual``, the collector is off in the loop (everything alive before it frozen:
    ``gc.freeze``) and collects once per epoch end, at the same step on every rank."""

    def __init__(self, manual: bool):
        self.manual, self.n, self.pause_s, self._t0 = manual, 0, 0.0, None
        self._was_enabled = gc.isenabled()
        self._stopped = False
        # gc.unfreeze() thaws everything frozen, so only thaw when nothing was frozen before us
        self._frozen_before = gc.get_freeze_count()
        if manual:
            gc.collect()  # before the loop: not one of its pauses
            gc.freeze()
            gc.disable()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.n += 1
            self.pause_s += time.perf_counter() - self._t0
            self._t0 = None

    def epoch_end(self) -> None:
        if self.manual:
            gc.collect()

    def stop(self) -> dict:
        """Puts the collector back as it was (once; later calls only report); returns what the
        loop saw."""
        if not self._stopped:
            self._stopped = True
            gc.callbacks.remove(self._callback)
            if self.manual:
                if self._frozen_before == 0:
                    gc.unfreeze()
                if self._was_enabled:
                    gc.enable()
        return {"manual_gc": self.manual, "gc_collections_in_loop": self.n, "gc_pause_s": round(self.pause_s, 4)}


def zero_grads_in_place(model: torch.nn.Module) -> int:
    """Give every trainable parameter a zero gradient of its own memory. Under CUDA graphs the
    backward's gradient outputs live in the graphs' memory pool, which the next replay writes
    into: autograd must add them into these tensors, never take them as the gradient itself (it
    does take a new gradient whole when ``.grad`` is None). Returns how many were created."""
    made = 0
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
            made += 1
    return made


@contextlib.contextmanager
def leaves_no_trace(model: torch.nn.Module, device: torch.device):
    """Passes before the clock (compiling, capturing) that the timed run must not feel: the
    gradients they leave are dropped and the RNG state is put back, so the timed run draws the same
    dropout masks and takes the same steps as without them."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    yield
    model.zero_grad(set_to_none=True)
    if cuda_rng is not None:
        torch.cuda.synchronize(device)
        torch.cuda.set_rng_state(cuda_rng, device)
    torch.set_rng_state(cpu_rng)


def shape_batches(representatives, make, device: torch.device):
    """One real batch per micro-batch shape (``representatives``: one row set per shape; ``make``
    builds its batch), on the device, with whether it pads any row: what the passes before the
    clock run."""
    for rows in representatives:
        rows_n, n_tokens, batch = make(rows)
        yield ({k: t.to(device, non_blocking=True) for k, t in batch.items()},
               has_padding(rows_n, n_tokens, batch["input_ids"].shape[1]))


def model_mask(prepared: Optional[PreparedMask], batch: dict, padded: bool):
    """What span_loss gives the model as its mask: the prepared one, or the batch's own."""
    return _KEEP if prepared is None else prepared(batch["attention_mask"], padded)


def capture_layers(model: torch.nn.Module, loss_fn, label_keys: tuple, amp_dtype, device: torch.device,
                   representatives, make, prepared: Optional[PreparedMask] = None):
    """train.graph_layers: capture the model's repeated layers as CUDA graphs for every
    micro-batch shape before the clock (``representatives``: one row set per shape). Each shape's
    first-layer inputs come from the model itself on a real batch of that shape, so the graphs
    see the mask exactly as the model builds it. The capture's warm-up runs draw dropout masks
    and compute gradients that autograd does not keep; the RNG state is put back after. Returns
    (the GraphedLayers, now routing the layers' calls, and seconds)."""
    from .graphed_layers import GraphedLayers, first_layer_inputs

    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"train.graph_layers: {type(model).__name__} has no repeated layer stack to capture")
    t0 = time.perf_counter()
    graphed = GraphedLayers([b for _, b in blocks])
    with leaves_no_trace(model, device):
        for batch, padded in shape_batches(representatives, make, device):
            # make_graphed_callables refuses autocast's weight cache (a cached cast would be captured)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None, cache_enabled=False):
                hidden, mask = first_layer_inputs(model, blocks[0][1], lambda: span_loss(
                    model, loss_fn, batch, label_keys, model_mask(prepared, batch, padded)))
                graphed.capture(hidden, mask)
    graphed.install()
    return graphed, time.perf_counter() - t0


def compile_warmup(model: torch.nn.Module, loss_fn, label_keys: tuple, amp_dtype, device: torch.device,
                   representatives, make, prepared: Optional[PreparedMask] = None) -> tuple[float, int]:
    """Compile every micro-batch shape before the clock: one forward + backward of a real batch
    per shape (``representatives``: one row set per shape; ``make`` builds its batch), then the
    gradients are dropped and the RNG state put back, so the timed run draws the same dropout
    masks and takes the same steps as without the warm-up. No optimizer step: the weights do not
    move. Returns (seconds, shapes)."""
    t0 = time.perf_counter()
    n = 0
    with leaves_no_trace(model, device):
        for batch, padded in shape_batches(representatives, make, device):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = span_loss(model, loss_fn, batch, label_keys, model_mask(prepared, batch, padded))
            loss.backward()
            n += 1
    return time.perf_counter() - t0, n


def _train(cfg: SuiteConfig, *, log: Callable[[str], None], mlrun, evaluate: bool, command: str = "") -> dict:
    from transformers import get_linear_schedule_with_warmup

    from ..data.evalset import load_evalset
    from ..measuring.measure import UtilizationSampler
    from ..measuring.progress import Progress

    t_all = time.perf_counter()
    tc = cfg.train
    world, rank, local_rank = _dist_info()
    cuda = torch.cuda.is_available()
    if world > 1:
        from ..measuring.launcher import SAFE_ENV

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
    n_buckets = -(-features.seq_len // tc.seq_bucket) if tc.seq_bucket else None
    compiled_blocks: list = []
    if tc.compile and n_buckets:
        # A bounded set of shapes: the rows per micro-batch are fixed (full global batches only,
        # divisible by processes x accumulation steps) and the length takes at most n_buckets
        # values, so each bucket is compiled once as a static graph (no dynamic-shape guards or
        # symbolic sizes); the recompile limit must let every bucket in.
        import torch._dynamo.config as dynamo_config

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

    # The global batch, not the per-process one, is the recipe: the same number of optimizer
    # steps with the same learning rate on 1, 2 or 4 GPUs, so they reach the same model.
    n = len(features)
    lengths = features.lengths()
    rng = np.random.default_rng(tc.seed)
    epochs = [length_grouped_batches(lengths, tc.batch_size, rng) for _ in range(max(1, math.ceil(tc.epochs)))]
    steps_per_epoch = max(1, n // tc.batch_size)
    total_steps = max(1, int(round(steps_per_epoch * tc.epochs)))
    amp_dtype = _autocast_dtype(tc.mixed_precision, device)

    shapes: set = set()

    def shape(rows) -> tuple[int, int]:
        # Trim to the longest feature, rounded up to 8 (tensor-core friendly) or to train.seq_bucket.
        return len(rows), trim_length(int(lengths[rows].max()), features.seq_len, tc.seq_bucket)

    def make(rows):
        rows_n, trim = shape(rows)
        shapes.add((rows_n, trim))
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
    label_keys = tuple(labels)

    prepare_s, warmed = 0.0, 0

    # One batch per shape, and per "no padding at all": HF's BERT then passes no attention mask,
    # which is another graph (a bucket of full 384-token windows does this).
    def graph_key(rows) -> tuple[int, int, bool]:
        rows_n, trim = shape(rows)
        return rows_n, trim, bool((lengths[rows] == trim).all())

    kinds = {graph_key(rows): rows for ms in micro for rows in ms}
    # train.no_host_sync: the encoder's mask from the lengths the host knows (prepared_mask.py).
    # A model compiled whole has no check to skip (dynamo traces it away and always builds the
    # mask): it keeps the 2-D mask, so its unpadded batches trace no second graph.
    whole = tc.compile and tc.compile_scope != "layers"
    prepared = PreparedMask(model) if tc.no_host_sync and not whole else None
    if prepared is not None and not prepared.active:
        prepared = None  # an encoder that builds its mask otherwise keeps the 2-D one
    if tc.compile and tc.compile_warmup and compiled_blocks and n_buckets:
        # Before DDP wraps the model: a throwaway backward then runs no all-reduce, so each
        # process compiles its own shapes without waiting for the others'.
        prepare_s, warmed = compile_warmup(model, loss_fn, label_keys, amp_dtype, device, kinds.values(), make,
                                           prepared)
        if rank == 0:
            log(f"train: compiled {warmed} micro-batch shapes before the clock in {prepare_s:.1f} s (prepare time)")
    graphed = None
    if tc.graph_layers:
        graphed, capture_s = capture_layers(model, loss_fn, label_keys, amp_dtype, device, kinds.values(), make,
                                            prepared)
        prepare_s += capture_s
        if rank == 0:
            log(f"train: captured {graphed.info()['cuda_graphs']} CUDA graphs ({len(graphed.layers)} layers x "
                f"{len(graphed.graphs)} shapes, forward and backward) before the clock in {capture_s:.1f} s")
        # before DDP wraps the model: its gradient-as-bucket-view then adopts these
        zero_grads_in_place(model)
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
    optimizer = make_adamw(model, tc.learning_rate, tc.weight_decay, fused=device.type == "cuda",
                           capturable=tc.graph_optimizer_step)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(tc.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    opt_step = optimizer_step(model.parameters(), optimizer, 1.0, graphed=tc.graph_optimizer_step, scaler=scaler,
                              zero_to_none=graphed is None)

    log_every = max(1, total_steps // 200)
    step, seen, tokens, losses = 0, 0, 0, []
    if mlrun is not None:
        mlrun.plan(total_steps, {"world_size": world, "device": str(device), "global_batch": tc.batch_size})
    sampler = UtilizationSampler(device) if rank == 0 else None
    bar = Progress(total_steps, "train", enabled=rank == 0, unit="step")
    window = profile_window(total_steps, tc.profile_steps) if rank == 0 else None
    prof = StepProfiler(*window, cuda=device.type == "cuda") if window else None
    graphs_before = _compiled_graphs()
    t_train = time.perf_counter()
    epoch_ends = []
    batches = iter(Prefetcher(make, (rows for ms in micro for rows in ms)))
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
        if mlrun is not None:
            mlrun.step(at["step"], value, at["samples"], total_steps, lr=at["lr"])

    try:
        for ms in micro:
            if prof is not None:
                prof.begin(step)
            loss_acc = None
            with prof.phase("forward_backward") if prof is not None else contextlib.nullcontext():
                for i, _ in enumerate(ms):
                    rows_n, n_tokens, batch = next(batches)
                    padded = has_padding(rows_n, n_tokens, batch["input_ids"].shape[1])
                    batch = {key: t.to(device, non_blocking=True) for key, t in batch.items()}
                    # DDP: all-reduce the gradients once, after the last micro-batch of the global batch.
                    sync = contextlib.nullcontext() if world == 1 or i == len(ms) - 1 else ddp_model.no_sync()
                    with sync:
                        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                            loss = span_loss(step_fn, loss_fn, batch, label_keys,
                                             model_mask(prepared, batch, padded)) / len(ms)
                        if scaler.is_enabled():
                            scaler.scale(loss).backward()
                        else:
                            loss.backward()
                    seen, tokens = seen + rows_n, tokens + n_tokens
                    loss_acc = loss.detach() if loss_acc is None else loss_acc + loss.detach()
            with prof.phase("optimizer") if prof is not None else contextlib.nullcontext():
                opt_step()
                scheduler.step()
            step += 1
            if prof is not None:
                prof.end(step)
            if step % steps_per_epoch == 0:
                if device.type == "cuda":
                    # the epoch's time is the GPU's: without per-step syncs the host may be steps ahead
                    torch.cuda.synchronize(device)
                epoch_ends.append(time.perf_counter() - t_train)
                gc_watch.epoch_end()
            if step % log_every == 0 or step == total_steps:
                for value, at in readback.push(loss_acc, step=step, samples=seen * world,
                                               lr=scheduler.get_last_lr()[0]):
                    report(value, at)
        if device.type == "cuda":
            torch.cuda.synchronize()  # a CUDA or NCCL error often surfaces here: still inside the try
        for value, at in readback.flush():
            report(value, at)
    finally:
        gc_stats = gc_watch.stop()  # the collector as it was, whatever ended the loop
    bar.close()
    train_s = time.perf_counter() - t_train
    compiled_in_loop = _compiled_graphs() - graphs_before
    # the layer stacks the loop replayed from the graphs (one per micro-step when all are graphed)
    graph_info = {**graphed.info(), "graphed_micro_steps": graphed.replays} if graphed else {}
    if graphed is not None:
        graphed.uninstall()  # the graphs' memory goes before evaluation; the weights stay
    util = sampler.stop() if sampler is not None else {}
    profiled = {}
    if prof is not None and prof.prof is not None and not prof.active:
        out_dir = Path(cfg.results_root) / "profiles" / f"{time.strftime('%Y%m%d-%H%M%S')}-train-{cfg.model.name}"
        profiled = prof.write(out_dir)
        profiled["overhead_s"] = prof.overhead_s  # inside train_s: starting/stopping the profiler
        log(f"train: profile of {prof.n} steps in {out_dir}: {profiled['step_ms']:.2f} ms/step"
            + (f", GPU idle {profiled['gpu_idle_fraction']:.1%}" if profiled["gpu_idle_fraction"] is not None else ""))

    fields = recipe_fields(cfg)
    metrics = {
        "train_questions": trainset.n_questions, "train_features": n, "train_steps": total_steps,
        "train_samples_per_s": seen * world / train_s, "train_s": train_s, "featurize_s": featurize_s,
        "train_epoch_s": [round(b - a, 2) for a, b in zip([0.0] + epoch_ends, epoch_ends)],
        "train_tokens_per_s": tokens * world / train_s,
        "final_loss": float(np.mean(losses[-5:])) if losses else float("nan"), "device": str(device),
        "device_name": device_name(device.type), "command": command, "date": time.strftime("%Y-%m-%d"),
        "world_size": world, "global_batch": tc.batch_size, "grad_accum": tc.grad_accum, "compile": tc.compile,
        "compile_scope": tc.compile_scope if tc.compile else None, "compiled_blocks": len(compiled_blocks),
        "graph_layers": tc.graph_layers, **graph_info,
        # compile before the clock (train.compile_warmup): its cost, the shapes it compiled, and
        # the graphs dynamo still compiled inside the timed loop (0 when the warm-up covered all)
        "train_prepare_s": round(prepare_s, 3), "train_warmup_shapes": warmed, "compiled_graphs_in_loop": compiled_in_loop,
        "train_samples_per_s_with_prepare": seen * world / (train_s + prepare_s),
        "seq_bucket": tc.seq_bucket, "loss_mask_padding": tc.loss_mask_padding,
        # the distinct lengths (and rows) of this process's micro-batches: the shapes a compiled step saw
        "train_lengths": sorted({t for _, t in shapes}), "train_rows": sorted({r for r, _ in shapes}),
        "ddp": ddp_settings(ddp_model) if world > 1 else None,  # as DDP runs them, read back
        # as configured, at every world size (the 1-GPU row of a series names it too); applies at world > 1
        "optimizer_step": opt_step.kind, "ddp_comm_hook": tc.ddp_comm_hook,
        # no host sync in the step: the loss read late, and the mask built by the trainer (False
        # where the encoder does not build it with transformers' create_bidirectional_mask)
        "no_host_sync": tc.no_host_sync, "prepared_mask": prepared is not None,
        **gc_stats,
        **({"profile": profiled} if profiled else {}),
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
    from ..backends.variants import VariantTable
    from ..data.evalset import load_evalset
    from ..measuring.schedule import make_plan, mask_padding
    from ..measuring.worker import Job, execute

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
    from ..model.checkpoint import resolve_checkpoint

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
    from ..model.checkpoint import model_digest, model_family

    return ModelInfo(model_dir, count_parameters(model_dir), metrics, primary, cfg.model.timing_only, note,
                     digest=model_digest(model_dir), family=model_family(model_dir))
