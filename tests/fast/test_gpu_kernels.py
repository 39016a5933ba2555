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


@pytest.mark.skipif(not SIMULATED, reason="calls a device function from the host, which only the simulator allows")
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_16_bit_rounding_is_ref_s(fmt):
    """gpu.half_bits rounds float32 values to f16 and bf16 bits as ref does (nearest even): random bit patterns of
    every magnitude, ties, subnormals, signed zeros, values past the format's range."""
    import numpy as np
    from ref.common.safetensors import to_bf16_bits
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (np.arange(1, 200, dtype=np.uint32) << (13 if fmt == "f16" else 16)) | (1 << (12 if fmt == "f16" else 15))
    x = np.concatenate([x, ties.view(np.float32), np.float32([0.0, -0.0, 6.0e-8, -3.0e-8, 65520.0, 1e39 / 1e10])])
    x = x[np.isfinite(x)]
    with np.errstate(over="ignore"):  # past f16's range: infinity, as the device gives
        want = x.astype(np.float16).view(np.uint16) if fmt == "f16" else to_bf16_bits(x)
    got = np.array([gpu.half_bits(v, gpu.KINDS[fmt]) for v in x], np.uint16)
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.skipif(not SIMULATED, reason="the simulator's allocation of shared arrays")
def test_a_blocks_threads_share_one_shared_array(monkeypatch):
    """tests.simulator's lock: eight threads asking for the same shared array while each is switched out inside the
    allocation (a 2 ms sleep there) all get one array; the simulator's own code gave each its own (the GPU golden
    test's rare failure)."""
    import threading
    import time

    import numpy as np
    from numba.cuda.simulator import kernelapi

    import tests.simulator as sim
    assert kernelapi.FakeCUDAShared.array.__module__ == "tests.simulator"  # installed by tests/conftest.py
    real = np.empty
    monkeypatch.setattr(sim, "np", type("slow", (), {"empty": staticmethod(lambda *a: (time.sleep(0.002), real(*a))[1])}))
    shared, got = kernelapi.FakeCUDAShared(0), []

    def ask():
        got.append(shared.array(4, np.float32))
    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(a is got[0] for a in got)
