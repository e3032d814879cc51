"""Whether the suite's Triton kernels (gelu_fp8.py's, add_layernorm_fp8.py's, varlen_attention.py's)
can run here: one answer for all of them, decided once when this module is imported; and the
dispatch the ``triton_op`` kernels share (their op on CUDA, their torch reference elsewhere)."""
import torch

try:  # torch >= 2.6: the custom-op wrapper that keeps a kernel inside torch.compile's graph
    from torch.library import triton_op, wrap_triton
except ImportError:  # older torch: the FP8 rows still import and run these kernels' torch references
    triton_op = wrap_triton = None


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


def op_unavailable_reason() -> str:
    """Why a ``triton_op`` kernel cannot run as a torch op here ('' when it can)."""
    return "" if triton_op is not None else f"torch {torch.__version__} has no torch.library.triton_op (2.6 and newer)"


def runs_triton_op(on_cuda: bool, op) -> bool:
    """Whether a kernel's registered ``op`` (None where torch has no triton_op) runs for tensors on CUDA (or not)."""
    return on_cuda and HAS_TRITON and op is not None


def op_implementation(on_cuda: bool, op, kernel: str) -> str:
    """What a ``triton_op`` kernel's dispatch runs for tensors on CUDA (or not), in words: ``kernel``
    (the Triton kernel's description) or torch's reference, with why."""
    if runs_triton_op(on_cuda, op):
        return kernel
    why = "not on CUDA" if not on_cuda else "triton is not installed" if not HAS_TRITON else op_unavailable_reason()
    return f"torch ({why})"
