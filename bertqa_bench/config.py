"""Suite configuration: dataclasses validated on construction, loaded from ``benchmarks/<suite>.yaml``.

A suite names the data, the model (and how to train it if missing), the backends to
benchmark and the parity tolerances. Any field can be overridden from the command line
with ``--set section.field=value`` (YAML syntax for the value).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = PROJECT_ROOT / "benchmarks"

TASKS = ("squad", "nq")
DATA_SOURCES = ("synthetic", "squad-json", "hf", "nq-jsonl", "nq-synthetic")
PADDINGS = ("max_length", "longest")


@dataclass
class SyntheticConfig:
    """Shape of the generated SQuAD/NQ-format set (see bertqa_bench/data/synthetic.py)."""

    seed: int = 13
    n_train_contexts: int = 2000
    n_dev_contexts: int = 500
    questions_per_context: int = 5
    min_words: int = 60
    max_words: int = 300
    mean_words: int = 120
    long_context_fraction: float = 0.02  # share of contexts longer than one 384-token window

    def __post_init__(self):
        if self.n_train_contexts < 0 or self.n_dev_contexts < 1:
            raise ConfigError("synthetic: n_train_contexts must be >= 0 and n_dev_contexts >= 1")
        if not (0 < self.min_words <= self.mean_words <= self.max_words):
            raise ConfigError("synthetic: need 0 < min_words <= mean_words <= max_words")
        if not 0.0 <= self.long_context_fraction <= 1.0:
            raise ConfigError("synthetic: long_context_fraction must be in [0, 1]")
        if self.questions_per_context < 1:
            raise ConfigError("synthetic: questions_per_context must be >= 1")


@dataclass
class DataConfig:
    source: str = "synthetic"
    train_file: Optional[str] = None  # squad-json / nq-jsonl
    dev_file: Optional[str] = None
    hf_name: str = "squad"  # source=hf: datasets.load_dataset(hf_name)
    data_dir: str = "data"  # where generated files are written (relative to the project root)
    max_seq_len: int = 384
    doc_stride: int = 128
    max_query_len: int = 64
    max_eval_examples: Optional[int] = None  # cap the dev set (None = all)
    max_train_examples: Optional[int] = None
    # Pad/replicate the eval features to this many (e.g. 10784 = SQuAD v1.1 dev with
    # bert-base-uncased); the extra features are scored as copies, timed as real work.
    target_eval_features: Optional[int] = None
    # NQ only: share of answer-less training windows kept (0.02 for real NQ, where most windows
    # are empty), and whether contexts carry [Paragraph=N]/[Table=N] candidate markers.
    nq_null_window_keep: float = 0.25
    nq_markers: bool = True
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self):
        if isinstance(self.synthetic, dict):
            self.synthetic = SyntheticConfig(**self.synthetic)
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"data.source '{self.source}' is not one of {', '.join(DATA_SOURCES)}")
        if self.source in ("squad-json", "nq-jsonl") and not self.dev_file:
            raise ConfigError(f"data.source={self.source} needs data.dev_file")
        if self.max_seq_len < 32:
            raise ConfigError("data.max_seq_len must be >= 32")
        if not 0 < self.doc_stride < self.max_seq_len:
            raise ConfigError("data.doc_stride must be in (0, max_seq_len)")
        if not 0 < self.max_query_len < self.max_seq_len:
            raise ConfigError("data.max_query_len must be in (0, max_seq_len)")


@dataclass
class ModelConfig:
    name: str = "minilm-squad-synthetic"  # directory under models/
    base: str = "embedded:all-MiniLM-L6-v2"  # hub name, local path, or embedded:<name>
    task: str = "squad"
    # random-init: build the architecture of `base` (or `config_overrides`) with random weights;
    # used to time BERT-base shapes where hub weights can't be reached. Never scored for accuracy.
    random_init: bool = False
    # timing_only: use the (random) weights as built, without fine-tuning (BERT-base timing shapes).
    timing_only: bool = False
    config_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ConfigError(f"model.task '{self.task}' is not one of {', '.join(TASKS)}")
        if self.timing_only and not self.random_init:
            raise ConfigError("model.timing_only needs model.random_init (pretrained weights should be fine-tuned)")


@dataclass
class TrainConfig:
    epochs: float = 2.0
    learning_rate: float = 5e-5
    batch_size: int = 16
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 42
    mixed_precision: str = "auto"  # auto (fp16 on CUDA) | fp16 | bf16 | no
    max_seq_len: Optional[int] = None  # defaults to data.max_seq_len
    grad_accum: int = 1
    num_threads: Optional[int] = None

    def __post_init__(self):
        if self.mixed_precision is False:  # YAML reads a bare `no` as false
            self.mixed_precision = "no"
        for k in ("epochs", "learning_rate", "warmup_ratio", "weight_decay"):
            setattr(self, k, _number(getattr(self, k), f"train.{k}"))
        if self.epochs <= 0 or self.learning_rate <= 0 or self.batch_size < 1:
            raise ConfigError("train: epochs, learning_rate and batch_size must be positive")
        if self.mixed_precision not in ("auto", "fp16", "bf16", "no"):
            raise ConfigError("train.mixed_precision must be auto, fp16, bf16 or no")


@dataclass
class BenchConfig:
    backends: list = field(default_factory=lambda: ["eager-fp32"])
    reference: str = "eager-fp32"
    batch_size: int = 32
    device: str = "auto"  # auto | cpu | cuda
    padding: str = "max_length"  # max_length (fixed shapes) | longest (per-batch, real length)
    warmup_batches: int = 3
    n_best: int = 20
    max_answer_len: int = 30
    num_threads: Optional[int] = None
    nq_top_k: int = 5  # NQ: start/end positions per window considered by postprocessing
    backend_options: dict = field(default_factory=dict)  # {backend-name: {option: value}}

    def __post_init__(self):
        if not self.backends:
            raise ConfigError("bench.backends is empty")
        if self.batch_size < 1:
            raise ConfigError("bench.batch_size must be >= 1")
        if self.padding not in PADDINGS:
            raise ConfigError(f"bench.padding must be one of {', '.join(PADDINGS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("bench.device must be auto, cpu or cuda")
        if self.warmup_batches < 1:
            raise ConfigError("bench.warmup_batches must be >= 1: never time a cold backend")


@dataclass
class Tolerance:
    min_f1_ratio: float  # backend F1 / reference F1
    min_agreement: float  # share of questions with the identical answer text

    def __post_init__(self):
        for k in ("min_f1_ratio", "min_agreement"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ConfigError(f"parity tolerance {k} must be in [0, 1]")


@dataclass
class ParityConfig:
    fp32: Tolerance = field(default_factory=lambda: Tolerance(0.999, 0.99))
    reduced: Tolerance = field(default_factory=lambda: Tolerance(0.99, 0.97))
    overrides: dict = field(default_factory=dict)  # {backend-name: {min_f1_ratio, min_agreement}}
    expected_file: Optional[str] = None  # benchmarks/expected/<suite>.csv
    expected_tolerance: float = 0.5  # allowed |EM/F1 - expected| in points

    def __post_init__(self):
        if isinstance(self.fp32, dict):
            self.fp32 = Tolerance(**self.fp32)
        if isinstance(self.reduced, dict):
            self.reduced = Tolerance(**self.reduced)
        self.overrides = {k: (v if isinstance(v, Tolerance) else Tolerance(**v)) for k, v in self.overrides.items()}


@dataclass
class SuiteConfig:
    name: str = "default"
    description: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    models_dir: str = "models"
    results_dir: str = "results"

    def __post_init__(self):
        for name, cls in (("data", DataConfig), ("model", ModelConfig), ("train", TrainConfig),
                          ("bench", BenchConfig), ("parity", ParityConfig)):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, _build(cls, getattr(self, name), name))
        if self.bench.reference not in self.bench.backends:
            # The reference always runs first: parity and speedup are measured against it.
            self.bench.backends = [self.bench.reference, *self.bench.backends]
        elif self.bench.backends[0] != self.bench.reference:
            self.bench.backends = [self.bench.reference] + [b for b in self.bench.backends if b != self.bench.reference]
        if self.model.task == "nq" and self.data.source not in ("nq-jsonl", "nq-synthetic"):
            raise ConfigError("model.task=nq needs data.source nq-jsonl or nq-synthetic")

    # Paths resolve against the project root so the CLI works from any directory.
    @property
    def model_dir(self) -> Path:
        return resolve_path(self.models_dir) / self.model.name

    @property
    def results_root(self) -> Path:
        return resolve_path(self.results_dir)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _number(value, where: str) -> float:
    try:  # YAML 1.1 reads "1e-4" (no dot) as a string
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a number, not {value!r}") from None


def resolve_path(p: str | os.PathLike) -> Path:
    p = Path(p)
    return p if p.is_absolute() else PROJECT_ROOT / p


def _build(cls, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def suite_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    candidate = BENCHMARKS_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in BENCHMARKS_DIR.glob("*.yaml"))
    raise ConfigError(f"unknown suite '{name_or_path}'; suites in {BENCHMARKS_DIR}: {', '.join(known)}")


def _parse_value(text: str):
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:  # YAML 1.1 reads "8e-5" as a string; a number is what anyone typing it means
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.field=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = _parse_value(value)
    return raw


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_raw(name_or_path: str, seen: tuple = ()) -> dict:
    path = suite_path(name_or_path)
    if path in seen:
        raise ConfigError(f"{path}: 'extends' loops through {', '.join(map(str, seen))}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    raw.setdefault("name", path.stem)
    # `extends: <suite>` reuses another suite and changes only what differs (same data, same model).
    parent = raw.pop("extends", None)
    if parent:
        base = _read_raw(parent, seen + (path,))
        base.pop("description", None)
        raw = _deep_merge(base, raw)
    return raw


def load_suite(name_or_path: str = "default", overrides: Optional[list[str]] = None) -> SuiteConfig:
    raw = _read_raw(name_or_path)
    raw = apply_overrides(raw, overrides or [])
    return _build(SuiteConfig, raw, str(suite_path(name_or_path)))
