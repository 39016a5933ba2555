#!/usr/bin/env bash
# On a machine with a CUDA GPU and no network: the GPU tests on the device (no simulator), then the GPU benchmark in
# f16 and q4_0 (kernel GB/s against a device copy; hybrid vs whole-layer offload at 10/25/50/100 % budgets), then one
# table of both (scripts/device_table.py).
# Python packages the device image lacks (ortools, immutabledict) travel as wheels in .whl/ (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d .whl ortools immutabledict
# Budget: under 8 minutes (tests about 1, each benchmark about 3 on an H200).
# --dry-run: everything but the device, on the CPU under numba's CUDA simulator (the tests collected, not run; the
# benchmark on a micro shape), as CI runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "scripts/device_check.sh: unknown argument '$arg' (only --dry-run)" >&2; exit 2 ;;
  esac
done
# The project's environment where there is one (README's .venv, or $PYTHON), else the machine's python3.
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
echo "python: $PY ($("$PY" --version 2>&1))"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} NUMBA_ENABLE_CUDASIM=$DRY PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
TESTS=(tests/fast/test_gpu_kernels.py tests/fast/test_hybrid.py tests/fast/test_families.py -k "gpu or hybrid")
if [ "$DRY" = 1 ]; then
  echo "dry run: numba's CUDA simulator, no device"
  "$PY" -m pytest -q --co "${TESTS[@]}" 2>&1 | tail -1
  BENCH=(--shape micro-32 --tokens 1 --runs 1 --budgets 40 -t 1)
  # the simulator runs each thread as a Python thread: launch constants shrunk as the tests shrink them, and the
  # interpreter's switch interval as tests/conftest.py sets it (its threads' hand-overs: 200 s -> 36 s a format)
  BENCH_GPU=(-c "import runpy, sys; sys.setswitchinterval(1e-4); from fast import gpu; gpu.THREADS = gpu.TILE = 4
gpu.CHUNKS = 3; sys.argv[0] = 'scripts/bench_gpu.py'; runpy.run_path(sys.argv[0], run_name='__main__')")
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 180 "$PY" -m pytest -q "${TESTS[@]}" 2>&1 | tail -5
  BENCH=(--shape llama-7b --tokens 4 --runs 2)
  BENCH_GPU=(scripts/bench_gpu.py)
fi
rc=0
for type in f16 q4_0; do
  timeout 200 "$PY" "${BENCH_GPU[@]}" "${BENCH[@]}" --type "$type" --json "$OUT/bench_gpu_$type.json" 2>&1 | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
"$PY" scripts/device_table.py "$OUT"/bench_gpu_f16.json "$OUT"/bench_gpu_q4_0.json || rc=1
exit $rc
