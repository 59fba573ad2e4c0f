# The two commands: `make demo` (the main job on the embedded default) and `make test` (the whole suite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
NPROC ?= 2

.PHONY: venv sysdeps demo test test-fast bench clean-storage

# torch first and pinned, so pip never resolves a multi-GB CUDA build on a CPU machine.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

# Debian packages the tests use for real: Slurm + munge (launch), Prometheus/promtool (monitor).
sysdeps:
	bash scripts/install_system_deps.sh

demo: venv
	bash scripts/demo.sh

test: venv sysdeps
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow and not slurm and not prometheus" $(PYTEST_ARGS)

bench: venv
	$(PY) benchmarks/train_throughput.py
