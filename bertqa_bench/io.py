"""Atomic file output: the one place the suite writes files that others read.

A reader (a later run, a crashed run's survivor, a concurrent `make report`) must see either
the old file or the new one, never half of one: write next to the target, then rename.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Union

PathLike = Union[str, os.PathLike]

# mkstemp creates 0600 files; what the suite writes (data, results, models) is meant to be shared.
_UMASK = os.umask(0)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


def json_default(o: Any):
    """numpy scalars and arrays, paths and anything else printable, for json.dumps."""
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover - numpy is a hard dependency
        pass
    return str(o)


@contextlib.contextmanager
def atomic_path(path: PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    ``suffix`` keeps an extension some writers insist on (``np.save`` appends ``.npy``,
    ``torch.onnx.export`` reads the extension).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if os.path.exists(tmp):
            os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if e.filename is None and e.errno is not None:
            # a writer through a file handle (np.savez, json) raises without a path: "No space left
            # on device" then named no file; the target's path is what a user can act on
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=json_default) + "\n")


def atomic_write_with(path: PathLike, write: Callable[[Path], None], suffix: str = "") -> Path:
    """Atomic output for writers that take a path (np.savez, onnx.save, gzip...)."""
    with atomic_path(path, suffix) as tmp:
        write(tmp)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: PathLike, replace: bool = True) -> Iterator[Path]:
    """Build a directory under a temporary name and swap it in whole (a saved model, a cache entry).
    ``replace=False`` is for content-keyed caches: when another process finished the same entry
    first, its copy stays (readers may have it open) and this one is dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
        _swap_in(tmp, path, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: Path, path: Path, replace: bool) -> None:
    """Rename ``tmp`` onto ``path``. A check for ``path`` before the rename cannot be trusted:
    another process can finish the same entry between the check and the rename, which then
    fails with ENOTEMPTY (two benches started together, building one evaluation set). Without
    ``replace`` the entry that got there first stays; with it the newer one wins."""
    for _ in range(3):
        try:
            os.replace(tmp, path)  # onto nothing, or an empty directory
            return
        except OSError as e:
            if not replace and e.errno in (errno.ENOTEMPTY, errno.EEXIST) and path.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if not replace or not os.path.lexists(path):
                raise
            # the old entry moved aside whole (readers may hold it open), then the rename again
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old."))
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, old / "x")
            shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, path)
