"""How a bench run's rows are timed, scored and recorded: interleaved rounds, or blocks.

**Rounds** (``bench.timing: rounds``, the default): every row's worker is started and prepared
one after the other and stays alive; then measuring/rounds.py times them one pass each per
round, in a rotating order, with the calibration workload first; then each worker writes its
outputs and record, and each row is scored here, reference first, its speedup paired round by
round (record/rounds.py). A row whose process would not fit beside those already alive (host
memory, or the GPU's) is timed after the rounds in a block of its own, and its row says so.

**Blocks** (``bench.timing: block``; a resumed run, whose reference passes are saved; data-parallel
rows): one row after the other, each its passes in one block, as a row that cannot stay alive
must be; its speedup is the ratio of two blocks timed at different times.

A row that crashes, hangs or cannot run here is recorded as such; the rest run.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..backends.variants import Variant
from ..config import BenchConfig, SuiteConfig
from ..data.evalset import EvalSet
from ..errors import format_error
from ..io import atomic_write_json
from ..measuring.jobs import make_job, plan_key
from ..measuring.launcher import launch, time_limit
from ..measuring.local_ranks import run_local_ranks, visible_gpus
from ..measuring.progress import rows_line
from ..measuring.gpu_sensor import GpuSensor
from ..measuring.rounds import RoundsLog, RoundsSettings, RowProcesses, run_rounds
from ..measuring.sessions import InProcessSession, WorkerSession, merge_records
from ..measuring.worker import load_outputs
from ..record.judging import Reference, apply_speedup, fill_timing, identity, judge
from ..record.noise import row_noise
from ..record.parity import determinism
from ..record.results import BackendResult, RunBundle
from ..record.rounds import block_speedup
from ..record.schedule import mask_padding
from ..reporting.tracking import Tracker
from ..tasks import Task

# Another row's process is started beside those alive only when this much more than the largest
# peak seen so far is free: a second copy of a model must not push the first into swap.
MEMORY_MARGIN = 1.5
# A CUDA context and the allocator's first blocks, beside a row's own reserved memory.
CUDA_CONTEXT_MIB = 1024


def rounds_settings(b: BenchConfig) -> RoundsSettings:
    return RoundsSettings(min_rounds=b.min_passes, max_rounds=b.max_rounds, budget_s=b.rounds_budget_s,
                          target_halfwidth_pct=b.target_halfwidth_pct, noise_cv_pct=b.noise_cv_pct,
                          rerun_spread_pct=b.rerun_spread_pct, pool_process_spread=b.pool_process_spread)


def mem_available_mib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def room_for_another(readies: list, available_mib: Optional[float]) -> str:
    """'' when one more row's process fits beside the ready ones, else why not. A row's own need
    is not known before it prepares, so the largest peak seen so far stands for it."""
    host = max((r.get("host_peak_mib") or 0.0 for r in readies), default=0.0)
    if available_mib is not None and host and available_mib < MEMORY_MARGIN * host:
        return (f"{available_mib:,.0f} MiB of host memory free beside {len(readies)} live row process(es), "
                f"each up to {host:,.0f} MiB")
    gpu = [r for r in readies if r.get("device_free_mib") is not None]
    if gpu:
        need = max(r.get("device_reserved_mib") or 0.0 for r in gpu) + CUDA_CONTEXT_MIB
        free = gpu[-1]["device_free_mib"]
        if free < MEMORY_MARGIN * need:
            return (f"{free:,.0f} MiB free on the GPU beside {len(gpu)} live row process(es), "
                    f"each up to {need:,.0f} MiB")
    return ""


@dataclass
class RowRunner:
    """The run's rows: started, timed, scored and recorded (the bundle, MLflow, the console)."""

    cfg: SuiteConfig
    task: Task
    model: object  # commands/provision.ModelInfo
    evalset: EvalSet
    bundle: RunBundle
    plans: dict
    tracker: Tracker
    env_tags: dict
    names: list
    tiling: float = 1.0  # rows per feature of the reference's plan (windows predicted per pass)
    progress: bool = True
    log: Callable[[str], None] = print
    cluster: object = None
    check_determinism: bool = False
    ref: Optional[Reference] = None
    problems: list = field(default_factory=list)
    _process_notes: dict = field(default_factory=dict)  # row -> why it has fewer processes than asked

    @property
    def reference(self) -> str:
        return self.cfg.bench.reference

    @property
    def options(self):
        """The task's own section: what its postprocessing and scoring take."""
        return self.cfg.task.options

    def _job(self, v: Variant, **kw):
        return make_job(self.cfg.bench, self.cfg.artifacts_root, self.task, v, self.model, self.evalset, self.bundle,
                        **kw)

    # --- the two ways -------------------------------------------------------------------------
    def run(self, variants: list, *, block_reason: str = "") -> None:
        """Time, score and record ``variants`` (reference first): in rounds unless ``block_reason``
        (or the suite's bench.timing) says blocks; data-parallel rows always in blocks."""
        if self.cfg.bench.timing == "block" and not block_reason:
            block_reason = "bench.timing: block"
        runnable, blocks = [], []
        for v in variants:
            r, why = self._not_run(v)
            if why:
                r.status, r.error = "not run", why
                self.record(r, v)
            elif block_reason or self.cluster is not None or (v.devices or 1) > 1:
                blocks.append((v, block_reason or "data-parallel: its ranks are timed together, in a block"))
            else:
                runnable.append(v)
        blocks = self._interleaved(runnable) + blocks
        t0, row_s = time.perf_counter(), []
        for i, (v, why) in enumerate(blocks):
            self.log(rows_line(i, len(blocks), v.name, row_s, time.perf_counter() - t0))
            t_row = time.perf_counter()
            self._block(v, why)
            row_s.append(time.perf_counter() - t_row)

    def _interleaved(self, variants: list) -> list:
        """Start each row's processes, time them in rounds, finish and score each; returns the rows
        left for blocks (those that would not fit beside the others), with why."""
        rows, readies, left = [], [], []
        try:
            for v in variants:
                why = room_for_another(readies, mem_available_mib()) if rows else ""
                if why:
                    left.append((v, f"timed in a block after the rounds: {why}"))
                    continue
                self.log(f"[{v.name}] prepare and warm-up ({len(rows) + 1} of {len(variants)} rows alive) ...")
                s = self._session(v)
                ready = s.start()
                rows.append((v, [s]))
                if ready is not None:
                    readies.append(ready)
                    rows[-1][1].extend(self._more_processes(v, readies))
            alive = [RowProcesses(v.name, procs) for v, procs in rows if procs[0].ready is not None]
            rounds = None
            if alive:
                self.log(f"rounds: {len(alive)} row(s), one timed pass of each a round in a rotating order, its "
                         f"processes taking turns, at least {self.cfg.bench.min_passes} rounds ...")
                ready = [v for v, procs in rows if procs[0].ready is not None]
                rounds = run_rounds(alive, self.reference, rounds_settings(self.cfg.bench), log=self.log,
                                    gpu_sensor=self._gpu_sensor(ready))
            self._note_rounds(rounds, left)
            for v, procs in rows:
                self._finish(v, procs, rounds)
        except BaseException:
            for _, procs in rows:
                for s in procs:
                    s.kill()
            raise
        return left

    def _more_processes(self, v: Variant, readies: list) -> list:
        """The row's second (and further) worker processes, started and prepared beside its first
        while memory allows (``room_for_another``); the row's note says why it has fewer."""
        extra, wanted = [], self.cfg.bench.processes if self.cfg.bench.isolation == "process" else 1
        if wanted > self.cfg.bench.max_rounds:
            # round k's pass comes from process k mod n: a process past max_rounds would never time
            # a pass, and a worker that ends without one is a failed row
            self._process_notes[v.name] = (f"{self.cfg.bench.max_rounds} of {wanted} processes: bench.max_rounds "
                                           f"{self.cfg.bench.max_rounds} gives the others no round")
            wanted = self.cfg.bench.max_rounds
        for i in range(2, wanted + 1):
            why = room_for_another(readies, mem_available_mib())
            if not why:
                self.log(f"[{v.name}] process {i} of {wanted}: prepare and warm-up ...")
                s = self._session(v, tag=f"-p{i}")
                if s.start() is not None:
                    readies.append(s.ready)
                    extra.append(s)
                    continue
                why = f"process {i} did not start ({s.result().get('error', 'ended')})"
            self._process_notes[v.name] = f"{i - 1} of {wanted} processes: {why}"
            self.log(f"[{v.name}] {self._process_notes[v.name]}")
            break
        return extra

    def _gpu_sensor(self, variants: list):
        """The GPU's noise sensor for a run whose live rows include a GPU row (measuring/gpu_sensor.py),
        else None."""
        if not any(v.device == "cuda" for v in variants):
            return None
        try:
            return GpuSensor()
        except Exception as e:  # noqa: BLE001 - without it the GPU rows are judged by nothing, and say so
            self.log(f"GPU sensor unavailable ({format_error(e)}): GPU rows carry no noise mark")
            return None

    def _session(self, v: Variant, tag: str = ""):
        job = self._job(v, progress=False, kind="rounds", tag=tag)
        if self.cfg.bench.isolation == "inprocess":
            return InProcessSession(job)
        return WorkerSession(job, self.bundle.path("logs", f"{v.name}{tag}.log"),
                             time_limit(v, self.cfg.bench.timeout_s), echo=self.progress)

    def _finish(self, v: Variant, procs: list, rounds: Optional[RoundsLog]) -> None:
        recs = [s.finish() if s.ready is not None else s.result() for s in procs]
        for s, rec in zip(procs[1:], recs[1:]):  # the row's answers are its first process's
            Path(s.job.outputs).unlink(missing_ok=True)
        rec = merge_records(recs)
        r = self._row(v)
        self._score(v, r, rec)
        if r.ok and rounds is not None:
            apply_speedup(r, rounds.speedup(v.name) if self.ref is not None else None, "rounds")
            r.processes, r.processes_note = rounds.n_processes(v.name), self._process_notes.get(v.name, "")
            self._judge_noise(r, rounds)
        self.record(r, v)

    def _judge_noise(self, r: BackendResult, rounds: RoundsLog) -> None:
        """Which sensor speaks for the row (record/noise.py), and whether it wandered."""
        gpu = rounds.gpu_noise if r.device == "cuda" else None
        r.calibration_cv_pct = rounds.calibration_cv_pct
        if gpu is not None:
            r.gpu_sensor_spread_pct, r.gpu_sensor_jitter_pct = gpu.spread_pct, gpu.jitter_pct
        r.timing_noisy, r.timing_noise_note = row_noise(r.device, calibration_cv_pct=r.calibration_cv_pct,
                                                        gpu_busy_pct=r.gpu_busy_pct, gpu=gpu,
                                                        threshold_pct=self.cfg.bench.noise_cv_pct)

    def _block(self, v: Variant, why: str) -> None:
        """One row, its passes in one block (today's way for what cannot stay alive)."""
        r = self._row(v)
        r.n_devices = self.cluster.world if self.cluster is not None else (v.devices or 1)
        self.log(f"[{v.name}] prepare, warm-up and {self.cfg.bench.min_passes}+ timed passes in a block"
                 + (f" on {r.n_devices} {'GPUs' if v.device == 'cuda' else 'CPU ranks'}" if r.n_devices > 1 else "")
                 + f" ({why}) ...")
        rec = self._launch_block(v)
        self._score(v, r, rec)
        if r.ok and self.ref is not None:
            apply_speedup(r, block_speedup(self.ref.pass_s, rec["pass_s"]), "block", why)
        elif r.ok:
            r.timing_mode, r.timing_mode_note = "block", why
        self.record(r, v)

    def _launch_block(self, v: Variant) -> dict:
        job = self._job(v, progress=self.progress)
        timeout = time_limit(v, self.cfg.bench.timeout_s)  # its message names the setting that applied
        if self.cluster is not None:  # bench-ddp: every torchrun rank predicts its share
            return self.cluster.run(job, timeout, self.bundle.path("logs"))
        if (v.devices or 1) > 1:
            gpus = visible_gpus(v.devices) if v.device == "cuda" else None
            return run_local_ranks(job, v.devices, timeout, self.bundle.path("logs"), gpus)
        return launch(job, timeout_s=timeout, log_path=self.bundle.path("logs", f"{v.name}.log"), echo=self.progress,
                      isolation=self.cfg.bench.isolation)

    # --- one row --------------------------------------------------------------------------------
    def _row(self, v: Variant) -> BackendResult:
        key = plan_key(self.cfg.bench, v)
        return identity(self.task, v, self.model, self.evalset, self.plans[key], batch_size=key[1],
                        model_name=self.cfg.model.name)

    def _not_run(self, v: Variant) -> tuple[BackendResult, str]:
        r = self._row(v)
        why = (v.backend_class.batching_reason(v.options, r.batching)
               or v.backend_class.family_reason(v.options, self.model.family))
        return r, why

    def _score(self, v: Variant, r: BackendResult, rec: dict) -> None:
        """The worker's record into the row: postprocess, score, compare with the reference."""
        r.status, r.error = rec["status"], rec.get("error", "")
        if not r.ok:
            return
        features = self.evalset.features
        try:
            outputs = mask_padding(load_outputs(rec["outputs"]), features.attention_mask, self.task.token_outputs)
            fill_timing(r, rec, self.tiling, self.evalset.n_questions)
            t0 = time.perf_counter()
            predictions = self.task.postprocess(self.evalset.examples, features, outputs, self.options)
            r.postprocess_s = (time.perf_counter() - t0) * self.tiling
            r.tokenize_s = self.evalset.build_s * self.tiling
            r.end_to_end_s = r.tokenize_s + r.predict_s + r.postprocess_s
            scores = self.task.score(self.evalset.examples, predictions, self.options)
            r.scores = {k: float(x) for k, x in scores.items()}
            per_question = self.task.question_scores(self.evalset.examples, predictions, self.options)
            self.bundle.write_predictions(v.name, predictions)
            for suffix, obj in self.task.side_files(predictions).items():  # e.g. SQuAD v2.0's na-prob file
                atomic_write_json(self.bundle.path("predictions", f"{v.name}.{suffix}.json"), obj, indent=None)
            if v.name == self.reference:
                self.ref = Reference(outputs, predictions, r.scores, rec["pass_s"], per_question)
                self._dev_scores_from(v, r)
                if self.check_determinism:
                    self.problems += self._determinism(v)
            if self.ref is not None:
                judge(self.cfg.parity, self.task, v, self.ref, r, predictions, per_question, outputs,
                      features.attention_mask, judged=not self.model.timing_only)
            if v.name != self.reference and not self.cfg.bench.keep_outputs:
                Path(rec["outputs"]).unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - scoring one backend must not lose the others
            r.status, r.error = "failed", f"while scoring: {format_error(e)}"

    def _dev_scores_from(self, v: Variant, r: BackendResult) -> None:
        """A model trained for this run without its dev evaluation takes the reference row's scores."""
        if not self.model.dev_from_reference:
            return
        meta = self.bundle.meta
        self.model.scored_by_reference(r.scores, self.task.metric_names, self.task.primary_metric,
                                       f"the reference row ({v.name}) of bench run {meta.run_id}")
        meta.model_note, meta.model_dev_metric = self.model.note, self.model.dev_primary
        self.log(f"model: dev scores from the reference row: {self.model.note.split('; ')[-1]}")

    def record(self, r: BackendResult, v: Variant) -> None:
        """The row into the bundle (results.csv, run.json), MLflow and the console."""
        r.model_dev_f1 = self.model.dev_primary  # rows made before the reference gave the model its scores
        meta = self.bundle.meta
        meta.problems = list(self.problems)
        _log_row(self.log, self.task, r)
        self.bundle.put(r, order=self.names)
        child = self.tracker.log_backend(meta, r, self.env_tags, [self.bundle.path("predictions", f"{r.backend}.json")]
                                         if r.ok else [], self.bundle.path("logs", f"{v.name}.log"))
        if child:
            meta.mlflow_children[r.backend] = child
        self.bundle.write_meta()

    def _note_rounds(self, rounds: Optional[RoundsLog], left: list) -> None:
        meta = self.bundle.meta
        if rounds is not None:
            meta.rounds = rounds.to_dict()
            meta.calibration_cv_pct = rounds.calibration_cv_pct
            meta.timing_noisy = rounds.noisy(self.cfg.bench.noise_cv_pct)
            meta.noise_cv_pct = self.cfg.bench.noise_cv_pct
            gpu = rounds.gpu_noise
            if gpu is not None:
                meta.gpu_sensor_spread_pct, meta.gpu_sensor_jitter_pct = gpu.spread_pct, gpu.jitter_pct
        for v, why in left:
            meta.notes.append(f"{v.name}: {why}")
        self.bundle.write_meta()

    def _determinism(self, v: Variant) -> list[str]:
        """The reference a second time, in a fresh process: identical logits and answers, or the
        differences of every backend below that noise are not the backend's fault."""
        job = self._job(v, tag="-again")
        rec = launch(job, timeout_s=self.cfg.bench.timeout_s, log_path=self.bundle.path("logs", f"{v.name}-again.log"),
                     isolation=self.cfg.bench.isolation)
        if rec["status"] != "ok":
            return [f"reference {v.name} failed on its second run: {rec.get('error')}"]
        features = self.evalset.features
        again = mask_padding(load_outputs(rec["outputs"]), features.attention_mask, self.task.token_outputs)
        Path(rec["outputs"]).unlink(missing_ok=True)
        preds = self.task.postprocess(self.evalset.examples, features, again, self.options)
        det = determinism(self.ref.outputs, again, features.attention_mask, self.ref.predictions, preds)
        self.bundle.meta.notes.append(f"determinism of {v.name} (two processes): max |Δ logit| "
                                      f"{det['max_abs_logit_diff']:.2e}, identical answers: {det['identical_answers']}")
        self.log(self.bundle.meta.notes[-1])
        if not det["identical_answers"]:
            return [f"reference {v.name} is not deterministic (answers changed between two runs, max |Δ logit| "
                    f"{det['max_abs_logit_diff']:.2e}): fix that before judging backends"]
        return []


def saved_reference(options, task: Task, evalset: EvalSet, bundle: RunBundle, reference: str) -> Optional[Reference]:
    """The reference as the interrupted run measured it: its kept outputs, its saved predictions,
    its scores and timed passes. None when it did not finish (it then runs first)."""
    row = next((r for r in bundle.results if r.backend == reference and r.ok), None)
    outputs_file, worker_file = bundle.path("outputs", f"{reference}.npz"), bundle.path("workers", f"{reference}.json")
    preds_file = bundle.path("predictions", f"{reference}.json")
    if row is None or not (outputs_file.exists() and worker_file.exists() and preds_file.exists()):
        return None
    outputs = mask_padding(load_outputs(outputs_file), evalset.features.attention_mask, task.token_outputs)
    predictions = json.loads(preds_file.read_text())
    # Scores recomputed from the saved predictions: results.csv keeps 6 significant digits, and a
    # delta against a rounded reference would differ from an uninterrupted run's.
    scores = {k: float(v) for k, v in task.score(evalset.examples, predictions, options).items()}
    return Reference(outputs, predictions, scores, json.loads(worker_file.read_text())["pass_s"],
                     task.question_scores(evalset.examples, predictions, options))


def _log_row(log, task: Task, r: BackendResult) -> None:
    if not r.ok:
        log(f"[{r.backend}] {r.status.upper()}: {r.error}")
        return
    scores = "  ".join(f"{k}={r.scores.get(k, float('nan')):.2f}" for k in task.metric_names)
    speed = ""
    if r.speedup is not None:
        ci = f" [{r.speedup_low:.2f}–{r.speedup_high:.2f}]" if r.speedup_low is not None else ""
        speed = (f"  {r.speedup:.2f}×{ci} ({r.timing_mode}" + (f", {r.rounds} rounds" if r.rounds else "")
                 + (f", {r.processes} processes" if r.processes and r.processes > 1 else "")
                 + (" ~ noisy" if r.timing_noisy else "") + ")")
    log(f"[{r.backend}] {r.predict_s:.3f}s (median of {r.n_passes}){speed}  {r.features_per_s:,.1f} features/s  "
        f"{scores}  parity={r.parity or '—'}")
