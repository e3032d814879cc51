# bertqa_bench — one command to benchmark every backend, one to test.
# Everything runs in a project virtualenv (.venv) made from the python3 on PATH.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUITE ?= default
ARGS ?=
# torch as pinned for the CPU machines; on a GPU machine set TORCH_SPEC=torch (PyPI's CUDA build).
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help install bench-all bench bench-ddp train train-ddp sweep loadgen report parity-check test ui-test ui-shots mutation-check mlflow-ui clean

help:
	@echo "make bench-all [SUITE=default|cpu|gpu-bert-base|bert-base-squad|nq|experiments] [ARGS='--set bench.batch_size=16']"
	@echo "make test | make ui-test | make parity-check | make mutation-check | make mlflow-ui | make clean"
	@echo "make train-ddp NPROC=4 SUITE=gpu-bert-base | make sweep SUITE=... ARGS='--batch-sizes 16,64,256'"
	@echo "make bench-ddp NNODES=1 NPROC=2 SUITE=gpu-bert-base ARGS='--backends eager-fp16' [RDZV_ENDPOINT=host:port when NNODES>1]"
	@echo "make loadgen SUITE=ci SCENARIO=SingleStream|Server|Offline [ARGS='--find-peak-qps']"

# Bytecode is written as modules are first imported, not at install: pip compiles every installed
# file, one at a time (74 of a fresh install's 115 s on 2 cores, 2026-12-03), where a run imports a
# fraction of them (transformers' 400 architectures, torch's tests and compilers). Where the
# environment sets PYTHONDONTWRITEBYTECODE (this project's CI machines do), nothing would ever be
# cached and every process would compile what it imports again, 8 s more a process: the targets
# below run without it, so the first import of a module writes its bytecode (.venv's and the
# repository's __pycache__, which git ignores).
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q --no-compile "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-compile -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

bench-all: install
	$(BIN)/bertqa-bench bench --suite $(SUITE) $(ARGS)

train: install
	$(BIN)/bertqa-bench train --suite $(SUITE) $(ARGS)

# Data-parallel training on NPROC GPUs of this host (torchrun + DDP over NCCL; gloo on CPUs).
# Multi-node: the same command with torchrun's rendezvous arguments instead of --standalone.
# NVLink multicast stays off in every process (shared multi-GPU hosts).
NPROC ?= 2
train-ddp: install
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	  $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) -m bertqa_bench.cli train --suite $(SUITE) $(ARGS)

# Data-parallel prediction over NPROC processes on each of NNODES hosts (torchrun): every rank
# predicts its share of each backend, rank 0 records. NNODES=1: --standalone; else run the same
# command on every host with RDZV_ENDPOINT=<first host>:<port> (c10d rendezvous, RDZV_ID the job).
NNODES ?= 1
RDZV_ENDPOINT ?=
RDZV_ID ?= bertqa-bench-ddp
ifeq ($(NNODES),1)
DDP_RDZV := --standalone
else
DDP_RDZV := --nnodes=$(NNODES) --rdzv-backend=c10d --rdzv-endpoint=$(RDZV_ENDPOINT) --rdzv-id=$(RDZV_ID)
endif
bench-ddp: install
	@if [ "$(NNODES)" != 1 ] && [ -z "$(RDZV_ENDPOINT)" ]; then echo "NNODES=$(NNODES) needs RDZV_ENDPOINT=host:port"; exit 2; fi
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	  $(BIN)/torchrun $(DDP_RDZV) --nproc_per_node=$(NPROC) -m bertqa_bench.cli bench-ddp --suite $(SUITE) $(ARGS)

sweep: install
	$(BIN)/bertqa-bench sweep --suite $(SUITE) $(ARGS)

# MLPerf LoadGen scenarios (SingleStream | Server | Offline), each backend as the system under
# test: make loadgen SUITE=ci SCENARIO=Server ARGS="--find-peak-qps --backends ort-fp32"
SCENARIO ?= SingleStream
loadgen: install
	$(BIN)/bertqa-bench loadgen --suite $(SUITE) --scenario $(SCENARIO) $(ARGS)

report: install
	$(BIN)/bertqa-bench report $(ARGS)

# The accuracy gate: trains the small CI model if models/ lacks it, runs the CPU backends, fails
# with a table when one drifts from eager FP32 or from benchmarks/expected/ci.csv.
parity-check: install
	$(BIN)/bertqa-bench parity --suite ci --no-progress $(ARGS)

# The parity gate, then the unit + end-to-end tests (the browser test is ui-test's). CI (.ci/run)
# runs this, then ui-test.
test: install
	$(MAKE) --no-print-directory parity-check
	$(BIN)/python -m pytest -q -ra -m "not ui" tests

# Plants known bugs (scorer, parity rule and gate, scatter, cache key, task/variant wiring) one at a
# time in a scratch copy and checks the tests catch each; not part of CI (~15 min on 2 cores).
# ARGS='-k cache' runs some of them, ARGS=--list lists them.
mutation-check: install
	$(BIN)/python scripts/mutation_check.py $(ARGS)

# The MLflow UI in a real browser: a small bench, `mlflow ui` on its store, Debian's Chromium
# (apt-get install chromium; no browser download) driven by Playwright. Kept out of `make test`
# because it needs that system package and about two minutes; CI installs Chromium and runs it
# with CI=true, where it fails rather than skips when it cannot run.
CHROMIUM ?= /usr/bin/chromium
ui-test: install
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,ui]"
	BERTQA_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest -q -ra -m ui tests/test_mlflow_ui.py

# The same test, writing its screenshots over docs/mlflow-*.png.
ui-shots: install
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,ui]"
	BERTQA_UI_SHOTS=docs BERTQA_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest -q -ra -m ui tests/test_mlflow_ui.py

# MLflow's UI through the bertqa-bench app plugin (bertqa_bench/reporting/mlflow_ui.py): MLflow 3.17 opens
# on its GenAI pages until a browser has chosen "Model training"; the plugin makes that the
# first-visit choice and sends an experiment's address to its latest bench view. The links printed
# first: each suite's runs table, its latest bench's view and compare page, its latest training.
mlflow-ui: install
	@MLFLOW_TRACKING_URI= $(BIN)/python -c "from bertqa_bench.reporting.tracking import ui_links; print('\n'.join(ui_links('results')))" 2>/dev/null || true
	$(BIN)/mlflow ui --app-name bertqa-bench --backend-store-uri sqlite:///results/mlflow.db \
	  --default-artifact-root results/mlruns --host 127.0.0.1 --port 5000

# Everything generated: the venv, run bundles, trained models and exported artifacts
# (models/artifacts/), generated data, the evaluation-set cache and device-run leftovers.
clean:
	rm -rf $(VENV) results/20* results/device-* results/profiles results/mlflow.db results/mlflow.db.lock results/mlruns \
	  data cache device-out
	find models -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
