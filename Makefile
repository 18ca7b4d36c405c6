SHELL := /bin/bash
# Two commands do all set-up on a fresh Linux machine with Python 3.11+:
#   make lab    - creates .venv on first use, installs kdtree, starts JupyterLab over the repository, on notebooks/
#                 (IP=0.0.0.0 PORT=8899 to choose; the notebooks' .ipynb are made from their tracked scripts)
#   make test   - the same environment, then the test suite (what CI runs)
# TORCH picks the torch pip installs: default `torch` from PyPI (a CUDA build on Linux);
# CI passes a CPU build, e.g. TORCH="torch==2.13.0" or TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
EXTRAS ?= lab,dev,nvrtc
BIN := $(VENV)/bin
STAMP := $(VENV)/.kdtree-installed

.PHONY: lab test lint test-gpu bench captures clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

IP ?= 127.0.0.1
PORT ?= 8888
lab: $(STAMP)
	$(BIN)/python -m kdtree.lab --ip $(IP) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# ruff (configured in pyproject.toml): lint and formatting of the package, tests, tools and experiments; clang-format
# (kernels/.clang-format): the kernels' formatting (the same checks as .pre-commit-config.yaml)
lint: $(STAMP)
	$(BIN)/ruff check kdtree tests tools experiments
	$(BIN)/ruff format --check kdtree tests tools experiments
	$(BIN)/clang-format --style=file --dry-run --Werror kernels/*.cu kernels/*.cuh

# On a machine with a CUDA GPU, torch, CuPy and triton: .venv's Python where `make` made one and the cuda13 or
# cuda12 extra put CuPy in it, else python3 (a GPU machine's own environment). Without a GPU the GPU tests skip with a
# reason. test-gpu: every test marked gpu (the kernel, the plan on the device, the serving path, SGLang's kit, real
# servers, A/B); the log is kept in test-gpu.log. PYTEST_ARGS adds to pytest's (say `-k fuzz`).
GPU_PYTHON ?= $(shell $(BIN)/python -c "import cupy" 2>/dev/null && echo $(BIN)/python || echo python3)
test-gpu:
	$(GPU_PYTHON) -m pytest -q -rs -m gpu tests $(PYTEST_ARGS) 2>&1 | tee test-gpu.log; exit $${PIPESTATUS[0]}

bench:
	$(GPU_PYTHON) -m kdtree bench -o bench-out

captures: $(STAMP)
	data/captured_batches/regenerate.sh $(BIN)/kdtree

clean:
	rm -rf $(VENV) .pytest_cache
