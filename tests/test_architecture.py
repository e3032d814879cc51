"""The package's shape: no import circles, tasks stay inside their packages, one writer of files."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "bertqa_bench"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Package modules this file imports, at module level or inside functions."""
    mod = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("bertqa_bench"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` imports module x
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("bertqa_bench"))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in files and t != m} for m, p in files.items()}


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["measuring.runner", "measuring.schedule", "measuring.launcher",
                                    "measuring.worker", "measuring.parity", "reporting.results", "measuring.bench",
                                    "reporting.report", "reporting.tracking", "backends.base",
                                    "backends.torch_backend", "backends.onnxruntime", "data.evalset"])
def test_nothing_outside_a_task_branches_on_a_task_name(module):
    src = (PKG / (module.replace(".", "/") + ".py")).read_text()
    for needle in ('"nq"', "'nq'", '"squad"', "'squad'", "micro_f1", "answer_type"):
        assert needle not in src, f"{module} mentions {needle}: task knowledge belongs in tasks/<name>/"


def test_one_atomic_writer():
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p.name != "io.py" and ("mkstemp" in p.read_text() or "os.replace(" in p.read_text())]
    assert not offenders, f"atomic writes belong in bertqa_bench/io.py: {offenders}"


@pytest.mark.parametrize("helper", ["official_squad.py", "official_nq.py"])
def test_reference_scorers_share_no_code_with_the_suite(helper):
    # A reference that imported the suite's own scorer would agree with any bug in it (an audit
    # swapped normalization steps in the suite and every comparison still passed).
    tree = ast.parse((Path(__file__).resolve().parent / helper).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in imported if m.split(".")[0] in ("bertqa_bench", "tests")], imported
    assert {m.split(".")[0] for m in imported} <= {"re", "string", "collections", "gzip", "json"}, imported
