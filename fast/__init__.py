"""The fast engine: numba kernels on the CPU (and numba.cuda on the GPU), checked against `ref`.

`Engine.load` loads a checkpoint; `apply_predictors` and `to_hybrid` are transforms applied to it; `load_engine` is
the facade that composes them as fast.run's flags ask.
"""

from fast.engine import Engine, Selector, apply_predictors
from fast.hybrid import HybridEngine, to_hybrid
from fast.load import load_engine

__all__ = ["Engine", "Selector", "apply_predictors", "HybridEngine", "to_hybrid", "load_engine"]
