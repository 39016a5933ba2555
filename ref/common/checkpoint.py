"""One entry for every checkpoint a user has: an HF folder (config.json + safetensors) or a GGUF file (llama.cpp's or
PowerInfer's, told apart by their magic, never by the path's name)."""

from pathlib import Path

from ref.common.config import ModelConfig
from ref.common.gguf_io import is_gguf, read_gguf
from ref.common.weights import Weights


def load_checkpoint(path: str | Path) -> Weights:
    """The checked weights by our names, with their config; a PowerInfer file's predictors as `predictors`, a GGUF
    file's activation-sparsity calibration as `sparsity`."""
    if is_gguf(path):
        ck = read_gguf(path)
        return Weights(ck.config, ck.tensors, ck.predictors, Path(path), ck.sparsity)
    return Weights.load(path, ModelConfig.from_hf(path))
