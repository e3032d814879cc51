"""Which encoder layers to keep in 16 bits: the per-layer sensitivity sweep, for INT8
(int8_dynamic.py) and FP8 (fp8_surgery.py) alike.

Sensitivity sweep: on real calibration batches, quantize one encoder layer at a time (the
others stay 16-bit) and measure how far the model's outputs move (max |Δ logit| over real
tokens); the ``keep`` most sensitive layers are then excluded from quantization. The sweep,
the recipe it chose and the scores go into the backend's prepare info.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

from .fp8_surgery import layer_index


def n_encoder_layers(model) -> int:
    return len({layer_index(n) for n, _ in model.named_modules() if layer_index(n) is not None})


def output_shift(reference: Sequence, outputs: Sequence, masks: Sequence) -> float:
    """Max |Δ| between two lists of output tuples, over real tokens for per-token outputs."""
    worst = 0.0
    for ref, out, mask in zip(reference, outputs, masks):
        for r, o in zip(ref, out):
            d = (o.float() - r.float()).abs()
            if d.dim() == 2 and d.shape == mask.shape:
                d = d[mask.bool()]
            worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst


def layer_sensitivity(module, batches: Sequence[tuple], quantize_layer: Callable[[object, int], None],
                      n_layers: Optional[int] = None) -> list[tuple[int, float]]:
    """[(layer, max |Δ output|)] with only that encoder layer quantized, most sensitive first.

    ``batches``: model input tuples (input_ids, attention_mask, token_type_ids) on the model's
    device; ``quantize_layer(copy, layer)`` quantizes one layer of a deep copy in place.
    """
    import torch

    n_layers = n_layers or n_encoder_layers(module)
    with torch.inference_mode():
        reference = [tuple(module(*b)) for b in batches]
    masks = [b[1] for b in batches]
    scores = []
    for layer in range(n_layers):
        trial = copy.deepcopy(module)
        quantize_layer(trial, layer)
        with torch.inference_mode():
            outs = [tuple(trial(*b)) for b in batches]
        scores.append((layer, output_shift(reference, outs, masks)))
        del trial
    return sorted(scores, key=lambda s: -s[1])


def choose_kept_layers(scores: Sequence[tuple[int, float]], keep: int) -> tuple[int, ...]:
    """The ``keep`` most sensitive layers (ties broken by layer index, for a stable recipe)."""
    ranked = sorted(scores, key=lambda s: (-s[1], s[0]))
    return tuple(sorted(layer for layer, _ in ranked[:max(0, keep)]))
