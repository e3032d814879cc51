"""The code's shape, beside the layer test: every function fits on a screen and every module in
a sitting, so a newcomer can read a stage whole. The argument parser may run longer: it is a
table of subcommands and flags, one line each."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bertqa_bench"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
TABLES = {("cli_parser.py", "build_parser")}  # functions that are tables, not steps
LONG_MODULES = {"config.py"}  # the typed suite dataclasses: one per section, each with its checks


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE), node.name, node.end_lineno - node.lineno + 1


def test_every_function_fits_on_a_screen():
    long = [f"{path}:{name} ({n} lines)" for path, name, n in _functions()
            if n > MAX_FUNCTION_LINES and (path.name, name) not in TABLES]
    assert not long, "cut these into named steps: " + "; ".join(long)


def test_every_module_reads_in_a_sitting():
    long = [f"{path.relative_to(PACKAGE)} ({n} lines)" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
            and path.name not in LONG_MODULES]
    assert not long, "split these by job: " + "; ".join(long)


def test_the_check_sees_a_long_function(tmp_path):
    """The rule can fail: a planted 81-line function is found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    tree = ast.parse(f"def planted():\n{body}\n")
    node = tree.body[0]
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1
