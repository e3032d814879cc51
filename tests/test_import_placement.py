"""Imports at the top of the file, beside the layer test: a module's first lines say what it
depends on. An import inside a function is allowed for one of two reasons, each named below:

- the package is optional (an extra, or a GPU-only library): the module must import without it,
  and the function that needs it says what to install;
- the package is slow to import (torch-class) and the importing module does not already pay for
  it: `bertqa-bench --help`, `report` and the config checks run before any of it loads.

An import of one of the project's own modules inside a function follows the same rule through
that module: it is allowed when importing it at the top would load an optional or slow package
that the importing module does not load already (the reason is printed: "pulls torch"). Anything
else — the standard library, numpy, yaml, a light module of our own — goes to the top.
"""
from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

from test_architecture import _module_name, from_target

PACKAGE = Path(__file__).resolve().parent.parent / "bertqa_bench"

# Optional: not in pyproject's `dependencies`; the function that needs one says what to install.
OPTIONAL = {
    "triton": "[dev] and the GPU machines: the Triton kernels",
    "nvmath": "[gpu]: cuBLASLt's GEMM epilogues",
    "cudnn": "[gpu]: the cuDNN frontend's attention",
    "torchao": "[gpu]: the torchao-fp8 rows",
    "tensorrt": "[tensorrt]: from NVIDIA's index",
    "datasets": "[hub]: SQuAD and NQ from the Hugging Face hub",
    "pynvml": "ships with CUDA builds of torch only",
    "playwright": "[ui]: the browser test's driver",
    "quack": "[quack]: quack-kernels' CuTe-DSL GEMM epilogues",
    "cutlass": "[quack]: CUTLASS's Python DSL, which quack builds on",
}
# Slow: a fresh process's import, in seconds, on the 2-vCPU CI machine (2026-11-29, after torch
# where torch comes first), or a backend's native runtime, which only that backend's worker loads.
SLOW = {
    "torch": "1.0 s",
    "torch._dynamo": "1.0 s after torch (torch.compile's tracer)",
    "torch._inductor": "1.0 s after torch (torch.compile's code generator)",
    "transformers": "0.6-0.8 s for a model or tokenizer class",
    "mlflow": "1.2 s",
    "nncf": "1.4 s",
    "onnxscript": "0.45 s",
    "scipy": "0.55 s for scipy.stats",
    "pandas": "0.25 s",
    "matplotlib": "0.15 s, pyplot 0.36 s",
    "onnx": "0.1 s",
    "onnxruntime": "a backend's native runtime (0.08 s; its optimizer 0.33 s)",
    "openvino": "a backend's native runtime (0.13 s for its Core)",
}
REASONS = OPTIONAL | SLOW


def module_name(path: Path) -> str:
    """``.../bertqa_bench/record/x.py`` -> ``bertqa_bench.record.x`` (a copy of the package elsewhere too)."""
    return _module_name(path, next(p for p in path.parents if p.name == PACKAGE.name).parent)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _target(node: ast.AST, here: str, is_package: bool) -> list[str]:
    """The modules an import statement loads: absolute names, own submodules resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    mod = from_target(node, here, is_package)
    subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
    return [mod] + subs


def _walk_module_level(tree: ast.Module):
    """Import statements run when the module is imported: the module body, its ifs, trys and class
    bodies, not function bodies (``if TYPE_CHECKING:`` blocks never run)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        elif isinstance(node, (ast.If, ast.Try, ast.ClassDef, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body


def _guarded(tree: ast.AST) -> set[int]:
    """Lines of imports inside ``try: ... except ImportError``: a declared package that may still
    be missing or broken here, whose handler says what to install (or falls back)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & set(ast.unparse(h.type).strip("()")
                                                                                  .replace(" ", "").split(","))
                for h in node.handlers):
            out |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def function_imports(path: Path):
    """(line, function, statement, targets) for every import inside a function of the file, but
    those guarded by ``except ImportError`` (an optional package by construction)."""
    here, tree = module_name(path), ast.parse(path.read_text(encoding="utf-8"))
    seen = _guarded(tree)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                    seen.add(node.lineno)
                    yield node.lineno, fn.name, ast.unparse(node), _target(node, here, path.name == "__init__.py")


@lru_cache(maxsize=None)
def _direct(module: str) -> frozenset[str]:
    """What importing ``module`` runs first: its parent packages and its module-level imports."""
    parts = module.split(".")
    out = {".".join(parts[:i]) for i in range(2, len(parts))}
    path = MODULES.get(module)
    if path is not None:
        for node in _walk_module_level(ast.parse(path.read_text(encoding="utf-8"))):
            out.update(_target(node, module, path.name == "__init__.py"))
    return frozenset(out - {module})


@lru_cache(maxsize=None)
def loads(module: str) -> frozenset[str]:
    """Optional or slow packages that importing ``module`` loads, through its module-level imports
    and its parent packages' ``__init__``, followed to the end."""
    seen, todo, out = {module}, [module], set()
    while todo:
        m = todo.pop()
        if m.split(".")[0] != PACKAGE.name:
            out |= {k for k in REASONS if m == k or m.startswith(k + ".")}
            continue
        for nxt in _direct(m) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return frozenset(out)


def file_loads(path: Path) -> frozenset[str]:
    """What importing this file loads (its own module-level imports, followed)."""
    name = module_name(path)
    if MODULES.get(name) == path:
        return loads(name)
    tree, parents = ast.parse(path.read_text(encoding="utf-8")), name.split(".")
    targets = {".".join(parents[:i]) for i in range(2, len(parents))}
    for node in _walk_module_level(tree):
        targets.update(_target(node, name, path.name == "__init__.py"))
    return frozenset().union(*(loads(t) for t in targets))


def misplaced(paths=None) -> list[str]:
    """Every function-level import without a reason: 'file:line (function): statement'."""
    out = []
    for path in sorted(paths or MODULES.values()):
        here = file_loads(path)
        for line, fn, stmt, targets in function_imports(path):
            new = set().union(*(loads(t) for t in targets)) - here
            if not new:
                out.append(f"{module_name(path).replace('.', '/')}.py:{line} ({fn}): {stmt}")
    return out


def reasons(paths=None) -> dict[str, int]:
    """How many function-level imports each reason covers (the closing-note count)."""
    count: dict[str, int] = {}
    for path in sorted(paths or MODULES.values()):
        here = file_loads(path)
        for _, _, _, targets in function_imports(path):
            new = set().union(*(loads(t) for t in targets)) - here
            own = any(t.startswith(PACKAGE.name + ".") or t == PACKAGE.name for t in targets)
            key = ("own module pulling " if own else "") + (
                "optional" if new & OPTIONAL.keys() else "slow" if new else "none")
            count[key] = count.get(key, 0) + 1
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_functions = {n.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        guarded = len(in_functions & _guarded(tree))
        count["guarded by except ImportError"] = count.get("guarded by except ImportError", 0) + guarded
    return count


def test_function_level_imports_have_a_reason():
    bad = misplaced()
    assert not bad, ("move these to the top of their file (the package is neither optional nor slow, or the "
                     "module loads it already):\n" + "\n".join(bad))


def test_every_reason_names_a_real_dependency_kind():
    """The tables stay honest: an optional package is not a core dependency of pyproject."""
    import tomllib

    deps = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower().replace("-", "_") for d in deps}
    assert not (OPTIONAL.keys() & core), "optional packages that pyproject makes core: " + str(OPTIONAL.keys() & core)


def test_the_check_sees_a_misplaced_import(tmp_path):
    """The rule can fail: a planted stdlib import inside a function is found; a planted torch
    import is allowed in a module that does not load torch, refused in one that does; a guarded
    one passes."""
    record = tmp_path / PACKAGE.name / "record"
    record.mkdir(parents=True)
    light, heavy = record / "planted_light.py", record / "planted_heavy.py"
    light.write_text("import json\n\n\ndef f():\n    import os\n    import torch\n    try:\n        import nvmath\n"
                     "    except ImportError:\n        nvmath = None\n    return os, torch, json, nvmath\n")
    heavy.write_text("import torch\n\n\ndef g():\n    import torch.nn\n    import torch._dynamo\n    return torch.nn\n")
    bad = misplaced([light, heavy])
    assert sorted(b.split(": ", 1)[1] for b in bad) == ["import os", "import torch.nn"], bad


if __name__ == "__main__":  # python tests/test_import_placement.py: the list and the count by reason
    print("\n".join(misplaced()))
    print(reasons(), file=sys.stderr)
