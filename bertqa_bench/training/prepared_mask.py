"""The encoder's attention mask built by the trainer, from what the host already knows, so that
no micro-step waits for the GPU to say whether its batch has padding.

Hugging Face's encoders (BERT, RoBERTa, ELECTRA, DistilBERT in transformers 5) turn the 2-D
padding mask into the attention implementation's mask with ``create_bidirectional_mask``. For
SDPA it first asks ``padding_mask.all()``, to drop the mask when nothing is padded: a host sync
on every forward that is not compiled whole. Under ``train.compile_scope: layers`` (and eager
training) that sync drains the GPU's queue once per micro-step; host K's profile of the 4-GPU
graphed step shows the GPU idle for ~2.5 ms after each one while the host launches the next
work (h100-scaling.md, host L's notes).

The trainer knows from the features' lengths whether a batch has padding. So it builds the mask
with the same transformers function, ``allow_is_bidirectional_skip=False`` (no check), for a
batch with padding, and passes no mask for a batch without (what the check would have decided).
The encoder returns a prepared 4-D mask as it is. The layers therefore receive the same mask
tensor as before, or the same ``None``, and the model computes the same numbers.

It is on only where that is known to hold: an encoder of the families below, under SDPA. There
the mask is boolean, so no dtype is guessed. The encoders are checked by the tests, family by
family. Other models keep the 2-D mask, and the step keeps its check:
- other model types: a 4-D mask passes through to the layers as it is, so a causal or
  sliding-window model would silently lose its own mask;
- eager attention: its float mask takes the dtype of the hidden states, and transformers 5.17
  builds it with a blocking copy anyway.
So does a model compiled whole (``train.compile_scope: model``): dynamo traces the check away
and always builds the mask there.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch


# The encoders whose forward turns a 2-D mask into the attention mask with create_bidirectional_mask
# alone, and passes a prepared 4-D mask through unchanged (tests/test_host_sync.py checks each).
ENCODER_TYPES = ("bert", "roberta", "distilbert", "albert", "electra")


def _mask_builder(model: torch.nn.Module) -> tuple[Optional[Callable], Optional[torch.nn.Module]]:
    """(transformers' create_bidirectional_mask, the encoder that calls it) or (None, None)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        fn = getattr(sys.modules.get(type(module).__module__), "create_bidirectional_mask", None)
        if fn is None or config is None:
            continue
        if (getattr(config, "model_type", None) in ENCODER_TYPES and not getattr(config, "is_decoder", False)
                and getattr(config, "_attn_implementation", None) == "sdpa"):
            return fn, module
        return None, None  # the outermost transformers model decides
    return None, None


class PreparedMask:
    """``prepared(mask_2d, padded)``: what the model should be given as its attention mask."""

    def __init__(self, model: torch.nn.Module):
        self.build, encoder = _mask_builder(model)
        self.config = encoder.config if encoder is not None else None

    @property
    def active(self) -> bool:
        return self.build is not None

    def __call__(self, mask: torch.Tensor, padded: bool) -> Optional[torch.Tensor]:
        if self.build is None:
            return mask
        if not padded:
            return None
        rows, length = mask.shape
        # create_bidirectional_mask reads only the batch size, length, dtype and device of its
        # embeddings; under SDPA the mask is boolean, so the dtype is not used
        embeds = torch.empty((rows, length, 0), device=mask.device)
        return self.build(config=self.config, inputs_embeds=embeds, attention_mask=mask,
                          allow_is_bidirectional_skip=False)


def has_padding(rows: int, real_tokens: int, length: int) -> bool:
    """Whether a batch of ``rows`` rows of ``length`` positions holding ``real_tokens`` real
    tokens pads any row (host-side numbers, no device read)."""
    return real_tokens < rows * length
