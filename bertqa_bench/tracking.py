"""MLflow: one experiment per suite, a parent run per invocation, a child run per backend.

The child run is a view of the BackendResult: choices (variant, device, precision, batching,
model) are params, numbers are metrics, status/parity/error are tags, predictions and the
backend's log are artifacts. The parent carries the run's own record, the comparison table
(``comparison.json``, an MLflow table: select two bench runs and compare them in the UI's
artifact view) and ends FINISHED or FAILED with the verdict. Training is logged live
(``Tracker.training``): the run starts and ends with the training, with loss and samples/s per
optimizer step. The store is a local SQLite file under results/ unless MLFLOW_TRACKING_URI says
otherwise. Tracking problems are reported and never lose the result bundle, which is written
first, nor stop a training.

The suite's experiment is tagged ``mlflow.experimentKind=custom_model_development`` (a
"Machine learning" experiment, not a GenAI one): MLflow 3.x UIs that read the kind open it on the
runs table. MLflow 3.17's UI no longer does: its sidebar switch "GenAI | Model training" decides
(the ``workflowType`` URL parameter, else the browser's last choice, GenAI at first), so
``ui_url``/``ui_links`` (printed by ``make mlflow-ui``) link to the runs table with
``workflowType=machine_learning``.
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
# MLflow's experiment "kind" (set_experiment_tag; the UI's kind selector writes the same tag):
# genai_development opens on traces, custom_model_development ("Machine learning") on the runs table
# in UIs that read it; 3.17 goes by its GenAI / Model training switch instead (see ui_url).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
COMPARISON_TABLE = "comparison.json"
# RunMeta fields that change while a run goes on: tags and artifacts, never (immutable) params.
RUN_STATE = ("verdict", "verdict_reasons", "notes", "metric_names", "status", "interrupted_by", "mlflow_parent_id",
             "mlflow_children", "resumes", "problems")
# Live training: at most about this many points per metric, whatever the number of steps.
TRAIN_LOG_POINTS = 200


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
            # Experiments made before the tag existed get it once; a kind someone chose is kept.
            if not exp.tags.get(EXPERIMENT_KIND_TAG):
                self._client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return exp.experiment_id
        artifacts = (self.results_root / "mlruns").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
        return self._client.create_experiment(name, artifact_location=artifacts,
                                              tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})

    @staticmethod
    def ui_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
        """The experiment's runs table in ``mlflow ui``; without workflowType, MLflow 3.17 opens a
        browser's first visit on its GenAI overview."""
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"

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
                      if k not in RUN_STATE and v not in (None, "", [], {})}
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
            return rid

        if self.active and self.parent_id:
            return self._try(go)
        return None

    # --- interruption and resume (bench.run_bench) ---------------------------------------------
    def reopen_bench(self, meta: RunMeta, tags: dict) -> None:
        """A resumed bench logs into the parent it started with (RUNNING again); if that run is
        gone from this store, a new parent tagged with the one it resumes."""
        def go():
            self.experiment_id = self.experiment(meta.suite)
            if meta.mlflow_parent_id:
                try:
                    self._client.get_run(meta.mlflow_parent_id)
                    self.parent_id = meta.mlflow_parent_id
                    self._client.update_run(self.parent_id, status="RUNNING")
                    self.log(self.parent_id, {}, {}, {"resumed": str(len(meta.resumes))})
                    return
                except Exception:  # noqa: BLE001 - not in this store: a linked new parent below
                    pass
            run = self._client.create_run(self.experiment_id, run_name=meta.run_id,
                                          tags={"kind": "bench", "resumes": meta.mlflow_parent_id or meta.run_id})
            self.parent_id = run.info.run_id
            self.log(self.parent_id, {}, {}, tags | {"run_id": meta.run_id})

        if self.active:
            self._try(go)

    def delete_run(self, run_id: str) -> None:
        """A failed row's child run, replaced by its re-run on resume (MLflow keeps it, deleted)."""
        if self.active and run_id:
            self._try(self._client.delete_run, run_id)

    def interrupt_bench(self, bundle: RunBundle, verdict, signal_name: str) -> None:
        """The bench was stopped by a signal: the verdict of what finished, the parent and any child
        still running end KILLED (never RUNNING for ever)."""
        def go():
            tags = {"verdict": verdict.status, "verdict_reasons": "; ".join(verdict.reasons)[:4900],
                    "interrupted_by": signal_name}
            self.log(self.parent_id, {}, {}, tags)
            self.artifacts(self.parent_id, [bundle.dir / "run.json", bundle.csv_path])
            children = self._client.search_runs([self.experiment_id],
                                                filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'")
            for c in children:
                if c.info.status == "RUNNING":
                    self._client.set_terminated(c.info.run_id, "KILLED")
            self._client.set_terminated(self.parent_id, "KILLED")

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
            self._try(self.log_comparison, self.parent_id, bundle)  # a table problem keeps the run's status
            self._client.set_terminated(self.parent_id, "FINISHED" if verdict.ok else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    def log_comparison(self, run_id: str, bundle: RunBundle) -> None:
        """The bench's comparison table (one row per backend, the results.csv columns) as an MLflow
        table artifact, so two benches can be put side by side in the UI's artifact view."""
        self._client.log_table(run_id, data=comparison_frame(bundle), artifact_file=COMPARISON_TABLE)

    # --- training ---------------------------------------------------------------------------
    def training(self, cfg) -> "TrainingRun":
        """A live training run, started now: params now, ``step()`` while training, ``finish()``
        (FINISHED) or ``fail()`` at the end. Used as a context manager, an exception ends it FAILED.
        Without a working store every call is a no-op."""
        def go():
            exp = self.experiment(cfg.name)
            run = self._client.create_run(exp, run_name=f"train {cfg.model.name}", tags={"kind": "train"})
            params = {f"train.{k}": v for k, v in vars(cfg.train).items()} | {
                "model": cfg.model.name, "base": cfg.model.base, "task": cfg.task.name,
                "max_seq_len": cfg.data.max_seq_len, "doc_stride": cfg.data.doc_stride, "data": cfg.data.source}
            self.log(run.info.run_id, {}, params, {"model_dir": str(cfg.model_dir)})
            return run.info.run_id

        return TrainingRun(self, self._try(go) if self.active else None)


def ui_links(results_root: Path, base: str = "http://127.0.0.1:5000") -> list[str]:
    """'<experiment>: <url of its runs table>' for every bertqa experiment of the store (``make mlflow-ui``)."""
    root = Path(results_root)
    if not os.environ.get("MLFLOW_TRACKING_URI") and not (root / "mlflow.db").exists():
        return []
    tracker = Tracker(root)
    if not tracker.active:
        return []
    exps = tracker._try(tracker._client.search_experiments, filter_string="name LIKE 'bertqa-%'") or []
    return [f"{e.name}: {Tracker.ui_url(e.experiment_id, base)}" for e in sorted(exps, key=lambda e: e.name)]


def comparison_frame(bundle: RunBundle):
    """results.csv as a DataFrame for ``MlflowClient.log_table``: one row per backend, the
    backend first and the headline numbers next (MLflow's artifact view groups by the first
    column and compares the second across the selected runs), then every other column; floats
    to 4 significant digits (results.csv keeps them whole)."""
    import pandas as pd

    primary = bundle.meta.primary_metric
    lead = ["backend", "features_per_s", "speedup", "predict_s", primary, "parity", "status"]
    rows = []
    for r in bundle.results:
        row = r.to_row()
        rows.append({k: _table_value(row.get(k)) for k in [*dict.fromkeys(lead), *row]})
    return pd.DataFrame(rows, columns=list(rows[0]) if rows else lead)


def _table_value(v):
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return float(f"{f:.4g}") if math.isfinite(f) else None


class TrainingRun:
    """The live MLflow run of one training (rank 0 only). Every call is guarded: a tracking
    problem prints a warning and never reaches the training; after a failed step it stops
    logging steps (a dead server would otherwise stall every step on retries)."""

    def __init__(self, tracker: Tracker, run_id: Optional[str]):
        self.tracker = tracker
        self.run_id = run_id
        self.every = 1
        self._ended = False
        self._steps_off = False
        self._last_step = 0
        self._last_t = time.perf_counter()
        self._last_seen = 0
        self._losses: list[float] = []

    @property
    def active(self) -> bool:
        return self.run_id is not None and not self._ended

    def plan(self, total_steps: int, params: Optional[dict] = None) -> int:
        """Once the number of optimizer steps is known: log every ``every`` steps, so that a long
        training logs at most about TRAIN_LOG_POINTS points. Returns ``every``."""
        self.every = max(1, math.ceil(total_steps / TRAIN_LOG_POINTS))
        if self.active:
            extra = dict(params or {}) | {"total_steps": total_steps, "log_every_steps": self.every}
            self.tracker._try(self.tracker.log, self.run_id, {}, extra, {})
        self._last_t = time.perf_counter()
        return self.every

    def step(self, step: int, loss: float, seen: int, total_steps: Optional[int] = None, **extra) -> None:
        """Called after optimizer steps (each one, or every few) with the loss and the samples seen
        so far (all ranks); logs ``train_loss`` (mean of the losses passed since the last point),
        ``samples_per_s`` (since the last point) and ``extra`` at least ``every`` steps apart and
        at the last step."""
        if not self.active or self._steps_off:
            return
        self._losses.append(float(loss))
        # At least ``every`` steps apart, whatever the caller's own cadence, and the last step.
        if step - self._last_step < self.every and step != total_steps:
            return
        self._last_step = step
        dt = time.perf_counter() - self._last_t
        metrics = {"train_loss": sum(self._losses) / len(self._losses)} | extra
        if dt > 0 and seen > self._last_seen:
            metrics["samples_per_s"] = (seen - self._last_seen) / dt
        self._losses, self._last_seen = [], seen

        def go():
            self.tracker.log(self.run_id, numeric(metrics), {}, {}, step=step)
            return True

        if not self.tracker._try(go):
            print("warning: MLflow: no more per-step training metrics after this failure", file=sys.stderr)
            self._steps_off = True  # the final metrics and the run's end are still tried
        self._last_t = time.perf_counter()  # the next interval's samples/s leaves this logging out

    def finish(self, metrics: dict, model_dir: Path) -> None:
        """The final metrics and train_metrics.json, then the run ends FINISHED (now)."""
        if not self.active:
            return
        t = self.tracker

        def go():
            # step 0, like the bench's metrics: one value per run, which the UI charts as bars.
            t.log(self.run_id, numeric(metrics), {}, {"model_dir": str(model_dir)})
            t.artifacts(self.run_id, [Path(model_dir) / "train_metrics.json"])

        t._try(go)
        self._end("FINISHED")

    def fail(self, error: Optional[BaseException] = None) -> None:
        if not self.active:
            return
        if error is not None:
            self.tracker._try(self.tracker.log, self.run_id, {}, {},
                              {"error": f"{type(error).__name__}: {error}"})
        self._end("FAILED" if not isinstance(error, KeyboardInterrupt) else "KILLED")

    def _end(self, status: str) -> None:
        self._ended = True
        self.tracker._try(self.tracker._client.set_terminated, self.run_id, status, int(time.time() * 1000))

    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.fail(exc)
        elif self.active:  # left without finish(): nothing went wrong, but nothing was saved either
            self._end("FINISHED")
        return False


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
