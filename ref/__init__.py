"""NumPy reference engine: the exact semantics every faster engine is checked against."""

from ref.config import ModelConfig
from ref.errors import UserError
from ref.generate import generate, sample
from ref.model import KVCache, Model, load_model
from ref.tokenizer import Tokenizer, load_tokenizer
from ref.weights import Weights

__all__ = ["ModelConfig", "UserError", "generate", "sample", "KVCache", "Model", "load_model", "Tokenizer",
           "load_tokenizer", "Weights"]
