from .base import FP32_CLASS, INPUT_NAMES, REDUCED_CLASS, Backend, BackendContext
from .registry import create, get_spec, names, register, specs, validate_names

__all__ = ["Backend", "BackendContext", "INPUT_NAMES", "FP32_CLASS", "REDUCED_CLASS",
           "create", "get_spec", "names", "register", "specs", "validate_names"]
