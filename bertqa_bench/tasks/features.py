"""Model inputs shared by every task and backend: one row per window ("feature").

A leaf module (numpy only): tasks build Features, the scheduler slices them into batches,
backends receive the named input arrays. Nothing here knows which task made them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

# Inputs every BERT QA backend receives, in this order (the ONNX/TensorRT input names too).
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class Features:
    """Tokenized model inputs: one row per window, several windows per long context.

    ``example_index[i]`` is the index (into the examples list the features were made from)
    of the question that feature i belongs to. ``offsets[i][t]`` is the (start, end) character
    span of token t in the example's context, or None when token t is not a context token
    (question, special tokens, padding) — postprocessing only ever picks context tokens.
    ``start_positions``/``end_positions`` are set for training features (0 = [CLS] when the
    answer is not inside that window). ``extra`` carries task-specific per-feature data
    (e.g. NQ's token maps, training labels) without the runner needing to know it.
    """

    input_ids: np.ndarray  # int64 [N, S]
    attention_mask: np.ndarray  # int64 [N, S]
    token_type_ids: np.ndarray  # int64 [N, S]
    example_index: np.ndarray  # int64 [N]
    offsets: list = field(default_factory=list)  # list[list[Optional[tuple[int, int]]]]
    start_positions: Optional[np.ndarray] = None
    end_positions: Optional[np.ndarray] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def inputs(self, rows=slice(None), trim_to: Optional[int] = None) -> dict[str, np.ndarray]:
        """Model inputs for ``rows`` (a slice or index array), optionally trimmed to ``trim_to`` tokens."""
        cols = slice(None) if trim_to is None else slice(0, trim_to)
        return {name: np.ascontiguousarray(getattr(self, name)[rows, cols]) for name in INPUT_NAMES}

    def lengths(self) -> np.ndarray:
        """Real (unpadded) length of each feature."""
        return self.attention_mask.sum(axis=1).astype(np.int64)
