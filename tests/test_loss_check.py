"""A fine-tune whose loss fell and climbed back is refused before its model is saved
(training/loss_check.py): the bench would otherwise judge every backend against a model that
answers nothing."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bertqa_bench.training.train as train_mod
from bertqa_bench.errors import TrainingCollapsedError
from bertqa_bench.suite import load_suite
from bertqa_bench.training.loss_check import BACK, CLIMB, SMOOTH, Collapse, collapse

# The H200 run that collapsed (gpu-bert-large, seed 42, 2026-12-03): the points its progress bar
# printed, (step, loss); the suite logs ~200 points over 1,948 steps
COLLAPSED_PRINTED = [(9, math.log(384)), (90, 2.428), (288, 0.447), (504, 5.948), (702, 5.954), (909, 4.852),
                     (1116, 4.720), (1350, 4.854), (1557, 5.075), (1755, 4.917), (1948, 5.664)]


def _logged(printed, every=9, total=1948):
    steps = np.arange(every, total + 1, every)
    return list(np.interp(steps, [s for s, _ in printed], [v for _, v in printed]))


def test_the_collapsed_h200_fine_tune_is_found_where_it_fell_and_climbed():
    c = collapse(_logged(COLLAPSED_PRINTED))
    assert c is not None
    assert 4.0 < c.first < math.log(384)  # the first 5 points' mean, falling from ln 384
    assert c.best < 1.0 and c.final > 4.5
    assert 250 <= (c.best_point + 1) * 9 <= 330  # the best rolling mean ends near step 288


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=2 * SMOOTH, max_size=300),
       st.lists(st.floats(0.5, 1.5), min_size=300, max_size=300))
def test_a_falling_loss_with_batch_noise_up_to_half_is_never_a_collapse(drops, noise):
    """A non-increasing loss times noise within [0.5, 1.5]. Each earlier window's bases are, point
    by point, at least the last window's, so every rolling mean is at least 0.5x the last window's
    mean base, and the last rolling mean at most 1.5x it: the end is within 3x of the best, below
    CLIMB (4x) whatever the curve, by that arithmetic."""
    base = np.sort(np.asarray(drops))[::-1]
    assert collapse(list(base * np.asarray(noise[:len(base)]))) is None


def test_too_few_points_or_small_losses_are_not_judged():
    assert collapse([5.0, 0.1, 6.0, 6.0]) is None  # fewer than two rolling means' worth
    # a large ratio of small numbers: 0.01 -> 0.05 late in training is noise, not a collapse
    tiny = [1.0] + [0.01] * 20 + [0.05] * 20
    assert collapse(tiny) is None
    start = float(np.mean(tiny[:SMOOTH]))
    assert 0.05 >= CLIMB * 0.01 and 0.05 < BACK * start  # the case is the BACK rule's, not CLIMB's
    climbed = [1.0] + [0.01] * 20 + [0.8] * 20
    assert isinstance(collapse(climbed), Collapse)


def test_a_collapsed_training_is_refused_before_anything_is_saved(tiny_suite, monkeypatch):
    """A tiny training whose losses are replaced by a collapsed run's: TrainingCollapsedError names
    the seed and learning rate to change, and no model folder is written; asked to keep it, the
    model is saved with the collapse recorded."""
    cfg = load_suite(str(tiny_suite(backends=["eager-fp32"])))
    real_loop = train_mod._timed_loop

    def collapsed_loop(*a, **kw):
        loop = real_loop(*a, **kw)
        return {**loop, "losses": _logged(COLLAPSED_PRINTED)}

    monkeypatch.setattr(train_mod, "_timed_loop", collapsed_loop)
    with pytest.raises(TrainingCollapsedError, match=r"the fine-tune collapsed: its loss fell from \d\.\d\d to 0\.\d+ "
                                                     r"\(around step \d+\) and climbed back to 5\.\d+ .*nothing was "
                                                     r"saved.*train\.seed=N; this run: 1\).*this run: 0\.001\)"):
        train_mod.train(cfg, log=lambda m: None)
    assert not cfg.model_dir.exists()
    # train.refuse_collapse: false saves it, the collapse and the losses it was read from recorded
    cfg.train.refuse_collapse = False
    said = []
    metrics = train_mod.train(cfg, log=said.append, evaluate=False)
    assert cfg.model_dir.exists() and metrics["train_collapsed"].startswith("its loss fell from")
    assert metrics["train_losses"] == [round(v, 4) for v in _logged(COLLAPSED_PRINTED)]
    assert any("WARNING: the fine-tune collapsed" in m for m in said)
    assert "train.refuse_collapse" not in train_mod.recipe_fields(cfg)  # it does not change the weights
