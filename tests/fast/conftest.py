import os

import numpy as np
import pytest

import ref
from fast import Engine, apply_predictors
from ref.common.artifacts import Predictors
from tests.helpers import write_model


@pytest.fixture
def small_launches(monkeypatch):
    """Under the CUDA simulator, launch constants small enough that a tiny shape still spans several blocks and
    several reduction steps (the simulator runs every thread as a Python thread)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from fast import gpu
        monkeypatch.setattr(gpu, "THREADS", 4)
        monkeypatch.setattr(gpu, "TILE", 4)
        monkeypatch.setattr(gpu, "CHUNKS", 3)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random model with random predictors (about half the neurons predicted per token)."""
    d = write_model(tmp_path_factory.mktemp("m"), {"eos_token_id": 99})
    cfg = ref.ModelConfig.from_hf(d)
    rng = np.random.default_rng(5)
    pred = Predictors([rng.standard_normal((8, cfg.d_model)).astype(np.float32) for _ in range(cfg.n_layers)],
                      [rng.standard_normal((cfg.d_ffn, 8)).astype(np.float32) for _ in range(cfg.n_layers)],
                      0.0, {"threshold": "0.0"})
    pred.save(d / "predictors.safetensors")
    return d


def sparse_engine(d):
    return apply_predictors(Engine.load(d), d / "predictors.safetensors")


def sparse_model(d):
    """ref's twin of sparse_engine: the predictors as stored."""
    return ref.apply_predictors(ref.Model.load(d), d / "predictors.safetensors")
