#!/usr/bin/env bash
# One GPU-machine call: environment, the GPU tests, then the microbenchmarks.
#
#   bash bench/gpu.sh [gpu_bench.py args, e.g. --only decode,prefill]
#
# heron is not pip-installed on the device, so this builds a throw-away `heron` namespace
# (symlinks core, plugins, server) and puts it first on PYTHONPATH. The packages the GPU
# machine's image lacks (msgspec, llguidance, gguf, structlog) travel as wheels in .whl/,
# which bench/gpu_wheels.sh fills; they are installed to a temp dir.
# Results (test log, JSON, markdown) go to $OUT, else bench/results/. Budget: < 8.5 minutes.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/bench/results}"
export OUT
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/pkgs/heron" "$SHIM/stubs"
for part in core plugins server; do ln -s "$REPO/$part" "$SHIM/pkgs/heron/$part"; done
export PYTHONPATH="$SHIM/pkgs:$REPO${PYTHONPATH:+:$PYTHONPATH}"
# Wheels carried to the device in .whl/ (msgspec, llguidance: not in its image) go to a temp dir.
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SHIM/site" \
    "$REPO"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:$SHIM/site"
fi

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
"$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import cupy
    print("cupy", cupy.__version__, "| nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as exc:
    print("cupy unavailable:", exc)
import heron.core.ops.cuda, heron.core.kernels
print("heron imports from", heron.core.ops.cuda.__file__)
PYEOF

cd "$REPO"
echo "== GPU tests"
TEST_START=$SECONDS
# GPU_TESTS: which tests (default: all of them)
timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest ${GPU_TESTS:-tests/gpu tests/test_sampler.py tests/test_logit_bias.py} \
  -q -m gpu -p no:cacheprovider -rfEs --durations 12 2>&1 | tee "$OUT/gpu_tests.txt" | tail -60
echo "tests: $((SECONDS - TEST_START)) s"

echo "== microbenchmarks"
timeout "${MICRO_TIMEOUT:-120}" "$PY" -m bench.gpu_bench --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.txt" | tail -80

# The end-to-end run takes the fastest attention kernels the microbenchmarks found correct.
echo "== end-to-end: random Llama-3-8B shapes, heron vs transformers"
timeout "${E2E_TIMEOUT:-170}" "$PY" -m bench.gpu_e2e --out "$OUT" --from-bench "$OUT/gpu_bench.json" \
  2>&1 | tee "$OUT/gpu_e2e.txt" | tail -40
