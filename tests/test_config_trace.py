"""The config walks down (docs/design.md): the suite's config stays with the commands and the
training stage; every stage below takes the section it needs. scripts/config_trace.py follows the
config object through a real bench run; this checks its counting, then the run itself."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import config_trace  # noqa: E402
from test_architecture import RANK, layer_of  # noqa: E402

# The layers that may hold the whole config: the commands compose the run, training's recipe spans
# the model, data, task and train sections.
HOLDERS = ("cli", "commands", "training")


def test_visits_climbs_and_returns_are_counted_on_a_planted_path():
    uses = ["bertqa_bench.commands.bench"] * 3 + ["bertqa_bench.data.evalset", "bertqa_bench.tasks.base",
                                                    "bertqa_bench.data.evalset", "bertqa_bench.commands.bench"]
    path = config_trace.visits(uses)
    assert path == ["bertqa_bench.commands.bench", "bertqa_bench.data.evalset", "bertqa_bench.tasks.base",
                    "bertqa_bench.data.evalset", "bertqa_bench.commands.bench"]
    assert config_trace.climbs(path) == 2  # tasks -> data, data -> commands
    assert config_trace.returns(path) == 2  # back to evalset, back to bench


@pytest.mark.slow
def test_a_bench_run_hands_sections_down_not_the_config(capsys):
    """A tiny bench, traced: the config never reaches a module below training, and it climbs back
    up at most the issue's 12 times (2 when this was written: provisioning's recipe and training)."""
    assert config_trace.main(["--uses", "100000", "--visits"]) == 0
    out = capsys.readouterr().out.splitlines()
    visited = [line for line in out if line.startswith("bertqa_bench.")]
    below = sorted({m for m in visited if RANK.get(layer_of(m), 0) > max(RANK[h] for h in HOLDERS)})
    assert not below, f"the whole config reached {below}: hand them the section they need"
    assert config_trace.climbs(visited) <= 12
