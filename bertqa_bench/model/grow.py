"""Grow a small pretrained BERT encoder into a larger shape: function-preserving widening, then
layer stacking.

Why: no BERT-base weights reach the machines this suite runs on, and BERT-base trained from
random init on generated data plateaus near F1 44 — a model that weak makes every parity
verdict noise. The embedded all-MiniLM-L6-v2 (hidden 384, 12 heads of 32, FFN 1536, 6 layers,
bert-base-uncased's vocabulary) grown to the exact bert-base-uncased shape (768, 12 heads of
64, FFN 3072, 12 layers) starts from pretrained knowledge and fine-tunes like a pretrained
model.

Widening by an integer factor k (Net2Net-style, every unit copied exactly k times):

* every hidden vector x becomes [x, x, ..., x] (k copies): embeddings and LayerNorm parameters
  are tiled; LayerNorm's mean and variance over the copies are those of x, so it is unchanged;
* every Linear gets its output units tiled in the layout its consumer expects and its input
  weights divided by k (each input now arrives k times): W'[o', i'] = W[o(o'), i(i')] / k;
* attention keeps its number of heads and makes each head k times wider by tiling the head's
  own dimensions, so q'.k' = k (q.k); the new head size's 1/sqrt(k d) scale then needs the
  queries multiplied by 1/sqrt(k) to give the old scores exactly;
* GELU and tanh act element-wise and commute with copying.

So the widened encoder reproduces the small one's hidden states, copied k times (tested to
~1e-6 in fp32). Stacking then repeats the layers ([0..5, 0..5] for 6 -> 12, "repeat", as in
progressive stacking; or [0, 0, 1, 1, ...], "interleave"), which is not function preserving
but starts every layer from trained weights; fine-tuning does the rest.
"""
from __future__ import annotations

import math
import re
from typing import Callable

import torch

STACK_MODES = ("repeat", "interleave")


def _layout_hidden(h: int) -> Callable[[int], int]:
    return lambda n: n % h


def _layout_heads(d: int, k: int) -> Callable[[int], int]:
    """Head-major layout: new dim n of head j (kd wide) copies old dim (n mod d) of head j."""
    return lambda n: (n // (k * d)) * d + (n % (k * d)) % d


def _index(fn: Callable[[int], int], size: int) -> torch.Tensor:
    return torch.tensor([fn(n) for n in range(size)], dtype=torch.long)


def widen_state_dict(sd: dict, *, hidden: int, heads: int, intermediate: int, k: int) -> dict:
    """A BertModel state dict widened k times (see the module docstring). Keys unchanged."""
    if k < 1 or int(k) != k:
        raise ValueError(f"the widening factor must be a positive integer, not {k}")
    d = hidden // heads
    H, I = _index(_layout_hidden(hidden), k * hidden), _index(_layout_hidden(intermediate), k * intermediate)
    A = _index(_layout_heads(d, k), k * hidden)
    q_scale = 1.0 / math.sqrt(k)

    def linear(w, b, out_idx, in_idx, scale=1.0):
        w2 = w[out_idx][:, in_idx] / k * scale
        return w2, None if b is None else b[out_idx] * scale

    out = {}
    for name, t in sd.items():
        if name in out:
            continue
        m = re.match(r"(.*\.)(weight|bias)$", name)
        prefix = m.group(1) if m else name
        if "embeddings." in name and name.endswith("_embeddings.weight"):
            out[name] = t[:, H]  # embedding rows are hidden vectors: tile
        elif "LayerNorm" in name:
            out[name] = t[H]
        elif name.endswith(".weight") and t.ndim == 2:
            bias = sd.get(prefix + "bias")
            if re.search(r"attention\.self\.(query|key|value)\.$", prefix):
                scale = q_scale if prefix.endswith("query.") else 1.0
                w, b = linear(t, bias, A, H, scale)
            elif prefix.endswith("attention.output.dense."):
                w, b = linear(t, bias, H, A)
            elif prefix.endswith("intermediate.dense."):
                w, b = linear(t, bias, I, H)
            elif re.search(r"layer\.\d+\.output\.dense\.$", prefix):
                w, b = linear(t, bias, H, I)
            elif prefix.endswith("pooler.dense."):
                w, b = linear(t, bias, H, H)
            else:
                raise ValueError(f"don't know how to widen {name} {tuple(t.shape)}")
            out[name] = w
            if b is not None:
                out[prefix + "bias"] = b
        elif name.endswith(".bias") and (prefix + "weight") in sd:
            continue  # handled with its weight
        else:
            out[name] = t  # buffers such as position_ids
    return out


def stack_layers(sd: dict, n_src: int, n_dst: int, mode: str = "repeat") -> dict:
    """Encoder layers 0..n_dst-1 copied from the n_src source layers."""
    if mode not in STACK_MODES:
        raise ValueError(f"stack mode '{mode}' is not one of {', '.join(STACK_MODES)}")
    pick = (lambda j: j % n_src) if mode == "repeat" else (lambda j: min(n_src - 1, j * n_src // n_dst))
    out = {k: v for k, v in sd.items() if ".layer." not in k}
    for j in range(n_dst):
        src = f"encoder.layer.{pick(j)}."
        for k, v in sd.items():
            if src in k:
                out[k.replace(src, f"encoder.layer.{j}.")] = v.clone()
    return out


def grow_encoder(source_dir: str, target_config, *, stack: str = "repeat"):
    """A BertModel of ``target_config``'s shape grown from the pretrained encoder in ``source_dir``."""
    from transformers import AutoConfig, BertModel

    src_cfg = AutoConfig.from_pretrained(source_dir)
    src = BertModel.from_pretrained(source_dir, dtype=torch.float32)
    k = target_config.hidden_size // src_cfg.hidden_size
    if (k * src_cfg.hidden_size != target_config.hidden_size or target_config.num_attention_heads
            != src_cfg.num_attention_heads or target_config.intermediate_size != k * src_cfg.intermediate_size
            or target_config.vocab_size != src_cfg.vocab_size):
        raise ValueError(
            f"cannot grow {src_cfg.hidden_size}/{src_cfg.num_attention_heads} heads/FFN {src_cfg.intermediate_size}/"
            f"vocab {src_cfg.vocab_size} into {target_config.hidden_size}/{target_config.num_attention_heads}/"
            f"{target_config.intermediate_size}/{target_config.vocab_size}: widening needs the same heads and "
            "vocabulary and integer ratios")
    sd = widen_state_dict(src.state_dict(), hidden=src_cfg.hidden_size, heads=src_cfg.num_attention_heads,
                          intermediate=src_cfg.intermediate_size, k=k)
    sd = stack_layers(sd, src_cfg.num_hidden_layers, target_config.num_hidden_layers, stack)
    dst = BertModel(target_config, add_pooling_layer="pooler.dense.weight" in sd)
    missing, unexpected = dst.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"grown state dict does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return dst, {"grown_from": source_dir, "widen": k, "stack": f"{stack} {src_cfg.num_hidden_layers}->"
                 f"{target_config.num_hidden_layers}"}
