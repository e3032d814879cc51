"""Whether the suite's Triton kernels (gelu_fp8.py's, varlen_attention.py's) can run here: one
answer for all of them, decided once when this module is imported."""
import torch


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Decided once at import: the kernels' torch-side wrappers run inside compiled code (gelu_fp8's
# gelu_tanh_fp8 asks it on every call), where an import attempt would break the graph.
HAS_TRITON = _has_triton()


def triton_unavailable_reason() -> str:
    """Why the suite's Triton kernels cannot run here ('' when they can: CUDA and Triton present)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not HAS_TRITON:
        return "triton is not installed (it comes with CUDA builds of torch)"
    return ""
