"""Suite configuration: typed sections validated on construction.

A suite (``benchmarks/<suite>.yaml``, loaded by ``suite.load_suite``) names the data, the task,
the model (and how to train it if missing), the backend variants to benchmark, how batches
are formed and timed, and the parity tolerances. Any field can be overridden from the command
line with ``--set section.field=value`` (YAML syntax for the value). This module holds only the
dataclasses: it imports no task and no backend, so everything can import it.
"""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = PROJECT_ROOT / "benchmarks"

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

DATA_SOURCES = ("synthetic", "squad-json", "hf", "nq-jsonl", "nq-synthetic")
# padded: every feature at max_seq_len, dataset order (the classic table); trimmed: dataset
# order, each batch cut to its longest feature; sorted: features sorted by length, batches of
# a token budget per length bucket; packed: real tokens only (a token budget of real tokens,
# for backends that compute no padding at all). See schedule.py.
BATCHINGS = ("padded", "trimmed", "sorted", "packed")
ISOLATIONS = ("process", "inprocess")
TIMINGS = ("rounds", "block")


@dataclass
class SyntheticConfig:
    """Shape of the generated SQuAD/NQ-format set (see tasks/squad/synthetic.py, tasks/nq/synthetic.py)."""

    seed: int = 13
    n_train_contexts: int = 2000
    n_dev_contexts: int = 500
    questions_per_context: int = 5
    min_words: int = 60
    max_words: int = 300
    mean_words: int = 120
    long_context_fraction: float = 0.02  # share of contexts longer than one 384-token window
    # SQuAD generator only (tasks/squad/synthetic.py): "hard" adds namesake distractors,
    # paraphrased questions, references across sentences and inconsistent answer boundaries;
    # `ambiguity` is the share of facts that a second source contradicts (the gold answer is
    # either claim), the knob the hard preset is calibrated with.
    difficulty: str = "standard"  # standard | hard
    ambiguity: float = 0.0
    # SQuAD v2.0 files: this share of questions made unanswerable (the asked-about entity renamed
    # to a namesake the paragraph never mentions; the original span kept as plausible_answers)
    unanswerable: float = 0.0

    def __post_init__(self):
        if self.difficulty not in ("standard", "hard"):
            raise ConfigError(f"synthetic.difficulty '{self.difficulty}' is not one of standard, hard")
        if not 0.0 <= self.ambiguity <= 1.0:
            raise ConfigError("synthetic.ambiguity must be in [0, 1]")
        if not 0.0 <= self.unanswerable < 1.0:
            raise ConfigError("synthetic.unanswerable must be in [0, 1)")
        if self.n_train_contexts < 0 or self.n_dev_contexts < 1:
            raise ConfigError("synthetic: n_train_contexts must be >= 0 and n_dev_contexts >= 1")
        if not (0 < self.min_words <= self.mean_words <= self.max_words):
            raise ConfigError("synthetic: need 0 < min_words <= mean_words <= max_words")
        if not 0.0 <= self.long_context_fraction <= 1.0:
            raise ConfigError("synthetic: long_context_fraction must be in [0, 1]")
        if self.questions_per_context < 1:
            raise ConfigError("synthetic: questions_per_context must be >= 1")

    def identity(self) -> dict:
        """The fields that decide the generated files (defaults of later-added knobs left out, so
        existing data sets keep their names)."""
        d = dataclasses.asdict(self)
        if d["difficulty"] == "standard":
            d.pop("difficulty")
        if d["ambiguity"] == 0.0:
            d.pop("ambiguity")
        if d["unanswerable"] == 0.0:
            d.pop("unanswerable")
        return d


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
        for k in ("max_eval_examples", "max_train_examples", "target_eval_features"):
            v = getattr(self, k)
            if v is not None and v < 1:  # a slice by 0 or a negative count would drop questions silently
                raise ConfigError(f"data.{k} must be >= 1 (or null: all of them), not {v}")


DEFAULT_MODEL_NAME = "minilm-squad-synthetic"


def checkpoint_model_name(spec: str) -> str:
    """A results/artifacts name for a checkpoint: its last path part, hub owner kept."""
    parts = [p for p in str(spec).replace("\\", "/").split("/") if p not in ("", ".", "..")]
    hub = len(parts) == 2 and not str(spec).startswith((".", "/", "~")) and not resolve_path(spec).is_dir()
    tail = "--".join(parts) if hub else (parts or ["model"])[-1]
    return re.sub(r"[^\w.-]", "_", tail)


@dataclass
class ModelConfig:
    name: str = DEFAULT_MODEL_NAME  # directory under models/ (a checkpoint: named after it)
    base: str = "embedded:all-MiniLM-L6-v2"  # hub name, local path, or embedded:<name>
    # random-init: build the architecture of `base` (or `config_overrides`) with random weights;
    # used to time BERT-base shapes where hub weights can't be reached. Never scored for accuracy.
    random_init: bool = False
    # timing_only: use the (random) weights as built, without fine-tuning (BERT-base timing shapes).
    timing_only: bool = False
    config_overrides: dict = field(default_factory=dict)
    # grow_from: build `base`'s architecture with its encoder grown (widened + stacked, grow.py)
    # from this smaller pretrained encoder, e.g. embedded:all-MiniLM-L6-v2 -> the BERT-base shape.
    grow_from: Optional[str] = None
    grow_stack: str = "repeat"  # repeat ([0..5, 0..5]) | interleave ([0, 0, 1, 1, ...])
    # checkpoint: a fine-tuned extractive-QA model (hub name or folder) benchmarked as it is, no
    # training (checkpoint.py checks it: QA head, tokenizer, no custom code, safetensors).
    checkpoint: Optional[str] = None
    # allow_pickle: accept a checkpoint whose only weights are pytorch_model.bin (unpickled on load)
    allow_pickle: bool = False

    def __post_init__(self):
        if self.checkpoint is not None:
            if not str(self.checkpoint).strip():
                raise ConfigError("model.checkpoint is empty")
            if self.random_init or self.grow_from or self.timing_only:
                raise ConfigError("model.checkpoint is benchmarked as it is: it excludes random_init, grow_from "
                                  "and timing_only")
            if self.name == DEFAULT_MODEL_NAME:
                # results and artifacts name the checkpoint, not the suite's default model
                self.name = checkpoint_model_name(self.checkpoint)
        if self.grow_from and self.random_init:
            raise ConfigError("model: grow_from and random_init exclude each other")
        if self.grow_stack not in ("repeat", "interleave"):
            raise ConfigError(f"model.grow_stack '{self.grow_stack}' is not one of repeat, interleave")
        if self.timing_only and not self.random_init:
            raise ConfigError("model.timing_only needs model.random_init (pretrained weights should be fine-tuned)")


COMPILE_SCOPES = ("layers", "model")
DDP_COMM_HOOKS = ("none", "allreduce", "bf16", "fp16")


@dataclass
class TrainConfig:
    epochs: float = 2.0
    learning_rate: float = 5e-5
    batch_size: int = 16
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 42
    mixed_precision: str = "auto"  # auto (fp16 on CUDA) | fp16 | bf16 | no
    # batch_size is the GLOBAL batch: under torchrun it is split over the processes (and over
    # grad_accum micro-steps), so 1, 2 and 4 GPUs take the same optimizer steps at the same
    # learning rate. To give each GPU more rows, raise batch_size (and the learning rate) for all.
    grad_accum: int = 1
    num_threads: Optional[int] = None
    compile: bool = False  # torch.compile the training step (dynamic shapes; static per bucket with seq_bucket)
    # What `compile` compiles. "layers" (regional compilation): each block of the model's repeated
    # layer stack (BertLayer, DistilBERT's TransformerBlock, ...) in place, the embeddings and the
    # head eager. The blocks share one compiled graph per shape, so compiling costs one layer's
    # trace per length bucket instead of the whole model's (117 s for 3 buckets of BERT-base on an
    # H100, h100-train-speed.md), and DDP keeps its own bucketed all-reduce, overlapped with the
    # backward, around the compiled blocks (no DDPOptimizer graph splitting). "model": the whole
    # (DDP-wrapped) model as one compiled region, as before.
    compile_scope: str = "layers"
    # Each layer of the model's repeated stack captured as two CUDA graphs per micro-batch shape,
    # its forward and its backward (torch.cuda.make_graphed_callables; training/graphed_layers.py),
    # and replayed in the loop: one launch per layer instead of its kernels' host work. The compiled
    # BERT-base step is bound by the host (53 of its 59.8 ms are host time at 4 GPUs, GPU idle 24.5%,
    # h100-scaling.md). Needs a GPU and seq_bucket > 0 (every shape is captured before the clock, as
    # prepare time). The gradients are then zeroed in place, never set to None. With `compile` the
    # graphs hold the compiled kernels.
    graph_layers: bool = False
    # Compiling is prepare time, not training time (the suite's timing rule): with `compile`,
    # compile_scope=layers and seq_bucket > 0, every micro-batch shape this process will see is
    # compiled before the clock starts, by one throwaway forward + backward per shape on a real
    # batch of that shape (no optimizer step; gradients dropped, the RNG state put back, before
    # DDP wraps the model), so the timed loop compiles nothing. train_metrics.json reports the
    # cost as train_prepare_s beside train_samples_per_s; false: compiled inside the timed loop.
    compile_warmup: bool = True
    # Length buckets, so compiled training sees few shapes. 0: every micro-batch is trimmed to its longest feature rounded up
    # to 8, as before (many shapes; `compile` then traces them dynamically). N > 0: rounded up to a
    # multiple of N instead (capped at the features' seq_len), so training sees at most
    # ceil(seq_len / N) shapes and `compile` builds one static graph per bucket. More padding per
    # row, so N > 0 turns on loss_mask_padding: padding then cannot change the loss.
    seq_bucket: int = 0
    # The span loss over real tokens only: start/end logits at padding positions are masked out of
    # the softmax. Off (HF's loss, as before): padding positions share the softmax, so how far a
    # batch is padded changes the loss a little. None: on when seq_bucket > 0. It changes what is
    # learned (slightly), so it is part of the model's recipe; seq_bucket itself is not.
    loss_mask_padding: Optional[bool] = None
    # DDP (world > 1 only; how fast, never what is learned). Gradients are all-reduced in buckets
    # of this many MB while the backward still runs: smaller buckets start communicating earlier
    # (less all-reduce tail after the last layer's backward) at more launches; None: DDP's 25.
    ddp_bucket_cap_mb: Optional[float] = None
    # The same parameters get gradients in the same order every step (true here: no unused
    # parameters, no control flow), so DDP may reorder buckets to the real gradient order after
    # the first step and skip its per-step bookkeeping. Off by default (DDP's default); with
    # `compile`, dynamo's DDPOptimizer and static_graph have not always agreed (pytorch#109261).
    ddp_static_graph: bool = False
    # Gradients live in DDP's communication buckets (views), so no copy between the two after
    # the all-reduce and ~1 gradient's worth less memory (436 MB at BERT-base); same numbers.
    ddp_gradient_as_bucket_view: bool = True
    # Gradients cross the GPUs in BF16 (DDP's bf16_compress_hook, NCCL only) or FP16 (fp16_compress_hook,
    # also gloo): half the bytes of FP32, so a shorter all-reduce tail after the backward; the
    # averaged gradient is rounded to 8 (BF16) or 11 (FP16) bits of mantissa before AdamW sees it.
    # "allreduce": FP32 through DDP's allreduce_hook, which averages each bucket with one division.
    # It saves launches only where the gradients are bucket views zeroed in place (train.graph_layers,
    # the graphed optimizer step): there DDP's own path divides every gradient on its own (~200 small
    # kernels a step at BERT-base). Where gradients are set to None, DDP copies and scales each in one
    # kernel, and the hook turns that into a copy plus a division per bucket (no saving). The numbers
    # are DDP's own at 2 or 4 processes (a division by a power of 2 is exact), not at 3.
    # "none": FP32, DDP's default. World > 1 only.
    ddp_comm_hook: str = "none"
    # The optimizer phase (clip, fused AdamW, zero the gradients) captured as one CUDA graph from
    # the third step on: one launch instead of ~4 ms of host work per step (training/optimizer_step.py
    # says what capture needs). CUDA with BF16/FP32 only: FP16's GradScaler decides on the host.
    graph_optimizer_step: bool = False
    # Python's cyclic garbage collector off inside the timed loop (objects alive before it frozen
    # out of its reach), and one collection at every epoch's end instead, on every rank at the same
    # step. Under DDP a collection on one rank stalls the others at the next all-reduce, so
    # threshold-triggered collections at different moments on N ranks cost up to N pauses a
    # step; aligned, they cost one (Megatron-LM's --manual-gc does this). The pauses the loop
    # did see are reported either way (train_metrics.json: gc_collections_in_loop, gc_pause_s).
    # Measured on 4 H100s (h100-scaling.md, host I): ~7 ms of pauses a whole run, no gain; off.
    manual_gc: bool = False
    # No step waits for the GPU (how fast, never what is learned). Host K's profile of the 4-GPU
    # graphed step (h100-scaling.md, host L's notes) found two host syncs a step: the logged loss
    # read with float() every log step (every step in a run of under 400 steps: 346 there) and
    # transformers asking `attention_mask.all()` in every forward that is not compiled whole.
    # Each drains the GPU's queue, and the GPU then idles while the host launches the next work
    # (~4 ms a step there). On: the loss is copied to pinned memory without a sync and read one log
    # step later; the encoder gets its mask built from the lengths the host already knows
    # (training/prepared_mask.py: the same mask tensor, or the same None). Off: both syncs, as before.
    no_host_sync: bool = True
    # Record this many optimizer steps with torch.profiler on rank 0, half-way through training
    # (after the first epoch: every length bucket compiled, allocator and cuBLAS warm), and write
    # a top-kernels table, the step time and the GPU idle fraction under
    # results/profiles/<time>-train-<model> (`bertqa-bench train --profile-steps N`). 0: off.
    profile_steps: int = 0
    # Refuse a fine-tune whose loss fell and climbed back (training/loss_check.py) before it is
    # saved. false: save it anyway, with the collapse recorded (train_collapsed), for a session
    # that wants the rows' timing on it; its accuracy columns then judge nothing.
    refuse_collapse: bool = True

    def __post_init__(self):
        if self.mixed_precision is False:  # YAML reads a bare `no` as false
            self.mixed_precision = "no"
        for k in ("epochs", "learning_rate", "warmup_ratio", "weight_decay"):
            setattr(self, k, _number(getattr(self, k), f"train.{k}"))
        # `not 0 < x < inf`: YAML's .nan passes every `<= 0` check, and a NaN epoch count plans no steps
        if not 0 < self.epochs < float("inf") or not 0 < self.learning_rate < float("inf") or self.batch_size < 1:
            raise ConfigError("train: epochs, learning_rate and batch_size must be positive (and finite)")
        if self.grad_accum < 1:
            raise ConfigError(f"train.grad_accum must be >= 1 (micro-steps per optimizer step), not {self.grad_accum}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1] (a share of the steps), not {self.warmup_ratio}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"train.num_threads must be >= 1 (or null: torch's default), not {self.num_threads}")
        if self.mixed_precision not in ("auto", "fp16", "bf16", "no"):
            raise ConfigError("train.mixed_precision must be auto, fp16, bf16 or no")
        if self.seq_bucket < 0 or self.profile_steps < 0:
            raise ConfigError("train.seq_bucket and train.profile_steps must be >= 0")
        if self.graph_layers and self.seq_bucket <= 0:
            raise ConfigError("train.graph_layers captures one set of CUDA graphs per micro-batch shape: it needs "
                              "train.seq_bucket > 0 (a bounded set of shapes)")
        if self.graph_layers and self.compile and self.compile_scope != "layers":
            raise ConfigError("train.graph_layers captures the layers, compiled in place or eager; with "
                              "train.compile it needs train.compile_scope=layers (a whole-model compile would trace "
                              "into the graphs' replay)")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(f"train.compile_scope {self.compile_scope!r} is unknown; valid: {', '.join(COMPILE_SCOPES)}")
        if self.ddp_comm_hook not in DDP_COMM_HOOKS:
            raise ConfigError(f"train.ddp_comm_hook {self.ddp_comm_hook!r} is unknown; valid: {', '.join(DDP_COMM_HOOKS)}")
        if self.ddp_bucket_cap_mb is not None and self.ddp_bucket_cap_mb <= 0:
            raise ConfigError("train.ddp_bucket_cap_mb must be positive (or null: DDP's default)")
        if self.loss_mask_padding is None:
            self.loss_mask_padding = self.seq_bucket > 0
        if self.seq_bucket > 0 and not self.loss_mask_padding:
            raise ConfigError("train.seq_bucket pads micro-batches further; it needs train.loss_mask_padding=true "
                              "(or unset), else the padding would change the loss and the model")


@dataclass
class TaskConfig:
    """``task:`` — which task, plus that task's own options (a dataclass the task declares,
    filled in by ``suite.load_suite``; see ``tasks/<name>/task.py``)."""

    name: str = "squad"
    options: Any = None


@dataclass
class BenchConfig:
    backends: list = field(default_factory=lambda: ["eager-fp32"])  # variant names (builtin or `variants:`)
    reference: str = "eager-fp32"
    batch_size: int = 32
    batching: str = "padded"  # padded | trimmed | sorted (see schedule.py)
    # sorted/trimmed: sequence lengths are rounded up to a multiple of this (a bounded set of shapes)
    seq_multiple: int = 32
    # sorted: tokens per batch (default batch_size x max_seq_len, the padded plan's batch), and
    # the most rows one batch may hold
    tokens_per_batch: Optional[int] = None
    max_batch_rows: Optional[int] = None
    warmup_batches: int = 3
    # rounds: every row's process stays alive and the rows are timed one pass each per round, in
    # a rotating order, each row's speedup taken against the reference's pass of the same round
    # (measuring/rounds.py); block: each row's passes in one block, one row after the other.
    timing: str = "rounds"
    # block: passes repeat until both are reached. rounds: min_passes is the fewest rounds.
    min_passes: int = 3
    min_duration_s: float = 1.0
    # rounds: the first min_passes fix how many run: enough for every row's interval to reach
    # +-target_halfwidth_pct at their spread, within max_rounds and rounds_budget_s (seconds of rounds)
    max_rounds: int = 20
    rounds_budget_s: float = 600.0
    target_halfwidth_pct: float = 5.0
    # rounds: a between-run spread (percent, one standard deviation of a row's log speedup from
    # run to run on this machine) added to every interval: what shifts a whole run (the host's
    # state over tens of minutes, where the VM's cores land) moves every round of it alike, so
    # no spread inside a run shows it. 0: the interval counts the rounds and processes only.
    # Measure it once per machine class from reruns (scripts/rerun_table.py prints it).
    rerun_spread_pct: float = 0.0
    # a run whose calibration workload (timed each round) varied more than this, as a coefficient
    # of variation in percent, is marked noisy
    noise_cv_pct: float = 10.0
    # rounds: the worker processes each row's passes come from, taking turns by round (fewer where
    # memory does not hold them); the interval then includes the spread between processes
    processes: int = 2
    # rounds: the spread between processes estimated once for the run, pooled over its rows (each
    # row's own estimate from two processes has one degree of freedom: t 12.7, and one unlucky pair
    # of processes gives an interval several times too wide); false: each row's own
    pool_process_spread: bool = True
    num_threads: Optional[int] = None
    isolation: str = "process"  # process: each variant in its own spawned process; inprocess: debugging/tests
    timeout_s: float = 1800.0  # per variant (prepare + warm-up + timed passes); past it the child is killed
    keep_outputs: bool = False  # keep every variant's logits in the run folder (the reference's are always kept)
    # cpu | cuda: where a variant name that exists on both devices runs (eager-fp32, eager-bf16);
    # unset: cpu. Names on one device only run there whatever this says.
    device: Optional[str] = None

    def __post_init__(self):
        if not self.backends:
            raise ConfigError("bench.backends is empty")
        bad = [b for b in self.backends if not isinstance(b, str)]
        if bad:
            raise ConfigError(f"bench.backends must be a list of variant names, not {bad[0]!r}")
        if self.batch_size < 1:
            raise ConfigError("bench.batch_size must be >= 1")
        if self.batching not in BATCHINGS:
            raise ConfigError(f"bench.batching '{self.batching}' is not one of {', '.join(BATCHINGS)}")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench.device '{self.device}' is not one of cpu, cuda")
        if self.isolation not in ISOLATIONS:
            raise ConfigError(f"bench.isolation '{self.isolation}' is not one of {', '.join(ISOLATIONS)}")
        if self.warmup_batches < 1:
            raise ConfigError("bench.warmup_batches must be >= 1: never time a cold backend")
        if self.min_passes < 1:
            raise ConfigError("bench.min_passes must be >= 1")
        if self.timing not in TIMINGS:
            raise ConfigError(f"bench.timing '{self.timing}' is not one of {', '.join(TIMINGS)}")
        if self.max_rounds < self.min_passes:
            raise ConfigError(f"bench.max_rounds ({self.max_rounds}) must be >= bench.min_passes ({self.min_passes})")
        for k in ("rounds_budget_s", "target_halfwidth_pct", "noise_cv_pct"):
            setattr(self, k, _number(getattr(self, k), f"bench.{k}"))
            if not 0 < getattr(self, k) < float("inf"):
                raise ConfigError(f"bench.{k} must be a positive number, not {getattr(self, k)}")
        self.rerun_spread_pct = _number(self.rerun_spread_pct, "bench.rerun_spread_pct")
        if not 0 <= self.rerun_spread_pct < 100:
            raise ConfigError(f"bench.rerun_spread_pct must be a percentage from 0 to under 100, not {self.rerun_spread_pct}")
        if self.seq_multiple < 1:
            raise ConfigError("bench.seq_multiple must be >= 1")
        if not isinstance(self.pool_process_spread, bool):
            raise ConfigError(f"bench.pool_process_spread must be true or false, not {self.pool_process_spread!r}")
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or self.processes < 1:
            raise ConfigError(f"bench.processes must be a whole number >= 1, not {self.processes!r}")
        for k in ("tokens_per_batch", "max_batch_rows", "num_threads"):
            v = getattr(self, k)
            if v is not None and v < 1:  # the plans would fall back to one-row batches without a word
                raise ConfigError(f"bench.{k} must be >= 1 (or null: the default), not {v}")
        self.min_duration_s = _number(self.min_duration_s, "bench.min_duration_s")
        self.timeout_s = _number(self.timeout_s, "bench.timeout_s")
        # `not >`: YAML's .nan passes every `<=` check, and a NaN limit never kills a hung child
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError(f"bench.timeout_s must be a positive number of seconds, not {self.timeout_s}")
        if not 0 <= self.min_duration_s < float("inf"):
            raise ConfigError(f"bench.min_duration_s must be a number of seconds >= 0, not {self.min_duration_s}")


SCENARIOS = ("SingleStream", "Server", "Offline")


@dataclass
class LoadGenConfig:
    """``loadgen:`` — MLPerf LoadGen settings for ``bertqa-bench loadgen`` (see loadgen.py).

    The evaluation set is LoadGen's query sample library, one sample = one feature (as in MLPerf's
    BERT); each variant is the system under test in its own worker process. LoadGen's defaults are
    MLPerf's (130 ms at the 99th percentile is its Server bound for BERT); durations and query
    counts are the suite's, so a CI suite can run a scenario in seconds.
    """

    min_duration_ms: int = 10000
    max_duration_ms: int = 0  # 0: no limit
    # LoadGen's early stopping needs enough queries to bound the percentile with 99% confidence:
    # ~460 for Server at p99 with none over the bound, ~64 for SingleStream at p90.
    min_query_count: int = 1024
    max_query_count: int = 0  # 0: no limit
    performance_sample_count: Optional[int] = None  # samples LoadGen may draw from (None: every feature)
    single_stream_target_latency_percentile: float = 0.90
    # None: from the same process's bench throughput (bench features/s x server_qps_fraction)
    server_target_qps: Optional[float] = None
    server_qps_fraction: float = 0.5
    # Offline: LoadGen sizes its one query as expected QPS x min_duration (+10%); the expected QPS
    # is the same process's bench throughput times this. Above 1 guards against a run that ends
    # before min_duration (INVALID) when LoadGen's rate beats the bench's, at the cost of a longer
    # run (2: about twice min_duration); a 600 s run may take 1.0, since LoadGen's rate stays at or
    # below the bench passes' (it adds its own per-query work)
    offline_qps_hint: float = 2.0
    server_target_latency_ns: int = 130_000_000
    server_target_latency_percentile: float = 0.99
    # The SUT's dynamic batcher: at most this many samples a batch (None: the variant's batch
    # size), a batch leaves when full or when its oldest sample has waited max_wait_us
    server_max_batch: Optional[int] = None
    server_max_wait_us: int = 2000
    # Server batches outstanding at once, capped by the backend's own window (Backend.in_flight():
    # two a CUDA stream for torch's pipeline; 1 for a synchronous backend); 0 takes that window
    # whole, 1 collects each batch before the next is formed. Two keep a batch on each of two
    # CUDA streams: on an H200 (BERT-large, packed FP8, two streams) the Server peak rose from
    # 5,855 to 6,296 QPS with 2, and 4 reached the same peak at a p99 of 115 ms against 98 ms
    # (results/reference/h200-mlperf-bert-large-server-in-flight.md)
    server_in_flight: int = 2
    # Batch sizes a Server batch is padded up to (each x every sequence bucket is a shape to
    # compile / capture in prepare); empty: powers of two up to server_max_batch
    server_batch_sizes: list = field(default_factory=list)
    # LoadGen may hand several due queries to one IssueQuery call (fewer Python callbacks at
    # thousands of QPS); arrival times and latencies are still per query
    server_coalesce_queries: bool = False
    # --find-peak-qps: double the target until INVALID, then bisect to this relative precision
    peak_precision: float = 0.05
    peak_max_runs: int = 14
    # Time the bench passes in the same worker (after warm-up, before LoadGen): the Offline
    # cross-check and the Server peak's share of bench throughput come from one process
    compare_bench: bool = True
    # False: the reference variant runs LoadGen's accuracy run alone, as one Offline query whatever
    # the scenario (its answers are what every row is judged against), with no bench passes and no
    # performance run, so its row has no QPS and the others no "x reference". On an H200 the eager
    # FP32 reference's full Offline row took ~8 of a 30-minute device session (184 features/s:
    # bench passes, a 59 s accuracy run, a 265 s performance query) to give a QPS nobody deploys
    reference_performance: bool = True
    seed: int = 0  # LoadGen's qsl / sample-index / schedule seeds

    def __post_init__(self):
        for k in ("min_duration_ms", "max_duration_ms", "min_query_count", "max_query_count", "server_max_wait_us",
                  "server_in_flight"):
            if getattr(self, k) < 0:
                raise ConfigError(f"loadgen.{k} must be >= 0")
        if self.min_query_count < 1:
            raise ConfigError("loadgen.min_query_count must be >= 1")
        for k in ("single_stream_target_latency_percentile", "server_target_latency_percentile"):
            if not 0.0 < getattr(self, k) < 1.0:
                raise ConfigError(f"loadgen.{k} must be in (0, 1)")
        if self.server_target_qps is not None and self.server_target_qps <= 0:
            raise ConfigError("loadgen.server_target_qps must be positive")
        if not 0.0 < self.offline_qps_hint:
            raise ConfigError("loadgen.offline_qps_hint must be positive")
        if not 0.0 < self.server_qps_fraction:
            raise ConfigError("loadgen.server_qps_fraction must be positive")
        if self.server_target_latency_ns <= 0:
            raise ConfigError("loadgen.server_target_latency_ns must be positive")
        if self.server_max_batch is not None and self.server_max_batch < 1:
            raise ConfigError("loadgen.server_max_batch must be >= 1")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.server_batch_sizes):
            raise ConfigError(f"loadgen.server_batch_sizes must be positive integers, not {self.server_batch_sizes!r:.80}")
        if self.performance_sample_count is not None and self.performance_sample_count < 1:
            raise ConfigError("loadgen.performance_sample_count must be >= 1")
        if not 0.0 < self.peak_precision < 1.0 or self.peak_max_runs < 2:
            raise ConfigError("loadgen: peak_precision must be in (0, 1) and peak_max_runs >= 2")


@dataclass
class VariantConfig:
    """One entry of a suite's ``variants:`` section: a backend variant declared in YAML.

    Either ``base`` (an existing variant whose implementation, device and options it starts
    from) or ``implementation`` (``torch``, ``onnxruntime``, ``tensorrt``, an entry-point name,
    or ``package.module:Class``) with ``device``. ``options`` are checked against the
    implementation's typed options (unknown keys fail with the valid ones listed).
    """

    base: Optional[str] = None
    implementation: Optional[str] = None
    device: Optional[str] = None
    options: dict = field(default_factory=dict)
    description: str = ""
    timeout_s: Optional[float] = None  # this variant's time limit, instead of bench.timeout_s
    # this variant's batching / batch size, instead of the bench section's (e.g. a sorted
    # variant in a padded suite: both rows in one table, against one reference)
    batching: Optional[str] = None
    batch_size: Optional[int] = None
    # data-parallel prediction: this many GPUs, one worker process each, every one taking a
    # length-balanced share of the plan; logits gathered back in dataset order
    devices: Optional[int] = None

    def __post_init__(self):
        if self.timeout_s is not None:
            self.timeout_s = _number(self.timeout_s, "variant timeout_s")
            if not 0 < self.timeout_s < float("inf"):
                raise ConfigError(f"variant timeout_s must be a positive number of seconds, not {self.timeout_s}")
        if self.devices is not None and self.devices < 1:
            raise ConfigError("variant devices must be >= 1")
        if self.batching is not None and self.batching not in BATCHINGS:
            raise ConfigError(f"variant batching '{self.batching}' is not one of {', '.join(BATCHINGS)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError("variant batch_size must be >= 1")
        if bool(self.base) == bool(self.implementation):
            raise ConfigError("a variant needs exactly one of 'base' (an existing variant) or 'implementation'")
        if self.implementation and ":" in self.implementation and not _IMPORT_PATH.match(self.implementation):
            # importlib would fail with TypeError/ValueError on e.g. '.:x' or 'a..b:C'
            raise ConfigError(f"variant implementation '{self.implementation}' is not an import path "
                              "of the form package.module:Class")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"variant device '{self.device}' is not one of cpu, cuda")
        if not isinstance(self.options, dict):
            raise ConfigError("variant options must be a mapping")


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
    # Allowed |score - expected|: in questions (each worth 100/n_questions points; a model
    # retrained on another CPU moves by a question or two), or else in points.
    expected_tolerance_questions: Optional[int] = None
    expected_tolerance: float = 0.5

    def __post_init__(self):
        if isinstance(self.fp32, dict):
            self.fp32 = Tolerance(**self.fp32)
        if isinstance(self.reduced, dict):
            self.reduced = Tolerance(**self.reduced)
        self.overrides = {k: (v if isinstance(v, Tolerance) else build(Tolerance, v, f"parity.overrides.{k}"))
                          for k, v in (self.overrides or {}).items()}
        if not self.expected_tolerance >= 0:  # `not >=`: a NaN would pass every score
            raise ConfigError(f"parity.expected_tolerance must be >= 0 points, not {self.expected_tolerance}")
        if self.expected_tolerance_questions is not None and self.expected_tolerance_questions < 0:
            raise ConfigError("parity.expected_tolerance_questions must be >= 0 (or null: use expected_tolerance), "
                              f"not {self.expected_tolerance_questions}")


# Later-added fields -> their defaults (user checkpoints, SQuAD v2.0, the padding-masked loss). At the default they
# are left out of model recipes (train.py) and evaluation-set keys (evalset.py), which then stay
# what they were before the fields existed: models and caches made earlier are still found.
ADDED_DEFAULTS = {"model.checkpoint": None, "model.allow_pickle": False, "data.synthetic.unanswerable": 0.0,
                  "task_options.null_score_diff_threshold": 0.0, "task_options.version_2": None,
                  "train.loss_mask_padding": False}

# What `bertqa-bench train` writes beside a saved model (train.py), and what reads it (scaling.py).
METRICS_FILE = "train_metrics.json"


@dataclass
class SuiteConfig:
    name: str = "default"
    description: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    loadgen: LoadGenConfig = field(default_factory=LoadGenConfig)  # `bertqa-bench loadgen` (loadgen.py)
    variants: dict = field(default_factory=dict)  # {name: VariantConfig}
    models_dir: str = "models"
    results_dir: str = "results"
    cache_dir: str = "cache"  # evaluation sets built once (see evalset.py)

    def __post_init__(self):
        for name, cls in (("data", DataConfig), ("task", TaskConfig), ("model", ModelConfig),
                          ("train", TrainConfig), ("bench", BenchConfig), ("parity", ParityConfig),
                          ("loadgen", LoadGenConfig)):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, build(cls, getattr(self, name), name))
        bad = [k for k in (self.variants or {}) if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"variants: variant names must be strings, not {bad[0]!r}")
        self.variants = {k: v if isinstance(v, VariantConfig) else build(VariantConfig, v or {}, f"variants.{k}")
                         for k, v in (self.variants or {}).items()}
        # The reference always runs first: parity and speedup are measured against it.
        self.bench.backends = [self.bench.reference] + [b for b in self.bench.backends if b != self.bench.reference]

    # Paths resolve against the project root so the CLI works from any directory.
    @property
    def model_dir(self) -> Path:
        return resolve_path(self.models_dir) / self.model.name

    @property
    def artifacts_root(self) -> Path:
        return resolve_path(self.models_dir) / "artifacts" / self.model.name

    @property
    def results_root(self) -> Path:
        return resolve_path(self.results_dir)

    @property
    def cache_root(self) -> Path:
        return resolve_path(self.cache_dir)

    @property
    def folders(self) -> dict[str, Path]:
        """The folders a run writes to, by the name its settings give them (``<name>_dir``)."""
        return {"results": self.results_root, "cache": self.cache_root, "models": resolve_path(self.models_dir)}

    def evalset_spec(self) -> "EvalSetSpec":
        """What the data stage takes from the suite (the sections it needs, not the whole config)."""
        return EvalSetSpec(self.data, self.task.options, self.train.seed, self.cache_root)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EvalSetSpec:
    """What an evaluation (or training) set is made from: the data section, the task's own options,
    the training seed (NQ samples its training windows with it) and the cache folder. The data
    stage and the tasks take this, not the whole suite."""
    data: DataConfig
    options: Any  # the task's Options dataclass (TaskConfig.options)
    seed: int = 0
    cache_root: Path = Path("cache")


def _number(value, where: str) -> float:
    try:  # YAML 1.1 reads "1e-4" (no dot) as a string
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float range (10**400)
        raise ConfigError(f"{where} must be a number, not {value!r:.80}") from None


def resolve_path(p: str | os.PathLike) -> Path:
    p = Path(p)
    return p if p.is_absolute() else PROJECT_ROOT / p


def _simple_types(hint) -> Optional[tuple]:
    """(types...) a field accepts when its annotation is a plain scalar (or Optional of one)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        got = _simple_types(inner[0]) if len(inner) == 1 else None
        return None if got is None else got + (type(None),)
    return (hint,) if hint in (bool, int, float, str) else None


def _check_type(value, hint, where: str):
    """Scalars are checked (a typo'd type fails here, not deep inside a run); ints pass for
    floats and YAML-1.1 strings like "1e-4" become floats; nested dataclasses are built."""
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(inner) == 1 and typing.get_origin(hint) in (typing.Union, types.UnionType)
    target = inner[0] if optional else hint
    if dataclasses.is_dataclass(target):
        if isinstance(value, dict):
            return build(target, value, where)
        if isinstance(value, target) or (value is None and optional):
            return value
        # e.g. `data: [1]` or `data:` (null): would crash later as an AttributeError on the list
        raise ConfigError(f"{where} must be a mapping, not {value!r:.80}")
    if target in (dict, list) and value is not None and not isinstance(value, target):
        # null passes as before (`variants:` with every entry commented out)
        raise ConfigError(f"{where} must be a {'mapping' if target is dict else 'list'}, not {value!r:.80}")
    accepted = _simple_types(hint)
    if accepted is None or isinstance(value, accepted) and not (isinstance(value, bool) and bool not in accepted):
        return value
    if float in accepted and isinstance(value, (int, str)) and not isinstance(value, bool):
        return _number(value, where)
    names = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
    raise ConfigError(f"{where} must be {names}, not {value!r}")


def build(cls, values: dict, where: str):
    """A dataclass from a mapping: unknown keys fail with the valid ones listed, scalar types are
    checked, nested dataclass fields are built the same way; __post_init__ validates the rest."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping, not {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        # YAML keys need not be strings (`1: x`, `null: x`): sort and show them as text
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(k if isinstance(k, str) else repr(k) for k in unknown))}; "
                          f"valid: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _check_type(v, hints.get(k), f"{where}.{k}") for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
