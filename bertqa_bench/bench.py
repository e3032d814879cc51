"""``bench``: every variant of a suite, each in its own process, judged against the reference.

The flow (DESIGN.md): load the suite; make sure the model exists (train it if not); load the
evaluation set (built once, cached); make the batch plan; then for each variant, reference
first: launch its worker (prepare, warm-up, timed passes, outputs to the run folder), and in
this process postprocess its outputs into answers, score them and compare them with the
reference's — one BackendResult, written to results.csv and MLflow before the next variant
starts. A variant that crashes, hangs or cannot run here is recorded as such; the rest run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .backends.variants import Variant, VariantTable
from .config import SuiteConfig
from .envinfo import device_name, environment
from .evalset import EvalSet, load_evalset
from .launcher import launch
from .parity import Verdict, compare, determinism, tolerance_for, verdict
from .report import write_report
from .results import BackendResult, RunBundle, RunMeta, new_run_id
from .schedule import Plan, make_plan
from .tasks import Task, get_task
from .tracking import Tracker
from .train import ModelInfo, ensure_model
from .worker import Job, load_outputs


@dataclass
class Reference:
    outputs: dict
    predictions: object
    scores: dict
    pass_s: list


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


def plan_for(cfg: SuiteConfig, evalset: EvalSet) -> Plan:
    b = cfg.bench
    return make_plan(evalset.lengths(), batching=b.batching, batch_size=b.batch_size,
                     max_seq_len=evalset.features.seq_len, seq_multiple=b.seq_multiple,
                     tokens_per_batch=b.tokens_per_batch, max_batch_rows=b.max_batch_rows,
                     target_rows=cfg.data.target_eval_features)


def make_job(cfg: SuiteConfig, task: Task, variant: Variant, model: ModelInfo, evalset: EvalSet, bundle: RunBundle,
             tag: str = "", progress: bool = False) -> Job:
    name = variant.name + tag
    b = cfg.bench
    return Job(variant=variant.to_dict(), model_dir=str(model.dir), task=task.name,
               artifacts_dir=str(cfg.artifacts_root / variant.name), evalset=str(evalset.path),
               plan=str(bundle.path("plan.npz")), outputs=str(bundle.path("outputs", f"{name}.npz")),
               result=str(bundle.path("workers", f"{name}.json")), output_names=list(task.output_names),
               token_outputs=list(task.token_outputs), max_seq_len=evalset.features.seq_len,
               warmup_batches=b.warmup_batches, min_passes=b.min_passes, min_duration_s=b.min_duration_s,
               num_threads=b.num_threads, progress=progress)


def identity(cfg: SuiteConfig, task: Task, variant: Variant, model: ModelInfo, evalset: EvalSet,
             plan: Plan) -> BackendResult:
    return BackendResult(
        backend=variant.name, implementation=variant.implementation, precision=variant.precision,
        parity_class=variant.parity_class, device=variant.device, device_name=device_name(variant.device),
        batching=plan.batching, batch_size=cfg.bench.batch_size, max_seq_len=evalset.features.seq_len,
        n_shapes=len(plan.shapes), n_features=plan.n_rows, n_questions=evalset.n_questions, model=cfg.model.name,
        model_params=model.params, model_dev_f1=model.dev_primary, task=task.name)


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


def run_bench(cfg: SuiteConfig, *, backends: Optional[list[str]] = None, run_id: Optional[str] = None,
              tracker: Optional[Tracker] = None, progress: bool = True, command: str = "",
              log: Callable[[str], None] = print, check_determinism: bool = False) -> BenchOutcome:
    reference = cfg.bench.reference
    table = VariantTable.for_suite(cfg)
    names = [reference] + [n for n in (backends or cfg.bench.backends) if n != reference]
    variants = table.require(names)  # an unknown name fails here, before any work
    tracker = tracker or Tracker(cfg.results_root, enabled=False)
    task = get_task(cfg.task.name)
    model = ensure_model(cfg, log, tracker)
    evalset = load_evalset(cfg, task, str(model.dir), log=log)
    plan = plan_for(cfg, evalset)
    tiling = plan.n_rows / plan.n_features
    log(f"data: {evalset.n_questions} questions -> {evalset.n_features} features (seq {evalset.features.seq_len}); "
        f"{plan.batching} batching: {len(plan.batches)} batches, {len(plan.shapes)} shape(s), "
        f"{plan.n_rows} rows per pass; evaluation set {'from cache' if evalset.cache_hit else 'built'}")

    env = environment()
    meta = RunMeta(suite=cfg.name, run_id=run_id or new_run_id(cfg.name), task=task.name,
                   metric_names=list(task.metric_names), primary_metric=task.primary_metric, reference=reference,
                   metric_labels=dict(task.metric_labels),
                   command=command, date=time.strftime("%Y-%m-%d", time.gmtime()), model=cfg.model.name,
                   model_note=model.note, model_params=model.params, model_dev_metric=model.dev_primary,
                   timing_only=model.timing_only, batching=plan.batching, batch_size=cfg.bench.batch_size,
                   max_seq_len=evalset.features.seq_len, n_features=plan.n_rows, n_questions=evalset.n_questions,
                   device_name=device_name(variants[0].device))
    bundle = RunBundle.create(cfg.results_root, meta, cfg.to_dict(), env)
    plan.save(bundle.path("plan.npz"))
    env_tags = {f"env.{k}": v for k, v in env.items()}
    tracker.start_bench(meta, tags=env_tags | {"results_dir": str(bundle.dir)})

    ref: Optional[Reference] = None
    problems: list[str] = []
    features = evalset.features
    for variant in variants:
        r = identity(cfg, task, variant, model, evalset, plan)
        log(f"[{variant.name}] prepare, warm-up and {cfg.bench.min_passes}+ timed passes ...")
        rec = launch(make_job(cfg, task, variant, model, evalset, bundle, progress=progress),
                     timeout_s=variant.timeout_s or cfg.bench.timeout_s,
                     log_path=bundle.path("logs", f"{variant.name}.log"),
                     echo=progress, isolation=cfg.bench.isolation)
        r.status = rec["status"]
        r.error = rec.get("error", "")
        pred_path = None
        if r.ok:
            try:
                outputs = load_outputs(rec["outputs"])
                _fill_timing(r, rec, tiling, evalset.n_questions)
                t0 = time.perf_counter()
                predictions = task.postprocess(evalset.examples, features, outputs, cfg)
                r.postprocess_s = (time.perf_counter() - t0) * tiling
                r.tokenize_s = evalset.build_s * tiling
                r.end_to_end_s = r.tokenize_s + r.predict_s + r.postprocess_s
                r.scores = {k: float(v) for k, v in task.score(evalset.examples, predictions, cfg).items()}
                pred_path = bundle.write_predictions(variant.name, predictions)
                if variant.name == reference:
                    ref = Reference(outputs, predictions, r.scores, rec["pass_s"])
                    if check_determinism:
                        problems += _determinism(cfg, task, variant, model, evalset, bundle, ref, r, log)
                if ref is not None:
                    _speedup(r, ref.pass_s, rec["pass_s"])
                    p = compare(parity_class=variant.parity_class,
                                tolerance=tolerance_for(cfg.parity, variant.name, variant.parity_class),
                                primary_metric=task.primary_metric, ref_scores=ref.scores, scores=r.scores,
                                agreement=task.agreement(predictions, ref.predictions), ref_outputs=ref.outputs,
                                outputs=outputs, attention_mask=features.attention_mask)
                    # Random weights give near-tied spans everywhere: logit differences are still
                    # informative, answer-level pass/fail is not. Parity is judged on trained models.
                    r.apply_parity(p, judged=not model.timing_only)
                if variant.name != reference and not cfg.bench.keep_outputs:
                    Path(rec["outputs"]).unlink(missing_ok=True)
            except Exception as e:  # noqa: BLE001 - scoring one backend must not lose the others
                from .worker import format_error

                r.status, r.error = "failed", f"while scoring: {format_error(e)}"
        _log_row(log, task, r)
        bundle.add(r)
        tracker.log_backend(meta, r, env_tags, [pred_path] if pred_path else [],
                            bundle.path("logs", f"{variant.name}.log"))

    v = verdict(bundle.results, reference, timing_only=model.timing_only, problems=problems)
    meta.verdict, meta.verdict_reasons = v.status, v.reasons
    bundle.write_meta()
    summary = write_report(bundle)
    tracker.finish_bench(bundle, v)
    return BenchOutcome(bundle, summary, v, evalset, ref, problems)


def _determinism(cfg, task, variant, model, evalset, bundle, ref: Reference, r: BackendResult, log) -> list[str]:
    """The reference a second time, in a fresh process: identical logits and answers, or the
    differences of every backend below that noise are not the backend's fault."""
    rec = launch(make_job(cfg, task, variant, model, evalset, bundle, tag="-again"), timeout_s=cfg.bench.timeout_s,
                 log_path=bundle.path("logs", f"{variant.name}-again.log"), isolation=cfg.bench.isolation)
    if rec["status"] != "ok":
        return [f"reference {variant.name} failed on its second run: {rec.get('error')}"]
    again = load_outputs(rec["outputs"])
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
