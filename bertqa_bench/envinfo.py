"""The environment a measurement was taken in, recorded beside every result."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from functools import lru_cache

from .config import PROJECT_ROOT


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cuda_visible_devices() -> list[str]:
    """The entries of CUDA_VISIBLE_DEVICES ([] when unset: every GPU of the host is visible)."""
    return [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def git_commit() -> str:
    if os.environ.get("BERTQA_GIT_COMMIT"):  # copies of the tree without .git (e.g. a lent GPU machine)
        return os.environ["BERTQA_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=5)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_digest() -> str:
    """A digest of the package's own source files: it names the code that ran even where the
    commit cannot (a copy of the tree whose .git is older than its files, as on a lent GPU
    machine, records an old commit plus '-dirty')."""
    pkg = PROJECT_ROOT / "bertqa_bench"
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "onnx": _version("onnx"),
        "onnxruntime": _version("onnxruntime"),
        "onnxruntime_gpu": _version("onnxruntime-gpu"),
        "tensorrt": _version("tensorrt"),
        "mlflow": _version("mlflow"),
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env.update({
            "gpu": torch.cuda.get_device_name(0),
            "gpu_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "cudnn": str(torch.backends.cudnn.version()),
            "driver": _nvidia_driver(),
        })
    return env


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def device_name(device: str) -> str:
    env = environment()
    return env.get("gpu", "cuda") if device == "cuda" else f"cpu ({env['cpu']}, {env['torch_threads']} threads)"
