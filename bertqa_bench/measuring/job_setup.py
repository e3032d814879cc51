"""What a job's worker loads before it prepares a backend, the same for a bench job
(worker.execute) and a LoadGen job (loadgen_sut): its variant, whether it can run here, the
CPU threads, the evaluation set's inputs and the batch plan."""
from __future__ import annotations

from pathlib import Path

from ..backends.variants import Variant
from ..data.evalset import load_inputs
from ..record.schedule import Plan
from .machine_state import usable_cores


def load_job(job, plan=None, inputs=None, *, mmap: bool = True, threads: int = 0):
    """What every kind of job (a ``worker.Job``) starts with, bench or LoadGen: (variant, why,
    inputs, plan). ``why``
    is the reason the variant cannot run here (then nothing is loaded); the CPU thread count is
    the job's, else ``threads`` when given; ``plan`` and ``inputs`` are loaded unless passed in."""
    variant = Variant.from_dict(job.variant)
    why = variant.unavailable_reason()
    if why:
        return variant, why, None, None
    if variant.device == "cpu":
        import torch

        # One thread plan for every CPU backend (ONNX Runtime and OpenVINO take torch's count):
        # the suite's bench.num_threads, else ``threads`` (1 per data-parallel rank), else the
        # cores this process may use, never more: threads that outnumber their cores spin at
        # OpenMP barriers while a preempted sibling finishes.
        torch.set_num_threads(int(job.num_threads or threads or usable_cores()))
    inputs = inputs if inputs is not None else load_inputs(Path(job.evalset), mmap=mmap)
    plan = plan if plan is not None else Plan.load(Path(job.plan))
    return variant, None, inputs, plan
