"""``bench-all``: train if needed, then benchmark every backend of a suite and report."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import backends as registry
from .config import SuiteConfig
from .data.types import Features
from .envinfo import device_name, environment
from .errors import BackendUnavailableError
from .modeling import build_model, load_tokenizer
from .parity import compare, tolerance_for
from .report import write_report
from .results import ResultBundle, new_run_id
from .runner import format_error, free_memory, run_backend
from .tasks import get_task
from .tracking import Tracker
from .train import METRICS_FILE, model_is_trained, train


@dataclass
class BenchOutcome:
    run_dir: Path
    rows: list
    summary: str
    verdict: str
    outputs: dict = field(default_factory=dict)  # backend -> outputs (kept only when asked)
    examples: list = field(default_factory=list)  # the scored questions and their features, for re-use
    features: Optional[Features] = None


def tile_features(features: Features, target: int) -> Features:
    """Repeat features up to ``target`` rows so timing covers a dataset of that size (e.g. SQuAD
    dev's 10,784). Only the first copy is scored; the rest are timed as real work."""
    n = len(features)
    if target <= n:
        return features
    idx = np.resize(np.arange(n), target)
    return Features(features.input_ids[idx], features.attention_mask[idx], features.token_type_ids[idx],
                    features.example_index[idx], [features.offsets[i] for i in idx] if features.offsets else [],
                    extra=features.extra)


def ensure_model(cfg: SuiteConfig, log: Callable[[str], None], tracker: Optional[Tracker]) -> dict:
    """Train the suite's model if models/ lacks it; random-weight timing models are just built."""
    model_dir = cfg.model_dir
    if model_is_trained(model_dir):
        log(f"model: reusing {model_dir}")
    elif cfg.model.timing_only:
        log(f"model: building {cfg.model.name} with random weights (timing only, not trained)")
        model = build_model(cfg.model.task, cfg.model.base, random_init=True,
                            config_overrides=cfg.model.config_overrides, seed=cfg.train.seed)
        tmp = model_dir.with_name(model_dir.name + ".tmp")
        model.save_pretrained(tmp)
        load_tokenizer(cfg.model.base).save_pretrained(tmp)
        (tmp / METRICS_FILE).write_text(json.dumps({"random_init": True, "note": "timing only"}))
        tmp.rename(model_dir)
    else:
        log(f"model: {model_dir} not found, fine-tuning {cfg.model.base} (suite {cfg.name})")
        train(cfg, log=log, tracker=tracker)
    return json.loads((model_dir / METRICS_FILE).read_text())


def run_bench(cfg: SuiteConfig, *, backends: Optional[list[str]] = None, run_id: Optional[str] = None,
              tracker: Optional[Tracker] = None, progress: bool = True, command: str = "",
              log: Callable[[str], None] = print, keep_outputs: bool = False) -> BenchOutcome:
    reference = cfg.bench.reference
    # The reference always runs, and first: speedup and parity are measured against it.
    names = [reference] + [n for n in (backends or cfg.bench.backends) if n != reference]
    registry.validate_names(names)  # fail before any work on a typo

    tracker = tracker or Tracker(cfg.results_root, enabled=False)
    task = get_task(cfg.model.task)
    train_metrics = ensure_model(cfg, log, tracker)
    model_dir = cfg.model_dir

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(str(model_dir))
    examples = task.load_examples(cfg, "dev")
    features = task.featurize(examples, tokenizer, cfg)
    tokenize_s = time.perf_counter() - t0
    timed = tile_features(features, cfg.data.target_eval_features or 0)
    n_scored = len(features)
    log(f"data: {len(examples)} questions -> {len(features)} features (seq {features.seq_len}), "
        f"timed over {len(timed)} features; tokenized in {tokenize_s:.1f}s")

    run_id = run_id or new_run_id(cfg.name)
    bundle = ResultBundle(cfg.results_root, run_id)
    env = environment()
    bundle.write_json("env.json", env)
    bundle.write_json("config.json", cfg.to_dict())
    model_note = ("random weights: timing only, accuracy columns not meaningful" if cfg.model.timing_only
                  else "fine-tuned by bertqa-bench train; dev " + ", ".join(
                      f"{k[4:]}={v:.2f}" for k, v in train_metrics.items() if k.startswith("dev_") and k != "dev_questions"))
    meta = {"suite": cfg.name, "run_id": run_id, "model": cfg.model.name, "model_note": model_note,
            "reference": reference, "command": command}
    env_tags = {f"env.{k}": v for k, v in env.items()}
    tracker.start_bench(cfg.name, run_id, params={"suite": cfg.name, "model": cfg.model.name, "task": task.name,
                                                  "batch_size": cfg.bench.batch_size, "max_seq_len": features.seq_len,
                                                  "padding": cfg.bench.padding, "backends": ",".join(names),
                                                  "n_features": len(timed), "n_questions": len(examples)},
                        tags=env_tags | {"run_id": run_id, "results_dir": str(bundle.dir)})

    ref = None
    kept = {}
    for name in names:
        spec = registry.get_spec(name)
        backend_cls = spec.cls
        row = {"backend": name, "status": "ok", "precision": backend_cls.precision,
               "parity_class": backend_cls.parity_class, "device": spec.device,
               "device_name": device_name(spec.device), "batch_size": cfg.bench.batch_size,
               "max_seq_len": features.seq_len, "padding": cfg.bench.padding, "n_features": len(timed),
               "n_questions": len(examples), "tokenize_s": tokenize_s, "model": cfg.model.name, "task": task.name}
        pred_path = None
        params = {}
        try:
            if cfg.bench.device == "cpu" and spec.device == "cuda":
                raise BackendUnavailableError("bench.device=cpu selected; this backend runs on CUDA")
            log(f"[{name}] prepare ...")
            run = run_backend(name, model_dir, timed, task.output_names, cfg, progress=progress)
            outputs = {k: v[:n_scored] for k, v in run.outputs.items()}
            t1 = time.perf_counter()
            predictions = task.postprocess(examples, features, outputs, cfg)
            row["postprocess_s"] = time.perf_counter() - t1
            scores = task.score(examples, predictions)
            params = {f"prepare.{k}": v for k, v in run.backend.prepare_info.items()}
            row.update({"prepare_s": run.prepare_s, **run.timing.summary(),
                        "questions_per_s": len(examples) * (len(timed) / n_scored) / run.timing.predict_s,
                        **{k: float(v) for k, v in scores.items()}})
            row["prepare_info"] = json.dumps(run.backend.prepare_info, default=str)
            if name == reference:
                ref = {"outputs": outputs, "predictions": predictions, "scores": scores, "predict_s": run.timing.predict_s}
            if ref is not None:
                tol = tolerance_for(cfg.parity, name, backend_cls.parity_class)
                p = compare(backend=name, parity_class=backend_cls.parity_class, tolerance=tol,
                            primary_metric=task.primary_metric, ref_scores=ref["scores"], scores=scores,
                            answer_agreement=task.agreement(predictions, ref["predictions"]),
                            ref_outputs=ref["outputs"], outputs=outputs, attention_mask=features.attention_mask)
                pr = p.as_row()
                for k in ("backend", "parity_class"):
                    pr.pop(k)
                if cfg.model.timing_only:
                    # Random weights give near-tied spans everywhere: logit differences are still
                    # informative, answer-level pass/fail is not. Parity is judged on trained models.
                    pr["parity"], pr["parity_failures"] = "n/a", "random weights (timing only)"
                row.update(pr)
                row["speedup"] = ref["predict_s"] / run.timing.predict_s
                row["pct_change_vs_ref"] = (run.timing.predict_s / ref["predict_s"] - 1.0) * 100.0
            pred_path = bundle.write_predictions(name, predictions)
            if keep_outputs:
                kept[name] = outputs
            log(f"[{name}] {row['predict_s']:.3f}s  {row['features_per_s']:.1f} features/s  "
                + "  ".join(f"{k}={row[k]:.2f}" for k in task.metric_names) + f"  parity={row.get('parity', '—')}")
        except BackendUnavailableError as e:
            row.update({"status": "not run", "error": str(e)})
            log(f"[{name}] not run: {e}")
        except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others
            row.update({"status": "failed", "error": format_error(e)})
            log(f"[{name}] FAILED: {row['error']}")
        bundle.add_row(row)
        tracker.log_backend(row, params, {"run_id": run_id} | env_tags, [pred_path] if pred_path else [])
        free_memory()

    verdict = overall_verdict(bundle.rows, reference)
    meta["verdict"] = verdict
    summary = write_report(bundle.dir, meta)
    ok_rows = [r for r in bundle.rows if r["status"] == "ok"]
    best = max(ok_rows, key=lambda r: r.get("speedup", 0), default=None)
    tracker.finish_bench({"n_backends_ok": len(ok_rows), "best_speedup": best.get("speedup", 0) if best else 0},
                         {"parity_verdict": verdict, "best_backend": best["backend"] if best else ""},
                         [bundle.dir / "summary.md", bundle.csv_path, bundle.dir / "comparison.png"],
                         ok=verdict != "FAIL")
    return BenchOutcome(bundle.dir, bundle.rows, summary, verdict, kept, examples, features)


def overall_verdict(rows: list[dict], reference: str) -> str:
    ref = next((r for r in rows if r["backend"] == reference), None)
    if ref is None or ref.get("status") != "ok":
        return "NO REFERENCE"
    if all(r.get("parity") in ("n/a", None) for r in rows if r.get("status") == "ok"):
        return "n/a (timing only: parity is checked on a trained model)"
    if any(r.get("parity") == "FAIL" for r in rows):
        return "FAIL"
    if any(r.get("status") == "failed" for r in rows):
        return "PASS (with failed backends)"
    return "PASS"
