import pytest

from fast import blas, cpu, gpu
from tests.fast.kernels import CASES, DEVICE_SHAPES, SHAPES, case_id, check_kernel


@pytest.mark.parametrize("name, shape, sim", SHAPES, ids=[case_id(*c) for c in SHAPES])
def test_cpu_kernel(name, shape, sim):
    check_kernel(cpu, name, shape)


BLAS_SHAPES = [c for c in SHAPES if hasattr(blas, c[0])]


@pytest.mark.parametrize("name, shape, sim", BLAS_SHAPES, ids=[case_id(*c) for c in BLAS_SHAPES])
def test_blas_kernel(name, shape, sim):
    """The prompt-chunk kernels (numpy's BLAS on decoded rows) against ref, as fast.cpu's."""
    check_kernel(blas, name, shape)


def test_every_kernel_a_table_names_exists():
    """Runs on the CPU: the device table must name only kernels fast.gpu has, or a real device fails where the
    simulator run did not look."""
    assert {n for n in CASES if not hasattr(cpu, n)} == set()
    assert {n for n, _, _ in DEVICE_SHAPES if not hasattr(gpu, n)} == set()


def test_cached_kernels_are_dropped_when_the_row_operations_change(tmp_path, monkeypatch):
    """numba checks a cached kernel against its own file only; fast.cpu also checks fast/quant.py, whose row
    operations are compiled into its kernels."""
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    for name in ("cpu.py", "quant.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    kernel, other = cache / "cpu.matmul-62.py311.nbi", cache / "engine.x.pyc"
    kernel.write_bytes(b"old")
    other.write_bytes(b"keep")
    cpu.drop_stale_cache(str(tmp_path))  # no stamp yet: dropped
    assert not kernel.exists() and other.exists()
    kernel.write_bytes(b"new")
    cpu.drop_stale_cache(str(tmp_path))  # nothing changed: kept
    assert kernel.exists()
    (tmp_path / "quant.py").write_text("# quant.py, edited\n")
    cpu.drop_stale_cache(str(tmp_path))
    assert not kernel.exists() and other.exists()
