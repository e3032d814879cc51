"""The package's shape: every import points down the layer order, no import circles, tasks stay
inside their packages, one writer of files."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "bertqa_bench"


def _module_name(path: Path, root: Path = PKG.parent) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Package modules this file imports, at module level or inside functions (``from . import x``
    counts as importing module x too)."""
    out = set()
    for _, target, names in _import_lines(path):
        out.add(target)
        out.update(f"{target}.{n}" for n in names)
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


# The pipeline, top to bottom. A module may import its own layer and any layer below it, never one
# above: the folders then read as the flow of a run (a command provisions a model, measures each
# backend in a worker, judges the records, reports them) and a change low down cannot depend on
# what calls it. Each entry is a package or a top-level module of bertqa_bench.
LAYERS = [
    ("cli", "cli_parser"),  # argument parsing, one function per subcommand
    ("commands",),       # whole-pipeline commands: bench, sweep, loadgen, profile, the parity gate, bench-ddp,
                         # and provisioning (a missing model is trained here)
    ("training",),       # the fine-tuning loop, its recipe and instrumentation
    ("reporting",),      # views of the record: tables, plots, summary, recommendation, MLflow, scaling
    ("measuring",),      # one backend's process: launcher, worker, timed passes, LoadGen SUT, data-parallel ranks
    ("record",),         # the typed record (BackendResult, run bundle), parity verdicts, batch plans
    ("suite",),          # a suite YAML read into the typed config, its variants and task checked
    ("backends",),       # the Backend interface, the variants table, the implementations (torch_backend; exported/:
                         # ONNX Runtime, OpenVINO, TensorRT) and the model transforms they apply (transforms/)
    ("kernels",),        # GPU kernels (Triton, cuBLASLt epilogues, cuDNN FP8 attention) and the e4m3 arithmetic they
                         # share: torch, triton and the optional GPU libraries only, nothing of the suite above
    ("data",),           # the evaluation set, built once and cached
    ("model",),          # locate, validate, grow and build a QA model
    ("tasks",),          # SQuAD, NQ: reader, features record, head, postprocessing, metric
    ("config", "io", "errors", "envinfo", "exit_codes"),  # typed config, atomic files, errors, environment facts,
                                                         # the exit codes a script acts on
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str:
    """``bertqa_bench.measuring.worker`` -> ``measuring``; the package root itself has no layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` statement in ``module`` reads from (relative
    levels resolved; an ``__init__`` is its own package)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _import_lines(path: Path, root: Path = PKG.parent):
    """(line, imported module, names) for every bertqa_bench import in the file, function-level
    ones too; ``from bertqa_bench import x`` is read as importing ``bertqa_bench.x``."""
    mod = _module_name(path, root)
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = from_target(node, mod, is_pkg)
            names = [a.name for a in node.names]
            if target == "bertqa_bench":
                for n in names:
                    yield node.lineno, f"bertqa_bench.{n}", []
            elif target.startswith("bertqa_bench."):
                yield node.lineno, target, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("bertqa_bench."):
                    yield node.lineno, a.name, []


def upward_imports(pkg: Path = PKG) -> list[str]:
    """Every import that points up the layer order, as 'file:line: layer imports higher layer (module)'."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        here = layer_of(_module_name(path, pkg.parent))
        if here not in RANK:
            continue
        for line, target, _ in _import_lines(path, pkg.parent):
            there = layer_of(target)
            if there in RANK and RANK[there] < RANK[here]:
                out.append(f"{path.relative_to(pkg.parent)}:{line}: {here} imports {there} ({target}), "
                           "a layer above it")
    return out


def test_every_module_belongs_to_a_layer():
    unknown = sorted({layer_of(_module_name(p)) for p in PKG.rglob("*.py")} - set(RANK) - {""})
    assert not unknown, f"packages or modules in no layer of LAYERS: {unknown}"


def test_every_import_points_down_the_layers():
    up = upward_imports()
    assert not up, "imports that go up the layer order:\n" + "\n".join(up)


def test_the_layer_check_sees_a_function_level_upward_import(tmp_path):
    # The check must read imports inside functions too: a planted one in a low layer is found.
    pkg = tmp_path / "bertqa_bench"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "m.py").write_text("def f():\n    from ..commands.bench import run_bench\n")
    up = upward_imports(pkg)
    assert len(up) == 1 and "model/m.py:2: model imports commands" in up[0], up


@pytest.mark.parametrize("module", ["measuring.runner", "record.schedule", "measuring.launcher",
                                    "measuring.worker", "record.parity", "record.results", "commands.bench",
                                    "reporting.report", "reporting.tracking", "backends.base",
                                    "backends.torch_backend", "backends.exported.onnxruntime", "data.evalset"])
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
