"""Synthetic firing counts with PowerInfer's power-law shape, for benchmarks of real model shapes."""

import numpy as np


def synthetic_counts(L: int, F: int, seed: int, tokens: int = 1_000_000) -> np.ndarray:
    """Zipf-like firing counts [L, F] (exponent 0.7-1.3 per layer, neuron ids shuffled), as PowerInfer's profiles show."""
    rng = np.random.default_rng(seed)
    rank = np.arange(1, F + 1)
    return np.stack([rng.permutation(np.minimum(tokens, tokens * 0.9 / rank ** rng.uniform(0.7, 1.3)).astype(np.int64))
                     for _ in range(L)])


def firing(F: int, sparsity: float, alpha: float = 1.0) -> np.ndarray:
    """Per-neuron firing probabilities [F] by rank (hottest first) with mean 1 - sparsity: p_i = min(1, c i^-alpha),
    c found by bisection."""
    target = (1 - sparsity) * F
    base = 1.0 / np.arange(1, F + 1) ** alpha
    lo, hi = 0.0, F / base.sum() * 1e3
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(1, mid * base).sum() < target else (lo, mid)
    return np.minimum(1, lo * base)
