"""Errors a user can act on. Each message names what to fix."""
from __future__ import annotations

import importlib
import traceback


class BenchError(Exception):
    """Base class for errors reported to the user without a traceback."""


class DatasetFormatError(BenchError):
    """A dataset file is malformed; names the file, the record and the field."""

    def __init__(self, path, record, field, reason):
        self.path, self.record, self.field, self.reason = str(path), record, field, reason
        super().__init__(f"{self.path}: record {record}: field '{field}': {reason}")


class UnknownBackendError(BenchError):
    def __init__(self, name, valid, what: str = "backend"):
        self.name, self.valid = name, sorted(valid)
        super().__init__(f"unknown {what} '{name}'; valid backends: {', '.join(self.valid)}")


class MissingDependencyError(BenchError):
    """An optional package is needed; names the package to install."""

    def __init__(self, package, purpose, install=None):
        self.package = package
        hint = install or f"pip install {package}"
        super().__init__(f"{purpose} needs the package '{package}', which is not installed: {hint}")


def import_optional(module: str, purpose: str, install: str | None = None):
    """``import module``, or a MissingDependencyError saying what needs it and what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(module, purpose, install=install) from None


class BackendUnavailableError(BenchError):
    """The backend cannot run on this machine (no GPU, missing provider, ...)."""


class ConfigError(BenchError):
    pass


class TrainingCollapsedError(BenchError):
    """A fine-tune whose loss fell and climbed back (training/loss_check.py): refused before the
    model is saved, with the seed and learning rate to change."""


def format_error(e: BaseException) -> str:
    if isinstance(e, BenchError):
        return str(e)

    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.split('/')[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
