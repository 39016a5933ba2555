"""The fast engine: numba kernels on the CPU (and numba.cuda on the GPU), checked against `ref`.

`Engine.load` loads a checkpoint; `apply_predictors`, `convert` and `to_hybrid` are transforms applied to it;
`load_engine` is the facade that composes them as fast.run's flags ask. The names load on first use, so that
`python -m fast.run` starts before numba does (and a Ctrl-C during its imports is caught there).
"""

from ref.common.lazy import lazy_names

_HOMES = {"Engine": "fast.engine", "Selector": "fast.engine", "apply_predictors": "fast.engine",
          "convert": "fast.engine", "HybridEngine": "fast.hybrid", "to_hybrid": "fast.hybrid",
          "load_engine": "fast.load"}
__getattr__ = lazy_names("fast", _HOMES)
__all__ = list(_HOMES)
