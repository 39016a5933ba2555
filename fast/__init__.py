"""The fast engine: numba kernels on the CPU (and numba.cuda on the GPU), checked against `ref`."""

from fast.engine import Engine, apply_predictors

__all__ = ["Engine", "apply_predictors"]
