"""A padding-free BERT encoder: real tokens only, variable-length attention.

``PackedEncoder`` replaces a task model's encoder (BertModel, or the same layout in RoBERTa,
ELECTRA; DistilBERT's blocks by their own names; ``PACKED_FAMILIES``) and computes it on
the batch's real tokens packed into one [T, hidden] matrix: embeddings, every projection and
FFN GEMM, LayerNorm and GELU see T = sum of real lengths rows instead of batch x seq_len, and
attention runs per sequence through a variable-length kernel given the cumulative sequence
lengths (``torch.nn.attention.varlen.varlen_attn``, FlashAttention, cuDNN's fused attention
through nvidia-cudnn-frontend, ``attention="cudnn"``, or the suite's Triton kernel,
``attention="triton"``, on CUDA; a per-sequence SDPA loop elsewhere, for tests). The hidden
states are scattered back to [batch, seq_len, hidden] (zeros at padding) so the task's own head
(QA span head, NQ's answer-type head on the pooled [CLS]) runs unchanged — the wrapper is
task-agnostic.

It uses the wrapped BertModel's own weights and modules, so it computes the same function as
the padded model on every real token (tested against it). Quantized Linears (FP8, INT8) swapped
into the model before packing are used as they are, FP8's fused query/key/value GEMM included.
Under torch.compile the data-dependent packing (nonzero, the longest length) breaks the graph;
the encoder layers after it compile with a dynamic token count. Right padding is assumed (real
tokens first in every row), as every featurizer here produces.

CUDA graphs need static shapes, and the token count T changes with every batch. ``TokenBuckets``
rounds T up to a multiple of a bucket size and captures one graph per bucket around the static
part of the encoder (``PackedEncoder.encode``). The extra tokens fill the unused slots of the
fixed-length cumulative-length vector as dummy sequences of their own (1 to ``max_len`` tokens
each); variable-length attention never mixes sequences, and every other op works row by row, so
the real tokens' outputs are those of the exact-T path (tested) and the dummy rows are dropped.
Motive: the packed rows' GPU idled 22% of the time (results/reference/h100-batching.md). Result
on the H100: +9% for compiled FP8, -4% for eager FP16 (results/reference/h100-packed-graphs.md).

``fuse_token_head`` (``head_first``) moves a per-token head (the QA span head, ``qa_outputs``) into
``encode``, so it runs on the packed [T, hidden] rows inside the bucket's graph and 2 logits a
token are scattered back instead of the hidden states; the task model's own head becomes the
identity. Padding positions get the head's output for a zero hidden state, as the padded scatter
gave them. Motive: after the encoder, the scatter of [T, 768] back to [batch, 384, 768]
(``index_put``, ~4x its memory floor), zeroing that tensor and the head over the padded rows took
~1.6% of the packed FP8 row's GPU time (h100-perf.md).

``HostPacker`` moves the data-dependent packing to the host for the bucketed path: the batch
arrives as numpy, so the real token positions, cumulative lengths and bucket are computed there
(``host_pack``, ``TokenBuckets.host_cu``), written into pinned buffers and copied to the graph's
static inputs asynchronously. The device-side ``pack`` needs two device-to-host syncs a batch
(``nonzero`` and the longest length) and ~15 small kernels before the replay can start; the
profile of the packed FP8 graph row showed the GPU idle 14% of the time.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch
from torch import nn

from ...kernels.cudnn_fp8_attention import attention_fp8, fp8_varlen_attention_reference
from ...kernels.fp8_math import saturate_to_e4m3
from ...kernels.varlen_attention import E4M3_HEAD_DIMS, HEAD_DIMS, varlen_attention_op
from ...model.checkpoint import OFFSET_POSITION_FAMILIES, PACKED_FAMILIES
from ..device_io import capture_streams
from ..torch_options import PACKED_ATTENTION
from .fp8_rules import ATTENTION_PVS


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# The variable-length attention kernels on CUDA: FlashAttention-2 through torch's varlen_attn, or
# cuDNN's fused attention through its Python frontend (PyPI nvidia-cudnn-frontend), given the same
# packed [T, heads, head_dim] tensors and cumulative lengths (its ragged offsets). FA2 is not a
# Hopper (wgmma) kernel: on BERT-large it ran at 3.2-3.8x the memory floor of Q, K, V and O
# (h100-mlperf-bert-large.md); cuDNN's is. Or the suite's own Triton kernel (varlen_attention.py),
# written for sequences this short, where per-tile fixed costs weigh as much as the loop over K/V:
# on the H200's kernel bench it took 168 us to cuDNN's 225 (hopper-kernel-levers.csv). The choice
# is PACKED_ATTENTION (torch_options).
CUDNN_INSTALL = "pip install nvidia-cudnn-frontend"


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None


def cudnn_unavailable_reason() -> str:
    """Why cuDNN's variable-length attention cannot run here ('' when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _cudnn_kernel()
    except (ImportError, OSError, AttributeError) as e:
        return f"cuDNN's variable-length attention needs the package nvidia-cudnn-frontend ({CUDNN_INSTALL}): {e}"
    return ""


def _cudnn_kernel():
    """torch.ops.cudnn.sdpa_fwd, registered by importing the frontend's torch op module (outside
    any traced code: its registration must not run inside torch.compile)."""
    import cudnn

    cudnn.sdpa_torch  # noqa: B018 - the lazy export imports cudnn.sdpa.fwd.torch_op, which registers the op
    return torch.ops.cudnn.sdpa_fwd


def _dense_plus(dense, x, residual):
    """dense(x) + residual; an FP8 GEMM that adds the residual itself (fp8_modules.Fp8Linear's ``plus``, fp8
    option ``residual: gemm``) does it in its epilogue."""
    plus = getattr(dense, "plus", None)
    return plus(x, residual) if plus is not None else dense(x) + residual


def _add_norm(output, inp, residual):
    """(LayerNorm(dense(inp) + residual), its e4m3 copy or None): one kernel writes both where the
    LayerNorm feeds an FP8 GEMM (fp8_modules.Fp8AddLayerNorm, fp8 option ``layernorm: triton``)."""
    add_norm = getattr(output.LayerNorm, "add_norm", None)
    if add_norm is None:
        return output.LayerNorm(_dense_plus(output.dense, inp, residual)), None
    y_scale = getattr(output.dense, "e4m3_out_scale", None)
    if y_scale is not None:  # the GEMM writes e4m3 for the kernel (fp8 option dense_output: e4m3)
        return add_norm(output.dense.forward_e4m3(inp), residual, y_scale=y_scale)
    return add_norm(output.dense(inp), residual)


class PackedEncoder(nn.Module):
    def __init__(self, bert: nn.Module, *, use_kernel: bool = True, attention: str = "flash", fp8_pv: str = "e4m3"):
        super().__init__()
        if attention not in PACKED_ATTENTION:
            raise ValueError(f"attention '{attention}' is not one of {', '.join(PACKED_ATTENTION)}")
        self.bert = bert
        cfg = bert.config
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.attention = attention
        if attention == "triton":
            # refused here, before compiling and capturing; on e4m3 Q, K, V (layers whose QKV GEMM
            # writes e4m3, swapped before packing) the FP8 MMA's K step needs head sizes >= 32
            fp8_layers = any(getattr(m, "qkv_out_scale", None) is not None for m in bert.modules())
            sizes = E4M3_HEAD_DIMS if fp8_layers else HEAD_DIMS
            if self.head_dim not in sizes:
                raise ValueError(f"attention 'triton' takes head sizes {', '.join(map(str, sizes))}"
                                 f"{' on e4m3 Q, K, V' if fp8_layers else ''}; this model's is {self.head_dim} "
                                 "(packed_attention: cudnn or flash take it)")
        # FP8 attention for layers whose QKV GEMM writes e4m3 (fp8_surgery attention_fp8): cuDNN's,
        # or the Triton kernel on e4m3 inputs (``_fp8_attention``); bound here, outside traced code
        self._cudnn_fp8 = attention_fp8
        if fp8_pv not in ATTENTION_PVS:
            raise ValueError(f"fp8_pv '{fp8_pv}' is not one of {', '.join(ATTENTION_PVS)}")
        if fp8_pv != "e4m3" and attention != "triton":
            raise ValueError(f"fp8_pv '{fp8_pv}' is the Triton kernel's choice (attention 'triton'), not '{attention}'s")
        self.fp8_pv = fp8_pv
        self._kernel = None
        on_cuda = next(bert.parameters()).is_cuda
        if use_kernel and attention == "flash":
            self._kernel = _varlen_kernel()
        elif use_kernel and on_cuda and attention == "triton":
            self._kernel = varlen_attention_op
        elif use_kernel and on_cuda:  # the frontend is needed only where it runs
            self._kernel = _cudnn_kernel()
        self.config = cfg
        self.family = getattr(cfg, "model_type", "bert")
        # RoBERTa-style embeddings number positions after the padding index (right padding:
        # the real token t sits at padding_idx + 1 + t)
        pad_idx = getattr(bert.embeddings, "padding_idx", None)
        self.position_offset = pad_idx + 1 if self.family in OFFSET_POSITION_FAMILIES and pad_idx is not None else 0
        # ELECTRA's embeddings may be narrower than the encoder, projected up before it
        self.project = getattr(bert, "embeddings_project", None)
        self.buckets: Optional["TokenBuckets"] = None  # set by TokenBuckets.attach
        # the task's per-token head, run on the packed rows at the end of encode (fuse_token_head)
        self.token_head: Optional[nn.Module] = None
        # (bucket size, real tokens, real positions on the device) of the next forward, packed on
        # the host by HostPacker; consumed by that forward
        self.prepacked: Optional[tuple] = None

    @property
    def takes_empty_sequences(self) -> bool:
        """Whether every attention path this encoder runs takes empty sequences in ``cu``: the
        suite's Triton kernel (its contract: a program past its sequence's end writes nothing) and
        the per-sequence SDPA loop off CUDA; not FlashAttention's or cuDNN's, untested here."""
        return self.attention == "triton"

    @property
    def kernel_name(self) -> str:
        layers = () if self.family == "distilbert" else self.bert.encoder.layer
        n_fp8 = sum(getattr(layer.attention.self, "qkv_out_scale", None) is not None for layer in layers)
        if n_fp8 and self.attention == "triton" and self._kernel is not None:
            return (f"Triton variable-length attention (varlen_attention.py) on e4m3 Q, K, V, P V in {self.fp8_pv}, "
                    f"e4m3 output in {n_fp8} layers")
        if n_fp8:  # layers whose QKV GEMM writes e4m3 run FP8 attention: cuDNN's, where not the Triton kernel's
            return f"cuDNN FP8 attention, ragged offsets (cudnn-frontend sdpa_fp8) in {n_fp8} layers"
        n_e4m3 = sum(getattr(layer.attention.self, "o_inv_scale", None) is not None for layer in layers)
        if n_e4m3 and self._kernel is not None and self.attention == "triton":
            return f"Triton variable-length attention (varlen_attention.py), e4m3 output in {n_e4m3} layers"
        if self._kernel is None:
            return "per-sequence SDPA"
        if self.attention == "cudnn":
            return "cuDNN fused attention, ragged offsets (cudnn-frontend sdpa_fwd)"
        if self.attention == "triton":
            return "Triton variable-length attention (varlen_attention.py)"
        return "varlen_attn (FlashAttention)"

    def _attention(self, q, k, v, cu, max_len: int, out_inv_scale=None):
        """Attention over the packed sequences: q's dtype, or e4m3 at ``out_inv_scale`` (the FP8
        output GEMM's static input scale, inverted; the Triton kernel writes it, the other paths
        quantize their 16-bit output as that GEMM would)."""
        if out_inv_scale is not None and self.attention == "triton" and self._kernel_takes(q):
            return self._kernel(q, k, v, cu, max_len, self.scale, out_inv_scale)
        out = self._attention_16bit(q, k, v, cu, max_len)
        if out_inv_scale is None:
            return out
        return saturate_to_e4m3(out, out_inv_scale)

    def _fp8_attention(self, q8, k8, v8, cu, max_len: int, qkv_scale, o_inv_scale):
        """Attention on e4m3 Q, K, V (the values over ``qkv_scale``), e4m3 out at ``o_inv_scale``: the
        Triton kernel on CUDA with attention 'triton', cuDNN's FP8 attention otherwise; off CUDA,
        the reference pipeline (P rounded to e4m3, or kept for ``fp8_pv`` fp16)."""
        if self.attention == "triton" and q8.is_cuda:  # never cuDNN's under the Triton row's name
            return varlen_attention_op(q8, k8, v8, cu, max_len, self.scale, o_inv_scale, qkv_scale,
                                       self.fp8_pv == "e4m3")
        if self.fp8_pv != "e4m3" and not q8.is_cuda:
            return fp8_varlen_attention_reference(q8, k8, v8, cu, self.scale, qkv_scale, o_inv_scale, p_e4m3=False)
        return self._cudnn_fp8(q8, k8, v8, cu, max_len, self.scale, qkv_scale, o_inv_scale)

    def _kernel_takes(self, q) -> bool:
        """Whether the bound CUDA kernel runs on q (16-bit, on the GPU), not the per-sequence SDPA loop."""
        return self._kernel is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)

    def _attention_16bit(self, q, k, v, cu, max_len: int):
        if self._kernel_takes(q):
            if self.attention == "cudnn":
                # q, k, v may be strided views of the fused [T, 3, heads, head_dim] QKV: the
                # frontend describes them by their real strides, no copy
                return self._kernel(q, k, v, self.scale, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                                    max_seqlen_kv=max_len, return_lse=False)[0]
            if self.attention == "triton":  # the same views, by their strides
                return self._kernel(q, k, v, cu, max_len, self.scale)
            return self._kernel(q, k, v, cu, cu, max_len, max_len, scale=self.scale)
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:  # an empty sequence computes nothing
                qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
                out[s:e] = nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=self.scale).transpose(0, 1)
        return out

    def pack(self, input_ids, attention_mask, token_type_ids):
        """The data-dependent part: real tokens' ids, positions and types, the cumulative lengths
        [rows + 1], the real positions in the [b*s] grid and the longest length."""
        b, s = input_ids.shape
        mask = attention_mask.bool()
        lengths = mask.sum(dim=1, dtype=torch.int32)
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        flat = mask.reshape(-1).nonzero().squeeze(1)  # real token positions in the [b*s] grid
        positions = torch.arange(s, device=input_ids.device).expand(b, s).reshape(-1)[flat] + self.position_offset
        if token_type_ids is None:  # DistilBERT's forward has none
            token_type_ids = torch.zeros_like(input_ids)
        return (input_ids.reshape(-1)[flat], positions, token_type_ids.reshape(-1)[flat], cu, flat,
                int(lengths.max()))

    def fuse_token_head(self, head: nn.Linear) -> None:
        """Run ``head`` (a per-token Linear: [*, hidden] -> [*, k]) on the packed rows in ``encode``.
        The padding positions of the scattered output get the head of a zero hidden state, its bias:
        what the task model's head computes on the zeros the hidden-state scatter leaves there.
        ``pack_model`` checks first that the model can take it (``head_first_reason``)."""
        self.token_head = head

    def _head_pad(self, dtype):
        """The head of a zero hidden state, read from the head at each call (never a stale copy)."""
        h = self.token_head
        return h.bias.to(dtype) if h.bias is not None else torch.zeros(h.out_features, dtype=dtype,
                                                                         device=h.weight.device)

    def encode(self, ids, positions, types, cu, max_len: int):
        """The static-shape part: [T] token ids, positions, types and the cumulative lengths of the
        sequences they form -> [T, hidden] (or the fused head's [T, k]). Rows interact only inside
        attention's sequences."""
        x = self._encode(ids, positions, types, cu, max_len)
        return x if self.token_head is None else self.token_head(x)

    def _encode(self, ids, positions, types, cu, max_len: int):
        if self.family == "distilbert":
            return self._encode_distilbert(ids, positions, cu, max_len)
        emb = self.bert.embeddings
        x = emb.word_embeddings(ids) + emb.position_embeddings(positions)
        if getattr(emb, "token_type_embeddings", None) is not None:
            x = x + emb.token_type_embeddings(types)
        x = emb.LayerNorm(x)
        if self.project is not None:
            x = self.project(x)
        t = x.shape[0]
        x8 = None  # the previous LayerNorm's e4m3 copy of x, where one kernel wrote it for this layer's QKV GEMM
        for layer in self.bert.encoder.layer:
            att = layer.attention
            sa = att.self
            if hasattr(sa, "qkv"):  # FP8's fused query/key/value (fp8_surgery): one GEMM, [T, 3 x hidden]
                q, k, v = sa.qkv(x if x8 is None else x8).view(t, 3, self.heads, self.head_dim).unbind(1)
            else:
                q = sa.query(x).view(t, self.heads, self.head_dim)
                k = sa.key(x).view(t, self.heads, self.head_dim)
                v = sa.value(x).view(t, self.heads, self.head_dim)
            o_inv = getattr(sa, "o_inv_scale", None)
            if o_inv is not None and sa.qkv_out_scale is not None:
                # FP8 attention on e4m3 Q, K, V: its e4m3 output is quantized at the output GEMM's
                # own static input scale, so that GEMM takes it as it is
                ctx = self._fp8_attention(q, k, v, cu, max_len, sa.qkv_out_scale, o_inv).reshape(t, -1)
            elif o_inv is not None:  # 16-bit attention writing e4m3 at that scale (fp8 attention_output)
                ctx = self._attention(q, k, v, cu, max_len, o_inv).reshape(t, -1)
            else:
                # (the fused FP8 GEMM may write bf16 under rowwise scaling: back to the model's dtype)
                ctx = self._attention(q, k, v, cu, max_len).reshape(t, -1).to(x.dtype)
            x, x8 = _add_norm(att.output, ctx, x)
            h = layer.intermediate(x if x8 is None else x8)  # dense + activation (e4m3 out of FP8's Fp8Intermediate)
            x, x8 = _add_norm(layer.output, h, x)
        return x

    def _encode_distilbert(self, ids, positions, cu, max_len: int):
        """DistilBERT's blocks (q_lin/k_lin/v_lin/out_lin, sa_layer_norm, ffn, output_layer_norm)
        on packed tokens: no segment embeddings, post-LayerNorm like BERT."""
        emb = self.bert.embeddings
        x = emb.LayerNorm(emb.word_embeddings(ids) + emb.position_embeddings(positions))
        t = x.shape[0]
        for block in self.bert.transformer.layer:
            a = block.attention
            q = a.q_lin(x).view(t, self.heads, self.head_dim)
            k = a.k_lin(x).view(t, self.heads, self.head_dim)
            v = a.v_lin(x).view(t, self.heads, self.head_dim)
            ctx = self._attention(q, k, v, cu, max_len).reshape(t, -1).to(x.dtype)
            x = block.sa_layer_norm(a.out_lin(ctx) + x)
            f = block.ffn
            x = block.output_layer_norm(f.lin2(f.activation(f.lin1(x))) + x)
        return x

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **_ignored):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        b, s = input_ids.shape
        if self.prepacked is not None:  # packed on the host, already in the bucket's graph inputs
            (size, t, flat, copy), self.prepacked = self.prepacked, None
            x = self.buckets.replay(size, t, copy)
        else:
            ids, positions, types, cu, flat, max_len = self.pack(input_ids, attention_mask, token_type_ids)
            if self.buckets is not None:
                x = self.buckets(ids, positions, types, cu)
            else:
                x = self.encode(ids, positions, types, cu, max_len)
        if self.token_head is None:
            seq = x.new_zeros(b * s, x.shape[1])
        else:  # the head's logits: padding gets the head of a zero hidden state
            seq = self._head_pad(x.dtype).expand(b * s, -1).clone()
        seq[flat] = x
        seq = seq.view(b, s, -1)
        pooled = self.bert.pooler(seq) if getattr(self.bert, "pooler", None) is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=seq, pooler_output=pooled)


class TokenBuckets:
    """The encoder's static part at token counts rounded up to multiples of ``bucket``: one CUDA
    graph per bucket on CUDA (``capture``), the same bucketed shapes run directly elsewhere (what
    the CPU tests check). ``max_rows`` and ``max_tokens`` bound the run's batches (from its
    shapes); ``max_len`` is the longest sequence.

    The cumulative-length vector has a fixed length, so a batch of fewer rows fills the rest with
    dummy sequences, none longer than ``max_len`` (what the kernel is told). By default every dummy
    gets at least 1 token (no empty sequence reaches the attention kernel): a batch of ``t`` tokens
    and ``k`` dummy sequences takes the bucket that holds ``t + k`` tokens. With ``empty_dummies``
    (an attention kernel that takes empty sequences: the packed encoder's ``takes_empty_sequences``)
    dummies may be empty, and a batch takes the bucket that holds ``t``: a packed batch filled to a
    budget of whole buckets (32,768 tokens) stays in it, where 73 one-token dummies pushed it into
    the next (33,792: 3.2 % of a typical full batch's tokens computed for nothing,
    h200-mlperf-bert-large-tokens-per-batch.md's records).
    """

    def __init__(self, encode, *, bucket: int, max_len: int, max_rows: int, max_tokens: int,
                 empty_dummies: bool = False):
        if bucket < 1 or max_len < 2 or max_rows < 1 or max_tokens < 1:
            raise ValueError("token buckets need bucket, max_rows, max_tokens >= 1 and max_len >= 2")
        self.encode, self.bucket, self.max_len, self.max_rows = encode, bucket, max_len, max_rows
        self.empty_dummies = bool(empty_dummies)
        # k dummy sequences share d < bucket + k tokens; k > (bucket - 1) / (max_len - 1) keeps each <= max_len
        self.min_dummies = -(-(bucket - 1) // (max_len - 1)) + 1
        self.cu_len = max_rows + self.min_dummies + 1
        top = max_tokens if self.empty_dummies else max_tokens + self.cu_len
        self.sizes = list(range(bucket, _round_up(top, bucket) + 1, bucket))
        # one dict of graphs per copy (``capture(copies=...)``); ``graphs`` is the first
        self.copies: list[dict[int, tuple]] = [{}]
        self.graphs: dict[int, tuple] = self.copies[0]

    def size_for(self, t: int, rows: int) -> int:
        if rows > self.max_rows:
            raise ValueError(f"a batch of {rows} rows is more than the prepared {self.max_rows}")
        # the extra tokens (fewer than a bucket) split over >= min_dummies dummies: each <= max_len
        size = _round_up(t if self.empty_dummies else t + self.cu_len - 1 - rows, self.bucket)
        if t < 1 or size > self.sizes[-1]:
            raise ValueError(f"a batch of {t} real tokens is outside the prepared buckets "
                             f"({self.sizes[0]}..{self.sizes[-1]} tokens)")
        return size

    def bucket_cu(self, cu, t: int, size: int):
        """The real sequences' cumulative lengths, then ``k`` dummy sequences splitting the
        ``size - t`` extra tokens evenly, up to the fixed length ``cu_len``."""
        k = self.cu_len - cu.numel()
        steps = torch.arange(1, k + 1, device=cu.device, dtype=torch.int64)
        return torch.cat([cu, (t + (size - t) * steps // k).to(cu.dtype)])

    def _static_inputs(self, size: int, device):
        z = torch.zeros(size, dtype=torch.long, device=device)
        cu = torch.zeros(self.cu_len, dtype=torch.int32, device=device)
        return z, z.clone(), z.clone(), cu

    def capture(self, device, copies: int = 1, around=None, first=None) -> int:
        """One CUDA graph per bucket, largest first, in one memory pool (they never run at once;
        each replay's output is copied out before the next). Returns how many were captured.

        ``first``: a real batch (ids, positions, types, cu on ``device``), run once at its bucket's
        shape before anything is captured. What tunes itself on its first call then tunes on real
        sequences: the Triton attention kernel's autotuner times its tiles on the batch it is
        first called with, and the captures' warm-ups only have dummy sequences of one length,
        where a tile's cost differs from that on real lengths. (One batch, whole: the backend
        passes the sample batch of median mean length; a tile timed on a mix of the plan's batches
        is not built.)

        ``copies`` > 1: that many independent sets of graphs, each with its own static inputs,
        memory pool and capture stream, so that copies can replay at once on different streams;
        ``around(k)`` is a context the warm-up and capture of copy k run in (its own cuBLASLt plans
        through nvmath, whose workspaces the graphs write into). The capture stream matters as
        much: torch keys cuBLAS's workspace by stream, and every graph captured on a stream
        writes into that stream's one workspace on replay (``capture_streams``)."""
        self.copies = [{} for _ in range(copies)]
        self.graphs = self.copies[0]
        if first is not None:  # no graph exists yet, so this runs the bucket's shape directly
            with around(0) if around is not None else contextlib.nullcontext():
                self(*first)
            torch.cuda.synchronize(device)
        self.capture_streams = capture_streams(device, copies)
        for k in range(copies):
            with around(k) if around is not None else contextlib.nullcontext():
                self._capture_copy(device, self.copies[k], self.capture_streams[k])
        return sum(len(c) for c in self.copies)

    def _capture_copy(self, device, graphs: dict, stream) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, pos, types, cu = self._static_inputs(size, device)
            # dummy sequences only: replay takes its shapes, not its values (a bucket smaller than
            # cu_len - 1 would get empty sequences here; the run's buckets hold >= max_rows + 1)
            cu.copy_(self.bucket_cu(cu[:1], 0, size))
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up off the capture stream, as capture requires
                for _ in range(2):
                    self.encode(ids, pos, types, cu, self.max_len)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.encode(ids, pos, types, cu, self.max_len)
            graphs[size] = (graph, ids, pos, types, cu, out)

    def __call__(self, ids, positions, types, cu):
        t = ids.numel()
        size = self.size_for(t, cu.numel() - 1)
        full_cu = self.bucket_cu(cu, t, size)
        if size not in self.graphs:  # not captured (CPU): the same bucketed shapes, run directly
            pad = size - t
            grow = lambda v: torch.nn.functional.pad(v, (0, pad))  # noqa: E731 - dummy tokens: id/position/type 0
            return self.encode(grow(ids), grow(positions), grow(types), full_cu, self.max_len)[:t]
        graph, s_ids, s_pos, s_types, s_cu, out = self.graphs[size]
        # The dummy rows keep whatever the last batch left there: valid ids, in sequences of their own.
        s_ids[:t].copy_(ids)
        s_pos[:t].copy_(positions)
        s_types[:t].copy_(types)
        s_cu.copy_(full_cu)
        graph.replay()
        return out[:t]

    def host_cu(self, cu: np.ndarray, t: int, size: int) -> np.ndarray:
        """``bucket_cu`` on the host (numpy, the same integers)."""
        k = self.cu_len - cu.size
        steps = np.arange(1, k + 1, dtype=np.int64)
        return np.concatenate([cu, t + (size - t) * steps // k]).astype(np.int32)

    def replay(self, size: int, t: int, copy: int = 0):
        """Replay copy ``copy`` of the bucket's graph on inputs already in its static buffers
        (HostPacker), on the current stream."""
        graph, *_, out = self.copies[copy][size]
        graph.replay()
        return out[:t]

    def attach(self, encoder: PackedEncoder) -> "TokenBuckets":
        encoder.buckets = self
        return self


def host_pack(input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: Optional[np.ndarray],
              position_offset: int = 0):
    """``PackedEncoder.pack`` on the host: the real tokens' ids, positions and types, the
    cumulative lengths [rows + 1] (int32), the real positions in the [b*s] grid and the longest
    length — the same values, from the numpy batch, with no device work."""
    b, s = input_ids.shape
    mask = np.asarray(attention_mask).astype(bool)
    lengths = mask.sum(axis=1).astype(np.int32)
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    flat = np.flatnonzero(mask.reshape(-1))
    types = np.zeros_like(flat) if token_type_ids is None else np.asarray(token_type_ids).reshape(-1)[flat]
    return (np.asarray(input_ids).reshape(-1)[flat], flat % s + position_offset, types, cu, flat,
            int(lengths.max()) if b else 0)


class HostPacker:
    """Packs each batch on the host into pinned buffers and copies it, asynchronously, into the
    static inputs of its token bucket's CUDA graph; the encoder's next forward replays that graph
    (``PackedEncoder.prepacked``) instead of packing on the device.

    The pinned buffers are reused, one set per ``slot``: a backend that keeps two batches in
    flight packs batch i+1 into the other slot while batch i's copies may still be queued, and
    collects batch i (``HostOutputs``: a wait after these copies) before its slot comes round
    again. The graph's static inputs themselves need no second copy: the copies into them are
    queued on the stream after the previous replay. With several copies of the graphs (one per
    stream, ``TokenBuckets.capture(copies=...)``) a batch names the copy it goes to, and its
    copies are queued on that copy's stream."""

    def __init__(self, encoder: PackedEncoder, device, slots: int = 1):
        if encoder.buckets is None or not encoder.buckets.graphs:
            raise ValueError("host packing feeds captured token-bucket graphs: capture them first")
        self.enc, self.device = encoder, device
        n = encoder.buckets.sizes[-1]
        self.pinned = [{k: torch.zeros(n, dtype=torch.long).pin_memory() for k in ("ids", "pos", "types", "flat")}
                       for _ in range(slots)]
        self.pinned_cu = [torch.zeros(encoder.buckets.cu_len, dtype=torch.int32).pin_memory() for _ in range(slots)]

    def __call__(self, batch, slot: int = 0, copy: int = 0) -> None:
        ids, pos, types, cu, flat, _ = host_pack(batch["input_ids"], batch["attention_mask"],
                                                 batch.get("token_type_ids"), self.enc.position_offset)
        bk = self.enc.buckets
        t = int(ids.size)
        size = bk.size_for(t, cu.size - 1)
        pinned, pinned_cu = self.pinned[slot], self.pinned_cu[slot]
        for key, v in (("ids", ids), ("pos", pos), ("types", types)):
            buf = pinned[key].numpy()
            buf[:t] = v
            buf[t:size] = 0  # dummy tokens: id, position and type 0, in sequences of their own
        pinned["flat"].numpy()[:t] = flat
        pinned_cu.numpy()[:] = bk.host_cu(cu, t, size)
        _, s_ids, s_pos, s_types, s_cu, _ = bk.copies[copy][size]
        s_ids.copy_(pinned["ids"][:size], non_blocking=True)
        s_pos.copy_(pinned["pos"][:size], non_blocking=True)
        s_types.copy_(pinned["types"][:size], non_blocking=True)
        s_cu.copy_(pinned_cu, non_blocking=True)
        self.enc.prepacked = (size, t, pinned["flat"][:t].to(self.device, non_blocking=True), copy)


def encoder_of(model: nn.Module) -> nn.Module:
    """A task model's encoder (``model.bert``, ``model.roberta``, ``model.distilbert``, ...)."""
    prefix = getattr(model, "base_model_prefix", "bert")
    if not hasattr(model, prefix):
        raise ValueError(f"{type(model).__name__} has no .{prefix} encoder to pack")
    return getattr(model, prefix)


# the per-token head of the task models that have one (transformers' *ForQuestionAnswering, NQ's)
TOKEN_HEAD = "qa_outputs"


def head_first_reason(model: nn.Module) -> Optional[str]:
    """Why ``head_first`` cannot pack this task model (no per-token Linear head, or a pooler that
    reads the scattered hidden states), or None."""
    if not isinstance(getattr(model, TOKEN_HEAD, None), nn.Linear):
        return (f"{type(model).__name__} has no per-token {TOKEN_HEAD} Linear to run before the scatter "
                "(head_first: false)")
    if getattr(encoder_of(model), "pooler", None) is not None:
        return ("this encoder has a pooler, which reads the scattered hidden states ([CLS]); the head cannot run "
                "before the scatter (head_first: false)")
    return None


def pack_model(model: nn.Module, *, head_first: bool = False, **kw) -> nn.Module:
    """Swap a task model's encoder (``bert``, ``roberta``, ...) for its padding-free version, in
    place; returns the model. ``head_first``: the model's per-token head runs inside the packed
    encoder (``PackedEncoder.fuse_token_head``) and the model's own becomes the identity."""
    enc = encoder_of(model)
    family = getattr(enc.config, "model_type", "bert")
    if family not in PACKED_FAMILIES:
        raise ValueError(f"the padding-free encoder does not know the {family} family")
    why = head_first_reason(model) if head_first else None
    if why:
        raise ValueError(why)
    packed = PackedEncoder(enc, **kw)
    if head_first:
        packed.fuse_token_head(getattr(model, TOKEN_HEAD))
        setattr(model, TOKEN_HEAD, nn.Identity())
    setattr(model, getattr(model, "base_model_prefix", "bert"), packed)
    return model
