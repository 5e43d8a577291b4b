# The two commands a newcomer types: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint fmt bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job: warm-start a tiny model on arithmetic, then GRPO through real services on CPU.
run: $(STAMP)
	$(VENV)/bin/meshrl demo

# The whole suite: lint, format check, type check, then every test that runs on this machine.
test: $(STAMP) lint
	$(PY) -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check meshrl tests benchmarks recipes
	$(VENV)/bin/ruff format --check meshrl tests benchmarks recipes
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix meshrl tests benchmarks recipes
	$(VENV)/bin/ruff format meshrl tests benchmarks recipes

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
