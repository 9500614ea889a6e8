#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (continuous batching over slots) from the llama.cpp that
# the llama-cpp-python sdist vendors, into $HERON_PEERS/llama.cpp (default ~/.cache/heron/peers).
# Only the server target is built: about 12 minutes on 2 cores.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${HERON_PEERS:-$HOME/.cache/heron/peers}/llama.cpp
if [ -x "$DIR/bin/llama-server" ]; then echo "llama-server already in $DIR"; exit 0; fi
mkdir -p "$DIR/src"
python3 -m pip download -q --no-deps --no-binary :all: -d "$DIR/src" "llama-cpp-python==$VERSION"
tar -xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$DIR/build" --target llama-server -j "$(nproc)"
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$DIR/bin/"
cp "$DIR/build/bin/"*.so* "$DIR/bin/" 2>/dev/null || true
echo "$VERSION" > "$DIR/VERSION"
"$DIR/bin/llama-server" --version 2>&1 | tail -2
