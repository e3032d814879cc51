"""A model folder's weight files and tokenizer, checked before any work starts.

A damaged ``model.safetensors`` used to surface deep inside a run: a header that is not UTF-8
as a ``UnicodeDecodeError`` traceback, an empty file as a ``JSONDecodeError``, a truncated one
only in each backend's worker (every row failed, the run "NO REFERENCE"). A tokenizer whose ids
run past the embedding matrix, or a span head with other than 2 outputs, failed inside the
workers too. Each is a one-line error here, naming the file and what is wrong with it.

The safetensors library itself validates a file (header length, UTF-8 JSON header, offsets
covering the data exactly): ``safe_open`` reads the header only, no weights. Its messages are
terse ("incomplete metadata, file not fully covered"), so the sizes it compared are recomputed
here to say how much is missing.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open

from ..errors import BenchError

# Bytes per element of the safetensors dtypes (the format's own list).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# Every supported family's span head (transformers' *ForQuestionAnswering, the NQ head): start, end.
QA_HEAD_WEIGHT_SUFFIX = "qa_outputs.weight"
SPAN_OUTPUTS = 2


class ModelFileError(BenchError):
    """A model file is damaged or does not fit the model; the message names the file."""

    def __init__(self, path, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{self.path}: {reason}")


def _why_unreadable(path: Path, size: int, library_message: str) -> str:
    """What is wrong with a safetensors file the library refused, in sizes a user can check."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8:
            return f"{size} bytes: too short for a safetensors file (8-byte header length, header, data); damaged"
        if 8 + n > size:
            return (f"its header length says {n:,} bytes of header, but only {size - 8:,} bytes follow: truncated, "
                    "or not a safetensors file")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"damaged header (not UTF-8 JSON: {type(e).__name__}: {e}); the file is corrupt"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return f"damaged header ({library_message})"
    want = 8 + n + end
    if size < want:
        return (f"truncated: {size:,} bytes, where its header describes {want:,} "
                f"({want - size:,} bytes of weights missing); copy or download it again")
    if size > want:
        return f"{size - want:,} bytes past the end its header describes ({want:,} bytes): damaged"
    return f"damaged ({library_message})"


def safetensors_header(path: str | Path) -> dict:
    """The tensor entries ({name: {dtype, shape, data_offsets}}) of a safetensors file that the
    safetensors library opens; a ModelFileError naming the file and the damage otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFileError(path, f"cannot be read: {e.strerror or e}") from None
    if size == 0:
        raise ModelFileError(path, "empty file (0 bytes): the weights were never written, or were lost; "
                                   "copy, download or train them again")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - SafetensorError and OS errors alike: the file is unusable
        raise ModelFileError(path, _why_unreadable(path, size, str(e))) from None
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n).decode("utf-8"))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def check_weight_files(folder: str | Path) -> dict:
    """Every ``*.safetensors`` file of a model folder opened and its tensors' sizes matched with
    their shapes; returns all their tensor entries. A ModelFileError names the first bad file."""
    entries: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        header = safetensors_header(f)
        for name, v in header.items():
            dtype, shape, (a, b) = v.get("dtype"), v.get("shape", []), v.get("data_offsets", (0, 0))
            if dtype in _DTYPE_BYTES and (b - a) != math.prod(shape) * _DTYPE_BYTES[dtype]:
                raise ModelFileError(f, f"tensor {name}: shape {shape} in {dtype} needs "
                                        f"{math.prod(shape) * _DTYPE_BYTES[dtype]:,} bytes, its offsets hold {b - a:,}")
        entries.update(header)
    return entries


def check_fits(folder: str | Path, entries: dict, tokenizer=None) -> None:
    """The weights fit the task and the tokenizer: a span head of 2 outputs, and no token id past
    the word-embedding matrix (else an index error inside every backend's worker)."""
    folder = Path(folder)
    weights = next(iter(sorted(folder.glob("*.safetensors"))), folder / "model.safetensors")
    heads = {k: v for k, v in entries.items() if k.endswith(QA_HEAD_WEIGHT_SUFFIX)}
    for k, v in heads.items():
        shape = list(v.get("shape", []))
        if not shape or shape[0] != SPAN_OUTPUTS:
            raise ModelFileError(weights, f"its question-answering head {k} has {shape[0] if shape else 0} outputs "
                                          f"(shape {shape}); an extractive-QA span head has {SPAN_OUTPUTS} "
                                          "(start, end logits): not a span-QA checkpoint")
    if tokenizer is None:
        return
    emb = [v for k, v in entries.items() if k.endswith("word_embeddings.weight")]
    if emb and emb[0].get("shape"):
        rows = int(emb[0]["shape"][0])
    else:
        try:
            rows = int(json.loads((folder / "config.json").read_text()).get("vocab_size") or 0)
        except (OSError, ValueError):
            rows = 0
    n = len(tokenizer)
    if rows and n > rows:
        raise ModelFileError(folder, f"its tokenizer has {n:,} tokens but the model's word-embedding matrix has "
                                     f"{rows:,} rows: ids past {rows - 1:,} would index outside it. The tokenizer "
                                     "belongs to another model; save the model's own tokenizer beside it")


def check_model_folder(folder: str | Path, hint: str = "") -> None:
    """A model folder the suite made (models/<name>): its weight files open, its head has 2
    outputs, its tokenizer fits its embeddings; ``hint`` (how to rebuild it) ends the message."""
    try:
        check_fits(folder, check_weight_files(folder), load_folder_tokenizer(folder))
    except ModelFileError as e:
        raise ModelFileError(e.path, e.reason + (f"; {hint}" if hint else "")) from None


def load_folder_tokenizer(folder: str | Path):
    """The folder's own fast tokenizer; a ModelFileError when it does not load (the featurizer
    could not use it either)."""
    from .modeling import load_tokenizer

    try:
        return load_tokenizer(str(folder))
    except Exception as e:  # noqa: BLE001 - any failure to build it is the folder's
        raise ModelFileError(folder, f"its tokenizer does not load: {type(e).__name__}: {str(e)[:300]}") from None
