#!/usr/bin/env bash
# Installs `transformers serve` (transformers' own OpenAI-compatible server) into its own venv:
# $HERON_PEERS/transformers (default ~/.cache/heron/peers).
set -euo pipefail
VERSION=${TRANSFORMERS_VERSION:-5.24.0}
DIR=${HERON_PEERS:-$HOME/.cache/heron/peers}/transformers
if [ -x "$DIR/bin/transformers" ] && "$DIR/bin/python" -c "import fastapi, transformers" 2>/dev/null; then
    echo "transformers serve already in $DIR"; exit 0
fi
python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q torch==2.13.0 "transformers[serving]==$VERSION"
"$DIR/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
