"""The backend catalogue (backends/variants.py): one naming rule, every variant in a suite, the GPU
suites carrying the fastest rows measured, old names resolving to the new ones."""
import csv
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from bertqa_bench.backends.variants import (ALIASES, CATALOGUE, DERIVED_BATCHINGS, VariantTable, default_table,
                                            experiment_renames)
from bertqa_bench.reporting.recommend import _overlap
from bertqa_bench.suite import canonicalize, load_suite, suite_names

REFERENCE = Path(__file__).resolve().parent.parent / "results" / "reference"
RUNTIMES = ("eager", "torch-compile", "ort", "openvino", "tensorrt")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "int8", "fp8")
GRAMMAR = re.compile(rf"(?P<runtime>{'|'.join(RUNTIMES)})-(?P<precision>{'|'.join(PRECISIONS)})"
                     r"(?:-(?P<executor>graph))?(?:-(?P<batching>sorted|packed))?")


def table(device):
    return VariantTable.for_suite(device=device)


def test_every_catalogue_name_follows_the_one_rule_and_says_what_it_is():
    for d in CATALOGUE:
        m = GRAMMAR.fullmatch(d["name"])
        assert m, d["name"]
        v = table(d["device"]).get(d["name"])
        assert v.device == d["device"] and "cpu" not in d["name"] and "cuda" not in d["name"]  # a field, not a suffix
        assert m["precision"] == v.precision, d["name"]  # the name says the arithmetic the variant runs
        assert (m["batching"] or "padded") == (v.batching or "padded"), d["name"]
        graphed = v.options.cuda_graph if v.implementation == "onnxruntime" else (
            getattr(v.options, "cuda_graph", "none") != "none" or getattr(v.options, "token_bucket", 0) > 0)
        assert bool(m["executor"]) == bool(graphed), d["name"]
        assert d["when"] and len(d["when"]) < 110, d["name"]  # one line of when to use it
    names = {d["name"] for d in CATALOGUE}
    assert 12 <= len(names) <= 20, len(names)


def test_a_name_on_both_devices_runs_on_the_suites_device():
    assert table("cpu").get("eager-fp32").device == "cpu" and table("cuda").get("eager-fp32").device == "cuda"
    assert default_table().get("eager-fp32").device == "cpu"
    # a name on one device runs there whatever the suite's device
    assert table("cpu").get("torch-compile-fp8-graph").device == "cuda"
    assert table("cuda").get("openvino-int8").device == "cpu"
    assert load_suite("gpu-bert-base").bench.device == "cuda"


def _suite_rows():
    """(suite, its device, the (name, device) of each backend it runs)."""
    for name in suite_names():
        cfg = load_suite(name)
        t = VariantTable.for_suite(cfg.variants, cfg.bench.device)
        yield name, cfg.bench.device, {(v.name, v.device) for v in t.require(cfg.bench.backends)}


def test_every_catalogue_variant_is_in_a_suite():
    covered = set().union(*(rows for _, _, rows in _suite_rows()))
    missing = {(d["name"], d["device"]) for d in CATALOGUE} - covered
    assert not missing, missing


def _passes(r):
    """A results.csv row as the recommendation reads it: its timed passes' range and feature count."""
    f = lambda k: float(r[k]) if r.get(k) else None  # noqa: E731
    return SimpleNamespace(predict_min_s=f("predict_min_s"), predict_max_s=f("predict_max_s"),
                           n_features=r.get("n_features"))


def _fastest_measured(batching):
    """The fastest row of the BERT-base GPU suite in the committed H100 and H200 tables at a decided parity
    pass, one GPU, a variant (not a sweep point), by features/s; with the rows of its run that are
    as fast within the noise of the timed passes (they overlap: the recommendation's ties)."""
    best, rows = None, []
    for path in sorted(REFERENCE.glob("h100-*.csv")) + sorted(REFERENCE.glob("h200-*.csv")):
        for r in csv.DictReader(open(path, newline="")):
            if (r.get("suite") != "gpu-bert-base" or r.get("status") != "ok" or r.get("parity") != "pass"
                    or r.get("parity_within_noise", "").lower() == "true" or r.get("batching") != batching
                    or "@" in r["backend"] or (r.get("n_devices") or "1") != "1" or not r.get("features_per_s")):
                continue
            rows.append(r)
            if best is None or float(r["features_per_s"]) > float(best["features_per_s"]):
                best = r
    if best is None:
        return None, []
    ties = [r for r in rows if r is not best and (r.get("run_id"), r.get("bundle")) == (best.get("run_id"), best.get("bundle"))
            and _overlap(_passes(best), _passes(r))]
    return best, ties


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_every_gpu_suite_runs_the_fastest_row_measured(batching):
    """The fastest row is in the catalogue and in every GPU suite. A research row that is fastest
    only within the noise of a catalogue row of its own run (timed passes overlap) leaves that
    catalogue row the one to run: the catalogue follows rows told apart, not medians inside noise."""
    row, ties = _fastest_measured(batching)
    assert row is not None, f"no {batching} row of gpu-bert-base in {REFERENCE}"
    catalogue = {d["name"] for d in CATALOGUE if d["device"] == "cuda"}
    # measured under its old name, it is a catalogue variant now
    names = [table("cuda").canonical(r["backend"]) for r in [row, *ties]]
    in_catalogue = [n for n in names if n in catalogue]
    assert in_catalogue, (row["backend"], names)
    name = in_catalogue[0]
    gpu_suites = [(s, rows) for s, device, rows in _suite_rows() if device == "cuda"]
    assert len(gpu_suites) >= 5
    for suite, rows in gpu_suites:
        assert (name, "cuda") in rows, (suite, name, row["features_per_s"])


def test_the_fastest_row_tie_rule_is_the_recommendations():
    """Passes that overlap are ties, passes apart are not, as in the report's recommendation."""
    a = {"predict_min_s": "1.0", "predict_max_s": "1.2", "n_features": "10"}
    assert _overlap(_passes(a), _passes({**a, "predict_min_s": "1.1", "predict_max_s": "1.3"}))
    assert not _overlap(_passes(a), _passes({**a, "predict_min_s": "1.21", "predict_max_s": "1.3"}))


def test_old_names_resolve_to_the_same_variant_and_say_the_new_name():
    for old, (new, device) in ALIASES.items():
        t = table(device)
        a, b = t.get(old), t.get(new)
        assert (a.name, a.device, a.implementation, a.options, a.batching) == (
            new, b.device, b.implementation, b.options, b.batching), old
        assert new in t.alias_note(old)
    lines = []
    assert table("cpu").canonical_names(["eager-fp32", "onnxruntime", "onnxruntime-sorted", "ort-fp32"],
                                        lines.append) == ["eager-fp32", "ort-fp32", "ort-fp32-sorted"]
    assert lines == ["note: 'onnxruntime' is an old name: its row is 'ort-fp32'",
                     "note: 'onnxruntime-sorted' is an old name: its row is 'ort-fp32-sorted'"]
    # a GPU reference named by its old name in a CPU suite keeps that name: it can't collide with eager-fp32
    v = table("cpu").get("eager-fp32-cuda")
    assert (v.name, v.device) == ("eager-fp32-cuda", "cuda") and "keeps the old name" in table("cpu").alias_note(
        "eager-fp32-cuda")


def test_a_suite_naming_old_names_runs_the_new_ones(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("extends: default\nbench:\n  backends: [eager-fp32, onnxruntime, openvino, onnxruntime-int8-sorted]\n"
                 "parity:\n  overrides: {onnxruntime-int8-sorted: {min_f1_ratio: 0.98, min_agreement: 0.9}}\n")
    cfg = load_suite(str(p))
    assert cfg.bench.backends == ["eager-fp32", "ort-fp32", "openvino-fp32", "ort-int8-sorted"]
    assert set(cfg.parity.overrides) == {"ort-int8-sorted"}
    gpu = load_suite("gpu-bert-base", ["bench.reference=eager-fp32-cuda", "bench.backends=[eager-fp32-cuda, "
                                       "torch-compile-fp8-packed-ffn8-tanh-head, torch-compile-fp8-cudnn-ffn8-tanh]"])
    assert gpu.bench.reference == "eager-fp32"
    # the old names of the catalogue rows' previous meanings: those rows, now research rows
    assert gpu.bench.backends == ["eager-fp32", "torch-compile-fp8-graph-packed+plain", "torch-compile-fp8-graph+plain"]
    # the fastest path's research name: the catalogue row it became
    long = load_suite("gpu-bert-base", ["bench.backends=[torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-"
                                        "autotune-2streams, torch-compile-fp8-graph-gelu-epilogue-autotune-2streams]"])
    assert long.bench.backends == ["eager-fp32", "torch-compile-fp8-graph-packed", "torch-compile-fp8-graph"]


def test_every_backend_named_in_the_committed_reference_tables_still_resolves():
    tables = {d: table(d) for d in ("cpu", "cuda")}
    seen = 0
    for path in REFERENCE.glob("*.csv"):
        for r in csv.DictReader(open(path, newline="")):
            if not r.get("backend") or r.get("device") not in tables:
                continue
            base = re.sub(r"@b\d+-[a-z]+(-x\d+)?$", "", r["backend"])  # a sweep point: its variant
            tables[r["device"]].get(base)
            seen += 1
    assert seen > 100


def test_research_rows_are_declared_on_catalogue_variants_and_resolve_anywhere():
    t = default_table()
    research = {d["name"]: d for d in t.declarations("experiments")}
    assert "torch-compile-fp8-graph-packed+ffn8" in research and "ort-int8+static" in research
    catalogue = {d["name"] for d in CATALOGUE}
    assert not catalogue & set(research)
    v = t.get("torch-compile-fp8-graph-packed+ffn8")
    assert v.device == "cuda" and v.batching == "packed" and v.options.fp8.ffn_hidden_fp8 and v.options.pipeline
    assert v.options.fp8.ffn_gelu == "exact" and not v.options.head_first  # what differs from the catalogue's row
    experiments = load_suite("experiments")
    assert set(experiments.bench.backends) <= set(research) | catalogue | {
        n for n in experiments.bench.backends if n.endswith(tuple(f"-{b}" for b in DERIVED_BATCHINGS))}


RESEARCH_NAME = re.compile(GRAMMAR.pattern + r"(?:\+[a-z0-9]+(?:-[a-z0-9]+)*)?")


def test_every_research_name_follows_the_grammar_and_no_standard_suite_names_one():
    """A research row is a catalogue-grammar name plus one ``+what-differs`` suffix; the names it
    was measured by still resolve, to it; the suites a user runs name catalogue rows only."""
    t = default_table()
    research = {d["name"] for d in t.declarations("experiments")}
    assert len(research) >= 40
    assert all(RESEARCH_NAME.fullmatch(n) for n in research), sorted(n for n in research if not RESEARCH_NAME.fullmatch(n))
    for old, new in experiment_renames().items():
        assert t.get(old).name == t.get(new).name == new, old
    for suite, _, rows in _suite_rows():
        if suite != "experiments":
            assert not {n for n, _ in rows} & research, suite


def test_backends_show_prints_every_option_of_a_row(capsys):
    from bertqa_bench.cli import main

    assert main(["backends", "--show", "torch-compile-fp8all-graph-packed-triton-e4m3out-epilogue-autotune-2streams"]) == 0
    out = capsys.readouterr().out
    assert "is an old name: its row is 'torch-compile-fp8-graph-packed'" in out
    for line in ("packed_attention: triton", "attention_output: e4m3", "ffn_gelu: epilogue", "cublaslt_autotune: 5",
                 "streams: 2", "declared in: the catalogue"):
        assert line in out, line
    assert main(["backends", "--show", "torch-compile-fp8-graph-packed+plain"]) == 0
    out = capsys.readouterr().out
    assert "packed_attention: flash" in out and "streams: 1" in out and "declared in: research" in out


def test_any_name_with_a_batching_suffix_runs_with_that_batching():
    t = table("cpu")
    v = t.get("ort-int8-sorted")
    assert v.batching == "sorted" and v.options == t.get("ort-int8").options
    assert t.get("eager-fp32-trimmed").batching == "trimmed"
    from bertqa_bench.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError):  # a packed row is packed already
        table("cuda").get("torch-compile-fp8-graph-packed-sorted")


def test_the_ci_gate_keys_its_expected_scores_by_the_names_its_rows_get():
    cfg = load_suite("ci")
    rows = list(csv.DictReader(open(Path(cfg.parity.expected_file) if Path(cfg.parity.expected_file).is_absolute()
                                    else REFERENCE.parent.parent / cfg.parity.expected_file)))
    assert [r["backend"] for r in rows] == cfg.bench.backends
    canonicalize(cfg)  # loading twice names nothing new
    assert [r["backend"] for r in rows] == cfg.bench.backends


def test_an_old_plugin_path_still_resolves_and_names_the_new_one(caplog):
    """A suite written before the kernels/, transforms/ and exported/ folders (issue 61) names
    ``bertqa_bench.backends.onnxruntime:OnnxRuntimeBackend``: it gets the same class, and one
    warning (per path) says what to write instead."""
    from bertqa_bench.backends import variants
    from bertqa_bench.backends.exported.onnxruntime import OnnxRuntimeBackend

    old = "bertqa_bench.backends.onnxruntime:OnnxRuntimeBackend"
    variants._WARNED_MOVED.discard(old)
    with caplog.at_level("WARNING", logger=variants.__name__):
        assert variants.import_object(old) is OnnxRuntimeBackend
        assert variants.import_object(old) is OnnxRuntimeBackend
        v = variants.make_variant("my-ort", old, "cpu", {"graph": "fp32"})
    warned = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "bertqa_bench.backends.exported.onnxruntime:OnnxRuntimeBackend" in warned[0]
    assert v.backend_class is OnnxRuntimeBackend


def test_every_moved_module_is_gone_from_its_old_place_and_imports_from_its_new_one():
    import importlib

    from bertqa_bench.backends.variants import MOVED_MODULES

    root = Path(__file__).resolve().parent.parent
    for old, new in MOVED_MODULES.items():
        assert not (root / (old.replace(".", "/") + ".py")).exists(), f"{old} is back: drop it from MOVED_MODULES"
        importlib.import_module(new)
