"""`make mutation-check` plants each bug by replacing one exact snippet: every snippet must still
stand exactly once in its file, or the mutant silently plants nothing after code moves."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutants():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the file executes
    spec.loader.exec_module(mod)
    return mod.MUTANTS


@pytest.mark.parametrize("mutant", _mutants(), ids=lambda m: m.name)
def test_every_mutant_plants_its_bug_in_one_place(mutant):
    path = ROOT / mutant.path
    assert path.is_file(), f"{mutant.name}: {mutant.path} does not exist"
    assert path.read_text().count(mutant.old) == 1, f"{mutant.name}: the snippet is not in {mutant.path} exactly once"
    for arg in mutant.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), f"{mutant.name}: no test file {arg}"
