"""MLflow logging: one experiment per suite, a parent run per invocation, a child run per backend.

Numbers are metrics, choices are params, the environment is tags. The store is a local SQLite
file under results/ unless MLFLOW_TRACKING_URI says otherwise. Tracking problems are reported
and never lose the result bundle, which is written first.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

PARAM_KEYS = ("backend", "precision", "parity_class", "device", "batch_size", "max_seq_len", "padding",
              "status", "model", "task")


def default_tracking_uri(results_root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(results_root).resolve() / 'mlflow.db'}"


def _metrics(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if k in PARAM_KEYS or isinstance(v, bool):
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


class Tracker:
    def __init__(self, results_root: Path, enabled: bool = True):
        self.enabled = enabled
        self.results_root = Path(results_root)
        self.parent_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._client = None
        if enabled:
            self._try(self._connect)

    def _warn(self, e: Exception) -> None:
        print(f"warning: MLflow tracking failed ({type(e).__name__}: {e}); the result bundle is unaffected",
              file=sys.stderr)

    def _try(self, fn, *a, **kw):
        if not self.enabled:
            return None
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - tracking must never take a benchmark down
            self._warn(e)
            return None

    def _connect(self) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = default_tracking_uri(self.results_root)
        self.results_root.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(self.uri)
        self._client = MlflowClient(self.uri)

    @property
    def active(self) -> bool:
        return self._client is not None

    def _experiment(self, name: str) -> str:
        exp = self._client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        artifacts = (self.results_root / "mlruns").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
        return self._client.create_experiment(name, artifact_location=artifacts)

    def _log(self, run_id: str, metrics: dict, params: dict, tags: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag

        ts = int(time.time() * 1000)
        self._client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()],
            params=[Param(k, str(v)[:6000]) for k, v in params.items() if v is not None],
            tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items() if v is not None],
        )

    def _artifacts(self, run_id: str, paths: Iterable[Path]) -> None:
        for p in paths:
            if p and Path(p).exists():
                self._client.log_artifact(run_id, str(p))

    # --- benchmark --------------------------------------------------------------------------
    def start_bench(self, suite: str, run_name: str, params: dict, tags: dict) -> None:
        def go():
            self.experiment_id = self._experiment(f"bertqa-{suite}")
            run = self._client.create_run(self.experiment_id, run_name=run_name, tags={"kind": "bench-all"})
            self.parent_id = run.info.run_id
            self._log(self.parent_id, {}, params, tags)

        self._try(go) if self.active else None

    def log_backend(self, row: dict, params: dict, tags: dict, artifacts: Iterable[Path] = ()) -> None:
        def go():
            run = self._client.create_run(self.experiment_id, run_name=row["backend"],
                                          tags={"mlflow.parentRunId": self.parent_id, "kind": "backend"})
            rid = run.info.run_id
            p = {k: row.get(k) for k in PARAM_KEYS if row.get(k) is not None} | params
            self._log(rid, _metrics(row), p, tags | {"parity": row.get("parity", ""), "error": row.get("error")})
            self._artifacts(rid, artifacts)
            self._client.set_terminated(rid, "FINISHED" if row.get("status") == "ok" else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    def finish_bench(self, metrics: dict, tags: dict, artifacts: Iterable[Path] = (), ok: bool = True) -> None:
        def go():
            self._log(self.parent_id, _metrics(metrics), {}, tags)
            self._artifacts(self.parent_id, artifacts)
            self._client.set_terminated(self.parent_id, "FINISHED" if ok else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    # --- training ---------------------------------------------------------------------------
    def log_training(self, cfg, metrics: dict, model_dir: Path) -> None:
        def go():
            exp = self._experiment(f"bertqa-{cfg.name}")
            run = self._client.create_run(exp, run_name=f"train {cfg.model.name}", tags={"kind": "train"})
            params = {f"train.{k}": v for k, v in vars(cfg.train).items()} | {
                "model": cfg.model.name, "base": cfg.model.base, "task": cfg.model.task,
                "max_seq_len": cfg.data.max_seq_len, "doc_stride": cfg.data.doc_stride, "data": cfg.data.source}
            self._log(run.info.run_id, _metrics(metrics), params, {"model_dir": str(model_dir)})
            self._artifacts(run.info.run_id, [Path(model_dir) / "train_metrics.json"])
            self._client.set_terminated(run.info.run_id, "FINISHED")

        if self.active:
            self._try(go)


def import_bundle(run_dir: Path, results_root: Path) -> str:
    """Log an existing result bundle (e.g. written on a GPU machine without MLflow) as a parent run
    with one child run per backend, exactly as a live ``bench`` would have."""
    import json

    from .results import read_csv

    run_dir = Path(run_dir)
    rows = read_csv(run_dir / "results.csv")
    cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    env = json.loads((run_dir / "env.json").read_text()) if (run_dir / "env.json").exists() else {}
    suite = cfg.get("name", "imported")
    tracker = Tracker(results_root)
    if not tracker.active:
        raise RuntimeError("MLflow is not available")
    env_tags = {f"env.{k}": v for k, v in env.items()}
    tracker.start_bench(suite, run_dir.name, params={"suite": suite, "imported_from": str(run_dir)},
                        tags=env_tags | {"run_id": run_dir.name, "results_dir": str(run_dir)})
    for row in rows:
        preds = run_dir / "predictions" / f"{row['backend']}.json"
        tracker.log_backend(row, {}, {"run_id": run_dir.name} | env_tags, [preds] if preds.exists() else [])
    tracker.finish_bench({"n_backends_ok": sum(r.get("status") == "ok" for r in rows)}, {},
                         [run_dir / "summary.md", run_dir / "results.csv"])
    return tracker.parent_id
