"""MLflow: one experiment per suite, a parent run per invocation, a child run per backend.

The child run is a view of the BackendResult: choices (variant, device, precision, batching,
model) are params, numbers are metrics, status/parity/error are tags, predictions and the
backend's log are artifacts. The parent carries the run's own record and ends FINISHED or
FAILED with the verdict. The store is a local SQLite file under results/ unless
MLFLOW_TRACKING_URI says otherwise. Tracking problems are reported and never lose the result
bundle, which is written first.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from .results import BackendResult, RunBundle, RunMeta

PARAM_FIELDS = ("backend", "implementation", "precision", "parity_class", "device", "device_name", "batching",
                "batch_size", "max_seq_len", "model", "task", "status")
TAG_FIELDS = ("status", "parity", "parity_failures", "error", "energy_note")


def default_tracking_uri(results_root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(results_root).resolve() / 'mlflow.db'}"


def numeric(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or v is None:
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def result_view(r: BackendResult) -> tuple[dict, dict, dict]:
    """(params, metrics, tags) of a backend's child run."""
    row = r.to_row()
    params = {k: row[k] for k in PARAM_FIELDS if row.get(k) not in (None, "")}
    params.update({f"prepare.{k}": v for k, v in r.prepare_info.items()})
    metrics = numeric({k: v for k, v in row.items() if k not in PARAM_FIELDS})
    tags = {k: row[k] for k in TAG_FIELDS if row.get(k)}
    return params, metrics, tags


class Tracker:
    def __init__(self, results_root: Path, enabled: bool = True):
        self.enabled = enabled
        self.results_root = Path(results_root)
        self.parent_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._client = None
        if enabled:
            self._try(self._connect)

    def _try(self, fn, *a, **kw):
        if not self.enabled:
            return None
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - tracking must never take a benchmark down
            print(f"warning: MLflow tracking failed ({type(e).__name__}: {e}); the result bundle is unaffected",
                  file=sys.stderr)
            return None

    def _connect(self) -> None:
        from mlflow.tracking import MlflowClient

        # An explicit client, not mlflow.set_tracking_uri(): that one also exports
        # MLFLOW_TRACKING_URI to the environment, so later trackers (and child processes) would
        # silently write to this store.
        self.uri = default_tracking_uri(self.results_root)
        self.results_root.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(self.uri)

    @property
    def active(self) -> bool:
        return self._client is not None

    def experiment(self, suite: str) -> str:
        name = f"bertqa-{suite}"
        exp = self._client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        artifacts = (self.results_root / "mlruns").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
        return self._client.create_experiment(name, artifact_location=artifacts)

    def log(self, run_id: str, metrics: dict, params: dict, tags: dict, step: int = 0) -> None:
        from mlflow.entities import Metric, Param, RunTag

        ts = int(time.time() * 1000)
        self._client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()],
            params=[Param(k, str(v)[:6000]) for k, v in params.items() if v is not None],
            tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items() if v is not None],
        )

    def artifacts(self, run_id: str, paths: Iterable[Path]) -> None:
        for p in paths:
            if p and Path(p).exists():
                self._client.log_artifact(run_id, str(p))

    # --- benchmark --------------------------------------------------------------------------
    def start_bench(self, meta: RunMeta, tags: dict) -> None:
        def go():
            self.experiment_id = self.experiment(meta.suite)
            run = self._client.create_run(self.experiment_id, run_name=meta.run_id, tags={"kind": "bench"})
            self.parent_id = run.info.run_id
            params = {k: v for k, v in dataclasses.asdict(meta).items()
                      if k not in ("verdict", "verdict_reasons", "notes", "metric_names") and v not in (None, "")}
            self.log(self.parent_id, {}, params, tags | {"run_id": meta.run_id})

        if self.active:
            self._try(go)

    def log_backend(self, meta: RunMeta, r: BackendResult, tags: dict, artifacts: Iterable[Path] = (),
                    log_file: Optional[Path] = None) -> None:
        def go():
            run = self._client.create_run(self.experiment_id, run_name=r.backend,
                                          tags={"mlflow.parentRunId": self.parent_id, "kind": "backend"})
            rid = run.info.run_id
            params, metrics, own_tags = result_view(r)
            self.log(rid, metrics, params, tags | own_tags | {"run_id": meta.run_id})
            self.artifacts(rid, [*artifacts, log_file])
            self._client.set_terminated(rid, "FINISHED" if r.ok else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    def finish_bench(self, bundle: RunBundle, verdict) -> None:
        def go():
            ok = [r for r in bundle.results if r.ok]
            best = max((r for r in ok if r.speedup and r.parity != "FAIL"), key=lambda r: r.speedup, default=None)
            metrics = {"n_backends_ok": len(ok), "best_speedup_at_parity": best.speedup if best else 0.0}
            tags = {"verdict": verdict.status, "verdict_reasons": "; ".join(verdict.reasons)[:4900],
                    "best_backend_at_parity": best.backend if best else ""}
            self.log(self.parent_id, metrics, {}, tags)
            self.artifacts(self.parent_id, [bundle.dir / "summary.md", bundle.csv_path, bundle.dir / "comparison.png",
                                            bundle.dir / "run.json"])
            self._client.set_terminated(self.parent_id, "FINISHED" if verdict.ok else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    # --- training ---------------------------------------------------------------------------
    def log_training(self, cfg, metrics: dict, model_dir: Path) -> None:
        def go():
            exp = self.experiment(cfg.name)
            run = self._client.create_run(exp, run_name=f"train {cfg.model.name}", tags={"kind": "train"})
            params = {f"train.{k}": v for k, v in vars(cfg.train).items()} | {
                "model": cfg.model.name, "base": cfg.model.base, "task": cfg.task.name,
                "max_seq_len": cfg.data.max_seq_len, "doc_stride": cfg.data.doc_stride, "data": cfg.data.source}
            self.log(run.info.run_id, numeric(metrics), params, {"model_dir": str(model_dir)})
            self.artifacts(run.info.run_id, [Path(model_dir) / "train_metrics.json"])
            self._client.set_terminated(run.info.run_id, "FINISHED")

        if self.active:
            self._try(go)


def import_bundle(run_dir: Path, results_root: Path) -> str:
    """Log a result bundle written without MLflow (e.g. on a GPU machine) as a parent run with one
    child per backend, exactly as a live ``bench`` would have."""
    from .parity import Verdict

    bundle = RunBundle.load(run_dir)
    tracker = Tracker(results_root)
    if not tracker.active:
        raise RuntimeError("MLflow is not available")
    env_tags = {f"env.{k}": v for k, v in bundle.env().items()}
    tracker.start_bench(bundle.meta, tags=env_tags | {"results_dir": str(bundle.dir), "imported_from": str(run_dir)})
    for r in bundle.results:
        preds = bundle.path("predictions", f"{r.backend}.json")
        tracker.log_backend(bundle.meta, r, env_tags, [preds] if preds.exists() else [],
                            bundle.path("logs", f"{r.backend}.log"))
    tracker.finish_bench(bundle, Verdict(bundle.meta.verdict or "N/A", list(bundle.meta.verdict_reasons)))
    return tracker.parent_id
