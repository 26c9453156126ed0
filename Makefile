# dropmatch: `make reproduce` runs the notebook series, `make test` runs lint and the test suite.
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PRESET ?= default
# Extra papermill parameters for `make reproduce`, e.g. ARGS="-p max_new_tokens 32"
ARGS   ?=

.PHONY: install test lint reproduce bench-engine bench-dropmatch gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check dropmatch tests notebooks

test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q

reproduce: $(STAMP)
	$(PY) -m dropmatch.reproduce --preset $(PRESET) $(ARGS)

bench-engine: $(STAMP)
	$(PY) -m dropmatch.benchmarks.engine

bench-dropmatch: $(STAMP)
	$(PY) -m dropmatch.benchmarks.dropmatch_overhead

gpu-check: $(STAMP)
	$(PY) -m dropmatch.benchmarks.gpu_check

clean:
	rm -rf results .pytest_cache .ruff_cache
