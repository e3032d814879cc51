"""Inference backends: the Backend interface, the variant table, and the implementations
(``torch_backend``; ``exported/``: ONNX Runtime, OpenVINO, TensorRT), which are imported only when
a variant uses them; ``transforms/`` holds what the PyTorch backend does to a model."""
from .base import FP32_CLASS, INPUT_NAMES, REDUCED_CLASS, Backend, BackendContext
from .variants import ENTRY_POINT_GROUP, Variant, VariantTable, default_table, make_variant

__all__ = ["Backend", "BackendContext", "INPUT_NAMES", "FP32_CLASS", "REDUCED_CLASS", "ENTRY_POINT_GROUP",
           "Variant", "VariantTable", "default_table", "make_variant"]
