"""kernel_floors: layer roles read from a profiled pass's kernels (names from the H200 profile of
the packed FP8 row, h200-bert-large-pass-profile.md), and each role's floor from FLOPs and bytes."""
import pytest

from bertqa_bench.measuring.kernel_floors import (FP16, PEAKS, ROLES, Peak, Recipe, floors_table, role_floors, role_of,
                                                  role_times, trace_kernels)

QKV = "nvjet_sm90_qqtsq_192x192_128x4_2x1_v_bz_coopB_bias_TNN"
ATT = "varlen_attention_fwd"
OUT = "nvjet_sm90_qqhsh_128x128_128x6_2x1_v_bz_bias_TNT"
LN = "add_layernorm_fp8_kernel"
UP = "nvjet_sm90_qqhsq_256x128_128x4_1x2_h_bz_coopA_gelubias_TNT"
DOWN = "nvjet_sm90_qqhsh_256x128_128x4_1x2_h_bz_coopA_bias_TNT"
LAYER = [(QKV, 180.0), (ATT, 120.0), (OUT, 58.0), (LN, 67.0), (UP, 300.0), (DOWN, 195.0), (LN, 68.0)]


EMB = "triton_poi_fused_embedding_0"
EMB_LN = "triton_per_fused_add_native_layer_norm_1"
HEAD = "nvjet_sm90_hhhsh_64x8_64x16_4x1_v_bz_TNT"


def _stream(stream, layers, t0, extra=()):
    """One packed batch on one stream: the embeddings and their LayerNorm, the layers, the QA head."""
    ks, t = [], t0
    seq = [(EMB, 5.0), (EMB_LN, 6.0)]
    for _ in range(layers):
        seq += [*LAYER[:3], *extra, *LAYER[3:]]
    for name, dur in [*seq, (HEAD, 4.0)]:
        ks.append({"name": name, "ts": t, "dur": dur, "stream": stream})
        t += dur + 1.0
    return ks


def test_roles_follow_the_layer_order_on_each_stream_whatever_the_interleaving():
    # two streams whose kernels interleave in time, a copy kernel between attention and its output
    # GEMM on one of them: each stream's own order names the roles; the embeddings, their
    # LayerNorm and the QA head's GEMM have none
    a = _stream(7, 3, 0.0, extra=[("Memcpy DtoD", 2.0)])
    b = _stream(13, 2, 0.5)
    t = role_times(sorted(a + b, key=lambda k: k["ts"]))
    assert {r: t[r]["calls"] for r in ROLES} == {"qkv": 5, "attention": 5, "attn_out": 5, "layernorm": 10,
                                                 "ffn_up": 5, "ffn_down": 5}
    assert t["qkv"]["us"] == 5 * 180.0 and t["ffn_down"]["us"] == 5 * 195.0 and t["layernorm"]["us"] == 5 * 135.0
    assert t["other"] == {"calls": 3 + 2 * 3, "us": 6.0 + 2 * 15.0}


def test_an_unfused_gelu_marks_the_gemm_before_it_as_ffn_up_across_other_kernels():
    # the FFN-up GEMM, a split-K reduction, then the GELU in a kernel of its own, then FFN-down
    names = [QKV, ATT, OUT, LN, "sm90_xmma_gemm_f16f16", "splitKreduce_kernel", "triton_poi_fused_gelu_0",
             "sm90_xmma_gemm_f16f16", LN]
    t = role_times([{"name": n, "ts": float(i), "dur": 1.0, "stream": 0} for i, n in enumerate(names)])
    assert {r: t[r]["calls"] for r in ROLES} == {"qkv": 1, "attention": 1, "attn_out": 1, "layernorm": 2,
                                                 "ffn_up": 1, "ffn_down": 1}
    assert t["other"]["calls"] == 2  # the reduction and the GELU
    assert role_of("sm90_xmma_gemm_f16f16", "layernorm", "gelu") == "ffn_up"
    assert role_of("sm90_xmma_gemm_f16f16", "gelu") == "ffn_down"
    assert role_of("sm90_xmma_gemm_f16f16", "layernorm", "attention") == "qkv"
    assert role_of("sm90_xmma_gemm_f16f16", "layernorm", "") == "other"  # the QA head: no attention follows
    assert role_of(EMB_LN, None) == "other" and role_of(EMB_LN, "ffn_down") == "layernorm"
    assert role_of("fmha_cutlassF_f16", "qkv") == "attention" and role_of("elementwise_kernel", "attention") == "other"


def test_trace_kernels_keep_gpu_kernels_and_their_stream():
    events = [{"ph": "X", "cat": "kernel", "name": QKV, "ts": 1.0, "dur": 2.0, "args": {"stream": 7}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.5, "dur": 9.0},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 3.0, "dur": 1.0, "args": {"stream": 7}}]
    assert trace_kernels(events) == [{"name": QKV, "ts": 1.0, "dur": 2.0, "stream": 7}]


def test_floors_are_the_flops_at_the_clocks_peak_or_the_bytes_at_hbm_bandwidth():
    h200 = PEAKS["NVIDIA H200"]
    t, s2 = 32768.0, 187 * 175.0 ** 2
    fl = role_floors(1024, 4096, 24, t, s2, peak=h200, clock_mhz=1980.0)  # the e4m3-dense recipe
    up = fl["ffn_up"]
    assert up["flops"] == 24 * 2 * t * 1024 * 4096 and up["bound"] == "FLOPs"
    assert up["floor_s"] == pytest.approx(up["flops"] / 1979e12)
    ln = fl["layernorm"]  # e4m3 GEMM output + 16-bit residual read, residual + e4m3 copy written, twice a layer
    assert ln["bound"] == "bytes" and ln["bytes"] == 24 * 2 * 6 * t * 1024
    assert ln["floor_s"] == pytest.approx(ln["bytes"] / 4.8e12)
    att = fl["attention"]  # QK^T on FP8 tensor cores, P V in fp16, e4m3 in and out
    assert att["flop_floor_s"] == pytest.approx(24 * (2 * s2 * 1024 / 1979e12 + 2 * s2 * 1024 / 989.5e12))
    assert att["bytes"] == 24 * 4 * t * 1024
    # one exp2 a score, 16 a clock on each of 132 SMs, beside the bytes: at the boost clock these
    # lengths' e4m3 bytes take longer, at a lower clock the exponentials do
    assert att["exp2_floor_s"] == pytest.approx(24 * s2 * 16 / (16 * 132 * 1980e6)) and up["exp2_floor_s"] == 0.0
    assert att["bound"] == "bytes" and att["byte_floor_s"] > att["exp2_floor_s"] > att["flop_floor_s"]
    half = role_floors(1024, 4096, 24, t, s2, peak=h200, clock_mhz=990.0)
    assert half["ffn_up"]["flop_floor_s"] == pytest.approx(2 * up["flop_floor_s"])  # the clock scales the peak
    assert half["layernorm"]["floor_s"] == pytest.approx(ln["floor_s"])  # and leaves HBM's bandwidth
    assert half["attention"]["bound"] == "exp2" and half["attention"]["floor_s"] == pytest.approx(
        2 * att["exp2_floor_s"])
    # attention reads only real tokens; the GEMMs compute whole token buckets
    fewer = role_floors(1024, 4096, 24, t, s2, peak=h200, clock_mhz=1980.0, attention_tokens=t / 2)
    assert fewer["attention"]["bytes"] == att["bytes"] / 2 and fewer["qkv"]["bytes"] == fl["qkv"]["bytes"]


def test_the_recipe_sets_each_tensors_bytes_and_each_products_peak():
    h200 = PEAKS["NVIDIA H200"]
    t, s2, h = 32768.0, 187 * 175.0 ** 2, 1024
    dense = role_floors(h, 4096, 1, t, s2, peak=h200, clock_mhz=1980.0)
    half = role_floors(h, 4096, 1, t, s2, peak=h200, clock_mhz=1980.0, recipe=FP16)
    assert half["ffn_up"]["flop_floor_s"] == pytest.approx(2 * dense["ffn_up"]["flop_floor_s"])
    assert half["qkv"]["bytes"] == 2 * dense["qkv"]["bytes"]
    assert half["layernorm"]["bytes"] == 2 * (2 + 2 + 2) * t * h  # 16-bit in and out, no e4m3 copy
    assert half["attention"]["flop_floor_s"] == pytest.approx(4 * s2 * h / 989.5e12)
    # 16-bit attention with an e4m3 output for the FP8 attention-output GEMM, fp16 dense outputs
    # (the catalogue's packed FP8 row): Q, K, V read in fp16, the LayerNorm reads 2 + 2 bytes
    r = Recipe(qkv_out=2, qk_fp8=False, attention_out=1, dense_out=2)
    mixed = role_floors(h, 4096, 1, t, s2, peak=h200, clock_mhz=1980.0, recipe=r)
    assert mixed["attention"]["bytes"] == (2 * 3 + 1) * t * h
    assert mixed["layernorm"]["bytes"] == (2 * (2 + 2 + 2) + 2) * t * h
    assert mixed["qkv"]["bytes"] == (t * h + 3 * h * h) + 2 * 3 * t * h
    # a GEMM left out of FP8 runs at the 16-bit peak on 16-bit operands
    no_out = role_floors(h, 4096, 1, t, s2, peak=h200, clock_mhz=1980.0,
                         recipe=Recipe(fp8_gemms=frozenset({"qkv", "ffn_up", "ffn_down"}), dense_out=2))
    assert no_out["attn_out"]["flop_floor_s"] == pytest.approx(2 * dense["attn_out"]["flop_floor_s"])
    assert no_out["attn_out"]["bytes"] == 2 * t * h + 2 * h * h + 2 * t * h
    pv8 = role_floors(h, 4096, 1, t, s2, peak=h200, clock_mhz=1980.0, recipe=Recipe(pv_fp8=True))
    assert pv8["attention"]["flop_floor_s"] == pytest.approx(4 * s2 * h / 1979e12)
    assert "FP8 GEMMs: qkv, attn_out, ffn_up, ffn_down" in Recipe().describe() and "none" in FP16.describe()


def test_the_table_sets_each_roles_time_against_its_floor():
    peak = Peak("card", 1000.0, 1000.0, 500.0, 1.0, 10, 16.0)
    fl = role_floors(64, 256, 2, 1000.0, 1000.0 * 50, peak=peak, clock_mhz=1000.0)
    times = {"ffn_up": {"calls": 2, "us": fl["ffn_up"]["floor_s"] * 3e6}, "other": {"calls": 4, "us": 10.0}}
    rows = {r["role"]: r for r in floors_table(times, fl)}
    assert list(rows) == [*ROLES, "other"]
    assert rows["ffn_up"]["x_floor"] == 3.0 and rows["ffn_up"]["calls"] == 2
    assert rows["qkv"]["calls"] == 0 and rows["qkv"]["x_floor"] is None  # a role that never ran has no ratio
    assert rows["other"]["measured_ms"] == 0.01 and rows["other"]["floor_ms"] is None


@pytest.mark.gpu
def test_the_profile_of_a_packed_fp8_row_names_every_role_and_its_floor(tiny_suite):
    from bertqa_bench.commands.profile import profile_backend
    from bertqa_bench.envinfo import device_name
    from bertqa_bench.suite import load_suite

    if device_name("cuda") not in PEAKS:
        pytest.skip(f"no published peaks for {device_name('cuda')} in kernel_floors.PEAKS")
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    out = profile_backend(cfg, "torch-compile-fp8-graph-packed", n_batches=2, top=10, clock_mhz=1700.0)
    rows = {r["role"]: r for r in out["floors"]}
    for role in ROLES:  # the real trace's kernel names and streams give every role its calls
        assert rows[role]["calls"] > 0 and rows[role]["x_floor"] > 0, (role, rows[role])
    assert rows["layernorm"]["calls"] >= 2 * rows["ffn_up"]["calls"]
    assert "at 1700 MHz" in (out["dir"] / "floors.md").read_text()


def test_each_rows_recipe_comes_from_its_fp8_options():
    from bertqa_bench.backends.variants import VariantTable
    from bertqa_bench.commands.profile import recipe_of
    from bertqa_bench.suite import load_suite

    cfg = load_suite("experiments")
    table = VariantTable.for_suite(cfg.variants, "cuda")
    head = recipe_of(table.get("torch-compile-fp8-graph-packed"))  # 16-bit attention writing e4m3
    assert head == Recipe(qkv_out=2, qk_fp8=False, pv_fp8=False, attention_out=1, dense_out=2, ffn_hidden=1)
    dense = recipe_of(table.get("torch-compile-fp8-graph-packed+fp8-attention-pv16-fused-layernorm-e4m3-dense"))
    assert dense == Recipe()
    assert recipe_of(table.get("torch-compile-fp8-graph-packed+fp8-attention")).pv_fp8 is True
    assert recipe_of(table.get("torch-compile-fp16-packed")) == FP16
