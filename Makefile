# heron: `make serve` and `make test` set everything up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup model test serve bench bench-multiturn bench-lora kernels-check clean

setup: $(STAMP) model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without a GPU, take the CPU build of torch first; a loose requirement would pull CUDA's.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

model: $(STAMP)
	$(BIN)/python -m heron.core.default_model

test: setup
	$(BIN)/heron kernels --check
	$(BIN)/python -m pytest -q -p no:cacheprovider

serve: setup
	$(BIN)/heron serve

bench: setup
	$(BIN)/python bench/offline.py

bench-multiturn: setup
	$(BIN)/python bench/multiturn.py

bench-lora: setup
	$(BIN)/python -m bench.lora

clean:
	rm -rf $(VENV) build *.egg-info
