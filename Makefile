# The README's commands. Each works on a fresh clone: the first target that needs the venv builds it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PDSERVE := $(VENV)/bin/pdserve

.PHONY: install install-dev pull test test-fast lint serve bench clean

# `install`: what serving needs (`make serve`); `install-dev`: that plus the dev extras the tests
# and the linter use (`make test`, `test-fast`, `lint`).
install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Without a GPU, install the CPU build of torch first so that resolving the project's
# `torch>=2.5` does not pull the multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install torch==2.13.0; fi
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -e '.[dev]'
	touch $@

pull: install
	$(PDSERVE) models pull

# Every test. pytest exits non-zero (5) when it collects nothing, so an empty run fails too.
test: install-dev pull
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# Every test but the e2e ones that start processes (marker `e2e`, pyproject.toml): the quick loop.
test-fast: install-dev pull
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not e2e"

lint: install-dev
	$(VENV)/bin/ruff check .

serve: pull
	$(PDSERVE) up

bench: pull
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
