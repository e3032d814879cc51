"""Extractive-QA checkpoints of each encoder family, made offline, saved as a user's folder is.

The machines here reach no model hub, yet ``bench --model FOLDER`` must be proven on every
family a user may bring. ``build_checkpoint`` makes one: the family's architecture from a
config (tiny for tests, base size for the GPU), random weights with a QA head, and a tokenizer
of the family's own kind —

* WordPiece families (BERT, DistilBERT, ELECTRA): the embedded all-MiniLM-L6-v2 vocabulary;
* byte-level BPE (RoBERTa): trained with ``tokenizers`` on the given corpus;
* SentencePiece-style Unigram (ALBERT, DeBERTa-v2/v3): trained with ``tokenizers`` likewise;

saved with ``save_pretrained`` (safetensors + tokenizer files), exactly what a user's folder
holds. Random weights time like trained ones; to score, fine-tune the folder first
(``bertqa-bench train --set model.base=FOLDER``) — the GPU plan does that.

    python -m bertqa_bench.commands.make_checkpoint roberta OUT_DIR [--size base] [--corpus FILE | --corpus-suite SUITE]
    python -m bertqa_bench.commands.make_checkpoint distilbert OUT_DIR --size base --grow-from embedded:all-MiniLM-L6-v2
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..io import atomic_dir

FAMILY_NAMES = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2")
TOKENIZER_KIND = {"bert": "wordpiece", "distilbert": "wordpiece", "electra": "wordpiece",
                  "roberta": "bpe", "albert": "unigram", "deberta-v2": "unigram"}

# Tiny: seconds on a CPU. Base: the family's published base shape.
_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def config_kwargs(family: str, size: str, vocab_size: int, special: dict) -> dict:
    dims = dict(_TINY if size == "tiny" else _BASE)
    kw: dict = {"vocab_size": vocab_size, "max_position_embeddings": 512}
    if family == "distilbert":
        # distilbert-base: BERT-base's width, half its layers
        kw.update(dim=dims["hidden_size"], n_layers=dims["num_hidden_layers"] // (2 if size == "base" else 1),
                  n_heads=dims["num_attention_heads"], hidden_dim=dims["intermediate_size"])
    else:
        kw.update(dims)
    if family == "roberta":
        # RoBERTa's positions start after the padding index (pad_token_id + 1)
        kw.update(max_position_embeddings=514, type_vocab_size=1)
    if family == "albert":
        kw.update(embedding_size=min(128, dims["hidden_size"]))
    if family == "electra":
        kw.update(embedding_size=dims["hidden_size"])
    if family == "deberta-v2":
        # the v3 recipe: relative attention, no absolute positions, no segment ids
        kw.update(relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
                  position_biased_input=False, max_relative_positions=-1, type_vocab_size=0, norm_rel_ebd="layer_norm",
                  share_att_key=True)
    kw.update(special)
    return kw


def _train_bpe(texts: list[str], vocab_size: int):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def _train_unigram(texts: list[str], vocab_size: int, special: list[str], unk: str):
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special, unk_token=unk,
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]


def make_tokenizer(family: str, texts: Optional[Iterable[str]] = None, vocab_size: int = 2000):
    """The family's kind of fast tokenizer (see the module docstring)."""
    kind = TOKENIZER_KIND[family]
    if kind == "wordpiece":
        from .modeling import load_tokenizer

        return load_tokenizer("embedded:all-MiniLM-L6-v2")
    texts = list(texts or [])
    if not texts:
        raise ValueError(f"a {kind} tokenizer for {family} is trained on a corpus: pass texts")
    if kind == "bpe":
        from transformers import RobertaTokenizer

        vocab, merges = _train_bpe(texts, vocab_size)
        return RobertaTokenizer(vocab=vocab, merges=merges)
    if family == "albert":
        from transformers import AlbertTokenizer

        special = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
        return AlbertTokenizer(vocab=_train_unigram(texts, vocab_size, special, "<unk>"), do_lower_case=True)
    from transformers import DebertaV2Tokenizer

    special = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    return DebertaV2Tokenizer(vocab=_train_unigram(texts, vocab_size, special, "[UNK]"), unk_id=3)


def corpus_from_squad(path: str | Path) -> list[str]:
    """Contexts and questions of a SQuAD-format file (what a tokenizer is trained on)."""
    obj = json.loads(Path(path).read_text())
    out = []
    for a in obj["data"]:
        for p in a["paragraphs"]:
            out.append(p["context"])
            out.extend(q["question"] for q in p["qas"])
    return out


def distilbert_state_from_bert(bert_sd: dict, n_layers: int) -> dict:
    """A BertModel's weights in DistilBertModel's names. DistilBERT has no segment embeddings:
    BERT's type-0 embedding (what every token of a single segment adds) is folded into the
    position embeddings, so a one-segment input gives the BERT encoder's hidden states."""
    sd = {"embeddings.word_embeddings.weight": bert_sd["embeddings.word_embeddings.weight"],
          "embeddings.position_embeddings.weight": bert_sd["embeddings.position_embeddings.weight"]
          + bert_sd["embeddings.token_type_embeddings.weight"][0],
          "embeddings.LayerNorm.weight": bert_sd["embeddings.LayerNorm.weight"],
          "embeddings.LayerNorm.bias": bert_sd["embeddings.LayerNorm.bias"]}
    names = {"attention.q_lin": "attention.self.query", "attention.k_lin": "attention.self.key",
             "attention.v_lin": "attention.self.value", "attention.out_lin": "attention.output.dense",
             "sa_layer_norm": "attention.output.LayerNorm", "ffn.lin1": "intermediate.dense",
             "ffn.lin2": "output.dense", "output_layer_norm": "output.LayerNorm"}
    for i in range(n_layers):
        for dst, src in names.items():
            for p in ("weight", "bias"):
                sd[f"transformer.layer.{i}.{dst}.{p}"] = bert_sd[f"encoder.layer.{i}.{src}.{p}"]
    return sd


def grown_encoder_state(family: str, config, grow_from: str) -> dict:
    """``config``'s encoder (a BERT or DistilBERT shape) grown from the pretrained BERT-family
    encoder ``grow_from`` (grow.py: widened function-preservingly, layers stacked)."""
    from transformers import BertConfig

    from .grow import grow_encoder
    from .modeling import resolve_base

    if family not in ("bert", "distilbert"):
        raise ValueError(f"growing from {grow_from} makes BERT-layout encoders (bert, distilbert), not {family}")
    bert_cfg = config if family == "bert" else BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, intermediate_size=config.hidden_dim,
        max_position_embeddings=config.max_position_embeddings)
    encoder, _ = grow_encoder(resolve_base(grow_from), bert_cfg)
    sd = encoder.state_dict()
    return sd if family == "bert" else distilbert_state_from_bert(sd, config.n_layers)


def build_checkpoint(family: str, out_dir: str | Path, *, texts: Optional[Iterable[str]] = None, size: str = "tiny",
                     seed: int = 0, vocab_size: int = 2000, with_head: bool = True, tokenizer=None,
                     head_scale: float = 1.0, grow_from: Optional[str] = None, layers: Optional[int] = None) -> Path:
    """A random-weight ``family`` QA model + its tokenizer, saved to ``out_dir`` (safetensors).
    ``with_head=False`` saves the base encoder only (a folder that must be refused).

    ``head_scale`` multiplies the random span head: a random model's start/end logits are nearly
    tied everywhere, so the rounding of bf16 or int8 flips its answers whatever the backend;
    a wider head gives the clear margins of a trained model, and parity on a tiny random
    checkpoint then tests the backend, not the coin toss (tests use it; timing is unchanged).

    ``grow_from`` (bert, distilbert; WordPiece vocabulary of the source): the encoder grown from
    that pretrained encoder instead of random, e.g. a DistilBERT-base shape from the embedded
    MiniLM; ``layers`` overrides the size's layer count."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForQuestionAnswering

    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown family '{family}'; one of {', '.join(FAMILY_NAMES)}")
    if size not in ("tiny", "base"):
        raise ValueError("size is tiny or base")
    tok = tokenizer if tokenizer is not None else make_tokenizer(family, texts, vocab_size)
    special = {"pad_token_id": tok.pad_token_id}
    if family == "roberta":
        special.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    kw = config_kwargs(family, size, len(tok), special)
    if layers:
        kw["n_layers" if family == "distilbert" else "num_hidden_layers"] = layers
    if grow_from and size == "base":
        # MiniLM's 12 heads: the grown shape keeps the source's head count (grow.py)
        kw.update({"n_heads" if family == "distilbert" else "num_attention_heads": 12})
    config = AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    model = (AutoModelForQuestionAnswering if with_head else AutoModel).from_config(config)
    if grow_from:
        encoder = getattr(model, model.base_model_prefix) if with_head else model
        missing, unexpected = encoder.load_state_dict(grown_encoder_state(family, config, grow_from), strict=False)
        bad = [m for m in missing if "position_ids" not in m and "pooler" not in m] + list(unexpected)
        if bad:
            raise RuntimeError(f"grown weights do not fit the {family} encoder: {bad[:5]}")
    if with_head and head_scale != 1.0:
        with torch.no_grad():
            model.qa_outputs.weight.mul_(head_scale)

    out = Path(out_dir)
    with atomic_dir(out) as tmp:  # a folder appears whole or not at all
        model.save_pretrained(tmp)  # safetensors by default
        tok.save_pretrained(tmp)
    return out
