# pipeplan: every target does its own set-up (virtual env in .venv, torch==2.13.0, editable install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# torchtitan for the export tests, each wheel --no-deps (no second torch): 0.2 in the venv; 0.3 (Python >= 3.11) in a
# folder of its own that the tests put on a subprocess's path; and what their model and config modules import
TT_STAMP := $(VENV)/.torchtitan-installed
TT_DEPS := torchdata==0.11.0 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 datasets==5.2.0 \
	multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 dill==0.4.1 xxhash==4.1.0
TT_03 := torchtitan==0.3.0 spmd_types==0.2.3 triton==3.9.0

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP) $(TT_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,plot,hf]'
	$(BIN)/pip install -q --no-deps 'torchtitan==0.2.0'  # its config loader, for the export tests (0.2: TOML configs)
	touch $(STAMP)

$(TT_STAMP): $(STAMP)
	rm -rf $(VENV)/torchtitan-deps $(VENV)/torchtitan-0.3
	$(BIN)/pip install -q --no-deps --target $(VENV)/torchtitan-deps $(TT_DEPS)
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(BIN)/pip install -q --no-deps --target $(VENV)/torchtitan-0.3 $(TT_03); \
	else echo "torchtitan 0.3 needs Python >= 3.11: its export tests skip"; fi
	touch $(TT_STAMP)

demo: $(STAMP)
	bash examples/demo.sh

lint: $(STAMP)
	$(BIN)/ruff check pipeplan tests benchmarks examples
	$(BIN)/ruff format --check pipeplan tests benchmarks examples
	$(BIN)/mypy pipeplan  # settings in pyproject.toml [tool.mypy]; its cache in .mypy_cache

format: $(STAMP)
	$(BIN)/ruff check --fix pipeplan tests benchmarks examples
	$(BIN)/ruff format pipeplan tests benchmarks examples

# two pytest workers (pytest-xdist), one test file each at a time (module fixtures built once); the suite also runs
# without them (plain `pytest`), only slower: a test never depends on another's worker
XDIST := -n 2 --dist loadfile
test: $(STAMP) $(TT_STAMP) lint
	$(BIN)/python -m pytest $(XDIST) --durations=30  # the slowest tests listed: the suite aims at 10 minutes on 2 cores

# everything but the tests marked slow: the multi-process runs (gloo ranks) and a few long ones
test-fast: $(STAMP) $(TT_STAMP) lint
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build *.egg-info
