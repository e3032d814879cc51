"""A user's checkpoint as it is (``bench --model FOLDER``): every encoder family end to end on
every CPU backend, the folder checks (no QA head, no tokenizer, pickle-only, custom code), and
the checkpoint's identity in results and MLflow.

Checkpoints are built offline (bertqa_bench/model/families.py): tiny random weights of each family
with a tokenizer of its own kind (MiniLM's WordPiece; BPE / Unigram trained on the generated
corpus), saved with save_pretrained as a user's folder is. The span head is widened
(``head_scale``) so reduced-precision parity judges the backend, not near-tied random logits.
"""
import json
import shutil

import numpy as np
import pytest
import yaml

from bertqa_bench.model.checkpoint import CheckpointError, resolve_checkpoint
from bertqa_bench.cli import main
from bertqa_bench.config import SyntheticConfig
from bertqa_bench.model.families import FAMILY_NAMES, build_checkpoint, corpus_from_squad
from bertqa_bench.record.results import RunBundle

CPU_BACKENDS = ["eager-fp32", "eager-bf16", "torch-compile-fp32", "ort-fp32", "ort-int8"]
SYN = dict(seed=5, n_train_contexts=6, n_dev_contexts=5, questions_per_context=2, min_words=30, max_words=90,
           mean_words=50, long_context_fraction=0.2)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    from bertqa_bench.tasks.squad.synthetic import ensure_squad_files

    d = tmp_path_factory.mktemp("ckdata")
    train, dev = ensure_squad_files(d, SyntheticConfig(**SYN))
    return d, train, dev


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory, corpus_dir):
    """One tiny checkpoint folder per family, built once for the session."""
    _, train, _ = corpus_dir
    texts = corpus_from_squad(train)
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: build_checkpoint(f, root / f, texts=texts, vocab_size=400, seed=1, head_scale=30.0)
            for f in FAMILY_NAMES}


def _suite(tmp_path, corpus, backends, **bench):
    d, _, _ = corpus
    raw = {"name": "ckpt",
           "data": {"source": "synthetic", "data_dir": str(d), "max_seq_len": 64, "doc_stride": 24,
                    "max_query_len": 24, "synthetic": dict(SYN)},
           "bench": {"backends": backends, "batch_size": 8, "warmup_batches": 1, "min_passes": 1,
                     "min_duration_s": 0, "isolation": "inprocess", **bench},
           # the exporter fallback (dynamo, tried when attention does not fuse) is tested in
           # test_backends; here one exporter keeps six families inside the CI time budget
           "variants": {n: {"base": n, "options": {"exporter": "torchscript"}}
                        for n in ("ort-fp32", "ort-int8") if n in backends},
           "models_dir": str(tmp_path / "models"), "results_dir": str(tmp_path / "results"),
           "cache_dir": str(tmp_path / "cache")}
    p = tmp_path / "ckpt.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _run(suite, model, *extra):
    rc = main(["bench", "--suite", str(suite), "--model", str(model), "--no-progress", "--no-mlflow", *extra])
    return rc


def _bundle(tmp_path):
    runs = sorted((tmp_path / "results").glob("*-ckpt"))
    assert runs, "no result bundle"
    return RunBundle.load(runs[-1])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bench_model_folder_every_cpu_backend(family, family_checkpoints, corpus_dir, tmp_path):
    suite = _suite(tmp_path, corpus_dir, CPU_BACKENDS)
    # the verdict's exit status is not the point here (each row's parity is checked below)
    assert _run(suite, family_checkpoints[family], "--no-fail-on-verdict") == 0
    bundle = _bundle(tmp_path)
    rows = {r.backend: r for r in bundle.results}
    assert list(rows) == CPU_BACKENDS
    ck = resolve_checkpoint(str(family_checkpoints[family]))
    for r in rows.values():
        # the identity: the name given, the digest of its files, its family
        assert r.model_checkpoint == str(family_checkpoints[family]) and r.model_digest == ck.digest
        assert r.model_family == family and r.model == family
        # each backend either ran and passed parity against eager fp32 of the same checkpoint, or
        # says why it did not run: never a silently different answer
        if r.status == "not run":
            assert r.error, r.backend
            continue
        assert r.ok, f"{r.backend}: {r.error}"
        # INT8 is lossy, and 10 questions cannot always decide its verdict: an answer it moves shows
        # as a failure within noise (on a 2-core AVX2 CPU, the 7-bit weights reduce_range gives
        # there moved 1 of roberta's 10), never as a silent pass; every other row passes
        assert r.parity == "pass" or (r.precision == "int8" and r.parity_within_noise), \
            f"{r.backend}: {r.parity} {r.parity_failures}"
    ref = rows["eager-fp32"]
    assert ref.ok and ref.n_questions == 10 and ref.scores["f1"] >= 0
    assert bundle.meta.model_checkpoint == str(family_checkpoints[family]) and bundle.meta.model_digest == ck.digest
    # fp32-class backends are run for every family and agree to rounding
    for name in ("torch-compile-fp32", "ort-fp32"):
        assert rows[name].ok and rows[name].max_abs_logit_diff < 1e-2, (name, rows[name].error)
    # nothing trained: the checkpoint folder is untouched and no model was written under models/
    assert not (tmp_path / "models" / family / "train_metrics.json").exists()


def test_identity_in_mlflow(family_checkpoints, corpus_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from bertqa_bench.reporting.tracking import default_tracking_uri

    suite = _suite(tmp_path, corpus_dir, ["eager-fp32"])
    folder = family_checkpoints["distilbert"]
    assert main(["bench", "--suite", str(suite), "--model", str(folder), "--no-progress"]) == 0
    digest = resolve_checkpoint(str(folder)).digest
    client = MlflowClient(default_tracking_uri(tmp_path / "results"))
    runs = client.search_runs([client.get_experiment_by_name("bertqa-ckpt").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("kind") == "bench")
    child = next(r for r in runs if r.data.tags.get("kind") == "backend")
    assert parent.data.params["model_checkpoint"] == str(folder) and parent.data.params["model_digest"] == digest
    assert child.data.tags["model.checkpoint"] == str(folder) and child.data.tags["model.digest"] == digest
    row = (sorted((tmp_path / "results").glob("*-ckpt"))[-1] / "results.csv").read_text()
    assert digest in row


# --- the folder checks ------------------------------------------------------------------------

def _copy(src, dst, drop=()):
    shutil.copytree(src, dst)
    for n in drop:
        (dst / n).unlink()
    return dst


def test_digest_follows_weights_config_and_tokenizer(family_checkpoints, tmp_path):
    src = family_checkpoints["bert"]
    base = resolve_checkpoint(str(src))
    assert len(base.digest) == 20 and base.weights == "safetensors" and base.model_type == "bert"
    assert resolve_checkpoint(str(_copy(src, tmp_path / "same"))).digest == base.digest  # content, not path
    other = _copy(src, tmp_path / "tok")
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert resolve_checkpoint(str(other)).digest != base.digest
    w = _copy(src, tmp_path / "w")
    data = bytearray((w / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (w / "model.safetensors").write_bytes(bytes(data))
    assert resolve_checkpoint(str(w)).digest != base.digest


def test_refuses_base_model_without_qa_head(corpus_dir, tmp_path):
    texts = corpus_from_squad(corpus_dir[1])
    folder = build_checkpoint("roberta", tmp_path / "base", texts=texts, vocab_size=300, with_head=False)
    with pytest.raises(CheckpointError, match="no question-answering head"):
        resolve_checkpoint(str(folder))


def test_refuses_folder_without_tokenizer(family_checkpoints, tmp_path):
    folder = _copy(family_checkpoints["roberta"], tmp_path / "notok", drop=("tokenizer.json",))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        resolve_checkpoint(str(folder))


def test_refuses_custom_code(family_checkpoints, tmp_path):
    folder = _copy(family_checkpoints["bert"], tmp_path / "remote")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForQuestionAnswering": "modeling_evil.EvilQA"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        resolve_checkpoint(str(folder))
    cfg.pop("auto_map")
    cfg["model_type"] = "my-own-arch"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        resolve_checkpoint(str(folder))


def test_pickle_only_needs_explicit_flag(family_checkpoints, tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = _copy(family_checkpoints["bert"], tmp_path / "pickled")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="allow-pickle"):
        resolve_checkpoint(str(folder))
    ck = resolve_checkpoint(str(folder), allow_pickle=True)
    assert ck.weights == "pickle"
    # the CLI refuses it too, as a named error (exit 2), before anything runs
    assert main(["bench", "--model", str(folder), "--no-mlflow", "--no-progress"]) == 2


def test_missing_folder_and_config_are_named(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="no such folder"):
        resolve_checkpoint(str(tmp_path / "nope" / "deeper"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_family_gates_say_why_not_run():
    """Backends that would quietly do nothing for a family report why (not run) instead."""
    from bertqa_bench.backends.variants import default_table

    t = default_table()
    fp8, int8, packed = (t.get(n) for n in ("torch-compile-fp8", "torch-compile-int8", "eager-fp16-packed"))
    for fam in ("distilbert", "albert", "deberta-v2"):
        assert "nothing would be quantized" in fp8.backend_class.family_reason(fp8.options, fam)
        assert int8.backend_class.family_reason(int8.options, fam)
    for fam in ("bert", "roberta", "electra"):
        assert fp8.backend_class.family_reason(fp8.options, fam) is None
    for fam in ("bert", "roberta", "electra", "distilbert"):
        assert packed.backend_class.family_reason(packed.options, fam) is None
    assert "not packed" in packed.backend_class.family_reason(packed.options, "deberta-v2")
    assert "not packed" in packed.backend_class.family_reason(packed.options, "albert")
    assert t.get("onnxruntime").backend_class.family_reason(t.get("onnxruntime").options, "deberta-v2") is None


def test_quant_families_have_their_target_linears(family_checkpoints):
    """QUANT_FAMILIES is a claim about module names: each family named there has the Linears the
    FP8/INT8 swap looks for, and each family left out has none of the q/k/v ones."""
    from bertqa_bench.backends.torch_options import QUANT_FAMILIES
    from bertqa_bench.backends.transforms.fp8_surgery import target_linears
    from bertqa_bench.model.modeling import load_inference_module

    for fam, folder in family_checkpoints.items():
        m = load_inference_module(folder, "squad")
        qkv = target_linears(m, ("qkv",))
        if fam in QUANT_FAMILIES:
            assert len(target_linears(m)) == 6 * 2, fam  # 2 layers x (q, k, v, attn out, ffn in, ffn out)
        else:
            assert not qkv, fam


def test_featurization_follows_the_tokenizer(family_checkpoints, corpus_dir):
    """Segment ids only for tokenizers that take them (run_qa passes what the tokenizer returns),
    and every context token's offsets cut a piece of the context (BPE's and Unigram's too)."""
    from bertqa_bench.model.modeling import load_tokenizer
    from bertqa_bench.tasks.squad.features import tokenize_examples
    from bertqa_bench.tasks.squad.reader import load_squad_json

    examples = load_squad_json(corpus_dir[2])[:6]
    for fam, folder in family_checkpoints.items():
        tok = load_tokenizer(str(folder))
        f = tokenize_examples(examples, tok, max_seq_len=64, doc_stride=24, max_query_len=24)
        takes = "token_type_ids" in tok.model_input_names
        assert bool(f.token_type_ids.any()) == takes, fam
        assert f.input_ids[:, 0].tolist() == [tok.cls_token_id] * len(f), fam  # the null answer's position
        for i, offs in enumerate(f.offsets):
            ctx = examples[f.example_index[i]].context
            for o in offs:
                if o is not None:
                    assert 0 <= o[0] <= o[1] <= len(ctx)
        # the gold answer is recoverable from the windows' offsets (the training labels)
        ft = tokenize_examples(examples, tok, max_seq_len=64, doc_stride=24, max_query_len=24, train=True)
        hits = 0
        for i in range(len(ft)):
            s, e = ft.start_positions[i], ft.end_positions[i]
            if s:
                ex = examples[ft.example_index[i]]
                text = ex.context[ft.offsets[i][s][0]:ft.offsets[i][e][1]]
                hits += ex.answers[0].text.strip() in text
        assert hits >= len(examples) // 2, fam
        assert np.all(f.attention_mask.sum(1) <= 64)


def test_distilbert_grown_from_minilm_keeps_the_encoder():
    """A DistilBERT shape grown from the embedded MiniLM (the GPU plan's model): its encoder gives
    MiniLM's hidden states, tiled, on a one-segment input (type-0 embedding folded in)."""
    import torch
    from transformers import AutoModel

    from bertqa_bench.model.modeling import load_tokenizer, resolve_base

    from transformers import DistilBertConfig

    from bertqa_bench.model.families import grown_encoder_state

    cfg = DistilBertConfig(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072)
    sd = grown_encoder_state("distilbert", cfg, "embedded:all-MiniLM-L6-v2")
    dist = AutoModel.from_config(cfg)
    dist.load_state_dict(sd, strict=False)
    dist.eval()
    src = AutoModel.from_pretrained(resolve_base("embedded:all-MiniLM-L6-v2")).eval()
    enc = load_tokenizer("embedded:all-MiniLM-L6-v2")(["Mara Venn founded the Hollin Company."], return_tensors="pt")
    with torch.no_grad():
        a = src(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        b = dist(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    assert torch.allclose(b[..., :384], a, atol=1e-4) and torch.allclose(b[..., 384:], a, atol=1e-4)


def test_hub_name_offline_is_a_named_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    with pytest.raises(CheckpointError, match="not in the local hub cache"):
        resolve_checkpoint("deepset/roberta-base-squad2")


@pytest.mark.parametrize("head_first", [False, True])
@pytest.mark.parametrize("family", ["roberta", "electra", "distilbert"])
def test_packed_encoder_matches_the_padded_model(family, head_first, family_checkpoints):
    """The padding-free path on each family it claims: the same start/end logits on every real
    token as the padded model (positions offset for RoBERTa, no segment ids for DistilBERT), with
    the QA head after the scatter or before it."""
    import copy

    import torch

    from bertqa_bench.backends.transforms.packed_encoder import pack_model
    from bertqa_bench.model.modeling import load_inference_module

    m = load_inference_module(family_checkpoints[family], "squad")
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(5, 300, size=(4, 40)))
    mask = torch.ones_like(ids)
    for r, n in enumerate((40, 31, 7, 19)):
        mask[r, n:] = 0
        ids[r, n:] = m.model.config.pad_token_id
    types = torch.zeros_like(ids)
    types[:, 10:] = 1 if m.uses_token_type_ids and getattr(m.model.config, "type_vocab_size", 1) > 1 else 0
    types *= mask
    with torch.no_grad():
        ref = m(ids, mask, types)
        packed = copy.deepcopy(m)
        pack_model(packed.model, head_first=head_first)
        out = packed(ids, mask, types)
    real = mask.bool()
    for a, b in zip(ref, out):
        assert (a - b)[real].abs().max() < 1e-4, family


def test_resume_a_checkpoint_run_checks_the_checkpoints_own_files(family_checkpoints, corpus_dir, tmp_path):
    """--resume of a `bench --model` run finds the model in the checkpoint's folder (not models/),
    and refuses when that folder's files changed since."""
    suite = _suite(tmp_path, corpus_dir, ["eager-fp32"])
    folder = _copy(family_checkpoints["electra"], tmp_path / "mine")
    assert _run(suite, folder) == 0
    run = sorted((tmp_path / "results").glob("*-ckpt"))[-1]
    assert main(["bench", "--resume", str(run), "--no-progress", "--no-mlflow"]) == 0
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_norm_eps"] = 1e-7  # the checkpoint replaced in place
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["bench", "--resume", str(run), "--no-progress", "--no-mlflow"]) == 2


def _short_positions(src, dst, positions: int):
    """A copy of ``src`` whose position embeddings reach ``positions`` tokens (a real model of
    that shape: the table cut, config.json saying so)."""
    from transformers import AutoModelForQuestionAnswering

    folder = _copy(src, dst)
    model = AutoModelForQuestionAnswering.from_pretrained(folder)
    emb = model.base_model.embeddings
    emb.position_embeddings.weight.data = emb.position_embeddings.weight.data[:positions].clone()
    emb.position_embeddings.num_embeddings = positions
    emb.register_buffer("position_ids", emb.position_ids[:, :positions].clone(), persistent=False)
    if hasattr(emb, "token_type_ids"):
        emb.register_buffer("token_type_ids", emb.token_type_ids[:, :positions].clone(), persistent=False)
    model.config.max_position_embeddings = positions
    model.save_pretrained(folder)
    return folder


def test_a_checkpoint_shorter_than_the_windows_is_refused_before_any_work(family_checkpoints, corpus_dir, tmp_path,
                                                                          capsys):
    folder = _short_positions(family_checkpoints["bert"], tmp_path / "short", 32)
    suite = _suite(tmp_path, corpus_dir, ["eager-fp32"])  # data.max_seq_len 64
    assert _run(suite, folder) == 2
    err = capsys.readouterr().err
    assert "reach 32 tokens" in err and "data.max_seq_len 64" in err and "--set data.max_seq_len=32" in err
    assert not list((tmp_path / "results").glob("*-ckpt"))  # no run folder
    assert not (tmp_path / "cache" / "evalsets").exists()  # nothing tokenized either


def test_usable_positions_by_family():
    from bertqa_bench.model.checkpoint import usable_positions

    assert usable_positions({"model_type": "bert", "max_position_embeddings": 512}) == 512
    assert usable_positions({"model_type": "roberta", "max_position_embeddings": 514}) == 512
    assert usable_positions({"model_type": "deberta-v2", "max_position_embeddings": 512,
                             "position_biased_input": False}) is None
    assert usable_positions({"model_type": "bert", "position_embedding_type": "relative_key",
                             "max_position_embeddings": 64}) is None
    assert usable_positions({"model_type": "bert"}) is None


def test_empty_questions_are_kept_with_a_warning_and_their_count(family_checkpoints, corpus_dir, tmp_path, capsys):
    d, _, dev = corpus_dir
    data = json.loads(dev.read_text())
    qas = [qa for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    qas[0]["question"], qas[1]["question"] = "", "   \t"
    bad = tmp_path / "dev-empty.json"
    bad.write_text(json.dumps(data))
    suite = _suite(tmp_path, corpus_dir, ["eager-fp32"])
    assert _run(suite, family_checkpoints["bert"], "--dev-file", str(bad)) in (0, 1)
    out = capsys.readouterr()
    assert f"2 of {len(qas)} questions are empty or whitespace only" in out.out + out.err
