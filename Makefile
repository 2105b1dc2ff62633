SHELL := /bin/bash
# Two entry points on a fresh machine: `make run` (the daemon) and `make test`; `make install`
# puts the `cachemgr` command on the PATH.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Empty: the daemon serves the root every cachemgr command uses by default (settings: root).
ROOT ?=
# /usr/local/bin is on every login shell's PATH; PREFIX=$HOME/.local installs for one user.
PREFIX ?= /usr/local
COMPLETIONS := $(PREFIX)/share/bash-completion/completions
PYTEST_ARGS ?=
# Each pass ends with its slowest tests, for whoever next cuts the CI time (bench/RESULTS.md).
DURATIONS ?= --durations=15
# pytest-xdist workers: 4 on CI's 2 cores, since most tests wait on daemons, processes and disks
# rather than compute (at 3 the pass kept the cores about half busy: bench/RESULTS.md, "CI
# time"); a test file stays on one worker. The `serial` tests (claims about time) run after
# them, alone; a pass that selects none exits 5, which is no failure here.
PYTEST_WORKERS ?= 4
# make test's set-up steps (the venv then lint, apt packages, the two engine envs) are
# independent and mostly wait on pip and apt: run at once, they take about as long as the
# slowest one rather than the sum (bench/RESULTS.md, "CI time").
SETUP_JOBS ?= 4

.PHONY: run install uninstall test test-setup lint deps sglang-env vllm-env bench clean

# The venv is rebuilt when pyproject.toml changes; the install compiles the C helpers again
# when its sources change.
$(VENV)/.installed: pyproject.toml constraints.txt hatch_build.py cachemgr/fs/_dirscan.c \
		cachemgr/fs/_unlink.c cachemgr/fs/helper_nice.h cachemgr/gc/_rank.c
	PY=$(PY) bash scripts/build-deps.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]' 2> >(grep -v "is ignored: it is neither" >&2)
	# An editable install leaves the package uncompiled, and under PYTHONDONTWRITEBYTECODE (set
	# on CI's machines, as in deploy/Dockerfile) every cachemgr process the tests start would
	# compile it again.
	$(BIN)/python -m compileall -q cachemgr
	touch $@

run: $(VENV)/.installed
	$(BIN)/cachemgr $(if $(ROOT),--root $(ROOT)) serve

# A link to the venv's command (its scripts name the venv's python, so it runs from anywhere)
# and bash completion where bash-completion looks for it.
install: $(VENV)/.installed
	mkdir -p $(PREFIX)/bin $(COMPLETIONS)
	ln -sfn $(CURDIR)/$(BIN)/cachemgr $(PREFIX)/bin/cachemgr
	_CACHEMGR_COMPLETE=bash_source $(BIN)/cachemgr > $(COMPLETIONS)/cachemgr

uninstall:
	rm -f $(PREFIX)/bin/cachemgr $(COMPLETIONS)/cachemgr

deps:
	bash scripts/test-deps.sh

sglang-env:
	bash scripts/sglang-env.sh

vllm-env:
	bash scripts/vllm-env.sh

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Everything the tests need; `make test` builds it with -j (SETUP_JOBS).
test-setup: $(VENV)/.installed deps sglang-env vllm-env lint

test:
	$(MAKE) --no-print-directory -j$(SETUP_JOBS) --output-sync=target test-setup
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --serial=exclude $(DURATIONS) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest --serial=only $(DURATIONS) $(PYTEST_ARGS) || [ $$? -eq 5 ]

bench: $(VENV)/.installed sglang-env
	@ls bench/bench_*.py | xargs -n1 $(BIN)/python

clean:
	rm -rf $(VENV) .sglang-env .vllm-env .pytest_cache .mypy_cache .ruff_cache
