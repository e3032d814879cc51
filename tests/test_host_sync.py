"""train.no_host_sync: the encoder's mask built by the trainer from host-known lengths gives the
same numbers without transformers' `attention_mask.all()` check, and the logged loss arrives one
log step late, unchanged."""
import json

import pytest
import torch

from bertqa_bench.suite import load_suite
from bertqa_bench.training.loss_readback import DeferredLoss
from bertqa_bench.training.prepared_mask import PreparedMask, has_padding
from bertqa_bench.training.train import train

# the families whose transformers encoder builds its mask with create_bidirectional_mask
PREPARED = ("bert", "roberta", "distilbert", "albert", "electra")


def _tiny(family: str, attn: str = "sdpa"):
    import transformers

    from bertqa_bench.model.families import config_kwargs

    torch.manual_seed(0)
    special = {"pad_token_id": 1} if family == "roberta" else {}
    # DeBERTa-v2 has no SDPA path in transformers
    kw = {**config_kwargs(family, "tiny", 100, special),
          "attn_implementation": "eager" if family == "deberta-v2" else attn}
    name = {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert", "albert": "Albert",
            "electra": "Electra", "deberta-v2": "DebertaV2"}[family]
    cfg = getattr(transformers, f"{name}Config")(**kw)
    return getattr(transformers, f"{name}ForQuestionAnswering")(cfg).eval()


def _batch(rows=4, seq=24, padded=True):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, seq + 1, (rows,), generator=g) if padded else torch.full((rows,), seq)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, 100, (rows, seq), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}, int(lengths.sum())


def _syncing_ops(fn) -> int:
    """Ops in ``fn`` that read a tensor's value back to the host (is_nonzero, item)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::is_nonzero", "aten::item"))


@pytest.mark.parametrize("family", PREPARED)
@pytest.mark.parametrize("padded", [True, False])
def test_the_prepared_mask_gives_the_models_logits_and_its_layers_mask_without_asking_the_device(family, padded):
    """SDPA's boolean mask, family by family (the families ENCODER_TYPES names)."""
    from bertqa_bench.training.graphed_layers import first_layer_inputs
    from bertqa_bench.training.prepared_mask import ENCODER_TYPES
    from bertqa_bench.training.steps import repeated_blocks

    assert set(PREPARED) == set(ENCODER_TYPES)
    model = _tiny(family)
    prepared = PreparedMask(model)
    assert prepared.active
    batch, real = _batch(padded=padded)
    rows, seq = batch["input_ids"].shape
    assert has_padding(rows, real, seq) is padded
    mask = prepared(batch["attention_mask"], has_padding(rows, real, seq))
    assert (mask is None) is (not padded)
    with torch.no_grad():
        own = model(**batch)
        mine = model(**{**batch, "attention_mask": mask})
    assert torch.equal(own.start_logits, mine.start_logits) and torch.equal(own.end_logits, mine.end_logits)
    # the first layer receives the very mask the model builds for itself (or None for both);
    # ALBERT shares one layer, so it has no stack to graph and is not probed
    for _, first in repeated_blocks(model)[:1]:
        with torch.no_grad():
            _, own_mask = first_layer_inputs(model, first, lambda: model(**batch))
            _, my_mask = first_layer_inputs(model, first, lambda: model(**{**batch, "attention_mask": mask}))
        assert (own_mask is None and my_mask is None) or torch.equal(own_mask, my_mask)
    # transformers reads the 2-D mask back to decide; preparing the mask and running the model
    # with it reads nothing back
    padding = has_padding(rows, real, seq)
    with torch.no_grad():
        assert _syncing_ops(lambda: model(**batch)) >= 1
        assert _syncing_ops(lambda: model(**{**batch, "attention_mask": prepared(batch["attention_mask"],
                                                                                 padding)})) == 0


def _gpt2():
    from transformers import GPT2Config, GPT2ForQuestionAnswering

    torch.manual_seed(0)
    return GPT2ForQuestionAnswering(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                               attn_implementation="sdpa")).eval()


@pytest.mark.parametrize("make", [lambda: _tiny("deberta-v2"), lambda: _tiny("bert", "eager"), _gpt2],
                         ids=["deberta-v2", "bert-eager", "gpt2"])
def test_a_model_outside_the_known_encoders_under_sdpa_keeps_its_2d_mask(make):
    """DeBERTa-v2 builds its mask its own way; eager attention's float mask would need a dtype
    guessed (and transformers 5.17 builds it with a blocking copy anyway); GPT-2 imports the same
    mask function but is causal, and a 4-D mask would pass through to its layers and drop the
    causality. None of them gets a prepared mask."""
    model = make()
    prepared = PreparedMask(model)
    batch, _ = _batch()
    assert not prepared.active and prepared(batch["attention_mask"], True) is batch["attention_mask"]


def test_the_deferred_loss_arrives_one_log_step_late_with_its_own_step_and_the_rest_at_flush():
    late = DeferredLoss()
    assert late.push(torch.tensor(3.0), step=1) == []
    assert late.push(torch.tensor(2.0), step=2) == [(3.0, {"step": 1})]
    assert late.push(torch.tensor(1.0), step=3) == [(2.0, {"step": 2})]
    assert late.flush() == [(1.0, {"step": 3})] and late.flush() == []
    at_once = DeferredLoss(defer=False)
    assert at_once.push(torch.tensor(3.0), step=1) == [(3.0, {"step": 1})]
    # the value is taken at push: later in-place changes to the loss tensor do not reach it
    t = torch.tensor(5.0)
    late.push(t, step=4)
    t.fill_(0.0)
    assert late.flush() == [(5.0, {"step": 4})]


@pytest.mark.gpu
def test_gpu_a_training_step_with_the_prepared_mask_and_the_deferred_loss_never_syncs():
    """On CUDA, with torch's sync debug mode set to raise: preparing the mask, forward, backward
    and pushing the loss wait for nothing (the 2-D mask's forward does, which shows the mode is on).
    The losses pushed are read back unchanged, and the last arrives at flush."""
    model = _tiny("bert").cuda().train()
    prepared = PreparedMask(model)
    batch, real = _batch()
    rows, seq = batch["input_ids"].shape
    batch = {k: v.cuda() for k, v in batch.items()}
    late, expected = DeferredLoss(), []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            model(**batch)
        for _ in range(3):
            out = model(**{**batch, "attention_mask": prepared(batch["attention_mask"], has_padding(rows, real, seq))})
            loss = out.start_logits.float().logsumexp(-1).mean()
            loss.backward()
            expected.append(loss.detach().clone())
            late.push(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = late.flush()
    assert len(got) == 1 and got[0][0] == float(expected[-1])


@pytest.mark.gpu
def test_the_deferred_loss_reads_a_cuda_loss_from_pinned_memory_unchanged():
    late = DeferredLoss()
    values = [torch.tensor(float(i), device="cuda") * 1.5 for i in range(4)]
    got = []
    for i, v in enumerate(values):
        got += late.push(v, step=i)
    got += late.flush()
    assert [g[0] for g in got] == [1.5 * i for i in range(4)] and [g[1]["step"] for g in got] == list(range(4))


def test_training_without_host_syncs_trains_the_same_model_and_logs_the_same_losses(tiny_suite, monkeypatch):
    """The whole trainer with train.no_host_sync on and off (32-token buckets: padded and
    unpadded micro-batches both occur, checked): the same weights bit for bit, the same logged
    losses, the same recipe; on, the trainer says it built the mask."""
    from safetensors.torch import load_file

    import bertqa_bench.training.train as trainer

    kinds = []

    def spy(rows, real, length):
        kinds.append(trainer_has_padding(rows, real, length))
        return kinds[-1]

    trainer_has_padding = trainer.has_padding
    monkeypatch.setattr(trainer, "has_padding", spy)

    from conftest import TINY_BERT

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    no_dropout = {**TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    suite = tiny_suite(backends=["eager-fp32"], model={"config_overrides": no_dropout})
    on = load_suite(str(suite), ["model.name=sync-free", "train.seq_bucket=32"])
    off = load_suite(str(suite), ["model.name=syncing", "train.seq_bucket=32", "train.no_host_sync=false"])
    m_on, m_off = train(on, log=lambda m: None, evaluate=False), train(off, log=lambda m: None, evaluate=False)
    assert True in kinds and False in kinds
    assert m_on["prepared_mask"] is True and m_off["prepared_mask"] is False
    assert m_on["no_host_sync"] is True and m_off["no_host_sync"] is False
    same = [{k: v for k, v in m["recipe_fields"].items() if k != "model.name"} for m in (m_on, m_off)]
    assert same[0] == same[1] and m_on["train_steps"] >= 2
    assert m_on["final_loss"] == m_off["final_loss"]
    w_on, w_off = load_file(on.model_dir / "model.safetensors"), load_file(off.model_dir / "model.safetensors")
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_on)
    saved = json.loads((on.model_dir / "train_metrics.json").read_text())
    assert saved["no_host_sync"] is True


def test_the_nq_model_gets_its_encoders_mask_prepared_and_the_same_logits():
    """BERT-joint (NQ) wraps a BertModel: the mask is prepared for that encoder, and the span and
    answer-type logits stay the same."""
    from transformers import BertConfig

    from bertqa_bench.model.families import config_kwargs
    from bertqa_bench.tasks.nq.model import BertJointForNaturalQuestions

    torch.manual_seed(0)
    model = BertJointForNaturalQuestions(BertConfig(**config_kwargs("bert", "tiny", 100, {}))).eval()
    prepared = PreparedMask(model)
    assert prepared.active and prepared.config is model.bert.config
    batch, real = _batch()
    rows, seq = batch["input_ids"].shape
    mask = prepared(batch["attention_mask"], has_padding(rows, real, seq))
    with torch.no_grad():
        own, mine = model(**batch), model(**{**batch, "attention_mask": mask})
    for name in ("start_logits", "end_logits", "answer_type_logits"):
        assert torch.equal(getattr(own, name), getattr(mine, name)), name
