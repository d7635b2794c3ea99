# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/vla-runtime demo

# the suite runs on one worker process per core, at most 4 (pytest-xdist); PYTEST_WORKERS=0 runs it in this process;
# it ends with its 25 slowest tests, to keep the whole suite near 12 minutes on 2 cores
PYTEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --maxprocesses 4 --dist worksteal --durations 25

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"
