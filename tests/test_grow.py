"""Growing the embedded MiniLM into the BERT-base shape: widening preserves the function,
stacking places the layers, the grown QA model has bert-base-uncased's exact size."""
import pytest
import torch

from bertqa_bench.model.grow import stack_layers, widen_state_dict
from bertqa_bench.model.modeling import build_model, resolve_base

BERT_BASE_SHAPE = "benchmarks/assets/bert-base-uncased-shape"


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (3, 40), generator=g)
    ids[:, 0] = 101
    mask = torch.ones_like(ids)
    mask[2, 25:] = 0
    return ids, mask


@pytest.mark.parametrize("k", [2, 3])
def test_widening_reproduces_the_small_encoders_hidden_states(k):
    from transformers import AutoConfig, BertModel

    src_dir = resolve_base("embedded:all-MiniLM-L6-v2")
    src = BertModel.from_pretrained(src_dir, dtype=torch.float32).eval()
    h = src.config.hidden_size
    wide = BertModel(AutoConfig.from_pretrained(src_dir, hidden_size=k * h,
                                                intermediate_size=k * src.config.intermediate_size)).eval()
    wide.load_state_dict(widen_state_dict(src.state_dict(), hidden=h, heads=12, intermediate=1536, k=k))
    ids, mask = _inputs()
    with torch.no_grad():
        a, b = src(ids, attention_mask=mask), wide(ids, attention_mask=mask)
    for c in range(k):  # k copies of every hidden vector, and of the pooled output
        assert (b.last_hidden_state[..., c * h:(c + 1) * h] - a.last_hidden_state).abs().max() < 2e-5
        assert (b.pooler_output[..., c * h:(c + 1) * h] - a.pooler_output).abs().max() < 2e-5


def test_widening_without_the_query_rescale_would_change_the_function():
    """The 1/sqrt(k) on queries is what keeps attention scores equal: check it matters."""
    from transformers import AutoConfig, BertModel

    src_dir = resolve_base("embedded:all-MiniLM-L6-v2")
    src = BertModel.from_pretrained(src_dir, dtype=torch.float32).eval()
    sd = widen_state_dict(src.state_dict(), hidden=384, heads=12, intermediate=1536, k=2)
    for name in list(sd):
        if "attention.self.query" in name:
            sd[name] = sd[name] * 2 ** 0.5  # undo the rescale
    wide = BertModel(AutoConfig.from_pretrained(src_dir, hidden_size=768, intermediate_size=3072)).eval()
    wide.load_state_dict(sd)
    ids, mask = _inputs()
    with torch.no_grad():
        diff = (wide(ids, attention_mask=mask).last_hidden_state[..., :384]
                - src(ids, attention_mask=mask).last_hidden_state).abs().max()
    assert diff > 1e-2


def test_stacking_repeats_or_interleaves_layers():
    sd = {f"encoder.layer.{i}.w": torch.tensor([float(i)]) for i in range(3)} | {"embeddings.w": torch.tensor([9.0])}
    rep = stack_layers(sd, 3, 6, "repeat")
    assert [float(rep[f"encoder.layer.{j}.w"]) for j in range(6)] == [0, 1, 2, 0, 1, 2]
    inter = stack_layers(sd, 3, 6, "interleave")
    assert [float(inter[f"encoder.layer.{j}.w"]) for j in range(6)] == [0, 0, 1, 1, 2, 2]
    assert float(rep["embeddings.w"]) == 9.0
    rep["encoder.layer.3.w"] += 1  # copies, not views of one tensor
    assert float(rep["encoder.layer.0.w"]) == 0.0


def test_grown_qa_model_has_the_exact_bert_base_shape_and_minilm_weights():
    model, info = build_model("squad", BERT_BASE_SHAPE, grow_from="embedded:all-MiniLM-L6-v2", seed=1)
    assert sum(p.numel() for p in model.parameters()) == 108_893_186  # bert-base-uncased QA
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (768, 12, 12, 3072)
    assert info["widen"] == "2" and info["stack"] == "repeat 6->12"
    # layer 6 starts as a copy of layer 0 (stacking), both copied from MiniLM's layer 0 (widening)
    l0 = model.bert.encoder.layer[0].intermediate.dense.weight
    assert torch.equal(l0, model.bert.encoder.layer[6].intermediate.dense.weight)
    from transformers import BertModel

    src = BertModel.from_pretrained(resolve_base("embedded:all-MiniLM-L6-v2"), dtype=torch.float32)
    w = src.encoder.layer[0].intermediate.dense.weight
    assert torch.allclose(l0[:1536, :384], w / 2) and torch.allclose(l0[1536:, 384:], w / 2)


# --- widths that are not a multiple of the source's (bert-large-uncased from MiniLM) ----------
BERT_LARGE_SHAPE = "benchmarks/assets/bert-large-uncased-shape"


class _WeightedLayerNorm(torch.nn.Module):
    """LayerNorm whose mean and variance weight each unit by ``w`` (summing to 1): what a plain
    LayerNorm computes over a vector in which unit i appears w_i x N times."""

    def __init__(self, ln: torch.nn.LayerNorm, w: torch.Tensor):
        super().__init__()
        self.ln, self.w = ln, w

    def forward(self, x):
        w = self.w.to(x.dtype)
        mean = (x * w).sum(-1, keepdim=True)
        var = ((x - mean) ** 2 * w).sum(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.ln.eps) * self.ln.weight + self.ln.bias


def _with_weighted_layernorms(model, w):
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.LayerNorm):
                setattr(mod, child_name, _WeightedLayerNorm(child, w))
    return model


def _tiny_pair(src_kw: dict, dst_kw: dict, seed=0):
    """A random small BertModel (LayerNorm parameters randomised too, so they matter) and a
    model of the wider shape holding its widened weights, both in float64."""
    from transformers import BertConfig, BertModel

    base = dict(vocab_size=50, max_position_embeddings=32, num_hidden_layers=2, attn_implementation="eager")
    torch.manual_seed(seed)
    src = BertModel(BertConfig(**base, **src_kw)).double().eval()
    with torch.no_grad():
        for n, p in src.named_parameters():
            if "LayerNorm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if n.endswith("weight") else 0.0))
    dst = BertModel(BertConfig(**base, **dst_kw)).double().eval()
    sd = widen_state_dict(src.state_dict(), hidden=src_kw["hidden_size"], heads=src_kw["num_attention_heads"],
                          intermediate=src_kw["intermediate_size"], new_hidden=dst_kw["hidden_size"],
                          new_heads=dst_kw["num_attention_heads"], new_intermediate=dst_kw["intermediate_size"])
    dst.load_state_dict(sd)
    return src, dst


def _tiny_inputs(batch=3, length=20, vocab=50):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    return ids, mask


SRC = dict(hidden_size=12, num_attention_heads=3, intermediate_size=20)      # heads of 4
DST = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48)      # heads of 8: 2.67x, 2.4x, +1 head


def test_uneven_widening_is_the_small_encoder_with_copy_weighted_layernorm_statistics():
    """Every linear map, the extra head and GELU exact; LayerNorm's statistics weighted by how
    often each unit is copied: with that one change the small encoder gives the wide one's
    hidden states at every one of their units (float64, so any wrong index or scale shows)."""
    from bertqa_bench.model.grow import hidden_copy_weights

    src, dst = _tiny_pair(SRC, DST)
    w = hidden_copy_weights(12, 32)
    assert sorted(set(w.mul(32).round().tolist())) == [2.0, 3.0]  # uneven: the case this covers
    oracle = _with_weighted_layernorms(src, w)
    ids, mask = _tiny_inputs()
    with torch.no_grad():
        a, b = oracle(ids, attention_mask=mask), dst(ids, attention_mask=mask)
    idx = torch.arange(32) % 12
    err = (b.last_hidden_state - a.last_hidden_state[..., idx]).abs().max()
    scale = a.last_hidden_state.abs().max()
    assert err <= 1e-12 * scale * 100, err
    assert (b.pooler_output - a.pooler_output[..., idx]).abs().max() <= 1e-10


def test_uneven_widening_changes_plain_layernorm_and_nothing_else_explains_it():
    """Against the unmodified small encoder the wide one differs (LayerNorm over uneven copies):
    the weighted-statistics test above is not passing trivially."""
    src, dst = _tiny_pair(SRC, DST)
    ids, mask = _tiny_inputs()
    with torch.no_grad():
        a, b = src(ids, attention_mask=mask), dst(ids, attention_mask=mask)
    idx = torch.arange(32) % 12
    assert (b.last_hidden_state - a.last_hidden_state[..., idx]).abs().max() > 1e-3


def test_extra_heads_alone_are_function_preserving():
    """More heads at the same hidden width ratio: 12 -> 24 hidden with 3 -> 6 heads of 4 (k = 2,
    each old head appears twice, the output projection halves each copy): exact, no LayerNorm
    change, since every hidden unit is copied twice."""
    src, dst = _tiny_pair(SRC, dict(hidden_size=24, num_attention_heads=6, intermediate_size=40))
    ids, mask = _tiny_inputs()
    with torch.no_grad():
        a, b = src(ids, attention_mask=mask), dst(ids, attention_mask=mask)
    assert (b.last_hidden_state - a.last_hidden_state[..., torch.arange(24) % 12]).abs().max() <= 1e-10


@pytest.mark.parametrize("dst, why", [
    (dict(hidden_size=30, num_attention_heads=5, intermediate_size=48), "integer multiple"),  # heads of 6 from 4
    (dict(hidden_size=8, num_attention_heads=2, intermediate_size=48), "only grows"),
    (dict(hidden_size=32, num_attention_heads=2, intermediate_size=48), "only grows"),  # fewer heads
])
def test_widening_refuses_shapes_it_cannot_make(dst, why):
    sd = {"embeddings.word_embeddings.weight": torch.zeros(5, 12)}
    with pytest.raises(ValueError, match=why):
        widen_state_dict(sd, hidden=12, heads=3, intermediate=20, new_hidden=dst["hidden_size"],
                         new_heads=dst["num_attention_heads"], new_intermediate=dst["intermediate_size"])


def test_minilm_widened_to_bert_large_width_is_minilm_with_weighted_layernorm():
    """The real weights (MiniLM has a few outlier hidden units): widened to 1024 / 16 heads /
    FFN 4096, 6 layers, the wide encoder equals MiniLM with copy-weighted LayerNorm statistics
    to float32 rounding."""
    from transformers import AutoConfig, BertModel

    from bertqa_bench.model.grow import hidden_copy_weights

    src_dir = resolve_base("embedded:all-MiniLM-L6-v2")
    src = BertModel.from_pretrained(src_dir, dtype=torch.float32).eval()
    wide = BertModel(AutoConfig.from_pretrained(src_dir, hidden_size=1024, num_attention_heads=16,
                                                intermediate_size=4096)).eval()
    wide.load_state_dict(widen_state_dict(src.state_dict(), hidden=384, heads=12, intermediate=1536,
                                          new_hidden=1024, new_heads=16, new_intermediate=4096))
    oracle = _with_weighted_layernorms(src, hidden_copy_weights(384, 1024))
    ids, mask = _inputs()
    with torch.no_grad():
        a, b = oracle(ids, attention_mask=mask).last_hidden_state, wide(ids, attention_mask=mask).last_hidden_state
    rel = (b - a[..., torch.arange(1024) % 384]).norm() / a.norm()
    assert rel < 1e-5, rel  # fp32 over 6 layers: ~1e-7-1e-6 of rounding


def test_grown_qa_model_has_the_exact_bert_large_shape_and_minilm_weights():
    model, info = build_model("squad", BERT_LARGE_SHAPE, grow_from="embedded:all-MiniLM-L6-v2", seed=1)
    assert sum(p.numel() for p in model.parameters()) == 334_094_338  # bert-large-uncased QA (no pooler)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (1024, 24, 16, 4096)
    assert info["stack"] == "repeat 6->24" and "384->1024" in info["widen"] and "weighted" in info["widen"]
    layers = model.bert.encoder.layer
    assert all(torch.equal(layers[j].intermediate.dense.weight, layers[j % 6].intermediate.dense.weight)
               for j in range(6, 24))
    from transformers import BertModel

    src = BertModel.from_pretrained(resolve_base("embedded:all-MiniLM-L6-v2"), dtype=torch.float32)
    w = src.encoder.layer[0].intermediate.dense.weight  # [1536, 384]
    up = layers[0].intermediate.dense.weight  # [4096, 1024]: row o copies row o % 1536, column i holds
    counts = torch.bincount(torch.arange(1024) % 384)  # column i % 384 over its copy count (3 or 2)
    expect = w[torch.arange(4096) % 1536][:, torch.arange(1024) % 384] / counts[torch.arange(1024) % 384]
    assert torch.equal(up, expect)
    # heads 12..15 copy heads 0..3: their query rows equal head 0..3's
    q = layers[0].attention.self.query.weight
    assert torch.equal(q[12 * 64:16 * 64], q[:4 * 64])


def test_gpu_bert_large_suite_names_the_bert_large_shape_and_grows_it():
    from transformers import AutoConfig

    from bertqa_bench.config import resolve_path
    from bertqa_bench.suite import load_suite

    cfg = load_suite("gpu-bert-large")
    c = AutoConfig.from_pretrained(str(resolve_path(cfg.model.base)))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size) == (
        1024, 24, 16, 4096, 30522)
    assert cfg.model.grow_from == "embedded:all-MiniLM-L6-v2"
    assert (cfg.data.max_seq_len, cfg.data.doc_stride) == (384, 128)  # MLPerf's BERT windows
    assert cfg.bench.reference == "eager-fp32" and cfg.bench.backends[0] == "eager-fp32" and cfg.bench.device == "cuda"
