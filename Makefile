# bertqa_bench — one command to benchmark every backend, one to test.
# Everything runs in a project virtualenv (.venv) made from the python3 on PATH.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUITE ?= default
ARGS ?=
# The CPU build of torch that lies on this machine's disk; on a GPU machine set TORCH_SPEC=torch
# (or keep the torch you have: `make bench-all VENV_SITE=1`).
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help install bench-all bench train report parity-check test test-fast mlflow-ui clean

help:
	@echo "make bench-all [SUITE=default|bert-base-squad|nq] [ARGS='--set bench.batch_size=16']"
	@echo "make test | make parity-check | make mlflow-ui | make clean"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

bench-all: install
	$(BIN)/bertqa-bench bench --suite $(SUITE) $(ARGS)

train: install
	$(BIN)/bertqa-bench train --suite $(SUITE) $(ARGS)

report: install
	$(BIN)/bertqa-bench report $(ARGS)

# The accuracy gate: trains the small CI model if models/ lacks it, runs the CPU backends, fails
# with a table when one drifts from eager FP32 or from benchmarks/expected/ci.csv.
parity-check: install
	$(BIN)/bertqa-bench parity --suite ci --no-progress $(ARGS)

# The parity gate, then the unit + end-to-end tests. CI (.ci/run) runs exactly this.
test: install
	$(MAKE) --no-print-directory parity-check
	$(BIN)/python -m pytest -q -ra tests

mlflow-ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///results/mlflow.db --default-artifact-root results/mlruns --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) results/20* models/*/artifacts
