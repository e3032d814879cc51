"""``bertqa-bench backends``: the catalogue a user chooses from, grouped by device, each variant
with its one line of when to use it and whether it can run on this machine; then the suite's own
variants, the research rows (with ``--all``) and the old names that still resolve. ``--show NAME``:
one variant's every option."""
from __future__ import annotations

import dataclasses

from ..backends.device_io import cuda_unavailable_reason
from ..backends.variants import ALIASES, DERIVED_BATCHINGS, EXPERIMENTS_FILE, VariantTable

GROUPS = {"cpu": "CPU", "cuda": "CUDA GPU"}
HEAD = ("name", "precision", "batching", "here", "when to use")


def _rows(table: VariantTable, decls: list) -> list[tuple]:
    rows = []
    for d in decls:
        v = table.get(d["name"], d["device"])
        why = v.unavailable_reason()
        rows.append((v.name, v.precision, v.batching or "padded", "yes" if why is None else "no",
                     d.get("when") or d.get("description", ""), why))
    return rows


def _group(title: str, rows: list[tuple], device_reason=None) -> list[str]:
    """``device_reason``: why nothing on this device runs here, said once in the title; a row's own
    reason (a missing package) is shown beside it."""
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in [HEAD, *rows]) for i in range(4)]
    lines = [title + (f" (not on this machine: {device_reason})" if device_reason else ""),
             "  " + "  ".join(str(h).ljust(w) for h, w in zip(HEAD, widths + [0])).rstrip()]
    for r in rows:
        own = r[5] if r[5] and not (device_reason and r[5].endswith(device_reason)) else None
        lines.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
                     + (f" [not here: {own}]" if own else ""))
    return lines + [""]


def listing(table: VariantTable, show_all: bool = False) -> str:
    """The text ``bertqa-bench backends`` prints."""
    lines = ["Backend names: <runtime>-<precision>[-<executor>][-<batching>] (docs/backends.md); any name + "
             + " or ".join(f"-{b}" for b in DERIVED_BATCHINGS) + " runs it with that batching.", ""]
    sources = [("builtin", "")]
    plugins = sorted({d.get("source") for d in table.declarations() if str(d.get("source", "")).startswith("entry point")})
    sources += [(s, f", {s}") for s in plugins]
    sources.append(("suite", ", this suite's own"))
    if show_all:
        sources.append(("experiments", f", research ({EXPERIMENTS_FILE.name})"))

    reasons = {"cpu": None, "cuda": cuda_unavailable_reason()}
    for device, name in GROUPS.items():
        for source, label in sources:
            decls = [d for d in table.declarations(source) if d.get("device") == device and not d.get("error")]
            lines += _group(f"{name}{label}", _rows(table, decls), reasons[device])
    research = table.declarations("experiments")
    if research and not show_all:
        lines.append(f"+ {len(research)} research and superseded variants ({EXPERIMENTS_FILE.name}, every suite can "
                     "name them): `bertqa-bench backends --all` lists them")
    lines.append("Old names, still accepted (a run names its row by the new one): "
                 + ", ".join(f"{old} -> {new}" + (f" ({dev})" if dev else "") for old, (new, dev) in ALIASES.items())
                 + f"; and {len(table.aliases) - len(ALIASES)} names research rows were measured by "
                 f"({EXPERIMENTS_FILE.name}, renamed:)")
    for name, why in table.broken().items():
        lines.append(f"{name}: invalid: {why}")
    return "\n".join(lines)


def _option_lines(options, indent: str = "  ") -> list[str]:
    out = []
    for k, v in (dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)).items():
        if isinstance(v, dict):
            out.append(f"{indent}{k}:")
            out += _option_lines(v, indent + "  ")
        else:
            out.append(f"{indent}{k}: {v}")
    return out


def show(table: VariantTable, name: str) -> str:
    """``bertqa-bench backends --show NAME``: what the name runs, every typed option, where it is
    declared, and whether it can run here (an old name: what it means now)."""
    v = table.get(name)
    note = table.alias_note(name)
    why = v.unavailable_reason()
    source = {"builtin": "the catalogue", "experiments": f"research ({EXPERIMENTS_FILE.name})"}.get(v.source, v.source)
    lines = ([f"note: {note}"] if note else []) + [
        f"{v.name}: {v.description}", f"  implementation: {v.implementation}, device: {v.device}, precision: "
        f"{v.precision}, batching: {v.batching or 'padded'}" + (f", batch size {v.batch_size}" if v.batch_size else ""),
        f"  declared in: {source}", f"  here: {'yes' if why is None else 'no: ' + why}", "  options:"]
    return "\n".join(lines + _option_lines(v.options, "    "))
