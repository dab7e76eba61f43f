# Two targets do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fmp-installed
TORCH_PIP_ARGS ?=

.PHONY: install demo test test-slow lint typecheck docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# On the project's machines pip finds torch==2.13.0 as a CPU build on local disk (an unpinned torch
	# would pull a multi-GB CUDA build). Elsewhere: make TORCH_PIP_ARGS=--index-url=https://download.pytorch.org/whl/cpu
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/seed_recipe.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (mkdocs-material + mkdocstrings), offline; --strict fails on any warning:
# a broken link, a missing snippet, a docstring griffe cannot parse.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

# Test files spread over up to 4 workers (two on 2 cores), each file whole on one worker, so a
# module fixture (a shared compiled step) is built once; compiling dominates, one core per worker.
test: lint typecheck docs
	$(PY) -m pytest -n auto --maxprocesses=4 --dist loadfile -m "not slow"

# The model-zoo cases left out of `make test` (each compiles a larger model's whole step).
test-slow: $(STAMP)
	$(PY) -m pytest -n auto --maxprocesses=4 --dist loadfile -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
