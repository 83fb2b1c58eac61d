# orca-serve: `make serve` runs the server in the foreground, `make test` runs the test suite.
# Both create .venv on first use. torch==2.13.0 is installed first: on these machines it is
# the CPU build from local disk, and a bare `torch` requirement would pull a CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

# Local single-machine use: no Ray token auth (see README "Security").
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: serve test gpu-test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	rm -f $(VENV)/.installed-* && touch $@

serve: $(STAMP)
	$(PY) -m deployments.launch serve_config.yaml

# Two workers: the tests with in-process servers in one, every other module in either
# (tests/conftest.py); they leave each other's ports and processes alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadgroup tests

# On the GPU machine (torch and triton preinstalled there): GPU tests only.
gpu-test:
	python3 -m pytest -q -p no:cacheprovider -m gpu tests

clean:
	rm -rf $(VENV)
