"""Inference backends: the Backend interface, the variant table, and the implementations
(``torch_backend``, ``onnxruntime``, ``tensorrt``), which are imported only when a variant uses them."""
from .base import FP32_CLASS, INPUT_NAMES, REDUCED_CLASS, Backend, BackendContext
from .variants import ENTRY_POINT_GROUP, Variant, VariantTable, default_table, make_variant

__all__ = ["Backend", "BackendContext", "INPUT_NAMES", "FP32_CLASS", "REDUCED_CLASS", "ENTRY_POINT_GROUP",
           "Variant", "VariantTable", "default_table", "make_variant"]
