"""Every fast.gpu kernel compiled for real devices (sm_80, sm_90) with NVIDIA's NVVM and ptxas from PyPI (the `gpu`
extra), no GPU needed: what the simulator cannot check. Runs outside this process, which has the simulator on."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

NO_SIM = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}


def python(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=NO_SIM, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def toolchain():
    r = python("-c", "from numba.cuda.cudadrv import nvvm; nvvm.NVVM()\n"
                     "from cuda.pathfinder import find_nvidia_binary_utility as f; assert f('ptxas')")
    if r.returncode:
        pytest.skip("NVIDIA's NVVM or ptxas missing: pip install -e '.[gpu]'")


def test_every_kernel_compiles_for_sm_80_and_sm_90_without_spills(toolchain):
    r = python("scripts/gpu_compile.py", "--cc", "8.0,9.0")
    assert r.returncode == 0, r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| _")]
    compiled = {(row[0][2:], row[1], row[2]) for row in rows}
    for fmt in ("f32", "f16", "bf16", "q8_0", "q4_0"):  # the kernels reading weights, once per format
        assert {("_sparse_rows", fmt, cc) for cc in ("8.0", "9.0")} <= compiled
    assert ("_union", "-", "9.0") in compiled and all(int(row[4]) == 0 for row in rows)  # no spills


@pytest.mark.parametrize("body, expect", [
    ("    l = [1.0]\n    l.append(2.0)\n    out[0] = l[1]", "TypingError"),  # a list grown: the simulator runs it
    ("    s = cuda.shared.array(20000, float32)\n    s[0] = 1\n    out[0] = s[0]", "shared"),  # 80 kB > 48 kB
])
def test_what_the_simulator_accepts_and_a_device_does_not_is_reported(toolchain, body, expect):
    code = ("import sys; sys.argv = ['x']\n"
            "from numba import cuda, float32\n"
            "import scripts.gpu_compile as g\n"
            f"def k(out):\n{body}\n"
            "try:\n"
            "    ptx, _ = cuda.compile_ptx(k, (g.a(float32, 1),), cc=(9, 0))\n"
            "    print(g.ptxas_report(ptx, (9, 0)))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    r = python("-c", code)
    assert expect.lower() in r.stdout.lower(), r.stdout + r.stderr
