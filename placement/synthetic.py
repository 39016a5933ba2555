"""Synthetic firing counts with PowerInfer's power-law shape, for benchmarks of real model shapes."""

import numpy as np


def synthetic_counts(L: int, F: int, seed: int, tokens: int = 1_000_000) -> np.ndarray:
    """Zipf-like firing counts [L, F] (exponent 0.7-1.3 per layer, neuron ids shuffled), as PowerInfer's profiles show."""
    rng = np.random.default_rng(seed)
    rank = np.arange(1, F + 1)
    return np.stack([rng.permutation(np.minimum(tokens, tokens * 0.9 / rank ** rng.uniform(0.7, 1.3)).astype(np.int64))
                     for _ in range(L)])
