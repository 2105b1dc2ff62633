SHELL := /bin/bash
# Two entry points on a fresh machine: `make run` (the daemon on a local root) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ROOT ?= $(CURDIR)/.cachemgr-data
PYTEST_ARGS ?=

.PHONY: run test lint deps sglang-env bench clean

# The venv is rebuilt when pyproject.toml changes; the install compiles the C helpers again
# when its sources change.
$(VENV)/.installed: pyproject.toml hatch_build.py cachemgr/fs/_dirscan.c cachemgr/fs/_unlink.c
	PY=$(PY) bash scripts/build-deps.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]' 2> >(grep -v "is ignored: it is neither" >&2)
	touch $@

run: $(VENV)/.installed
	$(BIN)/cachemgr --root $(ROOT) serve

deps:
	bash scripts/test-deps.sh

sglang-env:
	bash scripts/sglang-env.sh

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(VENV)/.installed deps sglang-env lint
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed
	@ls bench/bench_*.py | xargs -n1 $(BIN)/python

clean:
	rm -rf $(VENV) .sglang-env .pytest_cache .mypy_cache .ruff_cache
