"""A run owns its folder, and the disks a run writes are checked before any work.

Run ids used to be timestamps to the second, and an existing folder was reused: two benches
started together got one folder, one replaced the other's outputs (its row then failed on a
missing ``outputs/<backend>.npz``), its bundle overwrote the other's, and both exited 0; a
second bench with a hand-given ``--run-id`` overwrote ``results.csv`` and left the first run's
predictions and logs beside its own. Now:

* a generated run id is ``<UTC timestamp>-<4 random hex>-<suite>``, and the folder is claimed
  with an exclusive ``mkdir``: a clash (same second, same random part) draws another id, so two
  runs never share a folder, however many start at once;
* a ``--run-id`` whose folder exists is refused before any work, naming the folder and what it
  holds, unless ``--resume`` (finish that run) or ``--overwrite`` (empty it, then start again;
  only a run folder or an empty one is emptied, never another folder that happens to be there);
* results, cache and models folders are checked for write access and free space before the
  model or the data is touched, so a read-only or full disk is one line naming the path, not a
  traceback after minutes of loading, or rows that time their passes and then fail to save.
"""
from __future__ import annotations

import errno
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ..errors import BenchError

# Names under results/ that are not runs: the MLflow store and artifacts, profiles, committed
# reference tables, bench-ddp's per-rank scratch.
RESERVED = {"mlflow.db", "mlflow.db.lock", "mlruns", "profiles", "reference", ".ddp"}
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}$")

# Free space a run needs before it starts, by folder. Results: a run writes the reference's
# logits (n_features x seq x 2 float32: 1.4 MB per 1,000 features at 384 tokens), predictions,
# logs and plots, a few MB for a SQuAD dev set; 64 MiB leaves room for a sweep. Cache: one
# evaluation set (six int64 arrays of n_features x seq: ~18 MB per 1,000 features at 384), 64 MiB.
# Models: exported and compiled artifacts (ONNX of BERT-base is 440 MB in fp32, a TensorRT engine
# ~200 MB), 512 MiB.
MIN_FREE_MIB = {"results": 64, "cache": 64, "models": 512}


class RunFolderError(BenchError):
    pass


def check_run_id(run_id: str) -> None:
    if not _RUN_ID.match(run_id) or run_id in RESERVED or run_id in (".", ".."):
        raise RunFolderError(f"--run-id {run_id!r}: a run id is one folder name (letters, digits, . _ @ + -), "
                             f"not a path, and not one of {', '.join(sorted(RESERVED))}")


def describe(d: Path) -> str:
    """What an existing folder holds, for the refusal message."""
    meta = d / "run.json"
    if meta.exists():
        try:
            m = json.loads(meta.read_text())
            return f"run {m.get('run_id', d.name)} of suite {m.get('suite', '?')}, {m.get('status', '?')}"
        except (OSError, ValueError):
            return "a run whose run.json is unreadable"
    n = sum(1 for _ in d.iterdir()) if d.is_dir() else 0
    return f"not a run folder ({n} entries)" if n else "an empty folder"


def refuse_taken(root: Path, run_id: Optional[str], overwrite: bool) -> None:
    """Before any work: a ``--run-id`` whose folder exists is refused unless ``overwrite``, and
    ``overwrite`` empties only a run folder or an empty one."""
    if not run_id:
        if overwrite:
            raise RunFolderError("--overwrite empties the folder of a --run-id you name; a generated run id is new")
        return
    check_run_id(run_id)
    d = Path(root) / run_id
    if not d.exists():
        return
    what = describe(d)
    if not overwrite:
        raise RunFolderError(f"{d} already exists ({what}); a run owns its folder: `--resume {d}` finishes that run, "
                             f"`--overwrite` empties it and starts again, or choose another --run-id")
    if not (d / "run.json").exists() and any(d.iterdir()):
        raise RunFolderError(f"{d} is {what}; --overwrite empties run folders only: move it away or choose "
                             "another --run-id")


def claim(root: Path, run_id: Optional[str], fresh_id: Callable[[], str], overwrite: bool = False) -> str:
    """Create the run's folder, exclusively: a generated id that clashes draws another; a given id
    whose folder appeared since ``refuse_taken`` is refused (another run took it). ``overwrite``
    empties a run folder first. Returns the run id."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if not run_id:
        for _ in range(64):
            rid = fresh_id()
            try:
                (root / rid).mkdir()
                return rid
            except FileExistsError:
                continue
        raise RunFolderError(f"could not claim a new run folder under {root} after 64 tries")
    refuse_taken(root, run_id, overwrite)
    d = root / run_id
    if overwrite and d.exists():
        for p in d.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return run_id
    try:
        d.mkdir()
    except FileExistsError:
        raise RunFolderError(f"{d} was created by another run while this one loaded; choose another --run-id") from None
    return run_id


def _existing(path: Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: Path, what: str, need_mib: int) -> None:
    """``path`` (or, when it does not exist yet, the folder it would be made in) takes a file and
    has ``need_mib`` free; a RunFolderError naming the path otherwise. Nothing is left behind."""
    path = Path(path)
    base = _existing(path)
    if not base.is_dir():
        raise RunFolderError(f"{what} folder {path}: {base} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=base, prefix=".bertqa-write-check-"):
            pass
    except OSError as e:
        why = "read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e))
        raise RunFolderError(f"{what} folder {path} is not writable ({why} at {base}); set {what}_dir in the suite "
                             f"(--set {what}_dir=PATH) to a folder you can write") from None
    free = shutil.disk_usage(base).free
    if free < need_mib * 2**20:
        raise RunFolderError(f"{what} folder {path}: only {free / 2**20:,.0f} MiB free on its disk ({base}); a run "
                             f"needs at least {need_mib:,} MiB there. Free some space or set {what}_dir elsewhere")


def preflight(folders: dict[str, Path], run_id: Optional[str] = None, overwrite: bool = False,
              resume: bool = False) -> None:
    """Everything a run's folders (SuiteConfig.folders: results, cache, models) must allow,
    checked before the model or the data is touched."""
    if not resume:
        refuse_taken(folders["results"], run_id, overwrite)
    for what, path in folders.items():
        check_writable(path, what, MIN_FREE_MIB[what])

