"""``bench``: every variant of a suite, each in its own process, judged against the reference.

The flow (docs/design.md): load the suite; make sure the model exists (train it if not); load the
evaluation set (built once, cached); make the batch plan; then for each variant, reference
first: launch its worker (prepare, warm-up, timed passes, outputs to the run folder), and in
this process postprocess its outputs into answers, score them and compare them with the
reference's — one BackendResult, written to results.csv and MLflow before the next variant
starts. A variant that crashes, hangs or cannot run here is recorded as such; the rest run.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..backends.variants import Variant, VariantTable, note_once
from ..model.checkpoint import model_digest
from ..config import SuiteConfig
from ..errors import ConfigError
from ..envinfo import cuda_visible_devices, device_name, environment
from ..data.evalset import EvalSet, load_evalset
from ..io import atomic_write_json
from ..measuring.launcher import launch, time_limit
from ..measuring.progress import rows_line
from ..record.parity import Verdict, compare, determinism, tolerance_for, verdict
from ..record.run_folder import claim, preflight
from ..reporting.report import write_report
from ..record.results import BackendResult, RunBundle, RunMeta, new_run_id
from ..record.schedule import Plan, make_plan, mask_padding
from ..tasks import Task, get_task
from ..reporting.tracking import Tracker
from .provision import ModelInfo, ensure_model
from ..measuring.worker import Job, load_outputs


@dataclass
class Reference:
    outputs: dict
    predictions: object
    scores: dict
    pass_s: list
    question_scores: Optional[np.ndarray] = None  # per-question contributions (parity's bootstrap)


@dataclass
class BenchOutcome:
    bundle: RunBundle
    summary: str
    verdict: Verdict
    evalset: EvalSet
    reference: Optional[Reference] = None
    problems: list = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.bundle.dir

    @property
    def results(self) -> list[BackendResult]:
        return self.bundle.results


def plan_key(cfg: SuiteConfig, variant: Optional[Variant] = None) -> tuple[str, int]:
    """(batching, batch size) a variant runs with: its own, else the bench section's."""
    b = cfg.bench
    return ((variant.batching if variant and variant.batching else b.batching),
            (variant.batch_size if variant and variant.batch_size else b.batch_size))


def plan_for(cfg: SuiteConfig, evalset: EvalSet, key: Optional[tuple[str, int]] = None) -> Plan:
    b = cfg.bench
    batching, batch_size = key or plan_key(cfg)
    tokens = b.tokens_per_batch * batch_size // b.batch_size if b.tokens_per_batch else None
    return make_plan(evalset.lengths(), batching=batching, batch_size=batch_size,
                     max_seq_len=evalset.features.seq_len, seq_multiple=b.seq_multiple,
                     tokens_per_batch=tokens, max_batch_rows=b.max_batch_rows,
                     target_rows=cfg.data.target_eval_features)


def plan_path(bundle: RunBundle, key: tuple[str, int]) -> Path:
    return bundle.path("plans", f"{key[0]}-b{key[1]}.npz")


def make_job(cfg: SuiteConfig, task: Task, variant: Variant, model: ModelInfo, evalset: EvalSet, bundle: RunBundle,
             tag: str = "", progress: bool = False) -> Job:
    name = variant.name + tag
    b = cfg.bench
    return Job(variant=variant.to_dict(), model_dir=str(model.dir), task=task.name,
               artifacts_dir=str(cfg.artifacts_root / variant.name), evalset=str(evalset.path),
               plan=str(plan_path(bundle, plan_key(cfg, variant))), outputs=str(bundle.path("outputs", f"{name}.npz")),
               result=str(bundle.path("workers", f"{name}.json")), output_names=list(task.output_names),
               token_outputs=list(task.token_outputs), max_seq_len=evalset.features.seq_len,
               warmup_batches=b.warmup_batches, min_passes=b.min_passes, min_duration_s=b.min_duration_s,
               num_threads=b.num_threads, progress=progress)


def identity(cfg: SuiteConfig, task: Task, variant: Variant, model: ModelInfo, evalset: EvalSet,
             plan: Plan) -> BackendResult:
    return BackendResult(
        backend=variant.name, implementation=variant.implementation, precision=variant.precision,
        parity_class=variant.parity_class, device=variant.device, device_name=device_name(variant.device),
        batching=plan.batching, batch_size=plan_key(cfg, variant)[1], max_seq_len=evalset.features.seq_len,
        n_shapes=len(plan.shapes), n_devices=variant.devices or 1, n_features=plan.n_rows, n_questions=evalset.n_questions, model=cfg.model.name,
        model_params=model.params, model_dev_f1=model.dev_primary, model_checkpoint=model.checkpoint,
        model_digest=model.digest, model_family=model.family, task=task.name)


def _fill_timing(r: BackendResult, rec: dict, tiling: float, n_questions: int) -> None:
    t, m = rec["timing"], rec.get("measures", {})
    for k, v in {**t, **m}.items():
        if hasattr(r, k) and k not in ("scores", "deltas", "prepare_info"):
            setattr(r, k, v)
    r.prepare_s = rec["prepare_s"]
    r.prepare_info = dict(rec.get("prepare_info") or {})
    r.questions_per_s = n_questions * tiling / r.predict_s


def _speedup(r: BackendResult, ref_pass: list, pass_s: list) -> None:
    r.speedup = float(np.median(ref_pass)) / float(np.median(pass_s))
    r.speedup_low = min(ref_pass) / max(pass_s)
    r.speedup_high = max(ref_pass) / min(pass_s)
    r.speedup_within_noise = r.speedup_low <= 1.0 <= r.speedup_high
    r.pct_change_vs_ref = (float(np.median(pass_s)) / float(np.median(ref_pass)) - 1.0) * 100.0


def measured_model_dir(cfg: SuiteConfig) -> Path:
    """The folder whose files the rows are measured on: a checkpoint's own, else models/<name>."""
    if cfg.model.checkpoint:
        from ..model.checkpoint import resolve_checkpoint

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

    ``cluster`` (ddp.Cluster, ``bench-ddp`` under torchrun, on rank 0): every variant's prediction
    runs over all the torchrun ranks; the other ranks predict only (Cluster.serve).

    The run owns its folder (record/run_folder.py): a generated id is claimed exclusively; a ``run_id``
    whose folder exists is refused before any work unless ``overwrite`` (emptied first)."""
    reference = cfg.bench.reference
    table = VariantTable.for_suite(cfg)
    if resume is not None:
        if backends:
            raise ConfigError("--resume finishes the run as it was planned; it takes no --backends")
        names = list(resume.meta.variants) or [r.backend for r in resume.results]
    else:  # old names as the catalogue's, with a note each (an unknown name fails here, before any work)
        names = table.canonical_names([reference] + list(backends or cfg.bench.backends), note_once)
        reference = cfg.bench.reference = names[0]
    variants = table.require(names)
    if resume is not None:  # a run started under old names finishes under them
        variants = [v if v.name == n else dataclasses.replace(v, name=n) for n, v in zip(names, variants)]
    # a taken --run-id, an unwritable or full results/cache/models disk: refused before any work
    preflight(cfg, run_id, overwrite, resume=resume is not None)
    tracker = tracker or Tracker(cfg.results_root, enabled=False)
    task = get_task(cfg.task.name)
    mdir = measured_model_dir(cfg) if resume is not None else cfg.model_dir
    if resume is not None and not resume.meta.model_digest == model_digest(mdir):
        raise ConfigError(f"cannot resume {resume.meta.run_id}: its rows were measured on model "
                          f"{resume.meta.model_digest or '?'} and {mdir} is "
                          f"{model_digest(mdir) if mdir.is_dir() else 'missing'} "
                          "(retrained or replaced); start a new run")
    # a backend this machine cannot run still gets its row ("not run", with the reason and what to
    # install), but the user hears it now, before a model is trained for it
    for v in variants[1:]:
        reason = v.unavailable_reason()
        if reason:
            log(f"note: {v.name} cannot run here ({reason}); its row will say so")
    if cluster is not None:
        from ..measuring.ddp import without_dist_env

        with without_dist_env():  # a missing model trains here, as one process
            model = ensure_model(cfg, log, tracker)
    else:
        model = ensure_model(cfg, log, tracker)
    evalset = load_evalset(cfg, task, str(model.dir), log=log)
    if cluster is not None:
        cluster.prepared(model, evalset)
    if resume is not None and resume.meta.evalset_key and resume.meta.evalset_key != evalset.key:
        raise ConfigError(f"cannot resume {resume.meta.run_id}: its evaluation set was {resume.meta.evalset_key}, "
                          f"this one is {evalset.key} (data, tokenizer or windowing changed); start a new run")
    # One plan per (batching, batch size) among the variants: each is made once and every
    # variant that shares it runs exactly the same batches (a resume reads the run's own).
    keys = list(dict.fromkeys(plan_key(cfg, v) for v in variants))
    if resume is not None:
        plans = {k: Plan.load(plan_path(resume, k)) if plan_path(resume, k).exists() else plan_for(cfg, evalset, k)
                 for k in keys}
    else:
        plans = {k: plan_for(cfg, evalset, k) for k in keys}
    plan = plans[plan_key(cfg, variants[0])]  # the reference's
    tiling = plan.n_rows / plan.n_features
    log(f"data: {evalset.n_questions} questions -> {evalset.n_features} features (seq {evalset.features.seq_len}), "
        f"evaluation set {'from cache' if evalset.cache_hit else 'built'}; " + "; ".join(
            f"{k[0]} batching at {k[1]}: {len(p.batches)} batches, {len(p.shapes)} shape(s), {p.n_rows} rows per pass"
            for k, p in plans.items()))

    env = environment()
    env_tags = {f"env.{k}": v for k, v in env.items()}
    if model.checkpoint:  # every child run names the checkpoint it measured
        env_tags |= {"model.checkpoint": model.checkpoint, "model.digest": model.digest, "model.family": model.family}
    tracker.active  # opens (or creates) the MLflow store now: one that cannot be opened fails the run here
    if resume is None:
        run_id = claim(cfg.results_root, run_id, lambda: new_run_id(cfg.name), overwrite)
        meta = RunMeta(suite=cfg.name, run_id=run_id, task=task.name,
                       metric_names=list(task.metric_names), primary_metric=task.primary_metric, reference=reference,
                       metric_labels=dict(task.metric_labels),
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
    else:
        bundle, meta = resume, resume.meta
        kept = [r.backend for r in bundle.results if r.status in KEPT]
        todo = [n for n in names if n not in kept]
        meta.resumes.append({"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "command": command,
                             "ran": todo})
        meta.status, meta.interrupted_by = "running", ""
        for k, p in plans.items():
            if not plan_path(bundle, k).exists():
                p.save(plan_path(bundle, k))
        log(f"resume {meta.run_id}: keeping {', '.join(kept) or 'nothing'}; running {', '.join(todo) or 'nothing'}")
        tracker.reopen_bench(meta, tags=env_tags | {"results_dir": str(bundle.dir)})
        meta.mlflow_parent_id = tracker.parent_id or meta.mlflow_parent_id
    bundle.write_meta()

    problems: list[str] = list(meta.problems)
    t_rows, row_s = time.perf_counter(), []  # the wall time of each row run here, for the estimate
    try:
        ref = _saved_reference(cfg, task, evalset, bundle, reference) if resume is not None else None
        todo = [v for v in variants if not _kept(bundle, v, reference, ref)]
        for variant in variants:
            if _kept(bundle, variant, reference, ref):
                continue
            done = next((r for r in bundle.results if r.backend == variant.name), None)
            if done is not None:  # a failed row (or a reference without its saved outputs) runs again
                tracker.delete_run(meta.mlflow_children.pop(done.backend, ""))
            log(rows_line(len(row_s), len(todo), variant.name, row_s, time.perf_counter() - t_rows))
            t_row = time.perf_counter()
            r, new_ref, found = _run_variant(cfg, task, variant, model, evalset, bundle, plans, tiling, ref, progress,
                                             log, check_determinism and variant.name == reference, cluster)
            row_s.append(time.perf_counter() - t_row)
            ref = new_ref or ref
            problems += found
            meta.problems = list(problems)
            _log_row(log, task, r)
            bundle.put(r, order=names)
            child = tracker.log_backend(meta, r, env_tags, [bundle.path("predictions", f"{r.backend}.json")]
                                        if r.ok else [], bundle.path("logs", f"{variant.name}.log"))
            if child:
                meta.mlflow_children[r.backend] = child
            bundle.write_meta()
    except KeyboardInterrupt as e:  # interrupt.Interrupted: every signal the bench handles
        stop, v = close_interrupted(bundle, reference, model.timing_only, problems, tracker, e)
        log(f"interrupted by {stop.signal_name}: {len(bundle.results)} of {len(names)} variants finished "
            f"(verdict of those: {v.status}); results in {bundle.dir}; finish it with "
            f"`bertqa-bench bench --resume {bundle.dir}`")
        raise stop from None
    except Exception as e:
        close_failed(bundle, tracker, e)
        raise

    v, summary = close_complete(bundle, reference, model.timing_only, problems, tracker)
    return BenchOutcome(bundle, summary, v, evalset, ref, problems)


def close_complete(bundle: RunBundle, reference: str, timing_only: bool, problems: list,
                   tracker: Tracker) -> tuple[Verdict, str]:
    """A finished run's record (bench and loadgen): the verdict in run.json, the report, MLflow."""
    v = verdict(bundle.results, reference, timing_only=timing_only, problems=problems)
    bundle.meta.verdict, bundle.meta.verdict_reasons, bundle.meta.status = v.status, v.reasons, "complete"
    bundle.write_meta()
    summary = write_report(bundle)
    tracker.finish_bench(bundle, v)
    return v, summary


def close_interrupted(bundle: RunBundle, reference: str, timing_only: bool, problems: list, tracker: Tracker,
                      e: BaseException):
    """An interrupted run's record (bench and loadgen): the verdict of what finished, run.json
    ``interrupted`` with the signal, the report, MLflow runs KILLED. Returns (Interrupted, verdict)."""
    from ..measuring.interrupt import as_interrupted

    stop = as_interrupted(e)
    v = verdict(bundle.results, reference, timing_only=timing_only, problems=problems)
    meta = bundle.meta
    meta.status, meta.interrupted_by = "interrupted", stop.signal_name
    meta.verdict, meta.verdict_reasons = v.status, v.reasons
    bundle.write_meta()
    write_report(bundle)
    tracker.interrupt_bench(bundle, v, stop.signal_name)
    return stop, v


def close_failed(bundle: RunBundle, tracker: Tracker, e: BaseException) -> None:
    """The run itself broke (not one backend: a full disk while writing a row, a bug): run.json says
    ``failed`` with the error instead of ``running`` for ever, and the MLflow parent ends FAILED.
    Best effort: on a full disk run.json may not be writable either; the error is raised anyway."""
    from ..measuring.worker import format_error

    bundle.meta.status = "failed"
    bundle.meta.notes = list(bundle.meta.notes) + [f"failed: {format_error(e)}"]
    try:
        bundle.write_meta()
    except OSError:
        pass
    tracker.fail_bench(e)


# Rows a resume keeps as they are; a failed row runs again.
KEPT = ("ok", "not run")


def _kept(bundle: RunBundle, variant: Variant, reference: str, ref: Optional["Reference"]) -> bool:
    done = next((r for r in bundle.results if r.backend == variant.name), None)
    return done is not None and done.status in KEPT and (variant.name != reference or ref is not None)


def _saved_reference(cfg: SuiteConfig, task: Task, evalset: EvalSet, bundle: RunBundle,
                     reference: str) -> Optional[Reference]:
    """The reference as the interrupted run measured it: its kept outputs, its saved predictions,
    its scores and timed passes. None when it did not finish (it then runs first)."""
    import json

    row = next((r for r in bundle.results if r.backend == reference and r.ok), None)
    outputs_file, worker_file = bundle.path("outputs", f"{reference}.npz"), bundle.path("workers", f"{reference}.json")
    preds_file = bundle.path("predictions", f"{reference}.json")
    if row is None or not (outputs_file.exists() and worker_file.exists() and preds_file.exists()):
        return None
    outputs = mask_padding(load_outputs(outputs_file), evalset.features.attention_mask, task.token_outputs)
    predictions = json.loads(preds_file.read_text())
    # Scores recomputed from the saved predictions: results.csv keeps 6 significant digits, and a
    # delta against a rounded reference would differ from an uninterrupted run's.
    scores = {k: float(v) for k, v in task.score(evalset.examples, predictions, cfg).items()}
    return Reference(outputs, predictions, scores, json.loads(worker_file.read_text())["pass_s"],
                     task.question_scores(evalset.examples, predictions, cfg))


def judge(cfg: SuiteConfig, task: Task, variant: Variant, ref: Reference, r: BackendResult, predictions,
          per_question, outputs: dict, attention_mask: np.ndarray, *, judged: bool) -> None:
    """One row's parity against the reference, into the row: the comparison bench and loadgen
    both make (paired bootstrap over questions when the task decomposes its metric). ``judged``
    False (random weights: near-tied spans everywhere) keeps the numbers but gives no verdict."""
    paired = (ref.question_scores, per_question) if (
        ref.question_scores is not None and per_question is not None) else None
    p = compare(parity_class=variant.parity_class,
                tolerance=tolerance_for(cfg.parity, variant.name, variant.parity_class),
                primary_metric=task.primary_metric, ref_scores=ref.scores, scores=r.scores,
                agreement=task.agreement(predictions, ref.predictions), ref_outputs=ref.outputs,
                outputs=outputs, attention_mask=attention_mask, question_scores=paired,
                metrics_from_sums=task.metrics_from_sums if paired else None)
    r.apply_parity(p, judged=judged)


def _run_variant(cfg, task, variant, model, evalset, bundle, plans, tiling, ref, progress, log, determinism,
                 cluster=None):
    """One variant end to end: its worker, then postprocess, score and compare here.
    Returns (its row, the Reference when this was the reference, run-level problems found)."""
    reference = cfg.bench.reference
    features = evalset.features
    problems: list[str] = []
    new_ref = None
    r = identity(cfg, task, variant, model, evalset, plans[plan_key(cfg, variant)])
    why = (variant.backend_class.batching_reason(variant.options, r.batching)
           or variant.backend_class.family_reason(variant.options, model.family))
    if why:
        r.status, r.error = "not run", why
        return r, None, problems
    n_ranks = cluster.world if cluster is not None else (variant.devices or 1)
    r.n_devices = n_ranks
    log(f"[{variant.name}] prepare, warm-up and {cfg.bench.min_passes}+ timed passes"
        + (f" on {n_ranks} {'GPUs' if variant.device == 'cuda' else 'CPU ranks'}" if n_ranks > 1 else "") + " ...")
    job = make_job(cfg, task, variant, model, evalset, bundle, progress=progress)
    timeout = time_limit(variant, cfg.bench.timeout_s)  # its message names the setting that applied
    if cluster is not None:  # bench-ddp: every torchrun rank predicts its share
        rec = cluster.run(job, timeout, bundle.path("logs"))
    elif (variant.devices or 1) > 1:
        rec = run_data_parallel(job, variant.devices, timeout, bundle, variant)
    else:
        rec = launch(job, timeout_s=timeout, log_path=bundle.path("logs", f"{variant.name}.log"), echo=progress,
                     isolation=cfg.bench.isolation)
    r.status = rec["status"]
    r.error = rec.get("error", "")
    if not r.ok:
        return r, None, problems
    try:
        outputs = mask_padding(load_outputs(rec["outputs"]), features.attention_mask, task.token_outputs)
        _fill_timing(r, rec, tiling, evalset.n_questions)
        t0 = time.perf_counter()
        predictions = task.postprocess(evalset.examples, features, outputs, cfg)
        r.postprocess_s = (time.perf_counter() - t0) * tiling
        r.tokenize_s = evalset.build_s * tiling
        r.end_to_end_s = r.tokenize_s + r.predict_s + r.postprocess_s
        r.scores = {k: float(v) for k, v in task.score(evalset.examples, predictions, cfg).items()}
        per_question = task.question_scores(evalset.examples, predictions, cfg)
        bundle.write_predictions(variant.name, predictions)
        for suffix, obj in task.side_files(predictions).items():  # e.g. SQuAD v2.0's na-prob file
            atomic_write_json(bundle.path("predictions", f"{variant.name}.{suffix}.json"), obj, indent=None)
        if variant.name == reference:
            ref = new_ref = Reference(outputs, predictions, r.scores, rec["pass_s"], per_question)
            if determinism:
                problems += _determinism(cfg, task, variant, model, evalset, bundle, ref, r, log)
        if ref is not None:
            _speedup(r, ref.pass_s, rec["pass_s"])
            judge(cfg, task, variant, ref, r, predictions, per_question, outputs, features.attention_mask,
                  judged=not model.timing_only)
        if variant.name != reference and not cfg.bench.keep_outputs:
            Path(rec["outputs"]).unlink(missing_ok=True)
    except Exception as e:  # noqa: BLE001 - scoring one backend must not lose the others
        from ..measuring.worker import format_error

        r.status, r.error = "failed", f"while scoring: {format_error(e)}"
    return r, new_ref, problems


def visible_gpus(n: int) -> list[str]:
    """The first ``n`` GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: the parent's
    own list when it was given one (a share of a host), else indices 0..n-1."""
    given = cuda_visible_devices()
    if given and len(given) < n:
        raise ConfigError(f"data-parallel prediction on {n} GPUs, but CUDA_VISIBLE_DEVICES={','.join(given)} "
                          f"names only {len(given)}")
    return given[:n] if given else [str(i) for i in range(n)]


def run_data_parallel(job: Job, n: int, timeout_s: float, bundle: RunBundle, variant: Variant) -> dict:
    """``n`` ranks of one torch.distributed group on this host (ddp.py), one GPU each
    (CUDA_VISIBLE_DEVICES) or N gloo ranks on the CPU, each with a length-balanced share of the
    plan; a barrier after warm-up, so their timed passes overlap, and a gather to rank 0, which
    writes the one outputs file and result record a single worker would (dataset order, a pass
    as long as the slowest rank's, memory peaks per GPU, energy summed). A rank that fails fails
    the variant, named: "data-parallel rank 1 of 2: crashed: killed by SIGKILL"."""
    from .bench_ddp import run_local_ranks

    gpus = visible_gpus(n) if variant.device == "cuda" else None
    return run_local_ranks(job, n, timeout_s, bundle.path("logs"), gpus)


def _determinism(cfg, task, variant, model, evalset, bundle, ref: Reference, r: BackendResult, log) -> list[str]:
    """The reference a second time, in a fresh process: identical logits and answers, or the
    differences of every backend below that noise are not the backend's fault."""
    rec = launch(make_job(cfg, task, variant, model, evalset, bundle, tag="-again"), timeout_s=cfg.bench.timeout_s,
                 log_path=bundle.path("logs", f"{variant.name}-again.log"), isolation=cfg.bench.isolation)
    if rec["status"] != "ok":
        return [f"reference {variant.name} failed on its second run: {rec.get('error')}"]
    again = mask_padding(load_outputs(rec["outputs"]), evalset.features.attention_mask, task.token_outputs)
    Path(rec["outputs"]).unlink(missing_ok=True)
    preds = task.postprocess(evalset.examples, evalset.features, again, cfg)
    det = determinism(ref.outputs, again, evalset.features.attention_mask, ref.predictions, preds)
    bundle.meta.notes.append(f"determinism of {variant.name} (two processes): max |Δ logit| "
                             f"{det['max_abs_logit_diff']:.2e}, identical answers: {det['identical_answers']}")
    log(bundle.meta.notes[-1])
    if not det["identical_answers"]:
        return [f"reference {variant.name} is not deterministic (answers changed between two runs, max |Δ logit| "
                f"{det['max_abs_logit_diff']:.2e}): fix that before judging backends"]
    return []


def _log_row(log, task: Task, r: BackendResult) -> None:
    if not r.ok:
        log(f"[{r.backend}] {r.status.upper()}: {r.error}")
        return
    scores = "  ".join(f"{k}={r.scores.get(k, float('nan')):.2f}" for k in task.metric_names)
    log(f"[{r.backend}] {r.predict_s:.3f}s (median of {r.n_passes})  {r.features_per_s:,.1f} features/s  "
        f"{scores}  parity={r.parity or '—'}")
