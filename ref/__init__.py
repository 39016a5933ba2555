"""NumPy reference engine: the exact semantics every faster engine is checked against.

`ref.model` and `ref.sparse` define the semantics; `ref.profile`, `ref.predictor` and `ref.evaluate` are the offline
algorithms built on them; `ref.common` is the library every package shares. This module is the facade one floor up:
`load_model` (in `ref.sparse`) composes the loader with the predictor transform. The names load on first use, so
that `ref.common.errors` imports without numpy (fast.run catches a Ctrl-C during numpy's import with it).
"""

from ref.common.lazy import lazy_names

_HOMES = {"ModelConfig": "ref.common.config", "UserError": "ref.common.errors", "generate": "ref.common.sampling",
          "sample": "ref.common.sampling", "Model": "ref.model", "load_model": "ref.sparse",
          "Tokenizer": "ref.common.tokenizer", "load_tokenizer": "ref.common.tokenizer",
          "apply_predictors": "ref.sparse", "apply_oracle": "ref.sparse"}
__getattr__ = lazy_names("ref", _HOMES)
__all__ = list(_HOMES)
