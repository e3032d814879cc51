"""The comparison a user sees in the MLflow UI, checked in a real browser (``make ui-test``).

A small bench (tiny random BERT, three CPU backends) runs through the CLI; ``mlflow ui`` is started
on its store with the bertqa-bench app (what ``make mlflow-ui`` serves) on a free port; Debian's
Chromium, driven by Playwright with a fresh profile for every page, opens the links ``bench``
printed and the experiment's bare address, and each page must show every backend's F1,
features/s, speedup and parity. Screenshots go to $BERTQA_UI_SHOTS (``make ui-shots`` points it at
docs/).

Without Chromium or Playwright the test is skipped with the reason, except under CI=true, where a
test that cannot run fails instead of passing in silence.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ui, pytest.mark.slow]

CHROMIUM = os.environ.get("BERTQA_CHROMIUM", "/usr/bin/chromium")
# A headless, offline, first-run-free Chromium: no sandbox (CI containers run as root), no GPU,
# nothing fetched from Google on start.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BACKENDS = ["eager-fp32", "onnxruntime", "onnxruntime-sorted"]
PAGE_TIMEOUT_MS = 120_000  # first paint of MLflow's bundle on 2 busy cores takes tens of seconds


def _cannot_run(why: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the browser test must run in CI: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _cannot_run("playwright is not installed (make ui-test installs the ui extra)")
    if not Path(CHROMIUM).exists():
        _cannot_run(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """The tiny bench, run as a user runs it; returns its store, its printed links, its records."""
    import yaml

    from conftest import TINY_BERT

    root = tmp_path_factory.mktemp("ui")
    suite = {
        "name": "tiny",
        "data": {"source": "synthetic", "data_dir": str(root / "data"), "max_seq_len": 96, "doc_stride": 48,
                 "max_query_len": 32,
                 "synthetic": {"seed": 3, "n_train_contexts": 12, "n_dev_contexts": 6, "questions_per_context": 3,
                               "min_words": 40, "max_words": 160, "mean_words": 70, "long_context_fraction": 0.2}},
        "model": {"name": "tiny-qa", "base": "embedded:all-MiniLM-L6-v2", "random_init": True,
                  "config_overrides": dict(TINY_BERT)},
        "train": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "seed": 1},
        "bench": {"backends": BACKENDS, "batch_size": 8, "warmup_batches": 1, "min_passes": 2, "min_duration_s": 0},
        "variants": {"onnxruntime-sorted": {"base": "onnxruntime", "batching": "sorted"}},
        "models_dir": str(root / "models"), "results_dir": str(root / "results"), "cache_dir": str(root / "cache"),
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(suite))
    out = subprocess.run([sys.executable, "-m", "bertqa_bench.cli", "bench", "--suite", str(root / "tiny.yaml"),
                          "--no-progress"], capture_output=True, text=True, timeout=900,
                         env=os.environ | {"MLFLOW_TRACKING_URI": ""})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    links = dict(re.findall(r"^(MLflow, [^:]+): (http\S+)$", out.stdout, re.M))
    assert len(links) == 2, out.stdout[-2000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'results' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bertqa-tiny")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], "tags.kind = 'backend'")}
    assert sorted(runs) == sorted(BACKENDS)
    return {"root": root, "links": links, "experiment_id": exp.experiment_id, "runs": runs,
            "train": client.search_runs([exp.experiment_id], "tags.kind = 'train'")[0]}


@pytest.fixture(scope="module")
def ui(bench):
    """``mlflow ui`` with the bertqa-bench app (as ``make mlflow-ui`` starts it) on a free port."""
    if "bertqa-bench" not in {e.name for e in entry_points(group="mlflow.app")}:
        pytest.fail("the mlflow.app entry point bertqa-bench is not installed: reinstall the package (make install)")
    port = _free_port()
    results = bench["root"] / "results"
    log = open(bench["root"] / "mlflow-ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--app-name", "bertqa-bench", "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{results / 'mlflow.db'}",
                             "--default-artifact-root", str(results / "mlruns"),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (bench["root"] / "mlflow-ui.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow ui did not answer in 180 s"
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, 15)  # its own session: uvicorn's worker goes with it
        proc.wait(timeout=30)
        log.close()


def _page(browser, url: str):
    """A fresh profile (a new browser context: no stored choice, no cookies) at ``url``."""
    context = browser.new_context(viewport={"width": 1920, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    page.goto(url)
    return context, page


def _shot(page, name: str) -> None:
    where = os.environ.get("BERTQA_UI_SHOTS")
    if not where:
        return
    close = page.get_by_role("button", name="Close")  # the MLflow Assistant side panel: not ours to show
    if close.count():
        close.first.click()
        page.wait_for_timeout(500)
    Path(where).mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(Path(where) / name))


def _shown(value: float) -> str:
    """A metric as MLflow's table prints it (JavaScript's number formatting)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _assert_runs_table_shows_the_comparison(page, bench) -> None:
    page.get_by_text("onnxruntime-sorted", exact=True).first.wait_for()
    for name, run in bench["runs"].items():
        row = page.locator(f'[row-id$="{run.info.run_id}"]')
        m = run.data.metrics

        def cell(col):
            return row.locator(f'[col-id="{col}"]').first.inner_text().strip()

        # the name, after its colour pill: the backend's colour from comparison.png (mlflow.runColor)
        assert cell("attributes.`Run Name`").split("\n") == [run.data.tags["mlflow.runColor"], name]
        assert cell("metrics.`f1`") == _shown(m["f1"]), name
        assert cell("metrics.`features_per_s`") == _shown(m["features_per_s"]), name
        assert cell("metrics.`speedup`") == _shown(m["speedup"]), name
        assert cell("tags.`parity`") == run.data.tags["parity"] == "pass", name
        assert cell("metrics.`parity_pass`") == _shown(m["parity_pass"]) == "1", name


def test_printed_link_shows_every_backends_numbers(browser, ui, bench):
    url = bench["links"]["MLflow, this bench's comparison"].replace("http://127.0.0.1:5000", ui)
    context, page = _page(browser, url)
    try:
        _assert_runs_table_shows_the_comparison(page, bench)
        # the parent's verdict is a value in the table, and the run name starts with it
        page.get_by_text(re.compile(r"^PASS \d{8}-\d{6}-tiny$")).first.wait_for()
        _shot(page, "mlflow-runs.png")
        # the same view as charts: one bar per backend, in its mlflow.runColor
        page.goto(url + "&compareRunsMode=CHART")
        page.get_by_text("features_per_s", exact=True).first.wait_for()
        page.wait_for_timeout(3000)  # the charts draw after their titles
        _shot(page, "mlflow-chart.png")
    finally:
        context.close()


def test_the_experiments_bare_address_opens_the_same_comparison(browser, ui, bench):
    context, page = _page(browser, f"{ui}/#/experiments/{bench['experiment_id']}")
    try:
        _assert_runs_table_shows_the_comparison(page, bench)
        assert "workflowType=machine_learning" in page.url and "viewStateShareKey=" in page.url
        # the choice is remembered: a run page opened next in this profile is the model-training one
        run = bench["runs"]["onnxruntime"]
        page.goto(f"{ui}/#/experiments/{bench['experiment_id']}/runs/{run.info.run_id}")
        page.get_by_text("Model metrics", exact=True).first.wait_for()
        assert page.get_by_text("Evaluations", exact=True).count() == 0
        assert json.loads(page.evaluate("localStorage.getItem('mlflow.workflowType_v1')")) == "machine_learning"
        _shot(page, "mlflow-run.png")
    finally:
        context.close()


def test_compare_link_lays_the_backends_side_by_side(browser, ui, bench):
    url = bench["links"]["MLflow, its backends side by side"].replace("http://127.0.0.1:5000", ui)
    context, page = _page(browser, url)
    try:
        page.get_by_text(f"Comparing {len(BACKENDS)} Runs", exact=False).first.wait_for()
        text = page.inner_text("body")
        for name, run in bench["runs"].items():
            m = run.data.metrics
            assert name in text
            for key in ("f1", "features_per_s", "speedup", "parity_pass"):
                assert re.search(rf"(?<![\d.]){re.escape(_shown(m[key]))}(?![\d])", text), (name, key, m[key])
        if os.environ.get("BERTQA_UI_SHOTS"):  # the picture: the metrics table, not the plot above it
            page.get_by_text("Visualizations", exact=True).first.click()
            page.get_by_text("Run details", exact=True).first.click()
            page.get_by_text("Parameters", exact=True).first.click()
            page.wait_for_timeout(1000)
        _shot(page, "mlflow-compare.png")
    finally:
        context.close()


def test_training_run_opens_on_its_curves(browser, ui, bench):
    run = bench["train"]
    context, page = _page(browser, f"{ui}/#/experiments/{bench['experiment_id']}/runs/{run.info.run_id}/model-metrics")
    try:
        for key in ("train_loss", "lr", "samples_per_s"):
            page.get_by_text(key, exact=True).first.wait_for()
        page.wait_for_timeout(2000)  # the charts draw after their titles
        _shot(page, "mlflow-training.png")
    finally:
        context.close()
