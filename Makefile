# dflash-eval developer entry points.
#   make demo   create the venv, install the core and the `demo` extra (report only), run the main job end to end
#   make test   create/reuse the venv, install the `dev` extra (test tools, moto, rq-dashboard), run the test suite
#   make lint   ruff check and mypy (the `dev` extra)
# Override the venv location with VENV=/path, pass pytest flags with PYTEST_ARGS='-k redis'.

VENV ?= .venv
BASE_PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := constraints.txt
EXTRAS ?= dev
# Re-install only when the packaging inputs change (or the venv is new); one stamp per extra, so
# `make demo` installs only what the demo runs and a later `make test` adds the rest.
STAMP := $(VENV)/.dflash-eval-installed-$(EXTRAS)
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: venv install test lint demo bench clean distclean

venv: $(PY)

$(PY):
	@test -n "$(BASE_PYTHON)" || { echo "error: neither python3.11 nor python3 found on PATH" >&2; exit 1; }
	$(BASE_PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

install: $(STAMP)

$(VENV)/.dflash-eval-installed-%: $(PY) setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PIP) install -c $(CONSTRAINTS) -e ".[$*]"
	@touch $@

test: $(VENV)/.dflash-eval-installed-dev
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff and mypy read their configuration from pyproject.toml (mypy: the torch-free modules)
lint: $(VENV)/.dflash-eval-installed-dev
	$(PY) -m ruff check .
	$(PY) -m mypy

demo: $(VENV)/.dflash-eval-installed-demo
	$(VENV)/bin/dflash-eval demo $(DEMO_ARGS)

BENCHES ?= eval_speed train_throughput hook_overhead job_latency object_store
bench: install
	@set -e; for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py $(BENCH_ARGS); done

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f $(VENV)/.dflash-eval-installed-*

distclean: clean
	rm -rf $(VENV)
