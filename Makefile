# pipeplan: every target does its own set-up (virtual env in .venv, torch==2.13.0, editable install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,plot,hf]'
	$(BIN)/pip install -q --no-deps 'torchtitan==0.2.0'  # its config loader, for the export tests (0.2: TOML configs)
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh

lint: $(STAMP)
	$(BIN)/ruff check pipeplan tests benchmarks examples
	$(BIN)/ruff format --check pipeplan tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff check --fix pipeplan tests benchmarks examples
	$(BIN)/ruff format pipeplan tests benchmarks examples

test: $(STAMP) lint
	$(BIN)/python -m pytest

# everything but the tests marked slow: the multi-process runs (gloo ranks) and a few long ones
test-fast: $(STAMP) lint
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
