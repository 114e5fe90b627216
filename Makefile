# `make run` and `make test` set everything up on a fresh machine: each builds .venv from
# pyproject.toml (re-built when pyproject.toml changes) and then does its job.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test lint bench-quick docs clean gpu-check

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) -e '.[test,dev,ucx]'
	touch $@

$(VENV)/.plot: $(VENV)/.base
	$(PIP) -e '.[plot]'
	touch $@

run: $(VENV)/.plot
	$(PY) -m asynccoll.cli demo

# The suite in two parts: everything but the tests marked `alone`, then the `alone` ones
# (stopped ranks, liveness waits, timing statistics: the first part's load on a 2-core machine
# would move their clocks), each on two pytest-xdist workers (PYTEST_PARALLEL,
# PYTEST_ALONE_PARALLEL; empty: serially; tests/conftest.py gives each worker its own segment
# directory). Both parts always run; the target fails if either failed (exit 5, nothing
# selected, counts as passed). PYTEST_ARGS: extra options for both (a path, -k, -x,
# --durations=N). On the quiet 2-core machine: the first part 1781 passed in 1167 s (serially
# 2261 s), the alone part 83 passed in 144-145 s twice (serially 245 s).
PYTEST_ARGS ?=
PYTEST_PARALLEL ?= -n 2 --dist loadgroup
PYTEST_ALONE_PARALLEL ?= -n 2 --dist loadgroup
test: $(VENV)/.test
	@a=0; b=0; \
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not alone" $(PYTEST_ARGS) || a=$$?; \
	$(PY) -m pytest $(PYTEST_ALONE_PARALLEL) -m alone $(PYTEST_ARGS) || b=$$?; \
	echo "make test: first part exit $$a, alone part exit $$b (5: nothing selected)"; \
	[ $$a -eq 0 -o $$a -eq 5 ] && [ $$b -eq 0 -o $$b -eq 5 ] && [ $$a -eq 0 -o $$b -eq 0 ]

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-quick: $(VENV)/.test
	mkdir -p bench/results
	$(PY) bench/sched_overhead.py --quick --out bench/results/quick/sched_overhead.json

# Every picture in docs/img, from the current code (schedules, a traced run) and the benchmark
# results the docs quote (bench/results/*.json); re-measuring is `python bench/NAME.py`.
DOCS_IMG ?= docs/img
docs: $(VENV)/.plot
	$(PY) docs/pictures.py --out $(DOCS_IMG)

# On a machine with one CUDA GPU: every CUDA / CuPy test and the CUDA-tensor DDP-hook run, with
# the machine's own python3 (PYTHON=...), installing only what it lacks (bench/gpu_check.sh).
gpu-check:
	PYTHON="$(PYTHON)" bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
