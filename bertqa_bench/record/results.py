"""The result record and the run bundle.

``BackendResult`` is the one typed record of a backend in a run: identity (variant, device,
precision, batching, model), timing, memory and energy, scores, parity, prepare facts.
results.csv, the MLflow child run, summary.md and the reference tables are views of it, and a
bundle loads back into the same records (``RunBundle.load``). ``RunMeta`` is the run's own
record (suite, task, reference, command, model, verdict), kept as run.json.

``results/<run-id>/`` holds: run.json, config.json, env.json, results.csv (rewritten
atomically as each backend finishes, so a crash loses nothing already measured),
predictions/<backend>.json, outputs/<reference>.npz (the reference's logits; every backend's
with bench.keep_outputs), logs/<backend>.log, summary.md, comparison.png.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import secrets
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from ..errors import BenchError
from ..io import atomic_write_json, atomic_write_text
from ..tasks.squad.reader import read_json
from .parity import ParityResult


def new_run_id(suite: str) -> str:
    """``<UTC timestamp>-<4 random hex>-<suite>``: runs started in the same second differ (the
    folder is then claimed exclusively, run_folder.claim), and names still sort by start time."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + f"-{secrets.token_hex(2)}-{suite}"


@dataclass
class BackendResult:
    # --- what ran
    backend: str
    status: str = "ok"  # ok | not run | failed
    implementation: str = ""
    precision: str = ""
    parity_class: str = ""
    device: str = ""
    device_name: str = ""
    batching: str = ""
    batch_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    n_shapes: Optional[int] = None
    n_devices: Optional[int] = None  # GPUs (data-parallel workers) the prediction ran on
    n_features: Optional[int] = None  # rows predicted per pass
    n_questions: Optional[int] = None
    model: str = ""
    model_params: Optional[int] = None
    model_dev_f1: Optional[float] = None  # the model's primary dev metric from training
    # the model measured: a user's checkpoint's name as given (model.checkpoint; empty for the
    # suite's own models), the digest of its config, weight and tokenizer files (checkpoint.
    # model_digest, as run.json's), its family (config model_type)
    model_checkpoint: str = ""
    model_digest: str = ""
    model_family: str = ""
    task: str = ""
    # --- time (seconds unless named otherwise)
    prepare_s: Optional[float] = None
    predict_s: Optional[float] = None  # median full pass
    predict_min_s: Optional[float] = None
    predict_max_s: Optional[float] = None
    predict_stdev_s: Optional[float] = None
    n_passes: Optional[int] = None
    latency_p50_ms: Optional[float] = None
    latency_p90_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    latency_mean_ms: Optional[float] = None
    n_batches: Optional[int] = None
    features_per_s: Optional[float] = None
    questions_per_s: Optional[float] = None
    achieved_tflops: Optional[float] = None  # at the shapes computed (padding included)
    real_tflops: Optional[float] = None  # real tokens only
    tokenize_s: Optional[float] = None
    postprocess_s: Optional[float] = None
    end_to_end_s: Optional[float] = None  # tokenize + predict + postprocess
    # rounds (timing_mode "rounds", record/rounds.py): the median over rounds of the reference's
    # pass / this row's pass of the same round, and a 95 % interval for what a rerun shows;
    # block-timed rows: median pass / median pass, and the extremes of the passes
    speedup: Optional[float] = None
    speedup_low: Optional[float] = None
    speedup_high: Optional[float] = None
    speedup_within_noise: Optional[bool] = None  # the interval straddles 1.0
    speedup_halfwidth_pct: Optional[float] = None  # half the interval's width, in percent
    timing_mode: str = ""  # rounds | block (and why it was block-timed, in timing_mode_note)
    timing_mode_note: str = ""
    rounds: Optional[int] = None  # rounds paired with the reference
    calibration_cv_pct: Optional[float] = None  # the host's noise sensor (the same on every row of a run)
    # the GPU sensor (record/noise.py; the same on every GPU row of a run): its spread over rounds
    # and the spread of its repetitions within a round
    gpu_sensor_spread_pct: Optional[float] = None
    gpu_sensor_jitter_pct: Optional[float] = None
    # True: a sensor that speaks for this row wandered past bench.noise_cv_pct (timing_noise_note:
    # which, and by how much): a CPU row the host calibration, a GPU row the GPU sensor (and the
    # host calibration in proportion to its host-bound share)
    timing_noisy: Optional[bool] = None
    timing_noise_note: str = ""
    # the worker processes this row's passes came from, taking turns by round (one, and why, where
    # memory allowed no second); the interval includes the spread between them
    processes: Optional[int] = None
    processes_note: str = ""
    pct_change_vs_ref: Optional[float] = None
    identical_passes: Optional[bool] = None
    # --- memory and energy (measure.py); memory in MiB (2**20 bytes), as the kernel and torch count it
    prepare_host_peak_mib: Optional[float] = None
    predict_host_peak_mib: Optional[float] = None
    prepare_cuda_allocated_peak_mib: Optional[float] = None
    predict_cuda_allocated_peak_mib: Optional[float] = None
    predict_cuda_reserved_peak_mib: Optional[float] = None
    predict_device_used_mib: Optional[float] = None
    energy_j: Optional[float] = None
    energy_j_per_1k_features: Optional[float] = None
    avg_power_w: Optional[float] = None
    energy_note: str = ""
    # --- what the machine was doing while this row was timed (measuring/machine_state.py)
    threads: Optional[int] = None  # threads the runtime computed with (the thread plan, or the variant's own)
    usable_cores: Optional[int] = None  # cores the process may use (affinity, cgroup quota)
    other_cpu_cores: Optional[float] = None  # other processes' average CPU demand on those cores, in cores
    load_avg_1m: Optional[float] = None
    cpu_steal_pct: Optional[float] = None
    cpu_mhz_min: Optional[float] = None
    cpu_mhz_max: Optional[float] = None
    gpu_sm_clock_mhz: Optional[float] = None
    gpu_sm_clock_max_mhz: Optional[float] = None
    gpu_throttle: str = ""  # NVML throttle reasons beyond idle / power cap, in most samples while timed
    # NVML sampled over the row's own passes (measuring/gpu_sensor.GpuSampler): gpu_sm_clock_mhz is
    # the median clock then, gpu_power_w the median power, gpu_power_capped whether the software
    # power cap held the clock down in most samples, gpu_busy_pct the median utilization
    gpu_power_w: Optional[float] = None
    gpu_power_capped: Optional[bool] = None
    gpu_busy_pct: Optional[float] = None
    gpu_samples: Optional[int] = None
    gpu_other_processes: Optional[int] = None
    timing_reliable: Optional[bool] = None  # False: timed on a busy machine (timing_note says how)
    timing_note: str = ""
    # --- accuracy
    scores: dict = field(default_factory=dict)  # the task's metrics, e.g. {"exact_match": .., "f1": ..}
    parity: str = ""  # pass | FAIL | n/a | "" (not compared)
    parity_failures: str = ""
    primary_ratio: Optional[float] = None
    min_f1_ratio: Optional[float] = None
    min_agreement: Optional[float] = None
    answer_agreement: Optional[float] = None
    n_agree: Optional[int] = None
    n_compared: Optional[int] = None
    agreement_ci_low: Optional[float] = None
    agreement_ci_high: Optional[float] = None
    agreement_within_noise: Optional[bool] = None
    start_argmax_agreement: Optional[float] = None
    end_argmax_agreement: Optional[float] = None
    max_abs_logit_diff: Optional[float] = None
    mean_abs_logit_diff: Optional[float] = None
    deltas: dict = field(default_factory=dict)  # {metric: backend - reference}
    # paired-bootstrap 95% intervals over questions (parity.paired_bootstrap)
    delta_ci: dict = field(default_factory=dict)  # {metric: (low, high)} of backend - reference
    primary_ratio_low: Optional[float] = None
    primary_ratio_high: Optional[float] = None
    # the verdict could go the other way at this many questions (parity.ParityResult)
    parity_within_noise: Optional[bool] = None
    questions_to_decide: Optional[int] = None
    parity_decided_by: str = ""
    # --- what went wrong, what prepare did
    error: str = ""
    prepare_info: dict = field(default_factory=dict)
    # --- MLPerf LoadGen scenario rows (``bertqa-bench loadgen``, loadgen.py); empty for bench rows.
    # A LoadGen sample is one feature, so QPS counts features; latencies are LoadGen's per sample.
    scenario: str = ""  # SingleStream | Server | Offline
    loadgen_result: str = ""  # VALID | INVALID, LoadGen's own verdict of the performance run
    loadgen_invalid_reason: str = ""
    target_qps: Optional[float] = None  # Server: the Poisson arrival rate asked for
    achieved_qps: Optional[float] = None  # Server: completed; Offline: samples/s; SingleStream: 1 / mean
    sample_latency_p50_ms: Optional[float] = None
    sample_latency_p90_ms: Optional[float] = None
    sample_latency_p99_ms: Optional[float] = None
    sample_latency_p999_ms: Optional[float] = None
    sample_latency_mean_ms: Optional[float] = None
    target_latency_ms: Optional[float] = None  # Server: the bound at its percentile
    loadgen_min_duration_ms: Optional[int] = None
    loadgen_min_query_count: Optional[int] = None
    loadgen_query_count: Optional[int] = None
    peak_search: str = ""  # --find-peak-qps: every target tried and LoadGen's verdict
    sut_batcher: str = ""
    bench_features_per_s: Optional[float] = None  # bench passes in the same worker process
    qps_vs_bench_pct: Optional[float] = None  # achieved QPS / bench features/s
    accuracy_run: str = ""  # LoadGen's accuracy run: "ok: N samples" (a row without it fails)
    accuracy_samples: Optional[int] = None
    bench_answer_agreement: Optional[float] = None  # LoadGen-path answers = bench-path answers, same process

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def apply_parity(self, p: ParityResult, *, judged: bool = True) -> None:
        """Copy a comparison in; ``judged=False`` keeps the numbers but no verdict (random weights)."""
        for f in ("parity_class", "min_f1_ratio", "min_agreement", "primary_ratio", "answer_agreement", "n_agree",
                  "n_compared", "agreement_ci_low", "agreement_ci_high", "start_argmax_agreement",
                  "end_argmax_agreement", "max_abs_logit_diff", "mean_abs_logit_diff"):
            setattr(self, f, getattr(p, f))
        self.deltas = dict(p.metric_deltas)
        self.delta_ci = {k: tuple(v) for k, v in p.delta_ci.items()}
        self.primary_ratio_low, self.primary_ratio_high = p.ratio_ci_low, p.ratio_ci_high
        self.agreement_within_noise = p.within_noise
        self.parity_within_noise = p.verdict_within_noise if judged else None
        self.questions_to_decide = p.questions_to_decide if judged else None
        self.parity_decided_by = p.decided_by if judged else ""
        self.parity = p.status if judged else "n/a"
        self.parity_failures = "; ".join(p.failures) if judged else "random weights: timing only"

    # --- the flat view (results.csv, MLflow) --------------------------------------------
    def to_row(self) -> dict:
        row: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in _NESTED:
                continue
            row[f.name] = getattr(self, f.name)
        row.update(self.scores)
        row.update({f"{k}_delta": v for k, v in self.deltas.items()})
        for k, (low, high) in self.delta_ci.items():
            row[f"{k}_delta_low"], row[f"{k}_delta_high"] = low, high
        row["prepare_info"] = json.dumps(self.prepare_info, default=str, sort_keys=True) if self.prepare_info else ""
        return row

    @classmethod
    def from_row(cls, row: dict, metric_names: typing.Sequence[str] = ()) -> "BackendResult":
        # Bundles and reference tables written before the MiB rename name these columns *_mb; they
        # always held MiB, so the values carry over unchanged.
        row = {**{LEGACY_COLUMNS.get(k, k): v for k, v in row.items()}, **row}
        hints = typing.get_type_hints(cls)

        def cell(column, convert):
            # a damaged cell is named by its column and value (the caller adds the file and row)
            try:
                return convert(row[column])
            except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"column {column}: {row[column]!r} is not a valid value ({e})") from None

        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in _NESTED or f.name not in row:
                continue
            kwargs[f.name] = cell(f.name, lambda v, h=hints[f.name]: _parse(v, h))
        r = cls(**kwargs)
        r.scores = {m: cell(m, float) for m in metric_names if row.get(m) not in (None, "")}
        r.deltas = {m: cell(f"{m}_delta", float) for m in metric_names if row.get(f"{m}_delta") not in (None, "")}
        r.delta_ci = {m: (cell(f"{m}_delta_low", float), cell(f"{m}_delta_high", float)) for m in metric_names
                      if row.get(f"{m}_delta_low") not in (None, "") and row.get(f"{m}_delta_high") not in (None, "")}
        if row.get("prepare_info"):
            r.prepare_info = cell("prepare_info", json.loads)
        return r


LEGACY_COLUMNS = {f"{name[:-len('_mib')]}_mb": name for name in (
    "prepare_host_peak_mib", "predict_host_peak_mib", "prepare_cuda_allocated_peak_mib",
    "predict_cuda_allocated_peak_mib", "predict_cuda_reserved_peak_mib", "predict_device_used_mib")}


_NESTED = ("scores", "deltas", "delta_ci", "prepare_info")  # flattened into their own columns by to_row


def _parse(value, hint):
    if value is None or value == "" and hint is not str:
        return None
    if not isinstance(value, str):
        return value
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    t = base[0]
    if t is bool:
        return value.strip().lower() in ("true", "1", "yes")
    if t is int:
        return int(float(value))
    if t is float:
        return float(value)
    return value


@dataclass
class RunMeta:
    suite: str
    run_id: str
    task: str
    metric_names: list
    primary_metric: str
    reference: str
    metric_labels: dict = field(default_factory=dict)
    command: str = ""
    date: str = ""
    model: str = ""
    model_note: str = ""
    model_params: Optional[int] = None
    model_dev_metric: Optional[float] = None
    model_checkpoint: str = ""  # as BackendResult's (its digest is model_digest below)
    model_family: str = ""
    timing_only: bool = False
    batching: str = ""
    batch_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    n_features: Optional[int] = None
    n_questions: Optional[int] = None
    device_name: str = ""
    verdict: str = ""
    verdict_reasons: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # run-level facts (determinism, evaluation-set cache...)
    # --- what a resume checks and needs (bench.resume_bench)
    status: str = ""  # running | complete | interrupted | failed
    interrupted_by: str = ""  # the signal (SIGTERM, SIGINT, SIGHUP) that stopped it
    variants: list = field(default_factory=list)  # every variant the run was asked for, reference first
    model_recipe: str = ""
    model_digest: str = ""  # the weights, config and tokenizer the rows were measured on
    evalset_key: str = ""
    mlflow_parent_id: str = ""
    mlflow_children: dict = field(default_factory=dict)  # {backend: MLflow run id}
    resumes: list = field(default_factory=list)  # [{date, command, ran: [...]}] one per --resume
    problems: list = field(default_factory=list)  # run-level problems found so far (e.g. a non-deterministic reference)
    # --- how the rows were timed (measuring/rounds.py): the rounds' log (each row's pass per
    # round, the calibration, the order), the calibration's spread and whether it was too noisy
    rounds: dict = field(default_factory=dict)
    calibration_cv_pct: Optional[float] = None
    timing_noisy: Optional[bool] = None  # some row was marked noisy (each row's timing_noisy says which)
    noise_cv_pct: Optional[float] = None
    gpu_sensor_spread_pct: Optional[float] = None
    gpu_sensor_jitter_pct: Optional[float] = None


def _fmt(v):
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.10g}"  # enough digits that a value read back rounds as the original does
    if v is None:
        return ""
    return v


def rows_to_csv(rows: list[dict], columns: Optional[list[str]] = None) -> str:
    cols = list(columns or [])
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(v) for k, v in r.items()})
    return buf.getvalue()


def read_csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except (UnicodeDecodeError, IsADirectoryError, csv.Error) as e:
        raise BenchError(f"{path}: not a results table bertqa-bench can read ({type(e).__name__}: {e})") from None


def read_json_object(path: Path) -> dict:
    """A JSON object from one of a bundle's files, or a one-line error naming the file: the
    dataset reader's strict parse (encoding, syntax with line and column, nesting, huge numbers),
    then the object check a bundle's files need."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise BenchError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


class RunBundle:
    def __init__(self, run_dir: Path, meta: RunMeta, results: Optional[list] = None):
        self.dir = Path(run_dir)
        self.meta = meta
        self.results: list[BackendResult] = list(results or [])

    @classmethod
    def create(cls, root: Path, meta: RunMeta, config: dict, env: dict) -> "RunBundle":
        b = cls(Path(root) / meta.run_id, meta)
        b.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(b.dir / "config.json", config)
        atomic_write_json(b.dir / "env.json", env)
        b.write_meta()
        return b

    @property
    def csv_path(self) -> Path:
        return self.dir / "results.csv"

    def path(self, *parts: str) -> Path:
        return self.dir.joinpath(*parts)

    def write_meta(self) -> None:
        atomic_write_json(self.dir / "run.json", dataclasses.asdict(self.meta))

    def add(self, result: BackendResult) -> None:
        self.results.append(result)
        self.write_csv()

    def put(self, result: BackendResult, order: typing.Sequence[str] = ()) -> None:
        """Add a row, replacing an earlier row of the same backend (a resumed run's re-run of a
        failed variant), kept in ``order`` (the run's variants) so a resumed table reads like an
        uninterrupted one."""
        rows = [r for r in self.results if r.backend != result.backend] + [result]
        rank = {name: i for i, name in enumerate(order)}
        self.results = sorted(rows, key=lambda r: rank.get(r.backend, len(rank)))
        self.write_csv()

    def write_csv(self) -> None:
        atomic_write_text(self.csv_path, rows_to_csv([r.to_row() for r in self.results]))

    def write_predictions(self, backend: str, predictions: Any) -> Path:
        return atomic_write_json(self.dir / "predictions" / f"{backend}.json", predictions, indent=None)

    def env(self) -> dict:
        p = self.dir / "env.json"
        return read_json_object(p) if p.exists() else {}

    def config(self) -> dict:
        p = self.dir / "config.json"
        return read_json_object(p) if p.exists() else {}

    @classmethod
    def load(cls, run_dir: Path) -> "RunBundle":
        run_dir = Path(run_dir)
        meta_path = run_dir / "run.json"
        if not meta_path.exists():
            raise BenchError(f"{run_dir}: no run.json; pass a results/<run-id> folder written by bertqa-bench")
        raw = read_json_object(meta_path)
        fields = dataclasses.fields(RunMeta)
        missing = [f.name for f in fields if f.name not in raw and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise BenchError(f"{meta_path}: no {', '.join(missing)}; the bundle is damaged")
        meta = RunMeta(**{k: v for k, v in raw.items() if k in {f.name for f in fields}})
        csv_path = run_dir / "results.csv"
        results = []
        for i, r in enumerate(read_csv(csv_path) if csv_path.exists() else []):
            try:
                results.append(BackendResult.from_row(r, meta.metric_names))
            except ValueError as e:  # line i + 2: the header is line 1
                raise BenchError(f"{csv_path}, line {i + 2} ({r.get('backend') or 'no backend'}): {e}") from None
        return cls(run_dir, meta, results)
