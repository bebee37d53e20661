# Two entry points: `make run` (the matchmaker daemon on its in-memory store) and
# `make test` (lint, types, tests, and tests/rudp again against the mypyc build).
# Each creates .venv on first use and installs what it needs: `run` the daemon's
# extra only (aiorudp[matchmaker]), `test` the development tools too (aiorudp[dev]).
# `make dev` prepares that development venv without running anything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# Debian and Ubuntu ship python3 without its venv and ensurepip modules (they are in
# the python3-venv package), and `python3 -m venv` then fails inside ensurepip.
# Say so before trying.
NEEDS_VENV = @$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	echo "$(PYTHON) cannot create a virtual environment (no venv/ensurepip module)." >&2; \
	echo "On Debian or Ubuntu: sudo apt-get install python3-venv (or python3.X-venv" >&2; \
	echo "for the python3.X you use), then run make again; or set PYTHON=another python." >&2; \
	exit 1; }

.PHONY: run dev test lint typecheck pytest compiled-test bench clean

$(VENV)/.created:
	$(NEEDS_VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed-run: pyproject.toml $(VENV)/.created
	$(PY) -m pip install --quiet -e '.[matchmaker]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.created
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# make runs the daemon as its child: SIGTERM or Ctrl-C stops the daemon cleanly, but
# make itself then exits with the signal's status (143, 130), whatever the daemon's.
# Under a supervisor, run .venv/bin/matchmaker directly: it exits 0 on SIGTERM.
# The connect-token issuing key: made on the first `make run` (and its public half
# printed), kept in $(ISSUER_KEY) and $(ISSUER_KEY).pub for the next ones. A key given
# in the environment (MATCHMAKER_ISSUER_KEY_FILE, MATCHMAKER_ISSUER_KEY, or
# MATCHMAKER_EPHEMERAL_ISSUER_KEY=1) takes its place.
ISSUER_KEY ?= .matchmaker-issuer.key

run: $(VENV)/.installed-run
	@if [ -z "$$MATCHMAKER_ISSUER_KEY_FILE$$MATCHMAKER_ISSUER_KEY$$MATCHMAKER_EPHEMERAL_ISSUER_KEY" ]; then \
		$(PY) -m matchmaker keygen --out $(ISSUER_KEY) --if-absent || exit 2; \
		export MATCHMAKER_ISSUER_KEY_FILE=$(ISSUER_KEY); \
	fi; exec $(PY) -m matchmaker

dev: $(VENV)/.installed-dev

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(PY) -m mypy

pytest: $(VENV)/.installed-dev
	RUDP_EXPECT_COMPILED=0 $(PY) -m pytest -q

test: lint typecheck pytest compiled-test

# The mypyc build of the per-message code (RUDP_COMPILE=1, see setup.py), tested as a
# user gets it: a wheel, installed into a venv of its own, and tests/rudp run from
# a copy outside the source tree, so that they import the installed compiled package
# (test_build.py checks that they did).
# build/ is setuptools' and mypyc's scratch space: start from an empty one, so that
# nothing left there by an earlier build (a module since removed) lands in the wheel.
COMPILED_DIR ?= .compiled-test

compiled-test: $(VENV)/.installed-dev
	$(NEEDS_VENV)
	rm -rf build $(COMPILED_DIR)
	RUDP_COMPILE=1 $(PY) -m pip wheel --quiet --no-deps --wheel-dir $(COMPILED_DIR)/dist .
	$(PYTHON) -m venv $(COMPILED_DIR)/venv
	$(COMPILED_DIR)/venv/bin/python -m pip install --quiet --upgrade pip
	$(COMPILED_DIR)/venv/bin/python -m pip install --quiet "$$(ls $(COMPILED_DIR)/dist/aiorudp-*.whl)[dev]"
	mkdir -p $(COMPILED_DIR)/run
	cp -R pyproject.toml tests examples $(COMPILED_DIR)/run/
	cd $(COMPILED_DIR)/run && RUDP_EXPECT_COMPILED=1 ../venv/bin/python -m pytest -q -p no:cacheprovider tests/rudp

# The game-server benchmark (bench/game_server.py, docs/performance.md): rudp, both
# builds and both loops, against ENet (pyenet, installed here), raw UDP and TCP.
# Options through BENCH_ARGS, e.g. make bench BENCH_ARGS="--quick".
bench: $(VENV)/.installed-dev
	$(PY) -m pip install --quiet pyenet
	$(PY) bench/game_server.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis build .compiled-test
