"""GPU kernels against their ref twins: under the CUDA simulator in CI (launch constants shrunk so several blocks
and several reduction steps run), with the full shape table on a device (scripts/device_check.sh)."""

import os

import pytest

from fast import gpu
from tests.fast.kernels import SHAPES, SIM_SHAPES, check_kernel

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
CASES = SIM_SHAPES if SIMULATED else SHAPES


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    if SIMULATED:
        monkeypatch.setattr(gpu, "THREADS", 8)
        monkeypatch.setattr(gpu, "TILE", 8)
        monkeypatch.setattr(gpu, "CHUNKS", 3)


@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-{'-'.join(map(str, s.values()))}" for n, s in CASES])
def test_gpu_kernel(name, shape):
    check_kernel(gpu, name, shape)
