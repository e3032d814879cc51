"""A run's result bundle under results/<run-id>/, written atomically as each backend finishes."""
from __future__ import annotations

import csv
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

# The columns every results.csv starts with, in this order; task metrics and extras follow.
CORE_COLUMNS = [
    "backend", "status", "precision", "parity_class", "device", "device_name", "batch_size", "max_seq_len",
    "padding", "n_features", "n_questions", "prepare_s", "predict_s", "latency_p50_ms", "latency_p90_ms",
    "latency_p99_ms", "features_per_s", "questions_per_s", "achieved_tflops", "speedup", "pct_change_vs_ref",
    "exact_match", "f1", "em_delta", "f1_delta", "answer_agreement", "max_abs_logit_diff", "parity",
]


def new_run_id(suite: str) -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + f"-{suite}"


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return str(o)


def columns_for(rows: Iterable[dict]) -> list[str]:
    cols = list(CORE_COLUMNS)
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def write_csv(path: Path, rows: list[dict], columns: Optional[list[str]] = None) -> None:
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns or columns_for(rows), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class ResultBundle:
    def __init__(self, root: Path, run_id: str):
        self.run_id = run_id
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    @property
    def csv_path(self) -> Path:
        return self.dir / "results.csv"

    def add_row(self, row: dict) -> None:
        self.rows.append(row)
        write_csv(self.csv_path, self.rows)

    def write_predictions(self, backend: str, predictions: Any) -> Path:
        p = self.dir / "predictions" / f"{backend}.json"
        atomic_write_json(p, predictions)
        return p

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.dir / name
        atomic_write_json(p, obj)
        return p
