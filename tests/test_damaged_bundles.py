"""A damaged result bundle (a run.json, results.csv, env.json or config.json that a crash, a
truncated copy or a hand edit broke) is named in one line, file and row and column where there is
one, by every command that reads bundles (report, reference, track, scaling, --resume), instead of
a traceback; a healthy bundle beside it is untouched."""
import json

import pytest

from bertqa_bench import exit_codes
from bertqa_bench.cli import main
from bertqa_bench.errors import BenchError
from bertqa_bench.record.results import BackendResult, RunBundle, RunMeta


def _bundle(tmp_path, name="20260101-000000-x"):
    meta = RunMeta(suite="x", run_id=name, task="squad", metric_names=["exact_match", "f1"], primary_metric="f1",
                   reference="eager-fp32", command="bertqa-bench bench --suite x", date="2026-01-01")
    b = RunBundle.create(tmp_path, meta, {"name": "x"}, {"torch": "2.11"})
    b.add(BackendResult("eager-fp32", precision="fp32", device="cpu", batching="padded", predict_s=2.0,
                        scores={"exact_match": 60.0, "f1": 70.0}, prepare_info={"threads": 2}))
    b.add(BackendResult("onnxruntime", precision="fp32", device="cpu", batching="padded", predict_s=1.0,
                        scores={"exact_match": 60.0, "f1": 70.0}))
    return b


def _damage_cell(bundle, column, value, row=1):
    lines = bundle.csv_path.read_text().splitlines()
    header = lines[0].split(",")
    # a plain value in a cell without commas or quotes: enough for the columns damaged here
    cells = lines[row + 1].split(",") if column not in ("prepare_info",) else None
    if cells is None:
        lines[row + 1] = lines[row + 1].replace('"{""threads"": 2}"', value)
    else:
        cells[header.index(column)] = value
        lines[row + 1] = ",".join(cells)
    bundle.csv_path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("text, said", [
    ('{"suite":', "run.json: .*not valid JSON: .* at line 1 column 10"),
    ("", "run.json: .*not valid JSON"),
    ("[" * 100_000, "run.json: .*nested too deeply"),
    ("[1]", "run.json: holds a JSON list, not an object"),
    ('{"suite": "x"}', "run.json: no run_id, task, metric_names, primary_metric, reference"),
])
def test_a_damaged_run_json_is_named(tmp_path, text, said):
    b = _bundle(tmp_path)
    (b.dir / "run.json").write_text(text)
    with pytest.raises(BenchError, match=said):
        RunBundle.load(b.dir)


@pytest.mark.parametrize("column, value, said", [
    ("predict_s", "notanumber", r"results.csv, line 3 \(onnxruntime\): column predict_s: 'notanumber' is not"),
    ("f1", "abc", r"results.csv, line 3 \(onnxruntime\): column f1: 'abc' is not"),
])
def test_a_damaged_results_cell_is_named_by_file_line_and_column(tmp_path, column, value, said):
    b = _bundle(tmp_path)
    _damage_cell(b, column, value)
    with pytest.raises(BenchError, match=said):
        RunBundle.load(b.dir)


def test_damaged_json_inside_a_cell_and_a_table_that_is_not_text_are_named(tmp_path):
    b = _bundle(tmp_path)
    _damage_cell(b, "prepare_info", "{bad", row=0)
    with pytest.raises(BenchError, match=r"line 2 \(eager-fp32\): column prepare_info: '\{bad' is not a valid value"):
        RunBundle.load(b.dir)
    b.csv_path.write_bytes(b"backend,predict_s\n\xff\xfe,1\n")
    with pytest.raises(BenchError, match="results.csv: not a results table bertqa-bench can read"):
        RunBundle.load(b.dir)


@pytest.mark.parametrize("name", ["env.json", "config.json"])
def test_a_damaged_env_or_config_is_named_when_read(tmp_path, name):
    b = _bundle(tmp_path)
    (b.dir / name).write_text("{")
    loaded = RunBundle.load(b.dir)
    with pytest.raises(BenchError, match=f"{name}: .*not valid JSON"):
        loaded.env() if name == "env.json" else loaded.config()


def test_report_and_reference_on_a_damaged_bundle_exit_with_one_line(tmp_path, capsys):
    good = _bundle(tmp_path / "good")
    bad = _bundle(tmp_path / "bad")
    _damage_cell(bad, "predict_s", "notanumber")
    before = {p.name: p.read_bytes() for p in good.dir.iterdir() if p.is_file()}
    assert main(["report", str(bad.dir)]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert "results.csv, line 3 (onnxruntime): column predict_s" in err and "Traceback" not in err
    out = tmp_path / "ref"
    assert main(["reference", "--out", str(out), "--title", "t", str(good.dir), str(bad.dir)]) == exit_codes.BAD_INPUT
    assert "column predict_s" in capsys.readouterr().err and not out.with_suffix(".md").exists()
    assert {p.name: p.read_bytes() for p in good.dir.iterdir() if p.is_file()} == before
    assert json.loads((good.dir / "run.json").read_text())["run_id"] == good.meta.run_id
