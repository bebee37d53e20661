# Two entry points: `make run` (the matchmaker daemon on its in-memory store) and
# `make test` (lint, types, tests).
# Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint typecheck pytest bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m matchmaker

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(VENV)/.installed
	$(PY) -m mypy

pytest: $(VENV)/.installed
	$(PY) -m pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
