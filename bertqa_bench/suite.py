"""Loading a suite: YAML files in ``benchmarks/``, ``extends:``, ``--set`` overrides, and the
checks that need the task and backend registries (task options, declared variants).

``extends: <suite>`` (or a list, merged left to right) reuses other suites and changes only
what differs; a suite family keeps its backend list in one file (e.g. ``gpu-backends``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import yaml

from .backends.variants import VariantTable, note_once
from .config import BENCHMARKS_DIR, SuiteConfig, TaskConfig, build
from .errors import ConfigError, UnknownBackendError
from .tasks import get_task


def _is_file(p: Path) -> bool:
    try:  # a name too long for the file system is an OSError, not "no such suite"
        return p.is_file()
    except OSError:
        return False


def suite_path(name_or_path: str) -> Path:
    if not isinstance(name_or_path, (str, os.PathLike)) or name_or_path == "":
        raise ConfigError(f"a suite is named by a non-empty string, not {name_or_path!r:.80}")
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and _is_file(p):
        return p
    candidate = BENCHMARKS_DIR / f"{name_or_path}.yaml"
    if _is_file(candidate):
        return candidate
    raise ConfigError(f"unknown suite '{name_or_path}'; suites in {BENCHMARKS_DIR}: {', '.join(suite_names())}")


def suite_names() -> list[str]:
    return sorted(x.stem for x in BENCHMARKS_DIR.glob("*.yaml"))


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
        if not all(parts):
            raise ConfigError(f"override '{item}': '{key.strip()}' is not a field name; it must look like "
                              "section.field=value")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        try:
            node[parts[-1]] = _parse_value(value)
        except yaml.YAMLError as e:
            problem = str(getattr(e, "problem", "") or e).splitlines()[0]
            raise ConfigError(f"override '{item}': the value {value!r} is not valid YAML ({problem}); quote it to "
                              "pass it as a string") from None
    return raw


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_raw(name_or_path: str, seen: tuple = ()) -> dict:
    path = suite_path(name_or_path)
    if path in seen:
        raise ConfigError(f"{path}: 'extends' loops through {', '.join(map(str, seen))}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(f"{path}: not usable YAML: nested too deeply") from None
    except ValueError as e:  # e.g. an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"{path}: not usable YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    raw.setdefault("name", path.stem)
    # experiments.yaml's ``renamed:`` (the names its research rows were measured by) belongs to the
    # variant table (backends/variants.py), not to the suite that file also is
    raw.pop("renamed", None)
    parents = raw.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(x, str) for x in parents):
        raise ConfigError(f"{path}: 'extends' must be a suite name or a list of suite names, not {parents!r:.80}")
    merged: dict = {}
    for parent in parents:
        base = read_raw(parent, seen + (path,))
        base.pop("description", None)
        base.pop("name", None)
        merged = deep_merge(merged, base)
    return deep_merge(merged, raw)


def resolve_task(cfg: SuiteConfig) -> None:
    """Fill ``cfg.task.options`` with the task's own typed options; check the data source."""
    raw = cfg.task.options
    if raw is not None and not isinstance(raw, dict):
        return  # already resolved
    task = get_task(cfg.task.name)
    cfg.task = TaskConfig(cfg.task.name, build(task.Options, raw or {}, f"task ({task.name})"))
    if cfg.data.source not in task.sources:
        raise ConfigError(f"data.source '{cfg.data.source}' is not a source of task '{task.name}'; "
                          f"its sources: {', '.join(task.sources)}")


def load_suite(name_or_path: str = "default", overrides: Optional[list[str]] = None) -> SuiteConfig:
    path = suite_path(name_or_path)
    raw = apply_overrides(read_raw(name_or_path), overrides or [])
    task = raw.get("task")
    if isinstance(task, str):  # `task: nq` is short for `task: {name: nq}`
        raw["task"] = task = {"name": task}
    if isinstance(task, dict):  # the task's own options sit beside its name
        raw["task"] = {"name": task.get("name", "squad"), "options": {k: v for k, v in task.items() if k != "name"}}
    try:
        cfg = build(SuiteConfig, raw, str(path))
    except ConfigError as e:
        raise _from_override(e, path, overrides or []) from None
    resolve_task(cfg)
    canonicalize(cfg)  # old names -> the catalogue's (a note each); unknown names fail before any work
    return cfg


def _from_override(e: ConfigError, path: Path, overrides: list[str]) -> ConfigError:
    """An error in a field the user set with ``--set`` names the ``--set``, not the suite file it
    never wrote that field in (``default.yaml.bench.batch_size must be int``)."""
    message, prefix = str(e), f"{path}."
    if not message.startswith(prefix):
        return e
    rest = message[len(prefix):]
    for item in reversed(overrides):  # the last --set of a field is the one in force
        key = item.split("=", 1)[0].strip()
        section, _, field_name = key.rpartition(".")
        if rest.startswith((key + " ", key + ":")) or (
                section and rest.startswith(section + ": unknown field") and field_name in rest):
            return ConfigError(f"--set {item}: {rest}")
    return e


def suite_from_dict(raw: dict, where: str = "<saved config>") -> SuiteConfig:
    """A suite from ``SuiteConfig.to_dict()`` (a run bundle's config.json): what ``--resume`` runs."""
    cfg = build(SuiteConfig, dict(raw), where)
    resolve_task(cfg)
    return cfg


def canonicalize(cfg: SuiteConfig, note: Optional[Callable[[str], None]] = note_once) -> VariantTable:
    """The suite's backend names as their rows will be named (old names: the catalogue's, with a
    note each); an unknown name fails here, before any work. Returns the suite's table."""
    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    b = cfg.bench
    b.reference = table.canonical_names([b.reference], note)[0]
    b.backends = [b.reference] + [n for n in table.canonical_names(b.backends, note) if n != b.reference]
    renamed = {}
    for name, tol in cfg.parity.overrides.items():
        try:
            renamed[table.canonical(name)] = tol
        except UnknownBackendError as e:  # a typo'd name: its tolerance would never apply
            raise ConfigError(f"parity.overrides: {e}") from None
        except ConfigError:  # a tolerance for a name this suite never runs
            renamed[name] = tol
    cfg.parity.overrides = renamed
    return table
