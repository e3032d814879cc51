"""Backend registry: maps a name such as ``ort-cuda-fp16`` to a backend class and its options."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UnknownBackendError
from .base import Backend


@dataclass(frozen=True)
class BackendSpec:
    name: str
    cls: type[Backend]
    options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # the device this registered variant runs on
    description: str = ""

    def create(self, **overrides: Any) -> Backend:
        backend = self.cls(**{**self.options, **overrides})
        backend.name = self.name
        backend.device = self.device
        return backend

    def unavailable_reason(self) -> str | None:
        return self.cls.unavailable_reason(self.device)


_REGISTRY: dict[str, BackendSpec] = {}


def register(name: str, cls: type[Backend], *, device: str = "cpu", description: str = "", **options: Any) -> None:
    if name in _REGISTRY:
        raise ValueError(f"backend '{name}' registered twice")
    _REGISTRY[name] = BackendSpec(name, cls, dict(options), device, description)


def _ensure_loaded() -> None:
    # Importing the family modules registers their variants; imports of heavy optional
    # packages (onnxruntime, tensorrt) happen lazily inside them.
    from . import onnxruntime, tensorrt, torch_compile, torch_eager  # noqa: F401
    from . import torch_fp8  # noqa: F401


def get_spec(name: str) -> BackendSpec:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownBackendError(name, _REGISTRY) from None


def create(name: str, **overrides: Any) -> Backend:
    return get_spec(name).create(**overrides)


def names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def specs() -> list[BackendSpec]:
    _ensure_loaded()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def validate_names(requested: list[str]) -> None:
    """Fail early, before any work, if a suite names a backend that does not exist."""
    _ensure_loaded()
    for n in requested:
        if n not in _REGISTRY:
            raise UnknownBackendError(n, _REGISTRY)
