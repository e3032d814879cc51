"""transformers' LOAD REPORT when a QA model is made from a base encoder: the expected one (new head
MISSING, pooler UNEXPECTED) is one line; a real mismatch is shown in full."""
import logging

import pytest
import torch

from bertqa_bench.model.modeling import build_model
from conftest import TINY_BERT


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def report_log():
    h = _Records()
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(h)
    yield h.messages
    logger.removeHandler(h)


def _encoder(tmp_path, drop=()):
    """A tiny base encoder checkpoint (BertModel, pooler included), minus the ``drop`` weights."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=100, **TINY_BERT)).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    for k in drop:
        del state[k]
    save_file(state, weights, metadata={"format": "pt"})
    return tmp_path


def test_the_expected_new_head_is_one_line(tmp_path, report_log, capsys):
    model, _ = build_model("squad", str(_encoder(tmp_path)))
    assert not [m for m in report_log if "LOAD REPORT" in m], "the expected report was shown in full"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "new qa_outputs head" in out and "pooler" in out
    assert hasattr(model, "qa_outputs")


def test_a_real_mismatch_is_shown_in_full(tmp_path, report_log, capsys):
    dropped = "encoder.layer.0.attention.self.query.weight"
    build_model("squad", str(_encoder(tmp_path, drop=[dropped])))
    (report,) = [m for m in report_log if "LOAD REPORT" in m]
    assert dropped in report and "qa_outputs.weight" in report and "MISSING" in report
    assert "new qa_outputs head" not in capsys.readouterr().out
