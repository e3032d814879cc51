"""Variable-length attention in FP8 (e4m3 Q, K, V, softmax probabilities and output) through
cuDNN's fused FP8 attention (nvidia-cudnn-frontend's graph API, ``sdpa_fp8``, ragged offsets).

The packed FP8 rows keep attention in fp16 between two FP8 GEMMs: the fused QKV GEMM writes fp16
Q, K, V, and attention's fp16 output is quantized again for the attention-output GEMM. With Q, K
and V written in e4m3 by the QKV GEMM (its output scale calibrated like the FFN's hidden one) and
the attention output written in e4m3 at the attention-output GEMM's static input scale, attention
reads and writes half the bytes, its two matrix products run on FP8 tensor cores, and the
attention-output GEMM takes its input as it is. On BERT-large (H100) attention was 21.4% of the
packed row's GPU time and the FP16 attention-output GEMM 8.6%
(results/reference/h100-mlperf-bert-large.md).

cuDNN's FP8 attention (Hopper and newer) computes, per sequence:
    S = (Q8 * dq) (K8 * dk)^T * attn_scale,  P = softmax(S),  P8 = e4m3(P * scale_s),
    O = (P8 * descale_s) (V8 * dv),           O8 = e4m3(O * scale_o),
and reports amax(S) and amax(O). ``fp8_varlen_attention_reference`` is that pipeline in torch, one
sequence at a time (the CPU path and the tests' reference). The kernel, a flash-attention one,
quantizes the softmax numerator tile by tile before normalizing, so its P8 differs from the
reference's in rounding, not in range; the GPU test bounds the difference by what e4m3's 3-bit
mantissa allows.

scale_s: the probabilities lie in [0, 1]; 256 (a power of two below 448, as cuDNN suggests) maps
them onto e4m3's range.
"""
# No ``from __future__ import annotations``: custom_op reads the op's annotations as types.
import threading

import torch

from .fp8_math import saturate_to_e4m3

SCALE_S = 256.0
INSTALL = "pip install nvidia-cudnn-frontend"


def unavailable_reason() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return "cuDNN's FP8 attention needs Hopper (sm_90) or newer"
    try:
        import cudnn  # noqa: F401
    except (ImportError, OSError) as e:
        return f"FP8 attention needs the package nvidia-cudnn-frontend ({INSTALL}): {e}"
    return ""


def fp8_varlen_attention_reference(q8, k8, v8, cu, scale: float, qkv_scale, o_inv_scale, p_e4m3: bool = True):
    """The FP8 pipeline in torch over packed e4m3 [T, heads, d] q8, k8, v8 and cumulative lengths
    ``cu``: e4m3 [T, heads, d] out (the output scaled by ``o_inv_scale`` and saturated). ``p_e4m3``
    False: the probabilities stay fp32 (the Triton kernel's ``pv_e4m3`` off, whose fp16 P is
    closer to that than to e4m3's)."""
    s_qkv = float(qkv_scale)
    out = torch.zeros(q8.shape, dtype=torch.float32, device=q8.device)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        q, k, v = (t[a:b].float().transpose(0, 1) * s_qkv for t in (q8, k8, v8))  # [heads, n, d]
        p = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
        p8 = saturate_to_e4m3(p, SCALE_S).float() / SCALE_S if p_e4m3 else p
        out[a:b] = (p8 @ v).transpose(0, 1)
    return saturate_to_e4m3(out, float(o_inv_scale))


_GRAPHS: dict = {}
_LOCK = threading.Lock()
_HANDLES = threading.local()


def _handle(device):
    import cudnn

    handles = getattr(_HANDLES, "by_device", None)
    if handles is None:
        handles = _HANDLES.by_device = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


def _desc_stride(t, s_max: int):
    """(B, H, S, D) strides of a packed [T, H, D] view (its real token stride: a view of the fused
    [T, 3, H, D] QKV output steps 3 x H x D a token); the batch stride is a placeholder, the ragged
    offsets give each sequence's start."""
    s_t, s_h, s_d = t.stride()
    return [s_max * s_t, s_h, s_t, s_d]


def _build(handle, b: int, h: int, s: int, d: int, strides, scale: float):
    import cudnn

    fp8, f32, i32, i64 = (cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT, cudnn.data_type.INT32,
                          cudnn.data_type.INT64)
    g = cudnn.pygraph(handle=handle, io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
    one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    off = dict(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i64)
    lens = dict(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    t = {}
    for name, stride in zip(("q", "k", "v"), strides):
        t[name] = g.tensor(name=name, dim=[b, h, s, d], stride=stride, data_type=fp8)
        t["r" + name] = g.tensor(name="ragged_" + name, **off)
        t[name].set_ragged_offset(t["r" + name])
    for name in ("descale_qkv", "descale_s", "scale_s", "scale_o"):
        t[name] = g.tensor(name=name, **one)
    t["seq_len"] = g.tensor(name="seq_len", **lens)
    t["ro"] = g.tensor(name="ragged_o", **off)
    o, _stats, amax_s, amax_o = g.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_qkv"], descale_k=t["descale_qkv"],
        descale_v=t["descale_qkv"], descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
        attn_scale=scale, generate_stats=False, use_padding_mask=True, seq_len_q=t["seq_len"],
        seq_len_kv=t["seq_len"], name="sdpa_fp8")
    o.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(fp8)
    o.set_ragged_offset(t["ro"])
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t, o, amax_s, amax_o, g.get_workspace_size()


def _cuda(q8, k8, v8, cu, max_len: int, scale: float, qkv_scale, o_inv_scale):
    t_tokens, h, d = q8.shape
    b = cu.numel() - 1
    strides = [_desc_stride(x, max_len) for x in (q8, k8, v8)]
    key = (q8.device.index, b, h, max_len, d, tuple(map(tuple, strides)), float(scale))
    handle = _handle(q8.device)
    entry = _GRAPHS.get(key)
    if entry is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cuDNN's FP8 attention graph for this shape was not built before CUDA graph capture")
        with _LOCK:
            entry = _GRAPHS[key] = _build(handle, b, h, max_len, d, strides, scale)
    g, t, o_t, amax_s_t, amax_o_t, ws = entry
    cu64 = cu.to(torch.int64)
    o8 = torch.empty((t_tokens, h, d), dtype=torch.float8_e4m3fn, device=q8.device)
    amax = torch.empty(2, 1, 1, 1, dtype=torch.float32, device=q8.device)
    one = lambda v: v.reshape(1, 1, 1, 1).float()  # noqa: E731
    pack = {
        t["q"]: q8, t["k"]: k8, t["v"]: v8, o_t: o8,
        t["rq"]: cu64 * q8.stride(0), t["rk"]: cu64 * k8.stride(0), t["rv"]: cu64 * v8.stride(0),
        t["ro"]: cu64 * (h * d),
        t["seq_len"]: (cu[1:] - cu[:-1]).to(torch.int32).reshape(-1, 1, 1, 1),
        t["descale_qkv"]: one(qkv_scale), t["descale_s"]: torch.full((1, 1, 1, 1), 1.0 / SCALE_S, device=q8.device),
        t["scale_s"]: torch.full((1, 1, 1, 1), SCALE_S, device=q8.device), t["scale_o"]: one(o_inv_scale),
        amax_s_t: amax[0:1], amax_o_t: amax[1:2],
    }
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=q8.device)
    g.execute(pack, workspace, handle=handle)
    return o8


# A custom_op (with a fake), not a triton_op: the body calls cuDNN through its frontend, which
# builds and caches an execution plan on the host at call time; torch.compile must keep the call
# opaque, and the fake tells it the output (e4m3, q8's shape) without running cuDNN.
@torch.library.custom_op("bertqa::fp8_varlen_attention", mutates_args=())
def fp8_varlen_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, cu: torch.Tensor, max_len: int,
                         scale: float, qkv_scale: torch.Tensor, o_inv_scale: torch.Tensor) -> torch.Tensor:
    """Packed e4m3 [T, heads, d] Q, K, V (values x ``qkv_scale``) -> e4m3 [T, heads, d] attention
    output x ``o_inv_scale``: cuDNN's FP8 attention on CUDA, the reference pipeline elsewhere."""
    if q8.is_cuda:
        return _cuda(q8, k8, v8, cu, max_len, scale, qkv_scale, o_inv_scale)
    return fp8_varlen_attention_reference(q8, k8, v8, cu, scale, qkv_scale, o_inv_scale)


@fp8_varlen_attention.register_fake
def _(q8, k8, v8, cu, max_len, scale, qkv_scale, o_inv_scale):
    return torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=q8.device)


def attention_fp8(q8, k8, v8, cu, max_len: int, scale: float, qkv_scale, o_inv_scale):
    """``fp8_varlen_attention`` as a plain function (what a module holds)."""
    return fp8_varlen_attention(q8, k8, v8, cu, max_len, scale, qkv_scale, o_inv_scale)
