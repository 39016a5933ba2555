"""scripts/device_check.sh --dry-run, as a lent device would run it but on the CPU under numba's CUDA simulator: the
device tests collected, both benchmarks on a micro shape, the closing table (about 80 s alone)."""

import os
import subprocess
import sys

from tests.helpers import ROOT


def test_the_device_check_runs_dry(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "tests collected" in r.stdout
    last = r.stdout.strip().splitlines()[-2:]  # the table's rows, one per format
    assert [line.split(" | ")[1] for line in last] == ["f16", "q4_0"], r.stdout[-1000:]
    assert {p.name for p in tmp_path.iterdir()} == {"bench_gpu_f16.json", "bench_gpu_q4_0.json"}


def test_bench_gpu_refuses_bad_budgets():
    r = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--budgets", "0.5,-1"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)
    assert r.returncode != 0 and "--budgets" in r.stderr and "Traceback" not in r.stderr, r.stderr
