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
~1e-6 in fp32).

Widths that are not a multiple (bert-large-uncased: hidden 1024 from 384, 16 heads of 64 from 12
of 32, FFN 4096 from 1536): new unit n copies old unit n mod width, so some units are copied
once more than others (1024 = 2 x 384 + 256: the first 256 hidden units three times, the rest
twice). Each Linear divides every input weight by that input unit's own copy count, so every
linear map still gives exactly the old outputs, copied; the extra heads copy old heads (head j
copies head j mod 12, each head's dimensions tiled by the integer head-size ratio, queries
rescaled by its inverse square root as above), and the attention-output projection divides by
how often each context dimension appears. What is *not* preserved is LayerNorm: its mean and
variance are taken over unevenly copied units, i.e. the small encoder's statistics weighted by
the copy counts. No exact alternative exists with a plain LayerNorm (its statistics of a vector
of uneven copies are those of a weighted vector), so such a growth is approximately, not
exactly, function preserving; the tests check that it is the small encoder with those weighted
statistics, exactly, and fine-tuning does the rest. Stacking then repeats the layers ([0..5, 0..5] for 6 -> 12, "repeat", as in
progressive stacking; or [0, 0, 1, 1, ...], "interleave"), which is not function preserving
but starts every layer from trained weights; fine-tuning does the rest.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional

import torch

STACK_MODES = ("repeat", "interleave")


def _layout_hidden(h: int) -> Callable[[int], int]:
    return lambda n: n % h


def _layout_heads(d: int, k: int, heads: int) -> Callable[[int], int]:
    """Head-major layout: new dim n of head j (kd wide) copies old dim (n mod d) of head
    (j mod heads); with as many new heads as old ones that is head j itself."""
    return lambda n: ((n // (k * d)) % heads) * d + (n % (k * d)) % d


def _index(fn: Callable[[int], int], size: int) -> torch.Tensor:
    return torch.tensor([fn(n) for n in range(size)], dtype=torch.long)


def copy_counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """How many times each of the ``size`` old units appears in the new layout ``index``."""
    return torch.bincount(index, minlength=size)


def widen_state_dict(sd: dict, *, hidden: int, heads: int, intermediate: int, k: Optional[int] = None,
                     new_hidden: Optional[int] = None, new_heads: Optional[int] = None,
                     new_intermediate: Optional[int] = None) -> dict:
    """A BertModel state dict widened (see the module docstring). Keys unchanged.

    Either ``k`` (every width k times, the same heads: function preserving) or the new widths
    ``new_hidden`` / ``new_heads`` / ``new_intermediate``, each at least the old one and the new
    head size an integer multiple of the old; new unit n copies old unit n mod width, so where a
    width is not a multiple some units are copied once more than others. Every Linear divides each
    input by its own copy count, so all linear maps, attention and GELU stay exact; LayerNorm alone
    then sees unevenly copied units (its statistics weighted by the copy counts), which is the
    only difference from the small encoder (see the module docstring)."""
    if k is not None:
        if k < 1 or int(k) != k:
            raise ValueError(f"the widening factor must be a positive integer, not {k}")
        if (new_hidden, new_heads, new_intermediate) != (None, None, None):
            raise ValueError("give either k or the new widths, not both")
        k = int(k)
        new_hidden, new_heads, new_intermediate = k * hidden, heads, k * intermediate
    if new_hidden is None or new_heads is None or new_intermediate is None:
        raise ValueError("give k or all of new_hidden, new_heads and new_intermediate")
    d = hidden // heads
    if new_hidden < hidden or new_intermediate < intermediate or new_heads < heads:
        raise ValueError(f"widening only grows: hidden {hidden}->{new_hidden}, heads {heads}->{new_heads}, "
                         f"FFN {intermediate}->{new_intermediate}")
    if new_hidden % new_heads or (new_hidden // new_heads) % d:
        raise ValueError(f"the new head size ({new_hidden}/{new_heads}) must be an integer multiple of the old "
                         f"one ({d}): each new head copies one old head's dimensions a whole number of times")
    kh = new_hidden // new_heads // d  # head widening factor
    H = _index(_layout_hidden(hidden), new_hidden)
    I = _index(_layout_hidden(intermediate), new_intermediate)
    A = _index(_layout_heads(d, kh, heads), new_hidden)
    cH, cI, cA = copy_counts(H, hidden), copy_counts(I, intermediate), copy_counts(A, hidden)
    q_scale = 1.0 / math.sqrt(kh)

    def linear(w, b, out_idx, in_idx, in_counts, scale=1.0):
        # each input unit arrives in_counts[i] times: its weights are shared out among its copies
        w2 = w[out_idx][:, in_idx] / in_counts[in_idx].to(w.dtype) * scale
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
                w, b = linear(t, bias, A, H, cH, scale)
            elif prefix.endswith("attention.output.dense."):
                w, b = linear(t, bias, H, A, cA)
            elif prefix.endswith("intermediate.dense."):
                w, b = linear(t, bias, I, H, cH)
            elif re.search(r"layer\.\d+\.output\.dense\.$", prefix):
                w, b = linear(t, bias, H, I, cI)
            elif prefix.endswith("pooler.dense."):
                w, b = linear(t, bias, H, H, cH)
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


def hidden_copy_weights(hidden: int, new_hidden: int) -> torch.Tensor:
    """The weight each old hidden unit has in the widened encoder's LayerNorm statistics (its copy
    count over new_hidden): uniform exactly when new_hidden is a multiple of hidden."""
    return copy_counts(_index(_layout_hidden(hidden), new_hidden), hidden).double() / new_hidden


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
    h, nh = src_cfg.hidden_size, target_config.hidden_size
    heads, n_heads = src_cfg.num_attention_heads, target_config.num_attention_heads
    ffn, n_ffn = src_cfg.intermediate_size, target_config.intermediate_size
    if target_config.vocab_size != src_cfg.vocab_size:
        raise ValueError(f"cannot grow a vocabulary of {src_cfg.vocab_size} into {target_config.vocab_size}: "
                         "growing keeps the source's vocabulary (its tokenizer)")
    try:
        sd = widen_state_dict(src.state_dict(), hidden=h, heads=heads, intermediate=ffn, new_hidden=nh,
                              new_heads=n_heads, new_intermediate=n_ffn)
    except ValueError as e:
        raise ValueError(f"cannot grow {h}/{heads} heads/FFN {ffn} into {nh}/{n_heads} heads/FFN {n_ffn}: {e}") from None
    k = nh // h
    uniform = k * h == nh and n_heads == heads and k * ffn == n_ffn
    # uniform: the function-preserving widening by k ("2"); else the widths and the one inexact
    # part named, so every table that prints the recipe says how the model was made
    widen = k if uniform else (f"hidden {h}->{nh}, heads {heads}->{n_heads}, FFN {ffn}->{n_ffn} ("
                               + ("uneven copies: LayerNorm statistics weighted by copy count)" if nh % h
                                  else "function preserving)"))
    sd = stack_layers(sd, src_cfg.num_hidden_layers, target_config.num_hidden_layers, stack)
    dst = BertModel(target_config, add_pooling_layer="pooler.dense.weight" in sd)
    missing, unexpected = dst.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"grown state dict does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return dst, {"grown_from": source_dir, "widen": widen, "stack": f"{stack} {src_cfg.num_hidden_layers}->"
                 f"{target_config.num_hidden_layers}"}
