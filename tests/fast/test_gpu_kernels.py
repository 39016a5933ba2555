"""GPU kernels against their ref twins: under the CUDA simulator in CI (the table's `sim` entries, launch constants
shrunk so several blocks and several reduction steps run), the whole table on a device (scripts/device_check.sh)."""

import os

import pytest

from fast import gpu
from tests.fast.kernels import DEVICE_SHAPES, case_id, check_kernel

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
CASES = [c for c in DEVICE_SHAPES if c[2] or not SIMULATED]
pytestmark = pytest.mark.usefixtures("small_launches")


@pytest.mark.parametrize("name, shape, sim", CASES, ids=[case_id(*c) for c in CASES])
def test_gpu_kernel(name, shape, sim):
    check_kernel(gpu, name, shape)
