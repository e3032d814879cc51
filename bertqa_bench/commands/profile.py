"""``bertqa-bench profile``: a torch.profiler trace and a top-kernels table for one backend.

Profiles a few real batches of the suite's plan after prepare and warm-up. On CUDA the table
ranks device kernels by total device time (that is what limits throughput); on CPU it ranks
operators by self CPU time.
Works for every backend, ONNX Runtime and TensorRT included, because their kernels show up
in the CUDA activity stream even though their operators are not torch ops. A packed row on a
card of known peaks also gets ``floors.csv`` / ``floors.md``: each layer role's time over the
profiled batches beside its FLOP or byte floor (measuring/kernel_floors.py).
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np

from ..backends.transforms.fp8_rules import parse_gemms
from ..backends.variants import VariantTable
from ..config import SuiteConfig
from ..data.evalset import load_evalset
from ..errors import BackendUnavailableError
from ..envinfo import device_name
from ..measuring.flops import model_dims
from ..measuring.jobs import plan_for, plan_key
from ..measuring.kernel_floors import FP16, PEAKS, Recipe, floors_table, role_floors, role_times, trace_kernels
from ..measuring.runner import make_context, materialize, stream, warm_up
from ..measuring.trace_tables import write_profile
from ..tasks import get_task


def profile_backend(cfg: SuiteConfig, name: str, *, n_batches: int = 5, top: int = 25,
                    clock_mhz: float | None = None) -> dict:
    """Prepare and warm up one variant in this process, then profile ``n_batches`` real batches.
    ``clock_mhz``: the SM clock the floors assume (default the card's boost; a power-capped H200
    runs ~1,650-1,750 MHz, read from a bench row's NVML median)."""
    from torch.profiler import ProfilerActivity, profile

    from .provision import ensure_model

    variant = VariantTable.for_suite(cfg.variants, cfg.bench.device).get(name)
    reason = variant.unavailable_reason()
    if reason:
        raise BackendUnavailableError(f"{name}: {reason}")
    task = get_task(cfg.task.name)
    model = ensure_model(cfg, print, None)
    evalset = load_evalset(cfg.evalset_spec(), task, str(model.dir), log=print)
    plan = plan_for(cfg.bench, evalset, plan_key(cfg.bench, variant), cfg.data.target_eval_features)
    batches = materialize(evalset.features.inputs(), plan)
    ctx = make_context(model.dir, task.name, cfg.artifacts_root / name, task.output_names, plan, batches,
                       evalset.features.seq_len)
    backend = variant.create()
    cuda = variant.device == "cuda"
    try:
        backend.prepare(ctx)
        warm_up(backend, plan, batches, cfg.bench.warmup_batches)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, record_shapes=True) as prof:
            # the timed runner's own loop: a backend that keeps batches in flight is profiled so
            for _ in stream(backend, batches[:max(1, n_batches)]):
                pass
    finally:
        backend.close()

    out = Path(cfg.results_root) / "profiles" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    res = write_profile(prof, out, cuda, top=top)
    peak = PEAKS.get(device_name(variant.device)) if cuda else None
    floors = None
    if peak is not None and plan.batching == "packed" and variant.precision in ("fp8", "fp16", "bf16"):
        floors = _floors(variant, plan.batches[:max(1, n_batches)], evalset.lengths(), model.dir, res["trace"], out,
                         peak, clock_mhz or peak.boost_mhz)
    return {**{k: res[k] for k in ("dir", "trace", "top_csv", "table", "rows", "gpu_idle")}, "floors": floors}


def _floors(variant, profiled, all_lengths, model_dir, trace: Path, out: Path, peak, clock_mhz: float) -> list[dict]:
    """The profiled batches' layer roles against their floors, written as floors.csv / floors.md."""
    lengths = all_lengths[np.concatenate([b.rows for b in profiled])]
    real = float(lengths.sum())
    bucket = int(getattr(variant.options, "token_bucket", 0) or 0)  # graphs run whole buckets
    computed = float(sum(-(-int(all_lengths[b.rows].sum()) // bucket) * bucket for b in profiled)) if bucket else real
    hidden, layers, inter = model_dims(model_dir)
    heads = int(json.loads((Path(model_dir) / "config.json").read_text()).get("num_attention_heads") or 0)
    recipe = recipe_of(variant)
    fl = role_floors(hidden, inter, layers, computed, float((lengths.astype(np.float64) ** 2).sum()), peak=peak,
                     clock_mhz=clock_mhz, recipe=recipe, heads=heads, attention_tokens=real)
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    floors = floors_table(role_times(trace_kernels(events)), fl)
    _write_floors(out, floors, f"{peak.name} at {clock_mhz:g} MHz, {len(lengths)} sequences, "
                               f"{int(real):,} real tokens in {int(computed):,} computed; {recipe.describe()}")
    return floors


def recipe_of(variant) -> Recipe:
    """What the variant's kernels read and write, from its FP8 options (16-bit everywhere without)."""
    fp8 = getattr(variant.options, "fp8", None)
    if variant.precision != "fp8" or fp8 is None:
        return FP16
    roles = {"qkv": "qkv", "attn_out": "attn_out", "ffn_in": "ffn_up", "ffn_out": "ffn_down"}
    att8 = fp8.attention == "fp8"
    return Recipe(fp8_gemms=frozenset(roles[g] for g in parse_gemms(fp8.gemms)), qkv_out=1 if att8 else 2,
                  qk_fp8=att8, pv_fp8=att8 and fp8.attention_pv == "e4m3",
                  attention_out=1 if att8 or fp8.attention_output == "e4m3" else 2,
                  dense_out=1 if fp8.dense_output == "e4m3" else 2,
                  ffn_hidden=1 if fp8.ffn_hidden_fp8 or fp8.ffn_gelu == "epilogue" else 2)


def _write_floors(out: Path, rows: list[dict], what: str) -> None:
    with open(out / "floors.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cell = lambda v: "—" if v is None or v == "" else (f"{v:,}" if isinstance(v, (int, float)) else str(v))  # noqa: E731
    lines = [f"Kernels by layer role against their floors ({what}; floors: matrix FLOPs at the dense peak "
             "scaled to that clock, or bytes at HBM bandwidth, the longer)", "",
             "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell(r[k]) for k in rows[0]) + " |" for r in rows]
    (out / "floors.md").write_text("\n".join(lines) + "\n")
