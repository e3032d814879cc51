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
