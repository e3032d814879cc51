"""MLflow: one experiment per suite, a parent run per invocation, a child run per backend.

What a user sees in ``mlflow ui`` without configuring anything is designed here, from what the
installed MLflow's UI (3.17.2, its JS bundle under mlflow/server/js/build) actually reads:

* Each child run carries a few chosen metrics, the comparison itself: first ``Speedup``,
  ``Time_s`` (the median pass), ``F1_delta`` (the primary metric against the reference) and
  ``Parity_pass`` (1 pass / 0 FAIL: a value that sorts), capitalised so that MLflow's compare page,
  which lists metric keys in code-point order, shows them first; then features/s, the task's
  accuracy metrics (F1/EM, or NQ's), p50/p99 batch latency, prepare time, peak memory (MiB) and,
  where measured, energy. Choices are
  params, status/parity/error tags, and the whole record is one JSON artifact (``result.json``).
  Its ``mlflow.runColor`` tag is the backend's colour from colors.py, the same as in
  comparison.png and sweep.png (the UI's charts and run pills read that tag).
* The parent run ends named ``<run id> PASS|FAIL...`` with a ``verdict_pass`` metric (1 PASS,
  0 FAIL), so the verdict is a value in the table and not only the status icon, and the run's
  recommendation (recommend.py) as tags: ``recommendation`` (one line), ``recommended_backend``,
  ``recommended_fp32_backend``. It carries the comparison table (``comparison.json``, an MLflow
  table), summary.md, results.csv and the plot.
* The bench's *view*: MLflow's runs table shows only Source/Models/Dataset until a user picks
  columns, and the UI keeps its column choice per browser. Its "Save & share view" stores a view as
  an experiment tag ``mlflow.sharedViewState.<key>`` (a JSON envelope {name, createdAt, state}) and
  opens it with ``?viewStateShareKey=<key>``; every bench writes one, keyed by its parent run id,
  with the chosen columns and its parent expanded, and its chart mode showing every run (MLflow's
  default shows the first 10). It is the link ``bench`` and ``make mlflow-ui`` print, and it is
  listed in the runs page's "Views" menu.
* The compare link: MLflow's compare-runs page over the bench's children, every param and metric
  side by side (``#/compare-runs?runs=[...]&experiments=[...]``).
* GenAI or model training: 3.17.2 decides by its sidebar switch alone, the ``workflowType`` URL
  parameter, else the browser's stored choice (``localStorage["mlflow.workflowType_v1"]``), GenAI at
  first. It no longer reads the experiment's ``mlflow.experimentKind`` tag (the code that would is
  behind a feature check that is hard-wired on). So every link printed here carries
  ``workflowType=machine_learning``, and ``make mlflow-ui`` serves the UI through mlflow_ui.py,
  which makes "Model training" the first-visit default. The kind tag is still set: earlier 3.x UIs
  read it.

Training is logged live (``Tracker.training``): the run starts and ends with the training, with
loss, learning rate and samples/s per optimizer step as its only metrics, so its charts are those
curves; its final numbers (dev scores, times) are params ``final.<name>`` and train_metrics.json. The store is a local SQLite file under results/ unless MLFLOW_TRACKING_URI says
otherwise. Tracking problems are reported and never lose the result bundle, which is written first,
nor stop a training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import quote

from filelock import FileLock

from ..errors import BenchError
from ..record.parity import Verdict
from ..record.results import BackendResult, RunBundle, RunMeta
from .colors import BackendColors
from .mlflow_views import comparison_charts, comparison_frame, result_view, view_columns
from .recommend import for_run
from .training_run import TrainingRun

# MLflow's experiment "kind" (set_experiment_tag; the UI's kind selector writes the same tag):
# genai_development opens on traces, custom_model_development ("Machine learning") on the runs table
# in the 3.x UIs that read it; 3.17 goes by its GenAI / Model training switch instead (see ui_url).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
COMPARISON_TABLE = "comparison.json"
RESULT_ARTIFACT = "result.json"
# Names the MLflow 3.17 UI reads (its constants MLFLOW_RUN_COLOR_TAG,
# EXPERIMENT_PAGE_VIEW_STATE_SHARE_TAG_PREFIX / _URL_PARAM_KEY, the WorkflowType URL parameter).
RUN_COLOR_TAG = "mlflow.runColor"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_URL_PARAM = "viewStateShareKey"
WORKFLOW = "workflowType=machine_learning"
PARENT_COLOR = "#333333"
# The experiment's latest bench view, for mlflow_ui.py's first-visit redirect and ui_links.
LATEST_VIEW_TAG = "bertqa.latestView"
# Statuses as sortable values: the parity column sorts failures first, the verdict column too.
VERDICT_VALUE = {"PASS": 1.0, "FAIL": 0.0, "INCONCLUSIVE": 0.5}
# RunMeta fields that change while a run goes on: tags and artifacts, never (immutable) params.
RUN_STATE = ("verdict", "verdict_reasons", "notes", "metric_names", "status", "interrupted_by", "mlflow_parent_id",
             "mlflow_children", "resumes", "problems")
DEFAULT_UI = "http://127.0.0.1:5000"


def default_tracking_uri(results_root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(results_root).resolve() / 'mlflow.db'}"


def store_lock(uri: str, results_root: Path, timeout_s: float = 300.0):
    """An inter-process lock around opening a SQLite store (its creation and schema migration
    are not safe to run twice at once); a no-op for server stores, which serialize themselves."""
    if not uri.startswith("sqlite:///"):
        return contextlib.nullcontext()

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(db) + ".lock", timeout=timeout_s)


class TrackingStoreError(BenchError):
    """The MLflow store could not be opened or created: the run fails, before its work, rather
    than finishing with nothing in MLflow and exit 0."""


class Tracker:
    """MLflow logging of benches and trainings. The store is opened (created, migrated) on first
    use, not when the tracker is made: a run refused for its input writes nothing under results/."""

    def __init__(self, results_root: Path, enabled: bool = True):
        self.enabled = enabled
        self.results_root = Path(results_root)
        self.uri = default_tracking_uri(self.results_root)
        self.parent_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._mlflow = None
        self._opened = False
        self._colors = BackendColors()
        self._children: dict[str, dict] = {}

    @property
    def _client(self):
        if self.enabled and not self._opened:
            self._opened = True
            self._mlflow = self._connect()
        return self._mlflow

    @_client.setter
    def _client(self, client) -> None:
        self._opened, self._mlflow = True, client

    def _try(self, fn, *a, **kw):
        if not self.enabled:
            return None
        try:
            return fn(*a, **kw)
        except TrackingStoreError:
            raise
        except Exception as e:  # noqa: BLE001 - tracking must never take a benchmark down
            print(f"warning: MLflow tracking failed ({type(e).__name__}: {e}); the result bundle is unaffected",
                  file=sys.stderr)
            return None

    def _connect(self):
        """The client, its store created (or migrated) under a file lock: two runs starting at
        once against a new SQLite store both ran MLflow's schema migration, and one of them
        failed ("Online migration expected to match one row ... alembic_version; 0 found")."""
        from mlflow.tracking import MlflowClient

        # An explicit client, not mlflow.set_tracking_uri(): that one also exports
        # MLFLOW_TRACKING_URI to the environment, so later trackers (and child processes) would
        # silently write to this store.
        try:
            with store_lock(self.uri, self.results_root):
                client = MlflowClient(self.uri)
                client.search_experiments(max_results=1)  # creates and migrates the store now
        except Exception as e:  # noqa: BLE001 - any failure to open the store fails the run, named
            raise TrackingStoreError(f"MLflow store {self.uri} could not be opened ({type(e).__name__}: "
                                     f"{str(e)[:300]}); fix or move it, or run with --no-mlflow and log the "
                                     "result bundle later with `bertqa-bench track`") from None
        return client

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
    def ui_url(experiment_id: str, base: str = DEFAULT_UI) -> str:
        """The experiment's runs table in ``mlflow ui``, as model training (see the module's docstring)."""
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{WORKFLOW}"

    @staticmethod
    def view_url(experiment_id: str, view_key: str, base: str = DEFAULT_UI) -> str:
        """A bench's view: the runs table with its parent expanded and the comparison's columns."""
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{VIEW_URL_PARAM}={view_key}&{WORKFLOW}"

    @staticmethod
    def run_url(experiment_id: str, run_id: str, tab: str = "", base: str = DEFAULT_UI) -> str:
        """A run's page; ``tab="model-metrics"`` opens it on its charts (a training run's curves)."""
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "") + f"?{WORKFLOW}"

    @staticmethod
    def compare_url(experiment_id: str, run_ids: list[str], base: str = DEFAULT_UI) -> str:
        """MLflow's compare-runs page over these runs (its route takes JSON lists, URL-encoded)."""
        runs = quote(json.dumps(list(run_ids), separators=(",", ":")))
        exps = quote(json.dumps([str(experiment_id)], separators=(",", ":")))
        return f"{base.rstrip('/')}/#/compare-runs?runs={runs}&experiments={exps}&{WORKFLOW}"

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
        self._colors = BackendColors(meta.variants)  # as comparison.png colours them (colors.for_results)
        self._children: dict[str, dict] = {}  # run id -> its metric keys, in logging (suite) order

        def go():
            self.experiment_id = self.experiment(meta.suite)
            # A dark grey no backend has (colors.py), so the parent's bars never pass for a backend's.
            run = self._client.create_run(self.experiment_id, run_name=meta.run_id,
                                          tags={"kind": "bench", RUN_COLOR_TAG: PARENT_COLOR})
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
            params, metrics, own_tags = result_view(r, meta.metric_names, meta.primary_metric)
            colour = {RUN_COLOR_TAG: self._colors(r.backend, r.batching or None)}
            self.log(rid, metrics, params, tags | own_tags | colour | {"run_id": meta.run_id})
            self._client.log_dict(rid, r.to_row(), RESULT_ARTIFACT)
            self.artifacts(rid, [*artifacts, log_file])
            self._client.set_terminated(rid, "FINISHED" if r.ok else "FAILED")
            self._children[rid] = metrics
            return rid

        if self.active and self.parent_id:
            return self._try(go)
        return None

    # --- interruption and resume (bench.run_bench) ---------------------------------------------
    def reopen_bench(self, meta: RunMeta, tags: dict) -> None:
        """A resumed bench logs into the parent it started with (RUNNING again); if that run is
        gone from this store, a new parent tagged with the one it resumes."""
        self._colors = BackendColors(meta.variants)
        self._children = {}

        def go():
            self.experiment_id = self.experiment(meta.suite)
            if meta.mlflow_parent_id:
                try:
                    self._client.get_run(meta.mlflow_parent_id)
                    self.parent_id = meta.mlflow_parent_id
                    self._client.update_run(self.parent_id, status="RUNNING")
                    self.log(self.parent_id, {}, {}, {"resumed": str(len(meta.resumes))})
                    # the rows logged before the interruption stay in the bench's view and compare link
                    for c in self._client.search_runs([self.experiment_id],
                                                      f"tags.mlflow.parentRunId = '{self.parent_id}'",
                                                      order_by=["attributes.start_time ASC"]):
                        self._children[c.info.run_id] = c.data.metrics
                    return
                except Exception:  # noqa: BLE001 - not in this store: a linked new parent below
                    pass
            run = self._client.create_run(self.experiment_id, run_name=meta.run_id,
                                          tags={"kind": "bench", "resumes": meta.mlflow_parent_id or meta.run_id,
                                                RUN_COLOR_TAG: PARENT_COLOR})
            self.parent_id = run.info.run_id
            self.log(self.parent_id, {}, {}, tags | {"run_id": meta.run_id})

        if self.active:
            self._try(go)

    def delete_run(self, run_id: str) -> None:
        """A failed row's child run, replaced by its re-run on resume (MLflow keeps it, deleted)."""
        if self.active and run_id:
            self._children.pop(run_id, None)
            self._try(self._client.delete_run, run_id)

    def interrupt_bench(self, bundle: RunBundle, verdict, signal_name: str) -> None:
        """The bench was stopped by a signal: the verdict of what finished, the parent and any child
        still running end KILLED (never RUNNING for ever)."""
        def go():
            tags = {"verdict": verdict.status, "verdict_reasons": "; ".join(verdict.reasons)[:4900],
                    "interrupted_by": signal_name,
                    # what the table shows: the word, in the name and the parity column, beside KILLED's icon
                    "parity": f"INTERRUPTED ({verdict.status} so far)"}
            self.log(self.parent_id, {}, {}, tags)
            self._client.update_run(self.parent_id, name=f"INTERRUPTED {bundle.meta.run_id}")
            self.artifacts(self.parent_id, [bundle.dir / "run.json", bundle.csv_path])
            self._try(self.save_view, bundle.meta, f"interrupted, {verdict.status} so far")
            self._end_bench("KILLED")

        if self.active and self.parent_id:
            self._try(go)

    def _end_bench(self, status: str) -> None:
        """The parent and every child still running end with ``status`` (never RUNNING for ever)."""
        children = self._client.search_runs([self.experiment_id],
                                            filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'")
        for c in children:
            if c.info.status == "RUNNING":
                self._client.set_terminated(c.info.run_id, status)
        self._client.set_terminated(self.parent_id, status)

    def fail_bench(self, error: BaseException) -> None:
        """The run itself broke: the parent and any child still running end FAILED, with the error."""
        def go():
            self.log(self.parent_id, {}, {}, {"error": f"{type(error).__name__}: {error}"[:4900]})
            self._end_bench("FAILED")

        if self.active and self.parent_id:
            self._try(go)

    def finish_bench(self, bundle: RunBundle, verdict) -> None:
        def go():
            ok = [r for r in bundle.results if r.ok]
            rec = for_run(bundle.results, bundle.meta)  # decided parity passes only
            metrics = {"n_backends_ok": len(ok),
                       "best_speedup_at_parity": rec.best.speedup if rec.best and rec.best.speedup else 0.0}
            if verdict.status in VERDICT_VALUE:
                metrics["verdict_pass"] = VERDICT_VALUE[verdict.status]
            # "parity" too: the view's parity column then reads pass/FAIL on each backend and the
            # bench's verdict on its parent. The recommendation's tags (recommendation,
            # recommended_backend, recommended_fp32_backend) are columns of the runs table.
            tags = {"verdict": verdict.status, "parity": verdict.status,
                    "verdict_reasons": "; ".join(verdict.reasons)[:4900], **rec.tags()}
            unreliable = [r.backend for r in ok if r.timing_reliable is False]
            if any(r.timing_reliable is not None for r in ok):
                tags["timing"] = (f"unreliable: {', '.join(unreliable)} timed on a busy machine" if unreliable
                                  else "reliable")
            meta = bundle.meta
            if meta.timing_noisy:
                tags["timing"] = ("" if tags.get("timing") in (None, "reliable") else tags["timing"] + "; ") + (
                    f"noisy host: calibration spread {meta.calibration_cv_pct:.1f}% over "
                    f"{len(meta.rounds.get('calibration_s', []))} rounds (threshold {meta.noise_cv_pct:g}%)")
            for k in ("gpu_sensor_spread_pct", "gpu_sensor_jitter_pct"):  # the GPU sensor (record/noise.py)
                if getattr(meta, k) is not None:
                    metrics[k] = getattr(meta, k)
            noisy = [r.backend for r in ok if r.timing_noisy]
            if noisy:
                tags["timing_noisy_rows"] = ", ".join(noisy)
            if meta.calibration_cv_pct is not None:
                metrics["calibration_cv_pct"] = meta.calibration_cv_pct
                metrics["timing_rounds"] = len(meta.rounds.get("calibration_s", []))
            self.log(self.parent_id, metrics, {}, tags)
            # The verdict first in the name too: the one column every runs table shows, even cut short.
            self._client.update_run(self.parent_id, name=f"{verdict.status} {bundle.meta.run_id}")
            self.artifacts(self.parent_id, [bundle.dir / "summary.md", bundle.csv_path, bundle.dir / "comparison.png",
                                            bundle.dir / "run.json"])
            self._try(self.log_comparison, self.parent_id, bundle)  # a table problem keeps the run's status
            self._try(self.save_view, bundle.meta, verdict.status)
            self._client.set_terminated(self.parent_id, "FINISHED" if verdict.ok else "FAILED")

        if self.active and self.parent_id:
            self._try(go)

    def save_view(self, meta: RunMeta, verdict: str = "") -> str:
        """This bench's view as a saved MLflow view (see the module's docstring); returns its key."""
        key = self.parent_id
        columns = view_columns(self._children.values(), meta.metric_names, meta.primary_metric)
        # A shared view does not carry a user's expanded rows (MLflow leaves runsExpanded, pinned and
        # hidden rows out of it), so the bench is not shown as a collapsed parent: the view keeps this
        # bench's runs (its run_id tag) and groups them by kind, groups open by default, oldest
        # first: the parent with the verdict, then the backends in the suite's order.
        state = {"selectedColumns": columns, "columnOrder": columns,
                 # wide enough for "PASS 20261126-150016-default" (the grid's default cuts it short)
                 # and for the parent's recommendation
                 "columnWidths": {"attributes.`Run Name`": 280, "tags.`recommendation`": 560},
                 # the chart view plots every run of the bench: MLflow's default (FIRST_10_RUNS)
                 # showed the first 10 rows of an 11-backend bench, the parent among them, and
                 # hid the last two backends
                 "runsHiddenMode": "SHOW_ALL",
                 "searchFilter": f"tags.run_id = '{meta.run_id}'",
                 # the chart view plots each backend in its own colour, not the groups' aggregates
                 "useGroupedValuesInCharts": False,
                 "groupBy": {"aggregateFunction": "max", "groupByKeys": [{"mode": "tag", "groupByData": "kind"}]},
                 "orderByKey": "attributes.start_time", "orderByAsc": True,
                 **comparison_charts(self._children.values(), meta.primary_metric, len(self._children) + 1)}
        envelope = {"name": f"bench {meta.run_id}" + (f" ({verdict})" if verdict else ""),
                    "createdAt": int(time.time() * 1000), "state": json.dumps(state)}
        self._client.set_experiment_tag(self.experiment_id, VIEW_TAG_PREFIX + key, json.dumps(envelope))
        self._client.set_experiment_tag(self.experiment_id, LATEST_VIEW_TAG, key)
        return key

    def links(self, base: str = DEFAULT_UI) -> list[str]:
        """What ``bench`` prints: this bench's view and its compare page."""
        if not (self.active and self.parent_id):
            return []
        return [f"MLflow, this bench's comparison: {self.view_url(self.experiment_id, self.parent_id, base)}",
                f"MLflow, its backends side by side: {self.compare_url(self.experiment_id, list(self._children), base)}"]

    def log_comparison(self, run_id: str, bundle: RunBundle) -> None:
        """The bench's comparison table (one row per backend, the results.csv columns) as an MLflow
        table artifact, so two benches can be put side by side in the UI's artifact view."""
        self._client.log_table(run_id, data=comparison_frame(bundle), artifact_file=COMPARISON_TABLE)

    # --- training ---------------------------------------------------------------------------
    def training(self, suite: str, model: str, params: dict, model_dir: Path) -> "TrainingRun":
        """A live training run of ``model`` in the suite's experiment, started now: ``params`` now
        (training/train.training_params), ``step()`` while training, ``finish()`` (FINISHED) or
        ``fail()`` at the end. Used as a context manager, an exception ends it FAILED. Without a
        working store every call is a no-op."""
        def go():
            exp = self.experiment(suite)
            run = self._client.create_run(exp, run_name=f"train {model}", tags={"kind": "train"})
            self.log(run.info.run_id, {}, params, {"model_dir": str(model_dir)})
            return run.info.run_id

        return TrainingRun(self, self._try(go) if self.active else None)


def ui_links(results_root: Path, base: str = DEFAULT_UI) -> list[str]:
    """For every bertqa experiment of the store (``make mlflow-ui``): its runs table, its latest
    bench's view and that bench's compare page."""
    root = Path(results_root)
    if not os.environ.get("MLFLOW_TRACKING_URI") and not (root / "mlflow.db").exists():
        return []
    tracker = Tracker(root)
    if not tracker.active:
        return []
    exps = tracker._try(tracker._client.search_experiments, filter_string="name LIKE 'bertqa-%'") or []
    lines = []
    for e in sorted(exps, key=lambda e: e.name):
        lines.append(f"{e.name}: {Tracker.ui_url(e.experiment_id, base)}")
        trains = tracker._try(tracker._client.search_runs, [e.experiment_id], "tags.kind = 'train'",
                              max_results=1, order_by=["attributes.start_time DESC"]) or []
        for run in trains:
            lines.append(f"  latest training, its curves: "
                         f"{Tracker.run_url(e.experiment_id, run.info.run_id, 'model-metrics', base)}")
        key = e.tags.get(LATEST_VIEW_TAG)
        if key and (VIEW_TAG_PREFIX + key) in e.tags:
            children = tracker._try(tracker._client.search_runs, [e.experiment_id],
                                    f"tags.`mlflow.parentRunId` = '{key}'", order_by=["attributes.start_time ASC"]) or []
            lines.append(f"  latest bench: {Tracker.view_url(e.experiment_id, key, base)}")
            lines.append(f"  its backends side by side: "
                         f"{Tracker.compare_url(e.experiment_id, [r.info.run_id for r in children], base)}")
    return lines


def import_bundle(bundle: RunBundle, results_root: Path) -> str:
    """Log a result bundle written without MLflow (e.g. on a GPU machine) as a parent run with one
    child per backend, exactly as a live ``bench`` would have."""
    tracker = Tracker(results_root)
    if not tracker.active:
        raise RuntimeError("MLflow is not available")
    env_tags = {f"env.{k}": v for k, v in bundle.env().items()}
    tracker.start_bench(bundle.meta, tags=env_tags | {"results_dir": str(bundle.dir), "imported_from": str(bundle.dir)})
    for r in bundle.results:
        preds = bundle.path("predictions", f"{r.backend}.json")
        tracker.log_backend(bundle.meta, r, env_tags, [preds] if preds.exists() else [],
                            bundle.path("logs", f"{r.backend}.log"))
    tracker.finish_bench(bundle, Verdict(bundle.meta.verdict or "N/A", list(bundle.meta.verdict_reasons)))
    return tracker.parent_id
