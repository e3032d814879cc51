"""Scaling tables: throughput on 1, 2 and 4 GPUs of one host, as a view of what the runs saved.

Training rows come from each model's ``train_metrics.json`` (one torchrun per GPU count),
prediction rows from a sweep's result bundle over ``--devices`` (one row per GPU count). Scaling
efficiency is samples/s on N GPUs over N x the 1-GPU samples/s *of the same series on the same
host*: a series is one recipe (training: every recipe field but the model's name, the rows each
GPU computes per micro-step, and whether the step was compiled, on which length buckets;
prediction: backend, batching and batch size), so a ratio is never taken across recipes, machines
or runs of another kind. Training rows also give the last epoch's rate and its efficiency: a
compiled run pays its compilation (once per length bucket, on every rank at once) in the first
epoch, so the whole run's rate mixes a fixed cost into what scales. A run that compiled every
shape before its clock (``train.compile_warmup``) reports that cost apart, as prepare time, and is
a series of its own.

    bertqa-bench scaling hostA:models/m-gpus1 hostA:models/m-gpus2 hostA:results/predict-run \\
        --out results/reference/h100-scaling --title "..."
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import METRICS_FILE
from ..errors import BenchError
from ..io import atomic_write_text
from ..record.results import RunBundle, read_json_object, rows_to_csv
from .sweep import without_devices


@dataclass(frozen=True)
class ScalingRow:
    job: str  # train | predict
    n_gpus: int
    card: str
    host: str  # a label: efficiencies are only taken within one host
    series: str  # what must match for two rows to be compared (see the module doc)
    samples_per_s: float  # training samples/s, or prediction features/s
    dev_f1: Optional[float] = None
    dev_em: Optional[float] = None
    efficiency: Optional[float] = None
    last_epoch_samples_per_s: Optional[float] = None  # training: the last epoch alone (None for one epoch)
    last_epoch_efficiency: Optional[float] = None
    parity: str = ""  # prediction: the row's parity verdict against its run's reference (training: n/a)
    global_batch: Optional[int] = None
    rows_per_gpu: Optional[int] = None  # rows per GPU per micro-step (training) / batch size (prediction)
    grad_accum: Optional[int] = None
    train_features: Optional[int] = None
    train_steps: Optional[int] = None
    train_s: Optional[float] = None
    # training: compiling before the clock (train.compile_warmup), outside train_s and samples_per_s
    prepare_s: Optional[float] = None
    gpu_util_mean_pct: Optional[float] = None
    date: str = ""
    command: str = ""
    source: str = ""  # the file or bundle the row was read from
    # the series whose 1-GPU row is this row's denominator, where it is not the row's own: a run
    # that differs only in DDP settings (a comm hook, buckets, static graph) scales against the
    # 1-GPU run without them, since one process builds no DDP and those settings do nothing there
    baseline_series: str = ""


def _series_id(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _ddp_how(ddp: dict) -> str:
    """DDP settings (as the run read them back) that differ from DDP's defaults: a run with one of
    them is its own series, never a point of the default one's."""
    return ((", DDP static graph" if ddp.get("static_graph") else "")
            + (f", {ddp['bucket_cap_mb']:g} MB buckets" if ddp.get("bucket_cap_mb") not in (None, 25.0) else "")
            + (", gradients copied into buckets" if ddp.get("gradient_as_bucket_view") is False else ""))


def _hook_how(hook: str) -> str:
    """The DDP communication hook, when one is registered: its own series."""
    if hook == "none":
        return ""
    return ", FP32 all-reduce hook (one division a bucket)" if hook == "allreduce" else f", {hook.upper()} all-reduce"


def train_row(metrics: dict, *, host: str, source: str = "", card: str = "", date: str = "",
              command: str = "") -> ScalingRow:
    """One training run (all its ranks) as a row. ``card``, ``date`` and ``command`` fill in what
    metrics saved before those fields existed lack; what the metrics hold wins."""
    def need(key):
        if key not in metrics:
            raise BenchError(f"{source or 'train metrics'}: field '{key}' is missing; is this a train_metrics.json "
                             "written by bertqa-bench train?")
        return metrics[key]

    world, gb, accum = int(need("world_size")), int(need("global_batch")), int(metrics.get("grad_accum", 1))
    rows = gb // (world * accum)
    recipe = {k: v for k, v in (metrics.get("recipe_fields") or {}).items() if k != "model.name"}
    card = metrics.get("device_name") or card
    def how(ddp_settings: bool) -> str:
        return (f", compiled ({metrics.get('compile_scope') or 'model'})" if metrics.get("compile") else "") \
            + (f", {metrics['seq_bucket']}-token buckets" if metrics.get("seq_bucket") else "") \
            + (", compiled before the clock" if metrics.get("train_warmup_shapes") else "") \
            + (", graphed optimizer step" if metrics.get("optimizer_step") == "cuda-graph" else "") \
            + (_hook_how(metrics.get("ddp_comm_hook", "none")) + _ddp_how(metrics.get("ddp") or {})
               if ddp_settings else "") \
            + (", manual GC" if metrics.get("manual_gc") else "") \
            + (", layers as CUDA graphs" if metrics.get("graph_layers") else "") \
            + (", no host sync" if metrics.get("no_host_sync") else "")
    epochs = metrics.get("train_epoch_s") or []
    sps = float(need("train_samples_per_s"))
    last = (sps * float(metrics["train_s"]) / len(epochs) / float(epochs[-1])
            if len(epochs) > 1 and metrics.get("train_s") and epochs[-1] else None)
    if not card:
        raise BenchError(f"{source}: the metrics do not name the GPU (saved before 'device_name' existed); "
                         "pass --card")
    head = f"train {_series_id(recipe)}: global batch {gb}, {rows} rows/GPU, {need('train_features')} features"
    # one process builds no DDP: its hook or bucket settings (recorded as asked) did nothing
    series, baseline = head + how(world > 1), head + how(False)
    return ScalingRow(
        job="train", n_gpus=world, card=card, host=host, series=series,
        baseline_series=baseline if baseline != series else "",
        samples_per_s=sps, last_epoch_samples_per_s=last, dev_f1=metrics.get("dev_f1"),
        dev_em=metrics.get("dev_exact_match"), global_batch=gb, rows_per_gpu=rows, grad_accum=accum,
        train_features=metrics.get("train_features"), train_steps=metrics.get("train_steps"),
        train_s=metrics.get("train_s"),
        prepare_s=metrics.get("train_prepare_s") if metrics.get("train_warmup_shapes") else None,
        gpu_util_mean_pct=metrics.get("gpu_utilization_mean_pct"),
        date=metrics.get("date") or date, command=metrics.get("command") or command, source=source)


def predict_rows(bundle: RunBundle, *, host: str) -> list[ScalingRow]:
    """The rows of a bundle that ran data-parallel (the ones with ``n_devices``), and their
    1-device counterparts; F1/EM are the dev scores of that prediction."""
    out = []
    for r in bundle.results:
        if not r.ok or not r.n_devices or r.features_per_s is None:
            continue
        base = without_devices(r.backend)
        out.append(ScalingRow(
            job="predict", n_gpus=int(r.n_devices), card=r.device_name or bundle.meta.device_name, host=host,
            series=f"predict {base}: {r.batching}, batch {r.batch_size}, {r.precision}",
            samples_per_s=float(r.features_per_s), dev_f1=r.scores.get("f1"), dev_em=r.scores.get("exact_match"),
            parity=r.parity, rows_per_gpu=r.batch_size, date=bundle.meta.date, command=bundle.meta.command, source=str(bundle.dir)))
    # a series needs more than one GPU count to be a scaling series
    counts: dict[str, set] = {}
    for row in out:
        counts.setdefault(row.series, set()).add(row.n_gpus)
    return [row for row in out if len(counts[row.series]) > 1]


def with_efficiency(rows: list[ScalingRow]) -> list[ScalingRow]:
    """Efficiency against the 1-GPU row of the same job, host and series, or of the row's baseline
    series where it has one and its own series has no 1-GPU row (None where there is none). Where a
    series has several 1-GPU rows (one beside other jobs, one alone on the host), the fastest is the
    denominator, by the whole run's rate: the lowest efficiency, so a slow 1-GPU run never flatters
    the scaling. The last epoch's efficiency is taken against that same run (one denominator a row).
    A 1-GPU row without a finite positive rate is never a denominator."""
    one: dict[tuple, ScalingRow] = {}
    for r in rows:
        key, rate = (r.job, r.host, r.series), r.samples_per_s
        if (r.n_gpus == 1 and rate is not None and math.isfinite(rate) and rate > 0
                and (key not in one or rate > one[key].samples_per_s)):
            one[key] = r

    def eff(r: ScalingRow, field: str) -> Optional[float]:
        base = one.get((r.job, r.host, r.series)) or (one.get((r.job, r.host, r.baseline_series))
                                                      if r.baseline_series else None)
        mine, theirs = getattr(r, field), getattr(base, field) if base else None
        return mine / (r.n_gpus * theirs) if mine and theirs else None

    return [dataclasses.replace(r, efficiency=eff(r, "samples_per_s"),
                                last_epoch_efficiency=eff(r, "last_epoch_samples_per_s")) for r in rows]


def commands_from_log(text: str) -> dict[str, str]:
    """``model name -> command`` from a log that printed each command (a device run's
    driver log: ``HH:MM:SS start NAME: COMMAND``), for metrics saved before they kept their command."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"start [^:]+: (.*model\.name=(\S+).*)$", line)
        if m and m.group(2) not in out:
            cmd = m.group(1)
            out[m.group(2)] = ("torchrun " + cmd.split("torch.distributed.run ", 1)[1]
                               if "torch.distributed.run " in cmd else "bertqa-bench " + cmd.split("bertqa_bench.cli ", 1)[-1])
    return out


def load_rows(sources: list[str], *, card: str = "", date: str = "", commands: Optional[dict] = None) -> list[ScalingRow]:
    """``[HOST:]PATH`` sources: a model folder (its train_metrics.json) or a result bundle."""
    rows = []
    for spec in sources:
        host, _, path = spec.partition(":") if ":" in spec else ("", "", spec)
        host, p = host or "host", Path(path)
        if (p / METRICS_FILE).exists():
            metrics = read_json_object(p / METRICS_FILE)
            name = (metrics.get("recipe_fields") or {}).get("model.name", p.name)
            rows.append(train_row(metrics, host=host, source=str(p / METRICS_FILE), card=card, date=date,
                                  command=(commands or {}).get(name, "")))
        elif (p / "run.json").exists():
            rows += predict_rows(RunBundle.load(p), host=host)
        else:
            raise BenchError(f"{p}: neither a model folder with {METRICS_FILE} nor a result bundle with run.json")
    return with_efficiency(rows)


def _num(v: Optional[float], digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.1%}"


def markdown(rows: list[ScalingRow], title: str, notes: str = "") -> str:
    lines = [f"# {title}", ""] + ([notes.strip(), ""] if notes else [])
    groups: dict[tuple, list[ScalingRow]] = {}
    for r in rows:
        groups.setdefault((r.job, r.host, r.series), []).append(r)
    ones = collections.Counter((r.job, r.host, r.series) for r in rows if r.n_gpus == 1)
    for (job, host, series), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.n_gpus)
        unit = "training samples/s" if job == "train" else "features/s"
        lines += [f"## {series} — {host}, {rs[0].card}", ""]
        borrowed = {r.baseline_series for r in rs if r.baseline_series and r.efficiency is not None} \
            if not ones[(job, host, series)] else set()
        lines += [f"Scaling efficiency against the {'fastest ' if ones[(job, host, b)] > 1 else ''}1-GPU row of "
                  f"*{b}* on {host} (DDP settings do nothing in one process).\n" for b in sorted(borrowed)]
        if ones[(job, host, series)] > 1:
            lines += ["Scaling efficiency against the fastest of this series' 1-GPU rows.\n"]
        lines += [f"| GPUs | {unit} | scaling efficiency |"
                  + (" last epoch samples/s | last epoch efficiency |" if job == "train" else "")
                  + " dev EM | dev F1 |"
                  + (" time (s) | prepare (s) | mean GPU util (rank 0) |" if job == "train" else " parity (same run) |"),
                  "|---|---|---|---|---|" + ("---|---|---|---|---|" if job == "train" else "---|")]
        for r in rs:
            lines.append(f"| {r.n_gpus} | {r.samples_per_s:,.0f} | {_pct(r.efficiency)} |"
                         + (f" {'—' if r.last_epoch_samples_per_s is None else f'{r.last_epoch_samples_per_s:,.0f}'} |"
                            f" {_pct(r.last_epoch_efficiency)} |"
                            if job == "train" else "")
                         + f" {_num(r.dev_em)} | {_num(r.dev_f1)} |"
                         + (f" {_num(r.train_s, 1)} | {_num(r.prepare_s, 1)} | {_num(r.gpu_util_mean_pct, 0)}% |"
                            if job == "train"
                            else f" {r.parity or '—'} |"))
        lines += ["", "Commands (" + ", ".join(sorted({r.date for r in rs if r.date})) + "):", ""]
        lines += [f"- {r.n_gpus} GPU{'s' if r.n_gpus > 1 else ''}: `{r.command or 'not recorded'}`"
                  for r in rs if r.job == "train"] or [f"- `{rs[0].command}`"]
        lines.append("")
    return "\n".join(lines)


def write_reference(rows: list[ScalingRow], out_stem: Path, title: str, notes: str = "") -> str:
    md = markdown(rows, title, notes)
    atomic_write_text(Path(str(out_stem) + ".md"), md)
    atomic_write_text(Path(str(out_stem) + ".csv"), rows_to_csv([dataclasses.asdict(r) for r in rows]))
    return md
