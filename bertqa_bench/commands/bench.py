"""``bench``: every variant of a suite, each in its own process, judged against the reference.

The flow (docs/design.md): load the suite; make sure the model exists (train it if not); load the
evaluation set (built once, cached); make the batch plans; then the rows (bench_rows.py): every
variant's worker prepared and kept alive, their passes timed in interleaved rounds, then in this
process each row's outputs postprocessed into answers, scored and compared with the reference's
— one BackendResult each, written to results.csv and MLflow. A variant that crashes, hangs or
cannot run here is recorded as such; the rest run.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Optional

from ..backends.variants import Variant, VariantTable, note_once
from ..config import SuiteConfig
from ..data.evalset import EvalSet, load_evalset
from ..envinfo import device_name, environment
from ..errors import ConfigError
from ..measuring.ddp import without_dist_env
from ..measuring.jobs import plan_for, plan_key, plan_path
from ..model.checkpoint import model_digest, resolve_checkpoint
from ..record.judging import Reference
from ..record.results import RunBundle, RunMeta, new_run_id
from ..record.run_folder import claim, preflight
from ..record.schedule import Plan
from ..reporting.run_close import BenchOutcome, close_complete, close_failed, close_interrupted
from ..reporting.tracking import Tracker
from ..tasks import Task, get_task
from ..training.train import DEV_EVALUATOR
from .bench_rows import RowRunner, saved_reference
from .provision import ModelInfo, ensure_model


def measured_model_dir(cfg: SuiteConfig) -> Path:
    """The folder whose files the rows are measured on: a checkpoint's own, else models/<name>."""
    if cfg.model.checkpoint:
        return resolve_checkpoint(cfg.model.checkpoint, allow_pickle=cfg.model.allow_pickle).path
    return cfg.model_dir


def config_diff(saved: dict, wanted: dict, prefix: str = "") -> list[str]:
    """``section.field: saved -> wanted`` for every field that differs between two config dicts."""
    out = []
    for k in sorted(set(saved) | set(wanted), key=str):
        a, b = saved.get(k, "<absent>"), wanted.get(k, "<absent>")
        where = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, where)
        elif a != b:
            out.append(f"{where}: {a!r} -> {b!r}")
    return out


def run_bench(cfg: SuiteConfig, *, backends: Optional[list[str]] = None, run_id: Optional[str] = None,
              tracker: Optional[Tracker] = None, progress: bool = True, command: str = "",
              log: Callable[[str], None] = print, check_determinism: bool = False,
              resume: Optional[RunBundle] = None, cluster=None, overwrite: bool = False) -> BenchOutcome:
    """Benchmark the suite's variants (reference first), or, with ``resume``, finish a run that
    was interrupted or partly failed: its finished rows are kept, the reference's saved outputs
    are reused, only the missing (or failed) variants run, against the same evaluation set and
    plans. A signal (``interrupt.Interrupted``) ends the run ``interrupted``: finished rows stay,
    run.json has the verdict of what finished, the MLflow runs end KILLED; then it propagates.

    The rows are timed in interleaved rounds (bench_rows.py) unless the suite says blocks; a
    resumed run's rows are timed in blocks against the reference's saved passes.

    ``cluster`` (ddp.Cluster, ``bench-ddp`` under torchrun, on rank 0): every variant's prediction
    runs over all the torchrun ranks; the other ranks predict only (Cluster.serve).

    The run owns its folder (record/run_folder.py): a generated id is claimed exclusively; a ``run_id``
    whose folder exists is refused before any work unless ``overwrite`` (emptied first)."""
    names, variants = _variants(cfg, backends, resume)
    reference = cfg.bench.reference
    # a taken --run-id, an unwritable or full results/cache/models disk: refused before any work
    preflight(cfg.folders, run_id, overwrite, resume=resume is not None)
    tracker = tracker or Tracker(cfg.results_root, enabled=False)
    task = get_task(cfg.task.name)
    _check_resumable(cfg, resume)
    # a backend this machine cannot run still gets its row ("not run", with the reason and what to
    # install), but the user hears it now, before a model is trained for it
    for v in variants[1:]:
        reason = v.unavailable_reason()
        if reason:
            log(f"note: {v.name} cannot run here ({reason}); its row will say so")
    model, evalset = _model_and_evalset(cfg, task, resume, cluster, tracker, log)
    plans = _plans(cfg, evalset, variants, resume, log)
    plan = plans[plan_key(cfg.bench, variants[0])]  # the reference's
    env = environment()
    env_tags = {f"env.{k}": v for k, v in env.items()}
    if model.checkpoint:  # every child run names the checkpoint it measured
        env_tags |= {"model.checkpoint": model.checkpoint, "model.digest": model.digest, "model.family": model.family}
    tracker.active  # opens (or creates) the MLflow store now: one that cannot be opened fails the run here
    if resume is None:
        bundle = _new_bundle(cfg, task, model, evalset, plans, plan, names, variants, run_id, overwrite, command,
                             env, env_tags, tracker)
    else:
        bundle = _reopen_bundle(resume, names, plans, command, env_tags, tracker, log)
    meta = bundle.meta
    bundle.write_meta()
    rows = RowRunner(cfg, task, model, evalset, bundle, plans, tracker, env_tags, list(names),
                     tiling=plan.n_rows / plan.n_features, progress=progress, log=log, cluster=cluster,
                     check_determinism=check_determinism, problems=list(meta.problems))
    try:
        rows.ref = saved_reference(cfg.task.options, task, evalset, bundle, reference) if resume is not None else None
        todo = [v for v in variants if not _kept(bundle, v, reference, rows.ref)]
        for v in todo:
            done = next((r for r in bundle.results if r.backend == v.name), None)
            if done is not None:  # a failed row (or a reference without its saved outputs) runs again
                tracker.delete_run(meta.mlflow_children.pop(done.backend, ""))
        rows.run(todo, block_reason="resumed run: timed in blocks against the reference's saved passes"
                 if resume is not None else "")
    except KeyboardInterrupt as e:  # interrupt.Interrupted: every signal the bench handles
        stop, v = close_interrupted(bundle, reference, model.timing_only, rows.problems, tracker, e)
        log(f"interrupted by {stop.signal_name}: {len(bundle.results)} of {len(names)} variants finished "
            f"(verdict of those: {v.status}); results in {bundle.dir}; finish it with "
            f"`bertqa-bench bench --resume {bundle.dir}`")
        raise stop from None
    except Exception as e:
        close_failed(bundle, tracker, e)
        raise
    v, summary = close_complete(bundle, reference, model.timing_only, rows.problems, tracker)
    return BenchOutcome(bundle, summary, v, evalset, rows.ref, rows.problems)


def _variants(cfg: SuiteConfig, backends: Optional[list[str]], resume: Optional[RunBundle]) -> tuple[list, list]:
    """The run's variant names (reference first) and variants. Old names become the catalogue's,
    with a note each; an unknown name fails here, before any work. A resumed run keeps its own."""
    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    if resume is not None:
        if backends:
            raise ConfigError("--resume finishes the run as it was planned; it takes no --backends")
        names = list(resume.meta.variants) or [r.backend for r in resume.results]
    else:
        names = table.canonical_names([cfg.bench.reference] + list(backends or cfg.bench.backends), note_once)
        cfg.bench.reference = names[0]
    variants = table.require(names)
    if resume is not None:  # a run started under old names finishes under them
        variants = [v if v.name == n else dataclasses.replace(v, name=n) for n, v in zip(names, variants)]
    return names, variants


def _check_resumable(cfg: SuiteConfig, resume: Optional[RunBundle]) -> None:
    if resume is None:
        return
    mdir = measured_model_dir(cfg)
    if not resume.meta.model_digest == model_digest(mdir):
        raise ConfigError(f"cannot resume {resume.meta.run_id}: its rows were measured on model "
                          f"{resume.meta.model_digest or '?'} and {mdir} is "
                          f"{model_digest(mdir) if mdir.is_dir() else 'missing'} "
                          "(retrained or replaced); start a new run")


def _model_and_evalset(cfg: SuiteConfig, task: Task, resume, cluster, tracker, log) -> tuple[ModelInfo, EvalSet]:
    # A model trained here skips its dev evaluation where the reference row repeats it: eager FP32
    # on the same evaluation set (46 s of a cold default run on 2 cores; a minute of GPU time for
    # BERT-large). The reference row's scores become the model's (ModelInfo.scored_by_reference).
    evaluate = cfg.bench.reference != DEV_EVALUATOR
    if cluster is not None:
        with without_dist_env():  # a missing model trains here, as one process
            model = ensure_model(cfg, log, tracker, evaluate=evaluate)
    else:
        model = ensure_model(cfg, log, tracker, evaluate=evaluate)
    evalset = load_evalset(cfg.evalset_spec(), task, str(model.dir), log=log)
    if cluster is not None:
        cluster.prepared(model, evalset)
    if resume is not None and resume.meta.evalset_key and resume.meta.evalset_key != evalset.key:
        raise ConfigError(f"cannot resume {resume.meta.run_id}: its evaluation set was {resume.meta.evalset_key}, "
                          f"this one is {evalset.key} (data, tokenizer or windowing changed); start a new run")
    return model, evalset


def _plans(cfg: SuiteConfig, evalset: EvalSet, variants: list, resume, log) -> dict:
    """One plan per (batching, batch size) among the variants: each is made once and every
    variant that shares it runs exactly the same batches (a resume reads the run's own)."""
    keys = list(dict.fromkeys(plan_key(cfg.bench, v) for v in variants))
    rows = cfg.data.target_eval_features
    if resume is not None:
        plans = {k: Plan.load(plan_path(resume, k)) if plan_path(resume, k).exists()
                 else plan_for(cfg.bench, evalset, k, rows)
                 for k in keys}
    else:
        plans = {k: plan_for(cfg.bench, evalset, k, rows) for k in keys}
    log(f"data: {evalset.n_questions} questions -> {evalset.n_features} features (seq {evalset.features.seq_len}), "
        f"evaluation set {'from cache' if evalset.cache_hit else 'built'}; " + "; ".join(
            f"{k[0]} batching at {k[1]}: {len(p.batches)} batches, {len(p.shapes)} shape(s), {p.n_rows} rows per pass"
            for k, p in plans.items()))
    return plans


def _new_bundle(cfg, task, model, evalset, plans, plan, names, variants, run_id, overwrite, command, env, env_tags,
                tracker) -> RunBundle:
    replaced = replaced_mlflow_runs(cfg.results_root, run_id) if overwrite and run_id else []
    run_id = claim(cfg.results_root, run_id, lambda: new_run_id(cfg.name), overwrite)
    for old in replaced:  # the emptied run's MLflow runs go with it (deleted: MLflow's trash keeps them)
        tracker.delete_run(old)
    meta = RunMeta(suite=cfg.name, run_id=run_id, task=task.name,
                   metric_names=list(task.metric_names), primary_metric=task.primary_metric,
                   reference=cfg.bench.reference, metric_labels=dict(task.metric_labels),
                   command=command, date=time.strftime("%Y-%m-%d", time.gmtime()), model=cfg.model.name,
                   model_note=model.note, model_params=model.params, model_dev_metric=model.dev_primary,
                   model_checkpoint=model.checkpoint, model_family=model.family,
                   timing_only=model.timing_only, batching=plan.batching, batch_size=cfg.bench.batch_size,
                   max_seq_len=evalset.features.seq_len, n_features=plan.n_rows, n_questions=evalset.n_questions,
                   device_name=device_name(variants[0].device), status="running", variants=list(names),
                   model_recipe=str(model.metrics.get("recipe", "")), model_digest=model_digest(model.dir),
                   evalset_key=evalset.key)
    bundle = RunBundle.create(cfg.results_root, meta, cfg.to_dict(), env)
    for k, p in plans.items():
        p.save(plan_path(bundle, k))
    tracker.start_bench(meta, tags=env_tags | {"results_dir": str(bundle.dir)})
    meta.mlflow_parent_id = tracker.parent_id or ""
    return bundle


def replaced_mlflow_runs(results_root: Path, run_id: str) -> list[str]:
    """The MLflow parent and children of the run an ``--overwrite`` empties (none if unreadable)."""
    try:
        meta = json.loads((Path(results_root) / run_id / "run.json").read_text())
        return [r for r in [meta.get("mlflow_parent_id"), *dict(meta.get("mlflow_children") or {}).values()]
                if isinstance(r, str) and r]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def _reopen_bundle(bundle: RunBundle, names, plans, command, env_tags, tracker, log) -> RunBundle:
    meta = bundle.meta
    kept = [r.backend for r in bundle.results if r.status in KEPT]
    todo = [n for n in names if n not in kept]
    meta.resumes.append({"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "command": command, "ran": todo})
    meta.status, meta.interrupted_by = "running", ""
    for k, p in plans.items():
        if not plan_path(bundle, k).exists():
            p.save(plan_path(bundle, k))
    log(f"resume {meta.run_id}: keeping {', '.join(kept) or 'nothing'}; running {', '.join(todo) or 'nothing'}")
    tracker.reopen_bench(meta, tags=env_tags | {"results_dir": str(bundle.dir)})
    meta.mlflow_parent_id = tracker.parent_id or meta.mlflow_parent_id
    return bundle


# Rows a resume keeps as they are; a failed row runs again.
KEPT = ("ok", "not run")


def _kept(bundle: RunBundle, variant: Variant, reference: str, ref: Optional[Reference]) -> bool:
    done = next((r for r in bundle.results if r.backend == variant.name), None)
    return done is not None and done.status in KEPT and (variant.name != reference or ref is not None)
