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


@pytest.mark.skipif(not SIMULATED, reason="calls a device function from the host, which only the simulator allows")
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_16_bit_decode_is_exact_for_every_pattern(fmt):
    """gpu.elem decodes every finite f16 and bf16 bit pattern (subnormals and signed zeros included) to numpy's
    float32 value, bit for bit."""
    import numpy as np
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = (bits.view(np.float16).astype(np.float32) if fmt == "f16"
            else (bits.astype(np.uint32) << 16).view(np.float32))
    finite = np.isfinite(want)
    q, d = bits[finite].reshape(1, -1), np.zeros((1, 1), np.float32)
    got = np.array([gpu.elem(q, d, gpu.KINDS[fmt], 0, k) for k in range(q.shape[1])], np.float32)
    assert np.array_equal(got.view(np.uint32), want[finite].view(np.uint32))
