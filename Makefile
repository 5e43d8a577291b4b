# The two commands a newcomer types: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test test-vllm lint fmt bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,trackers,dashboard,agents,verifiers]'
	touch $(STAMP)

# The main job: warm-start a tiny model on arithmetic, then GRPO through real services on CPU.
run: $(STAMP)
	$(VENV)/bin/meshrl demo

# The whole suite: lint, format check, type check, then every test that runs on this machine, on two
# pytest workers (a test file stays on one worker, so its module fixtures run once).
test: $(STAMP) lint
	$(PY) -m pytest -q -m "slow or not slow" -n 2 --dist loadfile --durations=30

# The vLLM engine's tests, in an environment of their own (the default one stays lean): vLLM's CPU
# build is ~3.5 GB and brings CUDA builds of torchvision/torchaudio/torchcodec that break its import.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev,vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# On two workers, test by test (they sit in one file): 126 s instead of 166 on 2 cores.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm -n 2 --dist load

lint: $(STAMP)
	$(VENV)/bin/ruff check meshrl meshrl_vf_sums tests benchmarks recipes
	$(VENV)/bin/ruff format --check meshrl meshrl_vf_sums tests benchmarks recipes
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix meshrl meshrl_vf_sums tests benchmarks recipes
	$(VENV)/bin/ruff format meshrl meshrl_vf_sums tests benchmarks recipes

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .mypy_cache .ruff_cache
