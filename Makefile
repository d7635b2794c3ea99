# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/vla-runtime demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"
