"""`make mutation-check` plants each bug by replacing one exact snippet: every snippet must still
stand exactly once in its file, or the mutant silently plants nothing after code moves."""
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


def _mutants():
    return load_script("mutation_check").MUTANTS


@pytest.mark.parametrize("mutant", _mutants(), ids=lambda m: m.name)
def test_every_mutant_plants_its_bug_in_one_place(mutant):
    path = ROOT / mutant.path
    assert path.is_file(), f"{mutant.name}: {mutant.path} does not exist"
    assert path.read_text().count(mutant.old) == 1, f"{mutant.name}: the snippet is not in {mutant.path} exactly once"
    for arg in mutant.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), f"{mutant.name}: no test file {arg}"
