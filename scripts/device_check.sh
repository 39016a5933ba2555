#!/usr/bin/env bash
# On a machine with a CUDA GPU and no network: the GPU tests on the device (no simulator), then the GPU benchmark.
# Python packages the device image lacks (ortools, immutabledict) travel as wheels in .whl/ (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d .whl ortools immutabledict
# Budget: under 8 minutes (tests about 1, benchmark about 5 on an H200).
set -uo pipefail
cd "$(dirname "$0")/.."
# The project's environment where there is one (README's .venv, or $PYTHON), else the machine's python3.
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
echo "python: $PY ($("$PY" --version 2>&1))"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 180 "$PY" -m pytest -q tests/fast/test_gpu_kernels.py tests/fast/test_hybrid.py tests/fast/test_families.py -k "gpu or hybrid" 2>&1 | tail -5
timeout 330 "$PY" scripts/bench_gpu.py --shape llama-7b --json "$OUT/bench_gpu.json" 2>&1 | tail -12
