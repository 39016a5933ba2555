import pytest

from fast import cpu, gpu
from tests.fast.kernels import CASES, DEVICE_SHAPES, SHAPES, case_id, check_kernel


@pytest.mark.parametrize("name, shape, sim", SHAPES, ids=[case_id(*c) for c in SHAPES])
def test_cpu_kernel(name, shape, sim):
    check_kernel(cpu, name, shape)


def test_every_kernel_a_table_names_exists():
    """Runs on the CPU: the device table must name only kernels fast.gpu has, or a real device fails where the
    simulator run did not look."""
    assert {n for n in CASES if not hasattr(cpu, n)} == set()
    assert {n for n, _, _ in DEVICE_SHAPES if not hasattr(gpu, n)} == set()
