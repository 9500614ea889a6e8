# heron: `make serve` and `make test` set everything up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The GPT-2 plugin is installed the way a third party's would be (a built wheel, not the
# source tree), and reinstalled when its files change.
PLUGIN       := plugin_template
PLUGIN_STAMP := $(VENV)/.plugin-installed
PLUGIN_FILES := $(shell find $(PLUGIN) -path $(PLUGIN)/build -prune -o \( -name '*.py' -o -name '*.cu' -o -name '*.toml' \) -print)

.PHONY: setup model test serve bench bench-offline bench-profile bench-multiturn bench-lora bench-soak bench-translation bench-speculative kernels-check clean

setup: $(STAMP) $(PLUGIN_STAMP) model

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without a GPU, take the CPU build of torch first; a loose requirement would pull CUDA's.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

$(PLUGIN_STAMP): $(STAMP) $(PLUGIN_FILES)
	$(BIN)/python -m pip install -q -c constraints.txt './$(PLUGIN)[test]'
	touch $@

model: $(STAMP)
	$(BIN)/python -m heron.core.default_model

test: setup
	$(BIN)/heron kernels --check
	$(BIN)/python -m pytest -q -p no:cacheprovider
	cd $(PLUGIN) && ../$(BIN)/python -m pytest -q -p no:cacheprovider

serve: setup
	$(BIN)/heron serve

# The default model's MTP drafting head, trained once by self-distillation (about an hour
# on 2 cores, most of it generating samples, which are kept for retraining).
MTP_HEAD := bench/.mtp/smollm2-135m-instruct-mtp.safetensors

$(MTP_HEAD): | setup
	$(BIN)/heron train-mtp --out $@ --samples bench/.mtp/samples.pt

# heron against vLLM CPU and llama.cpp, one after another (peers set up once, in their own
# directories; one that fails to set up is skipped by the comparison, which says so).
bench: setup $(MTP_HEAD)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[bench]'
	-bash bench/peers/setup_vllm.sh
	-bash bench/peers/setup_llamacpp.sh
	-bash bench/peers/setup_transformers.sh
	$(BIN)/python -m bench.compare

bench-profile: setup
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python -m bench.profile_server

bench-offline: setup
	$(BIN)/python -m bench.offline

bench-multiturn: setup
	$(BIN)/python -m bench.multiturn

bench-lora: setup
	$(BIN)/python -m bench.lora

bench-translation: setup
	$(BIN)/python -m bench.translation

bench-speculative: setup $(MTP_HEAD)
	$(BIN)/python -m bench.speculative --methods ngram mtp --mtp-head $(MTP_HEAD) \
		--confidence-thresholds 0 0.25 --disable-by-batch-size 4 --draft-dtype bfloat16 \
		--prompt-lookup

bench-soak: setup
	$(BIN)/python -m bench.soak

clean:
	rm -rf $(VENV) build *.egg-info $(PLUGIN)/build $(PLUGIN)/src/*.egg-info
