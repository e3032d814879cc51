"""One backend's lifecycle, in whatever process runs it: prepare, warm up, timed passes.

* prepare (export / optimize / compile / build / capture) is timed on its own;
* warm-up runs a real batch of every shape of the plan, then more batches up to
  ``warmup_batches`` — untimed, never on zeros;
* the timed prediction is whole passes over the plan, repeated until both ``min_passes`` and
  ``min_duration_s`` are reached. A pass's time runs from the first batch handed to the
  backend until the last logits are in the dataset-order arrays on the host (a host clock
  around it is honest: the last batch's outputs are on the host when it stops); its batches'
  latencies are recorded too. The median pass is the prediction time; min/max/stdev show the
  spread.
* a backend that keeps batches in flight (``Backend.in_flight() > 1``, e.g. a torch variant with
  ``pipeline: true``) is handed batch i+1 before batch i is collected (``stream``): the host's
  work for one batch overlaps the device's compute of the other. A batch's latency then runs
  from its submission to its collection: it includes the next batch's submission and the
  previous batch's scatter, which the host does meanwhile, and the wait behind the batch before
  it on the device, so a pipelined row's per-batch latencies run about its batches in flight
  times its per-batch time and are not comparable with a synchronous row's (its throughput is; LoadGen measures latency
  under load). Such a row records ``batches_in_flight`` among its prepare facts.

Batch inputs are cut from the evaluation set before timing (the sample library's job, done
once), outputs are scattered back to dataset order inside the timed region.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional

import numpy as np

from ..backends.base import Backend, BackendContext
from ..errors import BenchError
from ..record.schedule import Plan, batch_inputs, empty_outputs, scatter, spread
from .machine_state import runtime_threads
from .progress import Progress


@dataclass
class Timing:
    pass_s: list  # seconds per full pass over the plan
    batch_ms: np.ndarray  # every batch of every pass
    n_rows: int  # rows predicted per pass
    n_batches: int  # batches per pass
    flops_computed: float  # per pass, at the shapes run (padding included)
    flops_real: float  # per pass, real tokens only
    identical_passes: bool  # the first and last pass gave bit-identical outputs

    @property
    def predict_s(self) -> float:
        return float(statistics.median(self.pass_s))

    def summary(self) -> dict:
        ms, p = self.batch_ms, self.predict_s
        return {
            "predict_s": p,
            "predict_min_s": float(min(self.pass_s)),
            "predict_max_s": float(max(self.pass_s)),
            "predict_stdev_s": float(statistics.stdev(self.pass_s)) if len(self.pass_s) > 1 else 0.0,
            "n_passes": len(self.pass_s),
            "latency_p50_ms": float(np.percentile(ms, 50)),
            "latency_p90_ms": float(np.percentile(ms, 90)),
            "latency_p99_ms": float(np.percentile(ms, 99)),
            "latency_mean_ms": float(ms.mean()),
            "n_batches": self.n_batches,
            "features_per_s": self.n_rows / p,
            "achieved_tflops": self.flops_computed / p / 1e12,
            "real_tflops": self.flops_real / p / 1e12,
            "identical_passes": self.identical_passes,
        }


def materialize(inputs: Mapping[str, np.ndarray], plan: Plan) -> list[dict[str, np.ndarray]]:
    """Every batch's host arrays, built once before anything is timed."""
    return [batch_inputs(inputs, b) for b in plan.batches]


def sample_batches(plan: Plan, batches: list, n: int = 8) -> tuple:
    """Up to ``n`` real batches spread over the plan, one of the largest shape first (for export
    checks, compile warm-up and calibration: several lengths, not one)."""
    largest = plan.shapes[0]
    first = next(i for i, b in enumerate(plan.batches) if b.shape == largest)
    order = [first] + [i for i in spread(len(batches), n) if i != first]
    return tuple(batches[i] for i in order[:n])


def make_context(model_dir, task: str, artifacts_dir, output_names, plan: Plan, batches: list,
                 max_seq_len: int) -> BackendContext:
    """What a backend prepares from: the model, and the run's shapes and real batches."""
    return BackendContext(model_dir=Path(model_dir), task=task, artifacts_dir=Path(artifacts_dir),
                          output_names=tuple(output_names), sample_batches=sample_batches(plan, batches),
                          shapes=tuple(plan.shapes), max_batch_size=max(s[0] for s in plan.shapes),
                          max_seq_len=int(max_seq_len))


class ContractError(BenchError):
    """A backend's output broke the Backend contract (names, dtype, shape, finiteness)."""


def check_contract(name: str, out: Mapping, batch: Mapping[str, np.ndarray], output_names: tuple,
                   token_outputs: tuple) -> None:
    """What every backend owes the scatter and the postprocessor: each named output, a float
    array of ``(rows, seq)`` for per-token outputs (``(rows, ...)`` for the others), finite on real
    tokens. Checked on every warm-up batch, so a breach names the backend and the rule instead of
    surfacing as a numpy error in the scatter (or as silently wrong answers)."""
    rows, seq = np.asarray(batch["input_ids"]).shape
    if not isinstance(out, Mapping):
        raise ContractError(f"backend {name} returned {type(out).__name__}; expected a dict of output arrays "
                            f"({', '.join(output_names)})")
    missing = [n for n in output_names if n not in out]
    if missing:
        raise ContractError(f"backend {name} returned no {', '.join(missing)} (it returned {', '.join(map(str, out)) or 'nothing'}); "
                            f"expected {', '.join(output_names)}")
    real = np.asarray(batch["attention_mask"]).astype(bool)
    for n in output_names:
        v = out[n]
        if not isinstance(v, np.ndarray):
            raise ContractError(f"backend {name} returned {n} as {type(v).__name__}; expected a numpy array on the host")
        if not np.issubdtype(v.dtype, np.floating):
            raise ContractError(f"backend {name} returned {n} of dtype {v.dtype}; expected a floating-point dtype")
        want = (rows, seq) if n in token_outputs else (rows,) + tuple(v.shape[1:])
        if tuple(v.shape) != want:
            raise ContractError(f"backend {name} returned {n} of shape {tuple(v.shape)}; expected {want}")
        finite = np.isfinite(v[real]) if n in token_outputs else np.isfinite(v)
        if not finite.all():
            raise ContractError(f"backend {name} returned {int((~finite).sum())} non-finite value(s) in {n} "
                                f"on real tokens (batch of {rows} x {seq})")


def warm_up(backend: Backend, plan: Plan, batches: list, n: int, output_names: tuple = (),
            token_outputs: tuple = ()) -> int:
    """A real batch of every shape, then more up to ``n`` batches; returns how many ran. With
    ``output_names``, every warm-up output is checked against the backend contract."""
    seen, order = set(), []
    for i, b in enumerate(plan.batches):
        if b.shape not in seen:
            seen.add(b.shape)
            order.append(i)
    chosen = set(order)
    order += [i for i in range(len(batches)) if i not in chosen][: max(0, n - len(order))]
    earlier: list = []
    # through the timed loop's own path (batches in flight too), so its first pass starts warm
    for k, out, _ in stream(backend, [batches[i] for i in order]):
        i = order[k]
        if output_names:
            check_contract(backend.name, out, batches[i], output_names, token_outputs)
            for prev in earlier:  # every earlier batch: a backend may reuse one buffer per shape
                check_owned(backend.name, prev, out)
            earlier.append(out)
    return len(order)


def check_owned(name: str, earlier: dict, later: dict) -> None:
    """The outputs of a predict are the caller's: a later predict must not write into them (the
    LoadGen SUT encodes one batch's answers on another thread while the next batch runs)."""
    for k, v in later.items():
        if k in earlier and np.shares_memory(earlier[k], v):
            raise ContractError(f"backend {name} returned {k} in the same memory as the previous batch's {k}; "
                                f"return arrays the caller owns (copy out of reused buffers)")


def in_flight_window(submitted: Iterable, depth: int) -> Iterator:
    """The items of ``submitted`` (a lazy iterator whose every step submits one batch) in order,
    each handed on for collection once ``depth`` are outstanding, the rest when it ends: the next
    batch is always submitted before the oldest is collected. Depth 1 is submit-then-collect."""
    pending: deque = deque()
    for item in submitted:
        pending.append(item)
        if len(pending) >= max(1, int(depth)):
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def stream(backend: Backend, batches: list, clock: Callable[[], float] = time.perf_counter):
    """Every batch through the backend, keeping ``backend.in_flight()`` submitted at once; yields
    (index, outputs, milliseconds from submission to collection) in submission order."""
    submitted = ((i, clock(), backend.submit(x)) for i, x in enumerate(batches))
    for i, t0, wait in in_flight_window(submitted, backend.in_flight()):
        out = wait()
        yield i, out, (clock() - t0) * 1e3


class PassTimer:
    """Timed whole passes over the plan, one at a time (a block of passes, or one a round): each
    pass's time and batch latencies, the outputs of the last pass, and whether the first and
    last gave bit-identical outputs.

    ``clock``: seconds, monotonic (tests pass a simulated one, so the loop's logic is checked
    without sleeping or depending on how busy the machine is)."""

    def __init__(self, backend: Backend, plan: Plan, batches: list, output_names: tuple, token_outputs: tuple,
                 max_seq_len: int, flops: tuple[float, float] = (0.0, 0.0),
                 clock: Callable[[], float] = time.perf_counter):
        self.backend, self.plan, self.batches = backend, plan, batches
        self.output_names, self.token_outputs, self.max_seq_len = output_names, token_outputs, max_seq_len
        self.flops, self.clock = flops, clock
        self.pass_s: list[float] = []
        self._lat: list[np.ndarray] = []
        self._first: Optional[dict] = None
        self.outputs: dict = {}

    def run_pass(self) -> float:
        """One pass over the whole plan; returns its seconds."""
        outputs: dict = {}
        ms = np.empty(len(self.batches))
        t_pass = self.clock()
        for i, out, dt_ms in stream(self.backend, self.batches, self.clock):
            ms[i] = dt_ms
            out = {n: out[n] for n in self.output_names}
            if not outputs:
                outputs = empty_outputs(out, self.plan.n_features, self.max_seq_len, self.token_outputs)
            scatter(outputs, self.plan.batches[i], out)
        seconds = self.clock() - t_pass
        self.pass_s.append(seconds)
        self._lat.append(ms)
        self.outputs = outputs
        if self._first is None:
            self._first = {k: v.copy() for k, v in outputs.items()}
        return seconds

    def timing(self) -> Timing:
        identical = all(np.array_equal(self._first[k], self.outputs[k], equal_nan=True) for k in self.outputs)
        return Timing(list(self.pass_s), np.concatenate(self._lat), self.plan.n_rows, len(self.batches),
                      self.flops[0], self.flops[1], identical)


def timed_passes(backend: Backend, plan: Plan, batches: list, output_names: tuple, token_outputs: tuple,
                 max_seq_len: int, *, min_passes: int = 1, min_duration_s: float = 0.0,
                 flops: tuple[float, float] = (0.0, 0.0), progress: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[dict, Timing]:
    """Whole passes over the plan until both minimums are reached (a block); outputs of the last pass."""
    timer = PassTimer(backend, plan, batches, output_names, token_outputs, max_seq_len, flops, clock)
    started = clock()
    bar = Progress(min_passes * len(batches), f"predict {backend.name}", enabled=progress, unit="batch")
    while len(timer.pass_s) < min_passes or clock() - started < min_duration_s:
        timer.run_pass()
        bar.update(len(batches))
    bar.close()
    return timer.outputs, timer.timing()


@dataclass
class RunOutput:
    prepare_s: float
    warmup_batches: int
    timing: Timing
    outputs: dict
    prepare_info: dict = field(default_factory=dict)
    measures: dict = field(default_factory=dict)


class PreparedBackend:
    """One backend through its lifecycle, a step at a time: ``prepare`` (prepare and warm-up),
    then any number of ``run_pass`` (each its own timed region: the machine's state and energy
    are read over the passes only, not over the time it waits while other rows are timed), then
    ``finish``. A block of passes (``run_block``) and interleaved rounds (a worker that waits
    for its turn) both drive it."""

    def __init__(self, backend: Backend, ctx: BackendContext, plan: Plan, batches: list, *, token_outputs: tuple,
                 warmup_batches: int, flops: tuple[float, float] = (0.0, 0.0), probe=None, laps: bool = False):
        self.backend, self.ctx, self.plan, self.batches = backend, ctx, plan, batches
        self.token_outputs, self.warmup_batches, self.probe = token_outputs, warmup_batches, probe
        self.timer = PassTimer(backend, plan, batches, ctx.output_names, token_outputs, ctx.max_seq_len, flops)
        self.prepare_s, self.n_warm = 0.0, 0
        # laps: the machine's state and energy are read over each pass alone (rounds: the other
        # rows' passes between this row's are not its); a block is one region from first to last pass
        self.laps = laps

    def prepare(self, before_timing=None) -> None:
        t0 = time.perf_counter()
        self.backend.prepare(self.ctx)
        self.prepare_s = time.perf_counter() - t0
        if self.probe is not None:
            self.probe.end_phase("prepare")
        self.n_warm = warm_up(self.backend, self.plan, self.batches, self.warmup_batches, self.ctx.output_names,
                              self.token_outputs)
        if before_timing is not None:
            before_timing()
        if self.probe is not None:
            self.probe.end_phase("warmup")
            self.probe.start_timed(threads=runtime_threads(self.backend.prepare_info))

    def run_pass(self) -> float:
        lap = self.probe is not None and self.laps
        if lap:
            self.probe.resume_timed()
        try:
            return self.timer.run_pass()
        finally:
            if lap:
                self.probe.pause_timed()

    def finish(self) -> RunOutput:
        timing = self.timer.timing()
        if self.probe is not None:
            self.probe.end_timed(sum(timing.pass_s), timing.n_rows * len(timing.pass_s))
            self.probe.end_phase("predict")
        return RunOutput(self.prepare_s, self.n_warm, timing, self.timer.outputs, dict(self.backend.prepare_info),
                         dict(self.probe.values) if self.probe is not None else {})

    def close(self) -> None:
        self.backend.close()


def run_block(run: PreparedBackend, *, min_passes: int, min_duration_s: float, progress: bool = False,
              before_timing=None) -> RunOutput:
    """Prepare, warm up and time one backend in one block of passes, until both minimums are
    reached; closes it either way. ``before_timing`` runs between warm-up and the timed passes
    (the data-parallel barrier)."""
    try:
        run.prepare(before_timing)
        bar = Progress(min_passes * len(run.batches), f"predict {run.backend.name}", enabled=progress, unit="batch")
        started = time.perf_counter()
        while len(run.timer.pass_s) < min_passes or time.perf_counter() - started < min_duration_s:
            run.run_pass()
            bar.update(len(run.batches))
        bar.close()
        return run.finish()
    finally:
        run.close()
