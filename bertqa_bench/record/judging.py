"""A row's identity, timing and judgement against the reference, filled into its BackendResult:
what bench and loadgen both do with a worker's record."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..config import ParityConfig
from ..envinfo import device_name
from ..tasks import Task
from .parity import compare, tolerance_for
from .results import BackendResult
from .rounds import PairedSpeedup
from .schedule import Plan


@dataclass
class Reference:
    outputs: dict
    predictions: object
    scores: dict
    pass_s: list
    question_scores: Optional[np.ndarray] = None  # per-question contributions (parity's bootstrap)


def identity(task: Task, variant, model, evalset, plan: Plan, *, batch_size: int, model_name: str) -> BackendResult:
    """A row's identity: the variant, its plan (of ``batch_size``) and the model
    (commands/provision.ModelInfo, the suite's ``model_name``)."""
    return BackendResult(
        backend=variant.name, implementation=variant.implementation, precision=variant.precision,
        parity_class=variant.parity_class, device=variant.device, device_name=device_name(variant.device),
        batching=plan.batching, batch_size=batch_size, max_seq_len=evalset.features.seq_len,
        n_shapes=len(plan.shapes), n_devices=variant.devices or 1, n_features=plan.n_rows,
        n_questions=evalset.n_questions, model=model_name, model_params=model.params,
        model_dev_f1=model.dev_primary, model_checkpoint=model.checkpoint, model_digest=model.digest,
        model_family=model.family, task=task.name)


def fill_timing(r: BackendResult, rec: dict, tiling: float, n_questions: int) -> None:
    """A worker's timing summary and measures into the row."""
    t, m = rec["timing"], rec.get("measures", {})
    for k, v in {**t, **m}.items():
        if hasattr(r, k) and k not in ("scores", "deltas", "prepare_info"):
            setattr(r, k, v)
    r.prepare_s = rec["prepare_s"]
    r.prepare_info = dict(rec.get("prepare_info") or {})
    r.questions_per_s = n_questions * tiling / r.predict_s


def apply_speedup(r: BackendResult, sp: Optional[PairedSpeedup], mode: str, note: str = "") -> None:
    """A paired (rounds) or block speedup into the row; the time change is the speedup's inverse."""
    r.timing_mode, r.timing_mode_note = mode, note
    if sp is None:
        return
    r.speedup, r.speedup_low, r.speedup_high = sp.speedup, sp.low, sp.high
    r.speedup_halfwidth_pct, r.rounds = sp.halfwidth_pct, sp.rounds if mode == "rounds" else None
    r.speedup_within_noise = sp.straddles_one
    r.pct_change_vs_ref = (1.0 / sp.speedup - 1.0) * 100.0


def judge(parity: ParityConfig, task: Task, variant, ref: Reference, r: BackendResult, predictions,
          per_question, outputs: dict, attention_mask: np.ndarray, *, judged: bool) -> None:
    """One row's parity against the reference, into the row: the comparison bench and loadgen
    both make (paired bootstrap over questions when the task decomposes its metric). ``judged``
    False (random weights: near-tied spans everywhere) keeps the numbers but gives no verdict."""
    paired = (ref.question_scores, per_question) if (
        ref.question_scores is not None and per_question is not None) else None
    p = compare(parity_class=variant.parity_class,
                tolerance=tolerance_for(parity, variant.name, variant.parity_class),
                primary_metric=task.primary_metric, ref_scores=ref.scores, scores=r.scores,
                agreement=task.agreement(predictions, ref.predictions), ref_outputs=ref.outputs,
                outputs=outputs, attention_mask=attention_mask, question_scores=paired,
                metrics_from_sums=task.metrics_from_sums if paired else None)
    r.apply_parity(p, judged=judged)
