# Two commands a newcomer needs: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/budgetq: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: demo test lint
demo: $(BIN)/budgetq
	$(BIN)/budgetq --log-level WARNING demo

test: $(BIN)/budgetq
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(BIN)/budgetq
	$(BIN)/ruff check .
