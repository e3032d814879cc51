"""How a bench or LoadGen run ends, and what it returns: the verdict into run.json, the report,
the MLflow parent closed (finished, interrupted or failed). Shared by every command that runs rows."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..data.evalset import EvalSet
from ..errors import format_error
from ..measuring.interrupt import as_interrupted
from ..record.judging import Reference
from ..record.parity import Verdict, verdict
from ..record.results import BackendResult, RunBundle
from .report import write_report
from .tracking import Tracker


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
    bundle.meta.status = "failed"
    bundle.meta.notes = list(bundle.meta.notes) + [f"failed: {format_error(e)}"]
    try:
        bundle.write_meta()
    except OSError:
        pass
    tracker.fail_bench(e)
