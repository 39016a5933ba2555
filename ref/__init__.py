"""NumPy reference engine: the exact semantics every faster engine is checked against.

`ref.model` and `ref.sparse` define the semantics; `ref.profile`, `ref.predictor` and `ref.evaluate` are the offline
algorithms built on them; `ref.common` is the library every package shares. This module is the facade one floor up:
`load_model` composes the loader with the predictor transform.
"""

from pathlib import Path

import numpy as np

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.sampling import generate, sample
from ref.common.tokenizer import Tokenizer, load_tokenizer
from ref.model import Model
from ref.sparse import apply_oracle, apply_predictors


def load_model(path: str | Path, predictors: str | Path | None = None, dtype=np.float32) -> Model:
    """`Model.load(path)`, made predictor-gated sparse by `apply_predictors` when a predictors file is given."""
    model = Model.load(path, dtype)
    return model if predictors is None else apply_predictors(model, predictors)


__all__ = ["ModelConfig", "UserError", "generate", "sample", "Model", "load_model", "Tokenizer", "load_tokenizer",
           "apply_predictors", "apply_oracle"]
