"""``bertqa-bench loadgen``: MLPerf LoadGen scenarios, beside ``bench``'s full-dataset throughput.

``bench`` answers MLPerf's Offline question (how long for the whole dataset?). LoadGen answers
the other two a deployment asks, with MLPerf's own load generator owning the clock:

* **SingleStream** — one query at a time, the next when the last has answered: the latency of
  one question (the 90th percentile is the result);
* **Server** — queries arriving as a Poisson process at a target rate: is the 99th-percentile
  latency within the bound (130 ms for BERT in MLPerf) — LoadGen's VALID / INVALID — and, with
  ``--find-peak-qps``, the highest target rate LoadGen calls VALID;
* **Offline** — every sample in one query: throughput, cross-checked with ``bench``'s.

The evaluation set is LoadGen's query sample library: one sample is one feature (a window of a
question and its context, as in MLPerf's BERT), so QPS here means features per second. Each
variant is the system under test in its own worker process (``loadgen_sut.py``), started by
``launcher.launch`` exactly as ``bench`` starts its workers: the same prepare and warm-up, the
same crash/hang isolation and time limit. LoadGen's accuracy run goes back through the same
postprocessor, scorer and parity check as ``bench`` (against the reference variant's own
accuracy run in the same scenario), and a row without a complete accuracy run is failed, never
reported as passing. One ``BackendResult`` per variant, with the scenario fields filled; LoadGen's
``mlperf_log_summary.txt`` and ``mlperf_log_detail.txt`` stay in ``loadgen/<variant>/`` of the
run bundle.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from ..backends.variants import VariantTable, note_once
from ..config import SCENARIOS, SuiteConfig
from ..data.evalset import load_evalset
from ..envinfo import device_name, environment
from ..errors import ConfigError
from ..measuring.jobs import batch_budget, make_job, plan_for, plan_key, plan_path
from ..measuring.launcher import launch, time_limit
from ..measuring.loadgen_log import NS_PER_MS, decode_accuracy_log
from ..measuring.worker import format_error, load_outputs
from ..record.judging import Reference, identity, judge
from ..record.results import RunBundle, RunMeta, new_run_id
from ..record.run_folder import claim, preflight
from ..record.schedule import mask_padding
from ..reporting.run_close import BenchOutcome, close_complete, close_interrupted
from ..reporting.tracking import Tracker
from ..tasks import get_task


# --- the parent side: one row per variant ---------------------------------------------------
def _job(cfg: SuiteConfig, task, variant, model, evalset, bundle, scenario: str, find_peak_qps: bool):
    b = cfg.bench
    batching, batch_size = plan_key(b, variant)
    tokens, rows = batch_budget(b, batch_size)
    job = make_job(b, cfg.artifacts_root, task, variant, model, evalset, bundle)
    accuracy_only = variant.name == b.reference and not cfg.loadgen.reference_performance
    spec = {"scenario": "Offline" if accuracy_only else scenario, "accuracy_only": accuracy_only,
            "settings": dataclasses.asdict(cfg.loadgen), "find_peak": bool(find_peak_qps), "out_dir": str(bundle.path("loadgen", variant.name)), "batch_size": batch_size,
            "seq_multiple": b.seq_multiple, "tokens_per_batch": tokens, "max_batch_rows": rows}
    return dataclasses.replace(job, kind="loadgen", loadgen=spec)


def _keep_logs(bundle, name: str, rec: dict) -> list[Path]:
    """The summary and detail logs of the accuracy run and of the reported performance run, in
    ``loadgen/<variant>/{accuracy,performance}/``; the traces and empty performance-mode
    accuracy logs go."""
    root = bundle.path("loadgen", name)
    perf = root / "performance"
    chosen = Path(rec.get("performance", {}).get("log_dir") or perf)
    if chosen != perf and chosen.exists():  # the peak search's reported run
        perf.mkdir(parents=True, exist_ok=True)
        for f in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
            if (chosen / f).exists():
                shutil.copyfile(chosen / f, perf / f)
    for f in root.rglob("mlperf_log_trace.json"):
        f.unlink()
    for f in root.rglob("mlperf_log_accuracy.json"):
        if f.parent.name != "accuracy":
            f.unlink()
    # The performance run's pair goes to MLflow (artifacts are keyed by file name: the accuracy
    # run's files of the same names stay in the bundle only).
    return [p for p in (perf / "mlperf_log_summary.txt", perf / "mlperf_log_detail.txt") if p.exists()]


ACCURACY_ONLY = "accuracy only"


def _fill_scenario(r, rec: dict, scenario: str) -> None:
    perf = rec.get("performance") or {}
    r.scenario = scenario
    r.loadgen_result = ACCURACY_ONLY if rec.get("accuracy_only") else perf.get("validity") or "?"
    r.loadgen_invalid_reason = (perf.get("why", "") if r.loadgen_result != ACCURACY_ONLY else
                                "loadgen.reference_performance is false: the reference's answers come from LoadGen's "
                                "accuracy run as one Offline query; no performance run, so no QPS")
    r.target_qps = perf.get("target_qps")
    r.achieved_qps = perf.get("achieved_qps")
    r.sample_latency_p50_ms = perf.get("p50_ms")
    r.sample_latency_p90_ms = perf.get("p90_ms")
    r.sample_latency_p99_ms = perf.get("p99_ms")
    r.sample_latency_p999_ms = perf.get("p999_ms")
    r.sample_latency_mean_ms = perf.get("mean_ms")
    r.target_latency_ms = perf.get("target_latency_ms") if scenario == "Server" else None
    r.loadgen_min_duration_ms = perf.get("min_duration_ms")
    r.loadgen_min_query_count = perf.get("min_query_count")
    r.loadgen_query_count = perf.get("query_count")
    runs = rec.get("peak_runs")
    if runs:
        r.peak_search = ", ".join(f"{x['target_qps']:.4g}:{'V' if x['validity'] == 'VALID' else 'I'}" for x in runs)
    sut = rec.get("sut") or {}
    scenario = "Offline" if r.loadgen_result == ACCURACY_ONLY else scenario  # the SUT's own: its facts' keys
    if sut:
        ladder = sut.get("ladder") or {}
        caps = "; ".join(f"{s} tokens: {sizes[-1]}" for s, sizes in sorted(ladder.items(), key=lambda x: int(x[0]))
                         if sizes and sizes[-1] < sut["max_batch"])
        r.sut_batcher = (f"{sut['grouping']}, max batch {sut['max_batch']}"
                         + (f" (token budget: {caps})" if caps else "")
                         + f", max wait {sut['max_wait_us']} µs"
                         + (f", {sut['in_flight']} batches in flight" if (sut.get("in_flight") or 1) > 1 else "")
                         + f", mean batch {sut['mean_batch_rows']:.1f}"
                         + (f", real tokens {sut['token_efficiency']:.0%} of those computed (bench plan "
                            f"{sut['bench_token_efficiency']:.0%})" if "token_efficiency" in sut else "")
                         if scenario == "Server" else
                         (f"batch of one at its own length, in {sut['shapes']} length buckets" if sut["length_aware"]
                          else "batch of one, padded to max_seq_len") if scenario == "SingleStream" else
                         "the bench plan over LoadGen's query")
        if scenario != "SingleStream" and sut.get("predict_features_per_s"):
            r.sut_batcher += f"; predict itself {sut['predict_features_per_s']:,.0f} features/s"
    bench = rec.get("bench")
    if bench:
        r.bench_features_per_s = bench["features_per_s"]
        if r.achieved_qps:
            r.qps_vs_bench_pct = r.achieved_qps / bench["features_per_s"] * 100.0
    r.prepare_s = rec.get("prepare_s")
    r.prepare_info = dict(rec.get("prepare_info") or {})
    for k, v in (rec.get("measures") or {}).items():
        if hasattr(r, k):
            setattr(r, k, v)


def headline(r) -> Optional[float]:
    """The scenario's result, higher is better: 1/p90 for SingleStream, achieved QPS otherwise."""
    if r.scenario == "SingleStream":
        return 1.0 / r.sample_latency_p90_ms if r.sample_latency_p90_ms else None
    return r.achieved_qps


def run_loadgen(cfg: SuiteConfig, scenario: str, *, backends: Optional[list[str]] = None,
                find_peak_qps: bool = False, run_id: Optional[str] = None, tracker=None, progress: bool = True,
                command: str = "", log: Callable[[str], None] = print, overwrite: bool = False):
    """Every variant (reference first) as LoadGen's SUT in ``scenario``; one BackendResult each."""
    from .provision import ensure_model

    if scenario not in SCENARIOS:
        raise ConfigError(f"scenario '{scenario}' is not one of {', '.join(SCENARIOS)}")
    if find_peak_qps and scenario != "Server":
        raise ConfigError("--find-peak-qps searches a Server target; it does not apply to " + scenario)
    try:
        import mlperf_loadgen  # noqa: F401
    except ImportError:
        raise ConfigError("LoadGen is not installed: pip install mlcommons-loadgen (module mlperf_loadgen)") from None
    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    names = table.canonical_names([cfg.bench.reference] + list(backends or cfg.bench.backends), note_once)
    reference = cfg.bench.reference = names[0]
    variants = table.require(names)

    preflight(cfg.folders, run_id, overwrite)  # a taken --run-id, an unwritable or full disk: refused before any work
    tracker = tracker or Tracker(cfg.results_root, enabled=False)
    task = get_task(cfg.task.name)
    model = ensure_model(cfg, log, tracker)
    evalset = load_evalset(cfg.evalset_spec(), task, str(model.dir), log=log)
    plans = {k: plan_for(cfg.bench, evalset, k, cfg.data.target_eval_features)
             for k in dict.fromkeys(plan_key(cfg.bench, v) for v in variants)}
    plan = plans[plan_key(cfg.bench, variants[0])]
    lg = cfg.loadgen
    env = environment()
    tracker.active  # opens (or creates) the MLflow store now: one that cannot be opened fails the run here
    run_id = claim(cfg.results_root, run_id, lambda: new_run_id(f"{cfg.name}-{scenario.lower()}"), overwrite)
    meta = RunMeta(suite=cfg.name, run_id=run_id, task=task.name,
                   metric_names=list(task.metric_names), primary_metric=task.primary_metric, reference=reference,
                   metric_labels=dict(task.metric_labels), command=command,
                   date=time.strftime("%Y-%m-%d", time.gmtime()), model=cfg.model.name, model_note=model.note,
                   model_params=model.params, model_dev_metric=model.dev_primary, timing_only=model.timing_only,
                   batching=plan.batching, batch_size=cfg.bench.batch_size, max_seq_len=evalset.features.seq_len,
                   n_features=evalset.n_features, n_questions=evalset.n_questions,
                   device_name=device_name(variants[0].device))
    meta.notes.append(
        f"MLPerf LoadGen {scenario}" + (" with the peak search (highest VALID target QPS)" if find_peak_qps else "")
        + f": the query sample library is the evaluation set, one sample = one feature (as in MLPerf's BERT), "
          f"{evalset.n_features} samples; QPS counts features. min duration {lg.min_duration_ms} ms, "
          f"min queries {lg.min_query_count}"
        + (f"; bound {lg.server_target_latency_ns / NS_PER_MS:g} ms at p{lg.server_target_latency_percentile * 100:g}"
           if scenario == "Server" else ""))
    bundle = RunBundle.create(cfg.results_root, meta, cfg.to_dict(), env)
    for k, p in plans.items():
        p.save(plan_path(bundle, k))
    env_tags = {f"env.{k}": v for k, v in env.items()}
    tracker.start_bench(meta, tags=env_tags | {"results_dir": str(bundle.dir), "scenario": scenario})
    log(f"loadgen {scenario}: {evalset.n_features} samples (features) of {evalset.n_questions} questions")

    meta.status, meta.variants = "running", list(names)
    bundle.write_meta()
    try:
        return _rows_of(cfg, scenario, find_peak_qps, variants, task, model, evalset, plans, bundle, meta, tracker,
                        env_tags, progress, log)
    except KeyboardInterrupt as e:  # interrupt.Interrupted (SIGTERM, SIGINT, SIGHUP): finished rows stay
        stop, _ = close_interrupted(bundle, reference, model.timing_only, list(meta.problems), tracker, e)
        log(f"interrupted by {stop.signal_name}: {len(bundle.results)} of {len(names)} variants finished; "
            f"results in {bundle.dir}")
        raise stop from None


def _rows_of(cfg, scenario, find_peak_qps, variants, task, model, evalset, plans, bundle, meta, tracker, env_tags,
             progress, log):
    """The variants one after the other (reference first), each row written as it finishes."""
    reference = cfg.bench.reference
    ref: Optional[Reference] = None
    ref_row = None
    problems: list[str] = []
    features = evalset.features
    lengths = evalset.lengths()
    for variant in variants:
        key = plan_key(cfg.bench, variant)
        r = identity(task, variant, model, evalset, plans[key], batch_size=key[1], model_name=cfg.model.name)
        r.scenario = scenario
        why = (variant.backend_class.batching_reason(variant.options, r.batching)
               or variant.backend_class.family_reason(variant.options, model.family))  # as bench does
        if why:
            r.status, r.error = "not run", why
            _log_row(log, task, r)
            bundle.add(r)
            tracker.log_backend(meta, r, env_tags | {"scenario": scenario})
            continue
        job = _job(cfg, task, variant, model, evalset, bundle, scenario, find_peak_qps)
        log(f"[{variant.name}] prepare, warm-up, then LoadGen's accuracy run alone, one Offline query "
            "(loadgen.reference_performance: false) ..." if job.loadgen["accuracy_only"]
            else f"[{variant.name}] prepare, warm-up, bench passes, then LoadGen {scenario} (accuracy, performance) ...")

        rec = launch(job, timeout_s=time_limit(variant, cfg.bench.timeout_s),
                     log_path=bundle.path("logs", f"{variant.name}.log"), echo=progress, isolation=cfg.bench.isolation)
        r.status, r.error = rec["status"], rec.get("error", "")
        kept: list[Path] = []
        pred_path = None
        if r.ok:
            try:
                kept = _keep_logs(bundle, variant.name, rec)
                _fill_scenario(r, rec, scenario)
                acc_log = Path(rec["accuracy_log"])
                lg_out, seen = decode_accuracy_log(acc_log, rec["layout"], lengths, features.seq_len)
                missing = int((seen == 0).sum())
                r.accuracy_samples = int((seen > 0).sum())
                if missing:
                    raise RuntimeError(f"LoadGen's accuracy log answers {r.accuracy_samples} of {len(seen)} features: "
                                       "without every answer the row cannot be scored")
                outputs = mask_padding(lg_out, features.attention_mask, task.token_outputs)
                t0 = time.perf_counter()
                options = cfg.task.options
                predictions = task.postprocess(evalset.examples, features, outputs, options)
                r.postprocess_s = time.perf_counter() - t0
                r.scores = {k: float(v) for k, v in task.score(evalset.examples, predictions, options).items()}
                per_question = task.question_scores(evalset.examples, predictions, options)
                r.accuracy_run = f"ok: {r.accuracy_samples} samples"
                pred_path = bundle.write_predictions(variant.name, predictions)
                if rec.get("bench"):  # the same process's bench outputs: LoadGen's path changes no answer
                    bench_out = mask_padding(load_outputs(job.outputs), features.attention_mask, task.token_outputs)
                    k, n = task.agreement(task.postprocess(evalset.examples, features, bench_out, options), predictions)
                    r.bench_answer_agreement = k / n if n else 1.0
                if variant.name == reference:
                    ref, ref_row = Reference(outputs, predictions, r.scores, [], per_question), r
                if ref is not None:  # exactly bench's comparison, paired bootstrap included
                    judge(cfg.parity, task, variant, ref, r, predictions, per_question, outputs,
                          features.attention_mask, judged=not model.timing_only)
                    a, b = headline(r), headline(ref_row) if ref_row else None
                    r.speedup = a / b if a and b else None
                if r.loadgen_result not in ("VALID", ACCURACY_ONLY):
                    problems.append(f"{variant.name}: LoadGen {scenario} {r.loadgen_result}: {r.loadgen_invalid_reason}")
                    meta.problems = list(problems)
                if variant.name != reference:
                    acc_log.unlink(missing_ok=True)  # large; the reference's stays, as bench keeps its logits
                if not cfg.bench.keep_outputs:
                    Path(job.outputs).unlink(missing_ok=True)
            except Exception as e:  # noqa: BLE001 - one row's scoring must not lose the others
                r.status, r.error = "failed", f"while scoring the LoadGen run: {format_error(e)}"
        _log_row(log, task, r)
        bundle.add(r)
        tracker.log_backend(meta, r, env_tags | {"scenario": scenario, "loadgen_result": r.loadgen_result},
                            [pred_path, *kept] if pred_path else kept, bundle.path("logs", f"{variant.name}.log"))

    v, summary = close_complete(bundle, reference, model.timing_only, problems, tracker)
    return BenchOutcome(bundle, summary, v, evalset, ref, problems)


def _log_row(log, task, r) -> None:
    if not r.ok:
        log(f"[{r.backend}] {r.status.upper()}: {r.error}")
        return
    scores = "  ".join(f"{k}={r.scores.get(k, float('nan')):.2f}" for k in task.metric_names)
    lat = "  ".join(f"{k}={getattr(r, f'sample_latency_{k}_ms'):.2f}ms" for k in ("p50", "p90", "p99")
                    if getattr(r, f"sample_latency_{k}_ms") is not None)
    log(f"[{r.backend}] {r.scenario} {r.loadgen_result}  {lat}"
        + (f"  {r.achieved_qps:,.1f} samples/s" if r.achieved_qps is not None else "")
        + (f" (target {r.target_qps:,.1f})" if r.target_qps else "")
        + (f"  bench {r.bench_features_per_s:,.1f} features/s" if r.bench_features_per_s else "")
        + f"  {scores}  parity={r.parity or '—'}" + (f"  [{r.loadgen_invalid_reason}]" if r.loadgen_invalid_reason else ""))
