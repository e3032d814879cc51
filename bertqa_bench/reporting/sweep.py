"""A sweep's own views (``sweep.md``, ``sweep.png``) and the names of its grid points:
``eager-fp16@b64-sorted`` is the variant ``eager-fp16`` at batch size 64, sorted batching;
``-x4`` on four GPUs."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from ..io import atomic_write_text
from ..record.results import BackendResult, RunBundle
from .colors import for_results
from .report import recommendation


def point_name(variant: str, batch_size: int, batching: str, devices: int = 1) -> str:
    return f"{variant}@b{batch_size}-{batching}" + (f"-x{devices}" if devices > 1 else "")


def without_devices(name: str) -> str:
    """The one-GPU row a data-parallel row scales from: ``a@b64-sorted-x4`` -> ``a@b64-sorted``
    (also a suite's own ``eager-fp32-x2`` -> ``eager-fp32``)."""
    return re.sub(r"-x\d+$", "", name)


def _point(r: BackendResult) -> Optional[tuple[str, int, str]]:
    if "@b" not in r.backend:
        return None
    base, rest = without_devices(r.backend).rsplit("@b", 1)
    bs, batching = rest.split("-", 1)
    return base, int(bs), batching


def scaling_table(results: list[BackendResult]) -> str:
    """Throughput on N GPUs against N x the same point on one GPU, from the same run."""
    single = {_point(r): r for r in results if _point(r) and r.ok and (r.n_devices or 1) == 1}
    lines = []
    for r in results:
        p = _point(r)
        if p and r.ok and (r.n_devices or 1) > 1 and p in single:
            eff = r.features_per_s / (r.n_devices * single[p].features_per_s)
            lines.append(f"| {p[0]} | {p[1]} | {p[2]} | {r.n_devices} | {r.features_per_s:,.0f} | "
                         f"{single[p].features_per_s:,.0f} | {eff:.1%} | {r.parity} |")
    if not lines:
        return ""
    return "\n".join(["| Backend | Batch | Batching | GPUs | Features/s | 1 GPU features/s | Scaling efficiency | Parity |",
                      "|---|---|---|---|---|---|---|---|", *lines])


def best_table(results: list[BackendResult]) -> str:
    best: dict[str, BackendResult] = {}
    for r in results:
        p = _point(r)
        if p is None or not r.ok or r.parity == "FAIL" or (r.n_devices or 1) > 1:
            continue
        if p[0] not in best or r.features_per_s > best[p[0]].features_per_s:
            best[p[0]] = r
    lines = ["| Backend | Best batch size | Batching | Features/s | Speedup | Parity | Peak GPU MiB | J / 1k features |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(best.items(), key=lambda kv: -kv[1].features_per_s):
        _, bs, bt = _point(r)
        mem = r.predict_device_used_mib or r.predict_cuda_reserved_peak_mib
        lines.append(f"| {name} | {bs} | {bt} | {r.features_per_s:,.0f} | {r.speedup:.2f}× | {r.parity} | "
                     f"{'—' if mem is None else f'{mem:,.0f}'} | "
                     f"{'—' if r.energy_j_per_1k_features is None else f'{r.energy_j_per_1k_features:.1f}'} |")
    failed = [r for r in results if _point(r) and (not r.ok or r.parity == "FAIL")]
    if failed:
        lines += ["", "Points left out (failed, not run, or parity FAIL):"]
        lines += [f"- `{r.backend}`: {r.status}{' / parity ' + r.parity if r.parity else ''} "
                  f"{r.error or r.parity_failures}" for r in failed]
    return "\n".join(lines)


def plot(results: list[BackendResult], path: Path, variants: Sequence[str] = ()) -> Optional[Path]:
    series: dict[tuple[str, str], list[tuple[int, float, bool]]] = {}
    for r in results:
        p = _point(r)
        if p and r.ok and (r.n_devices or 1) == 1:
            series.setdefault((p[0], p[2]), []).append((p[1], r.features_per_s, r.parity != "FAIL"))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = for_results(results, variants)  # the same colour as the backend's bar in comparison.png
    fig, ax = plt.subplots(figsize=(9, 5))
    for (name, batching), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour(name, batching),
                linestyle="-" if batching == "padded" else "--", label=f"{name} ({batching})")
        bad = [p for p in pts if not p[2]]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="red", zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows; sorted batching: the token budget of this many padded rows)")
    ax.set_ylabel("features / s (median pass)")
    ax.set_title("Throughput vs batch size (red x: parity FAIL)")
    # The legend sits outside the axes (it covered the lines inside them) and bbox_inches="tight"
    # grows the figure to hold it whole, however many series and however long their names.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def sweep_tables(bundle: RunBundle) -> str:
    """The sweep's own tables: the best configuration per backend, data-parallel scaling."""
    md = "\n".join([f"Reference: `{bundle.meta.reference}` "
                    f"({bundle.meta.batching}, batch {bundle.meta.batch_size}); speedups against it, same run.", "",
                    "Best configuration per backend among the points that keep parity:", "",
                    best_table(bundle.results), ""])
    scaling = scaling_table(bundle.results)
    if scaling:
        md += "\nData-parallel prediction (same run):\n\n" + scaling + "\n"
    return md


def write_sweep_report(bundle: RunBundle) -> str:
    """sweep.md (the run's recommendation first, then its tables) and sweep.png."""
    md = "\n".join([f"# Sweep {bundle.meta.run_id}", "", *recommendation(bundle).lines(), "", sweep_tables(bundle)])
    atomic_write_text(bundle.dir / "sweep.md", md)
    plot(bundle.results, bundle.dir / "sweep.png", bundle.meta.variants)
    return md
