# The two commands a new user needs (see README):
#   make up    set up .venv and run the main job
#   make test  set up .venv and run the test suite
# Python 3.11 or newer: python3.11 if it is on PATH, else python3 (checked below).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Installed before the lock and kept out of it: on a CPU machine pip takes the CPU wheel,
# on a GPU host the CUDA build.
TORCH  := torch==2.13.0

.PHONY: up test setup clean lock bench-setup system-deps format lint

setup: $(STAMP)

# Reinstall whenever the lock or the project metadata changes. pip 23.2 resolves this
# set very slowly, so upgrade pip first and install the already-resolved lock; the project
# itself goes in with --no-deps.
$(STAMP): requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "error: $(PYTHON) is older than Python 3.11; set PYTHON=/path/to/python3.11" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $@

up: $(STAMP)
	$(BIN)/fleet up

# Test modules run on both cores (pytest-xdist): a module's tests stay together on one worker,
# so its fixtures (a trained model, a served fleet) are built once; the slowest modules start
# first (tests/conftest.py). TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The formatter, the linter and the layer contracts (all configured in pyproject.toml),
# before any test: a change that breaks them fails here in seconds. `make format` rewrites
# what the formatter and linter can.
lint: $(STAMP)
	@$(BIN)/ruff format --check --quiet . || { echo "error: files above are not formatted; run make format" >&2; exit 1; }
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format --quiet .
	$(BIN)/ruff check --quiet --fix .

# Debian packages the tests run for real (Prometheus scraping a gateway and its promtool, Redis for shared quotas,
# Alertmanager's amtool checking the alerting config), or the benchmarks (wrk, nginx). Installed once, with
# apt-get (as root, else through sudo).
TEST_PACKAGES  := prometheus redis-server prometheus-alertmanager
BENCH_PACKAGES := wrk nghttp2-client nginx-light
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

system-deps:
	$(call apt_install,$(TEST_PACKAGES))

# Re-resolve the locks after changing dependencies in pyproject.toml. The bench lock is the
# test set plus the bench extra (Evidently, for bench/drift.py), resolved together so that
# installing it beside the test set changes no version.
lock:
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip compile pyproject.toml --extra test --python-version 3.11 -o requirements.lock
	$(BIN)/uv pip compile pyproject.toml --extra test --extra bench --python-version 3.11 -o requirements-bench.lock

# What the benchmarks need beyond the tests (run by hand, never by make test).
bench-setup: $(STAMP)
	$(call apt_install,$(BENCH_PACKAGES))
	$(BIN)/python -m pip install --quiet -r requirements-bench.lock

clean:
	rm -rf $(VENV) .fleet
