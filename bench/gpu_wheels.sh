#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on the GPU machine, whose image lacks them: this repo's
# pinned versions (constraints.txt) for CPython 3.12 on x86-64 Linux, into .whl/ (ignored
# by git; carry it with the call).
#
#   bash bench/gpu_wheels.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACKAGES=(msgspec llguidance gguf structlog)
rm -rf "$REPO/.whl"
for name in "${PACKAGES[@]}"; do
  pin="$(grep -i "^$name==" "$REPO/constraints.txt")"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$REPO/.whl" "$pin"
done
ls -1 "$REPO/.whl"
