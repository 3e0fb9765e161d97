# straw: developer entry points. `make demo` runs the main job (the benchmark),
# `make test` runs lint, types and the test suite. Both create .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The peer implementation (straw-queue, Rust core) lives in its own venv, made once with
#   python -m venv /work/peer && /work/peer/bin/pip install straw-queue torch==2.13.0 numpy
PEER_PY ?= /work/peer/bin/python
# Scenarios of ../shared/bench/bench_api.py to compare (a..g); see ../shared/bench/README.md.
ONLY ?= --only ab

.PHONY: all test demo bench lint typecheck fmt slow compare compat clean crash sim soak

all: test

# Re-install whenever pyproject.toml changes (dependencies, extras, entry points).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,torch,engines,ray,demo]'
	touch $@

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src/straw
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/straw demo

bench: $(STAMP)
	$(BIN)/straw bench

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy src/straw

fmt: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# Verification campaigns (issues 6 and 11); each runs its long variants, which `make test` samples.
# The full crash campaign: every byte prefix and bit flip of the last journal/catalog frame,
# an abrupt exit at every named durable phase; and the full damage campaign: every metadata
# file of a pool deleted, cut, flipped and replaced by a link, at several positions.
crash: $(STAMP)
	STRAW_CRASH_FULL=1 $(BIN)/python -m pytest tests/test_crash_campaign.py tests/test_damage_campaign.py -m "slow or not slow"

# The seeded simulation on the in-memory fault-injecting filesystem: `make sim SEEDS=1000`
# runs seeds 1000-1999; BASE=2000 starts elsewhere.
SEEDS ?= 200
BASE ?= 1000
sim: $(STAMP)
	STRAW_SIM_SEEDS=$(SEEDS) STRAW_SIM_BASE=$(BASE) $(BIN)/python -m pytest tests/sim -m "slow or not slow"

# A few minutes of writers, a coordinator, workers and a collector on two JuiceFS clients.
soak: $(STAMP)
	STRAW_JUICEFS=require $(BIN)/python -m pytest tests/soak -m "slow or not slow"

compare: $(STAMP)
	bash ../shared/bench/compare.sh $(BIN)/python $(PEER_PY) $(ONLY)

# The conformance suite (tests/conformance, issue 10) against ours and, when its venv exists,
# against the peer (PEER_PY=... to point elsewhere); `make test` runs it against ours only.
compat: $(STAMP)
	$(BIN)/python -m pytest tests/conformance
	@if [ -x "$(PEER_PY)" ]; then \
		cd tests/conformance && $(abspath $(PEER_PY)) -m pytest -c pytest.ini . ; \
	else \
		echo "compat: no peer venv at $(PEER_PY); the suite ran against ours only"; \
	fi

# Keeps .venv (reinstalling torch is slow); `rm -rf .venv` for a full reset.
clean:
	rm -rf build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
