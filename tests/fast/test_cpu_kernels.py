import pytest

from fast import cpu
from tests.fast.kernels import SHAPES, check_kernel


@pytest.mark.parametrize("name, shape", SHAPES, ids=[f"{n}-{'-'.join(map(str, s.values()))}" for n, s in SHAPES])
def test_cpu_kernel(name, shape):
    check_kernel(cpu, name, shape)
