"""Matrix FLOPs of a BERT QA forward pass, for achieved TFLOP/s beside each timing.

Counts 2 FLOPs per multiply-add of the matrix products (projections, FFN, attention scores
and context); element-wise work is ignored. BERT-base at 384 tokens gives ~70.7 GFLOP.
Two views of a plan: the FLOPs of the shapes actually computed (padding included: what the
device did) and the FLOPs of the real tokens alone (what the answers needed).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..model.checkpoint import model_dims as family_dims  # other names (DistilBERT: dim, n_layers, hidden_dim)


def bert_flops_per_sequence(hidden: int, layers: int, intermediate: int, seq_len, heads_out: int = 2):
    s, h, i = np.asarray(seq_len, dtype=np.float64), hidden, intermediate
    per_layer = 2 * s * (4 * h * h + 2 * h * i) + 2 * 2 * s * s * h
    out = layers * per_layer + 2 * s * h * heads_out
    return float(out) if np.ndim(out) == 0 else out


def model_dims(model_dir: str | Path) -> tuple[int, int, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if all(k in cfg for k in ("hidden_size", "num_hidden_layers", "intermediate_size")):
        return int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])

    d = family_dims(model_dir)
    return d["hidden"], d["layers"], d["intermediate"]


def plan_flops(dims: tuple[int, int, int], plan, lengths: np.ndarray) -> tuple[float, float]:
    """(FLOPs at the computed shapes, FLOPs of the real tokens) for one pass over the plan; a
    packed plan computes real tokens only."""
    real = sum(float(np.sum(bert_flops_per_sequence(*dims, lengths[b.rows]))) for b in plan.batches)
    if plan.batching == "packed":
        return real, real
    computed = sum(b.shape[0] * bert_flops_per_sequence(*dims, b.shape[1]) for b in plan.batches)
    return float(computed), float(real)
