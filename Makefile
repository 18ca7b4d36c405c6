SHELL := /bin/bash
# Two commands do all set-up on a fresh Linux machine with Python 3.11+:
#   make        - creates .venv and installs kdtree into it with the tested set of its build (below)
#   make test   - the same environment, then the test suite (what CI runs); `make lab` starts JupyterLab on it
# BUILD: which torch (and CuPy) .venv gets - cuda13 where the NVIDIA driver runs CUDA 13, cuda12 where it runs
# only CUDA 12, cpu without one - detected by requirements/pick.py unless given (make BUILD=cpu). Each build's
# versions are pinned in requirements/BUILD.txt (`make lock` writes them anew: requirements/lock.sh).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ifeq ($(origin BUILD),undefined)
  PICKED := $(shell $(PYTHON) requirements/pick.py)
  BUILD := $(firstword $(PICKED))
  WHY := $(wordlist 2,100,$(PICKED))
else
  WHY := BUILD=$(BUILD) given
endif
EXTRAS_cpu := lab,dev,nvrtc
EXTRAS_cuda13 := lab,dev,nvrtc,cuda13
EXTRAS_cuda12 := lab,dev,cuda12
EXTRAS := $(EXTRAS_$(BUILD))
ifeq ($(EXTRAS),)
  $(error BUILD=$(BUILD): no such build (cpu, cuda13, cuda12))
endif
LOCK := requirements/$(BUILD).txt
STAMP := $(VENV)/.kdtree-$(BUILD)

.PHONY: all lab test lint lock wheel test-gpu bench captures clean

all: $(STAMP)

# The build's torch from its index alone (requirements/BUILD.in; pip would ask that index for every package), then
# the build's lock - exactly its versions - and kdtree itself in place. A build without a lock (cuda12 until
# `make lock` runs where PyTorch's CUDA 12 index answers) resolves today's versions, and says so.
$(STAMP): pyproject.toml $(wildcard $(LOCK))
	@echo "kdtree: the $(BUILD) build ($(WHY)); another: make clean; make BUILD=cpu|cuda13|cuda12"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.kdtree-*
	$(BIN)/python -m pip install -q --no-deps -r requirements/$(BUILD).in
	if [ -f $(LOCK) ]; then \
	  $(BIN)/python -m pip install -q -r $(LOCK) && $(BIN)/python -m pip install -q --no-deps -e . ; \
	else \
	  echo "kdtree: no $(LOCK): installing today's versions, untested (requirements/lock.sh $(BUILD) pins them)" && \
	  $(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" ; \
	fi
	$(BIN)/python -m pip check
	touch $@

IP ?= 127.0.0.1
PORT ?= 8888
lab: $(STAMP)
	$(BIN)/python -m kdtree.lab --ip $(IP) --port $(PORT)

# Chromium (for tests/test_browser.py) is the one thing beyond Python packages; without it that test skips, and the
# end of the run lists what skipped and why.
test: $(STAMP)
	@command -v chromium >/dev/null || echo "kdtree: no chromium on PATH: the browser test will skip (Debian/Ubuntu: sudo apt-get install chromium)"
	$(BIN)/python -m pytest -q

lock:
	requirements/lock.sh $(BUILDS)

# kdtree's wheel in dist/ (the kernel sources inside): what a server's environment installs (tools/wheel_check.sh
# installs one into a clean environment and uses it from outside the checkout, as CI does)
wheel: $(STAMP)
	rm -rf build
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

# ruff (configured in pyproject.toml): lint and formatting of the package, tests, tools and experiments; clang-format
# (kernels/.clang-format): the kernels' formatting (the same checks as .pre-commit-config.yaml)
lint: $(STAMP)
	$(BIN)/ruff check kdtree tests tools experiments requirements
	$(BIN)/ruff format --check kdtree tests tools experiments requirements
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
