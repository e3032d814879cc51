"""A padding-free BERT encoder: real tokens only, variable-length attention.

``PackedEncoder`` replaces a task model's ``bert`` (a transformers BertModel) and computes it on
the batch's real tokens packed into one [T, hidden] matrix: embeddings, every projection and
FFN GEMM, LayerNorm and GELU see T = sum of real lengths rows instead of batch x seq_len, and
attention runs per sequence through a variable-length kernel given the cumulative sequence
lengths (``torch.nn.attention.varlen.varlen_attn``, FlashAttention, on CUDA; a per-sequence
SDPA loop elsewhere, for tests). The hidden states are scattered back to [batch, seq_len, hidden]
(zeros at padding) so the task's own head (QA span head, NQ's answer-type head on the pooled
[CLS]) runs unchanged — the wrapper is task-agnostic.

It uses the wrapped BertModel's own weights and modules, so it computes the same function as
the padded model on every real token (tested against it). Quantized Linears (FP8, INT8) swapped
into the model before packing are used as they are, FP8's fused query/key/value GEMM included.
Under torch.compile the data-dependent packing (nonzero, the longest length) breaks the graph;
the encoder layers after it compile with a dynamic token count. Right padding is assumed (real
tokens first in every row), as every featurizer here produces.
"""
from __future__ import annotations

import torch
from torch import nn


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None


class PackedEncoder(nn.Module):
    def __init__(self, bert: nn.Module, *, use_kernel: bool = True):
        super().__init__()
        self.bert = bert
        cfg = bert.config
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self._kernel = _varlen_kernel() if use_kernel else None
        self.config = cfg

    @property
    def kernel_name(self) -> str:
        return "varlen_attn (FlashAttention)" if self._kernel is not None else "per-sequence SDPA"

    def _attention(self, q, k, v, cu, max_len: int, lengths):
        if self._kernel is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            return self._kernel(q, k, v, cu, cu, max_len, max_len, scale=self.scale)
        out = torch.empty_like(q)
        starts = cu[:-1].tolist()
        for s, n in zip(starts, lengths.tolist()):
            qi, ki, vi = (t[s:s + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
            out[s:s + n] = nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=self.scale).transpose(0, 1)
        return out

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **_ignored):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        b, s = input_ids.shape
        mask = attention_mask.bool()
        lengths = mask.sum(dim=1, dtype=torch.int32)
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        flat = mask.reshape(-1).nonzero().squeeze(1)  # real token positions in the [b*s] grid
        max_len = int(lengths.max())
        positions = torch.arange(s, device=input_ids.device).expand(b, s).reshape(-1)[flat]

        emb = self.bert.embeddings
        x = (emb.word_embeddings(input_ids.reshape(-1)[flat]) + emb.position_embeddings(positions)
             + emb.token_type_embeddings(token_type_ids.reshape(-1)[flat]))
        x = emb.LayerNorm(x)
        t = x.shape[0]
        for layer in self.bert.encoder.layer:
            att = layer.attention
            sa = att.self
            if hasattr(sa, "qkv"):  # FP8's fused query/key/value (torch_fp8): one GEMM, [T, 3 x hidden]
                q, k, v = sa.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)
            else:
                q = sa.query(x).view(t, self.heads, self.head_dim)
                k = sa.key(x).view(t, self.heads, self.head_dim)
                v = sa.value(x).view(t, self.heads, self.head_dim)
            # (the fused FP8 GEMM may write bf16 under rowwise scaling: back to the model's dtype)
            ctx = self._attention(q, k, v, cu, max_len, lengths).reshape(t, -1).to(x.dtype)
            x = att.output.LayerNorm(att.output.dense(ctx) + x)
            h = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
            x = layer.output.LayerNorm(layer.output.dense(h) + x)
        seq = x.new_zeros(b * s, x.shape[1])
        seq[flat] = x
        seq = seq.view(b, s, -1)
        pooled = self.bert.pooler(seq) if getattr(self.bert, "pooler", None) is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=seq, pooler_output=pooled)


def pack_model(model: nn.Module, **kw) -> nn.Module:
    """Swap a task model's ``bert`` for its padding-free version, in place; returns the model."""
    if not hasattr(model, "bert"):
        raise ValueError(f"{type(model).__name__} has no .bert encoder to pack")
    model.bert = PackedEncoder(model.bert, **kw)
    return model
