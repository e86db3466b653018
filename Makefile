# dflash-eval developer entry points.
#   make demo   create the venv, install the core and the `demo` extra (report only), run the main job end to end
#   make test   create/reuse the venv, install the `dev` extra (test tools, moto, rq-dashboard), run the test suite
#   make lint   ruff check and mypy (the `dev` extra)
#   make lock   recompile requirements.lock (every package of every extra, pinned) from setup.cfg's ranges
#   make test-newest  the tests that touch other packages' internals, in a throwaway venv with the newest releases
#   make gpu-wheels   .whl/: the wheels bench/gpu_check.sh carries to a lent GPU machine (bench/gpu_wheels.txt)
# Override the venv location with VENV=/path, pass pytest flags with PYTEST_ARGS='-k redis'.

VENV ?= .venv
BASE_PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := constraints.txt
# The lock: the whole closure of every extra, pinned, compiled by `make lock` (uv) from setup.cfg's ranges. Every
# install uses it as a constraints file, so each extra installs exactly the lock's versions of what it needs.
LOCK := requirements.lock
EXTRAS ?= dev
# Re-install only when the packaging inputs change (or the venv is new); one stamp per extra, so
# `make demo` installs only what the demo runs and a later `make test` adds the rest.
STAMP := $(VENV)/.dflash-eval-installed-$(EXTRAS)
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: venv install test lint demo bench gpu-wheels lock test-newest clean distclean

venv: $(PY)

$(PY):
	@test -n "$(BASE_PYTHON)" || { echo "error: neither python3.11 nor python3 found on PATH" >&2; exit 1; }
	$(BASE_PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

install: $(STAMP)

$(VENV)/.dflash-eval-installed-%: $(PY) setup.cfg pyproject.toml $(CONSTRAINTS) $(LOCK)
	@start=$$(date +%s); \
	$(PIP) install -c $(CONSTRAINTS) -c $(LOCK) -e ".[$*]" && \
	echo "make: installed the [$*] extra from $(LOCK) in $$(( $$(date +%s) - start )) s"
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

# then run bench/gpu_check.sh on the lent machine with `.whl` carried
gpu-wheels: $(PY)
	PYTHON=$(PY) bash bench/gpu_wheels.sh .whl

# torch comes from constraints.txt (its CPU build, found through pip's find-links where one is configured), so
# the lock holds torch's own requirements but not torch: the CUDA images install PyPI's build of the same version.
LOCK_FLAGS ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
lock: $(VENV)/.dflash-eval-installed-dev
	$(VENV)/bin/uv pip compile setup.cfg --all-extras -c $(CONSTRAINTS) --python-version 3.11 \
	  --no-emit-package torch --no-header --annotation-style line $(LOCK_FLAGS) -o $(LOCK).new
	@{ echo "# Every package of every extra, pinned for CPython 3.11 on Linux: \`make lock\` writes it (uv pip compile"; \
	   echo "# from setup.cfg's ranges and constraints.txt; torch itself is pinned there). Edit setup.cfg, not this file."; \
	   cat $(LOCK).new; } > $(LOCK) && rm -f $(LOCK).new

NEWEST_VENV ?= /tmp/dflash-newest-venv
test-newest:
	BASE_PYTHON=$(BASE_PYTHON) NEWEST_VENV=$(NEWEST_VENV) bash tools/test_newest.sh $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f $(VENV)/.dflash-eval-installed-*

distclean: clean
	rm -rf $(VENV)
