"""A user's fine-tuned extractive-QA checkpoint, benchmarked as it is (``model.checkpoint`` /
``bench --model``): found, checked and fingerprinted before any backend touches it.

What is checked, and why each check is a named error rather than a warning:

* ``config.json`` names an encoder family this suite's backends know (``FAMILIES``), loadable
  by ``AutoModelForQuestionAnswering`` without custom code. A config with ``auto_map`` (or an
  unknown ``model_type``) needs ``trust_remote_code``: that would execute Python shipped with
  the checkpoint, so it is refused with that reason (a checkpoint never runs code).
* The weights hold a QA head (``qa_outputs.*``). Without one, transformers would initialise a
  random head and every backend would agree on meaningless answers: a silently wrong result.
* Weights load from safetensors. A folder with only ``pytorch_model.bin`` is refused unless the
  user says it may be unpickled (``model.allow_pickle`` / ``--allow-pickle``): unpickling can run
  code.
* A fast tokenizer's files are there (featurization needs its offsets).
* Every safetensors file opens (header, sizes: an empty, truncated or corrupt file is named
  with what is wrong), the span head has 2 outputs, and the tokenizer's ids fit the word
  embeddings (weights_file.py): otherwise each would fail inside every backend's worker.

The identity that goes into results, run.json and MLflow is the name the user gave plus a
digest of the config, weight and tokenizer files: two runs of "my-model" compare only if the
digests match.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import resolve_path
from ..errors import BenchError, MissingDependencyError
from .weights_file import check_fits, check_weight_files, load_folder_tokenizer, safetensors_header


class CheckpointError(BenchError):
    """A checkpoint cannot be benchmarked as given; the message says what is missing or refused."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"checkpoint '{name}': {reason}")


# Encoder families the backends are built and tested for (tests/test_checkpoint.py builds each),
# -> the model type onnxruntime's transformer optimizer fuses them as (optimum maps the same way:
# they are all BERT-shaped encoders to its fusion passes).
FAMILIES = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "camembert": "bert",
    "distilbert": "bert",
    "albert": "bert",
    "electra": "bert",
    "deberta-v2": "bert",
}

# Families whose encoder the padding-free path (backends/transforms/packed_encoder.py) computes, each tested
# against its padded model (tests/test_checkpoint.py); RoBERTa-style ones number positions after
# the padding index.
PACKED_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert")
OFFSET_POSITION_FAMILIES = ("roberta", "xlm-roberta", "camembert")

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Tokenizer files: the fast tokenizer's own file, or what a fast one is converted from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spm.model", "sentencepiece.bpe.model", "spiece.model")
_TOKENIZER_VOCABS = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "sentencepiece.bpe.model",
                     "spiece.model")
# Every listed family names its span head qa_outputs (transformers' *ForQuestionAnswering).
QA_HEAD_PREFIX = "qa_outputs."
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass
class Checkpoint:
    name: str  # as the user gave it (hub name or folder)
    path: Path  # the local folder (a hub snapshot lives in the hub cache)
    model_type: str
    digest: str  # model_digest: 20 hex of the sha256 over config, weight and tokenizer files
    weights: str  # "safetensors" | "pickle"
    architectures: list = field(default_factory=list)
    files: list = field(default_factory=list)  # the files the digest covers
    max_positions: Optional[int] = None  # the longest window its position embeddings can read

    def position_reason(self, max_seq_len: int) -> str:
        """Why this checkpoint cannot read windows of ``max_seq_len`` tokens ('' when it can)."""
        if self.max_positions is None or max_seq_len <= self.max_positions:
            return ""
        return (f"model.checkpoint {self.name}: its position embeddings reach {self.max_positions} tokens "
                f"(max_position_embeddings in config.json), below data.max_seq_len {max_seq_len}; run it with "
                f"--set data.max_seq_len={self.max_positions} (and a data.doc_stride below that)")

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.digest}"

    @property
    def optimizer_model_type(self) -> str:
        return FAMILIES[self.model_type]


def _is_local(spec: str) -> Optional[Path]:
    for p in (Path(spec).expanduser(), resolve_path(spec)):
        if p.is_dir():
            return p.resolve()
    return None


def _download(spec: str, allow_pickle: bool) -> Path:
    """A hub name -> the snapshot folder (only the files benchmarking needs: no code, no other
    frameworks' weights). Offline (HF_HUB_OFFLINE=1), only the local hub cache is used."""
    if not _HUB_NAME.match(spec):
        raise CheckpointError(spec, "no such folder (and not a hub name of the form owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise MissingDependencyError("huggingface_hub", f"downloading checkpoint '{spec}'") from None
    patterns = [CONFIG_FILE, "*.safetensors", SAFETENSORS_INDEX, *TOKENIZER_FILES]
    if allow_pickle:
        patterns += list(PICKLE_WEIGHTS) + ["pytorch_model-*.bin"]
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(spec, allow_patterns=patterns, local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one named error
        where = "not in the local hub cache (HF_HUB_OFFLINE is set)" if offline else "could not be downloaded"
        raise CheckpointError(spec, f"not a local folder, and as a hub name {where}: {type(e).__name__}: {e}") from None


def _safetensors_keys(path: Path) -> list[str]:
    return list(safetensors_header(path))


def model_digest(model_dir: str | Path) -> str:
    """The model the rows are measured on: its config, weights and tokenizer files (every .json
    but train_metrics.json, .safetensors, .bin, .txt, .model), by content: a copy elsewhere has
    the same digest, a retrained or replaced model another. One digest for a run's identity
    (results, run.json, MLflow) and its resume check (bench.py)."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin", ".txt", ".model")) and f.name != "train_metrics.json":
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
    return h.hexdigest()[:20]


def inspect_folder(name: str, folder: Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Check a local model folder (see the module docstring); raise CheckpointError naming what
    is missing or refused."""
    folder = Path(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.exists():
        raise CheckpointError(name, f"{folder} has no {CONFIG_FILE}: not a saved Hugging Face model "
                                    "(save it with model.save_pretrained(folder))")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(name, f"{cfg_path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(name, f"{cfg_path} holds a JSON {type(config).__name__}, not the object "
                                    "save_pretrained writes")
    model_type = config.get("model_type")
    if config.get("auto_map"):
        raise CheckpointError(name, f"its config maps to custom code (auto_map: {sorted(config['auto_map'])}), which "
                                    "needs trust_remote_code; refused: a benchmarked checkpoint never runs code")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(name, f"model_type {model_type!r} is not one transformers knows; loading it would need "
                                    "trust_remote_code, which is refused: a benchmarked checkpoint never runs code")
    if model_type not in FAMILIES:
        raise CheckpointError(name, f"model_type '{model_type}' is not one of the encoder families the backends "
                                    f"support ({', '.join(sorted(FAMILIES))})")

    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    shards = [f for f in files if f.endswith(".safetensors")]
    pickles = [f for f in files if f in PICKLE_WEIGHTS or (f.startswith("pytorch_model-") and f.endswith(".bin"))]
    if shards:
        weights, weight_files = "safetensors", shards + ([SAFETENSORS_INDEX] if SAFETENSORS_INDEX in files else [])
    elif pickles:
        if not allow_pickle:
            raise CheckpointError(name, f"its only weights are pickle files ({', '.join(pickles)}): loading them runs "
                                        "Python's unpickler, which can execute code. Convert them to safetensors, or "
                                        "pass --allow-pickle (model.allow_pickle: true) to accept unpickling them")
        weights, weight_files = "pickle", pickles
    else:
        raise CheckpointError(name, f"{folder} has no PyTorch weights (model.safetensors; found: "
                                    f"{', '.join(files) or 'no files'})")

    architectures = list(config.get("architectures") or [])
    entries: dict = {}
    if weights == "safetensors":
        entries = check_weight_files(folder)  # a damaged, empty or truncated file is named here
        keys = list(entries)
        has_head = any(k.startswith(QA_HEAD_PREFIX) or f".{QA_HEAD_PREFIX}" in k for k in keys)
        if not has_head:
            raise CheckpointError(name, f"its weights have no question-answering head ({QA_HEAD_PREFIX}* ; "
                                        f"architectures: {architectures or 'none'}): it is a base model, not fine-tuned "
                                        "for extractive QA. Loading it would add a random head; fine-tune it first "
                                        "(bertqa-bench train with model.base set to it)")
    elif not any(a.endswith("ForQuestionAnswering") for a in architectures):
        raise CheckpointError(name, f"config.json architectures {architectures or 'none'} name no "
                                    "*ForQuestionAnswering head: not an extractive-QA model")

    tok_files = [f for f in files if f in TOKENIZER_FILES]
    if not any(f in _TOKENIZER_VOCABS for f in tok_files):
        raise CheckpointError(name, f"{folder} has no tokenizer (none of {', '.join(_TOKENIZER_VOCABS)}); save it "
                                    "beside the model with tokenizer.save_pretrained(folder)")
    check_model_fits(folder, entries)
    digest = model_digest(folder)
    return Checkpoint(name=name, path=folder, model_type=model_type, digest=digest, weights=weights,
                      architectures=architectures, files=[CONFIG_FILE] + weight_files + tok_files,
                      max_positions=usable_positions(config))


# RoBERTa's family numbers positions from padding_idx + 1 (2), so two of its embeddings are never
# a token's: a 514-position RoBERTa reads 512 tokens.
_POSITION_OFFSET = {"roberta": 2, "xlm-roberta": 2, "camembert": 2}


def usable_positions(config: dict) -> Optional[int]:
    """The longest window a checkpoint's absolute position embeddings can read, from its config."""
    n = config.get("max_position_embeddings")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if config.get("position_embedding_type", "absolute") != "absolute":
        return None  # relative positions: no table to run off the end of
    if config.get("model_type") == "deberta-v2" and not config.get("position_biased_input", True):
        return None  # DeBERTa-v3: relative attention only
    return n - _POSITION_OFFSET.get(config.get("model_type"), 0)


def check_model_fits(folder: Path, entries: dict) -> None:
    """The span head has 2 outputs and the tokenizer's ids fit the embedding matrix (weights_file)."""
    check_fits(folder, entries, load_folder_tokenizer(folder))


def resolve_checkpoint(spec: str, *, allow_pickle: bool = False) -> Checkpoint:
    """A hub name or a local folder -> a checked Checkpoint (CheckpointError otherwise)."""
    if not spec or not str(spec).strip():
        raise CheckpointError(str(spec), "empty checkpoint name")
    local = _is_local(spec)
    folder = local if local is not None else _download(spec, allow_pickle)
    return inspect_folder(spec, folder, allow_pickle=allow_pickle)


def model_family(model_dir: str | Path) -> str:
    """``model_type`` of a saved model folder ("bert" when unreadable: the suite's own models)."""
    try:
        return str(json.loads((Path(model_dir) / CONFIG_FILE).read_text()).get("model_type") or "bert")
    except (OSError, ValueError):
        return "bert"


def model_dims(model_dir: str | Path) -> dict:
    """heads, hidden, layers, intermediate of any supported family, through transformers' config
    (whose attribute maps turn DistilBERT's n_heads/dim/n_layers/hidden_dim into the usual names)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    inter = getattr(c, "intermediate_size", None) or getattr(c, "hidden_dim", None) or 4 * c.hidden_size
    return {"heads": int(c.num_attention_heads), "hidden": int(c.hidden_size), "layers": int(c.num_hidden_layers),
            "intermediate": int(inter)}
