# heron: `make serve` and `make test` set everything up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup model test serve bench bench-offline bench-profile bench-multiturn bench-lora kernels-check clean

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

# heron against vLLM CPU and llama.cpp, one after another (peers set up once, in their own
# directories; one that fails to set up is skipped by the comparison, which says so).
bench: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	-bash bench/peers/setup_vllm.sh
	-bash bench/peers/setup_llamacpp.sh
	-bash bench/peers/setup_transformers.sh
	$(BIN)/python -m bench.compare

bench-profile: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench.profile_server

bench-offline: setup
	$(BIN)/python -m bench.offline

bench-multiturn: setup
	$(BIN)/python -m bench.multiturn

bench-lora: setup
	$(BIN)/python -m bench.lora

clean:
	rm -rf $(VENV) build *.egg-info
