import os

import pytest


@pytest.fixture
def small_launches(monkeypatch):
    """Under the CUDA simulator, launch constants small enough that a tiny shape still spans several blocks and
    several reduction steps (the simulator runs every thread as a Python thread)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from fast import gpu
        monkeypatch.setattr(gpu, "THREADS", 4)
        monkeypatch.setattr(gpu, "TILE", 4)
        monkeypatch.setattr(gpu, "CHUNKS", 3)
