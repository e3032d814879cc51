"""Bad command-line arguments and suite values: a one-line error naming the flag or field, exit 2,
before any work (no training, no timing, nothing logged), where each used to end in a traceback,
start work first, or be accepted without a word."""
import pytest

from bertqa_bench import exit_codes
from bertqa_bench.cli import main
from bertqa_bench.commands.bench import run_bench as real_run_bench  # before no_work replaces it
from bertqa_bench.errors import ConfigError
from bertqa_bench.suite import load_suite


def _fails(argv, said, capsys):
    assert main(argv) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Any of these reaching real work is the bug: training, a bench, a profile or an MLflow import."""
    def boom(*a, **k):
        raise AssertionError("work started before the bad argument was refused")

    import bertqa_bench.cli as cli
    import bertqa_bench.commands.bench as bench

    monkeypatch.setattr(bench, "run_bench", boom)  # the commands import it when they run
    monkeypatch.setattr(cli, "profile_backend", boom)  # the cli imports these at its top
    monkeypatch.setattr(cli, "import_bundle", boom)


@pytest.mark.parametrize("argv, said", [
    (["backends", "--set", "bench.batch_size=[1"], "override 'bench.batch_size=[1': the value '[1' is not valid YAML"),
    (["backends", "--set", "=3"], "override '=3': '' is not a field name"),
    (["backends", "--set", "bench..x=1"], "'bench..x' is not a field name"),
    # --set without --suite applies to the default suite here too, as in every other command
    (["backends", "--set", "bench.batch_size=-1"], "bench.batch_size must be >= 1"),
    (["sweep", "--batch-sizes", "x,0,-1"], "--batch-sizes takes whole numbers >= 1, comma-separated (e.g. 4,16,64); "
                                           "got 'x,0,-1'"),
    (["sweep", "--devices", "two"], "--devices takes whole numbers >= 1"),
    (["sweep", "--batch-sizes", ","], "--batch-sizes takes whole numbers >= 1"),
    (["profile", "--backend", "eager-fp32", "--batches", "-1"], "--batches and --top must be >= 1"),
    (["profile", "--backend", "eager-fp32", "--top", "0"], "--batches and --top must be >= 1"),
    (["profile", "--backend", "eager-fp32", "--clock-mhz", "0"], "--clock-mhz must be a positive number"),
    (["profile", "--backend", "eager-fp32", "--clock-mhz", "nan"], "--clock-mhz must be a positive number"),
    (["bench", "--backends", ","], "--backends ',' names no backend"),
    (["loadgen", "--scenario", "Offline", "--backends", ","], "--backends ',' names no backend"),
    (["bench", "--model", ""], "--model is empty"),
    # loadgen without --suite reads the default suite (its help says so), not a None name
    (["loadgen", "--scenario", "Offline", "--backends", "nope"], "unknown backend 'nope'; valid backends:"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(argv, said, capsys):
    _fails(argv, said, capsys)


def test_a_folder_where_a_file_goes_is_named(tmp_path, capsys):
    pred = tmp_path / "pred.json"
    pred.write_text("{}")
    _fails(["score", str(tmp_path), str(pred)], f"{tmp_path}: a folder, where a file was expected", capsys)
    _fails(["reference", "--out", str(tmp_path / "r"), "--title", "t", "--notes", str(tmp_path), str(tmp_path)],
           "a folder, where a file was expected", capsys)


def test_a_checkpoint_config_that_is_not_an_object_is_named(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("[1]")
    with pytest.raises(Exception, match="config.json holds a JSON list, not the object save_pretrained writes"):
        from bertqa_bench.model.checkpoint import inspect_folder

        inspect_folder("ck", tmp_path / "ck")


def test_a_damaged_train_metrics_file_is_named_by_scaling(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train_metrics.json").write_text("[1]")
    _fails(["scaling", "--out", str(tmp_path / "s"), "--title", "t", str(tmp_path / "m")],
           "train_metrics.json: holds a JSON list, not an object", capsys)


def test_track_reads_every_bundle_before_logging_any(tmp_path, capsys):
    from test_damaged_bundles import _bundle

    good = _bundle(tmp_path / "good")
    _fails(["track", str(good.dir), str(tmp_path / "missing")], "missing: no run.json", capsys)


@pytest.mark.parametrize("override, said", [
    ("train.grad_accum=0", "train.grad_accum must be >= 1"),
    ("train.num_threads=-2", "train.num_threads must be >= 1"),
    ("train.warmup_ratio=5", "train.warmup_ratio must be in [0, 1]"),
    ("bench.num_threads=-3", "bench.num_threads must be >= 1"),
    ("bench.tokens_per_batch=-5", "bench.tokens_per_batch must be >= 1"),
    ("train.epochs=.nan", "epochs, learning_rate and batch_size must be positive"),  # found by test_fuzz
    ("train.learning_rate=.inf", "epochs, learning_rate and batch_size must be positive"),
    ("bench.max_batch_rows=0", "bench.max_batch_rows must be >= 1"),
    ("data.max_eval_examples=-1", "data.max_eval_examples must be >= 1 (or null: all of them)"),
    ("data.max_eval_examples=0", "data.max_eval_examples must be >= 1"),
    ("data.target_eval_features=-10", "data.target_eval_features must be >= 1"),
    ("parity.expected_tolerance=-1", "parity.expected_tolerance must be >= 0"),
    ("parity.expected_tolerance=.nan", "parity.expected_tolerance must be >= 0"),
    ("parity.expected_tolerance_questions=-3", "parity.expected_tolerance_questions must be >= 0"),
    ("parity.overrides={ort-fp32-sortd: {min_f1_ratio: 0.9, min_agreement: 0.9}}",
     "parity.overrides: unknown backend 'ort-fp32-sortd'; valid backends:"),
])
def test_out_of_range_suite_values_are_refused_naming_the_field(override, said):
    with pytest.raises(ConfigError) as e:
        load_suite("default", [override])
    assert said in str(e.value)


def test_the_boundaries_themselves_are_accepted():
    cfg = load_suite("default", ["train.grad_accum=1", "train.warmup_ratio=0", "data.max_eval_examples=1",
                                 "parity.expected_tolerance=0", "parity.expected_tolerance_questions=0",
                                 "bench.max_batch_rows=1", "parity.overrides={ort-fp32: {min_f1_ratio: 0.9, "
                                 "min_agreement: 0.9}}"])
    assert cfg.train.grad_accum == 1 and cfg.data.max_eval_examples == 1 and "ort-fp32" in cfg.parity.overrides
    assert cfg.parity.expected_tolerance == 0 and cfg.parity.expected_tolerance_questions == 0


def test_a_backend_this_machine_cannot_run_is_said_before_the_model_is_trained(tmp_path, monkeypatch):
    import bertqa_bench.commands.bench as bench
    from bertqa_bench.backends.variants import VariantTable

    cfg = load_suite("default", [f"results_dir={tmp_path / 'r'}", f"models_dir={tmp_path / 'm'}",
                                 f"cache_dir={tmp_path / 'c'}"])
    table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    cannot = next((n for n in table.names() if table.get(n).unavailable_reason()), None)
    if cannot is None:
        pytest.skip("every backend can run on this machine")
    said = []

    class Trained(Exception):
        pass

    def ensure_model(*a, **k):
        raise Trained

    monkeypatch.setattr(bench, "ensure_model", ensure_model)
    with pytest.raises(Trained):
        real_run_bench(cfg, backends=[cannot], log=said.append)
    assert any(line.startswith(f"note: {cannot} cannot run here (") for line in said), said
