"""The pieces of a training step: length buckets and micro-batches per rank, the masked span
loss, DDP settings and its all-reduce hook, compiled blocks and captured layers, and the
warm-up that leaves no trace on the model."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .graphed_layers import GraphedLayers, first_layer_inputs
from .prepared_mask import PreparedMask, has_padding


def dist_info() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return world, rank, local


def autocast_dtype(mode: str, device: torch.device) -> Optional[torch.dtype]:
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
    pad = attention_mask == 0
    ignored = start_logits.size(1)

    def ce(logits, pos):
        logits = logits.float().masked_fill(pad, torch.finfo(torch.float32).min)
        return F.cross_entropy(logits, pos.view(-1).clamp(0, ignored), ignore_index=ignored)

    loss = ce(start_logits, start_positions) + ce(end_logits, end_positions)
    if answer_type_logits is not None and answer_types is not None:
        return (loss + F.cross_entropy(answer_type_logits.float(), answer_types.view(-1))) / 3
    return loss / 2


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
