"""What a forward step reads and writes besides the weights: a batch of tokens, each tagged with its sequence and
position, and the KV cache whose slots hold the sequences.

Every engine's `forward(batch, cache)` takes these. Today a batch holds one sequence continuing its cached positions
(`Batch.single`); the cache already has a slot per sequence and a length per slot.
Dimensions: N batch tokens, L layers, C capacity per slot, K key-value heads, E head dim.
"""

from dataclasses import dataclass

import numpy as np

from ref.common.config import ModelConfig
from ref.common.errors import UserError


@dataclass
class KVCache:
    """Keys and values per layer, each [slots, capacity, K, E] (a host array, or a device array where that layer's
    attention runs on the GPU), and each slot's length."""

    k: list
    v: list
    lengths: np.ndarray  # [slots] int64

    @staticmethod
    def empty(cfg: ModelConfig, capacity: int, dtype, slots: int = 1, alloc=None) -> "KVCache":
        """A cache for `slots` sequences of up to `capacity` positions; `alloc(shape, dtype, l)` places layer l's
        arrays (default: zeroed host arrays)."""
        alloc = alloc or host_zeros
        shape = (slots, capacity, cfg.n_kv_heads, cfg.head_dim)
        return KVCache([alloc(shape, dtype, l) for l in range(cfg.n_layers)],
                       [alloc(shape, dtype, l) for l in range(cfg.n_layers)], np.zeros(slots, np.int64))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def host_zeros(shape, dtype, l):
    return np.zeros(shape, dtype)


@dataclass(frozen=True)
class Batch:
    """One forward step's tokens, each with its sequence (cache slot) and position."""

    tokens: np.ndarray  # [N] int64
    seqs: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64

    @staticmethod
    def single(ids, cache: KVCache, seq: int = 0) -> "Batch":
        """`ids` continuing sequence `seq` after its cached positions (llama.cpp's llama_batch_get_one)."""
        tokens = np.asarray(ids, dtype=np.int64).reshape(-1)
        start = int(cache.lengths[seq])
        return Batch(tokens, np.full(len(tokens), seq, np.int64), np.arange(start, start + len(tokens)))

    def __len__(self) -> int:
        return len(self.tokens)


def check_batch(batch: Batch, cache: KVCache, cfg: ModelConfig) -> tuple[int, int]:
    """(sequence, first position) of a batch that one sequence's next positions fill, checked to fit the cache and the
    vocabulary; an engine then appends the batch to that sequence's slot."""
    n = len(batch)
    seq = int(batch.seqs[0]) if n else 0
    if not 0 <= seq < len(cache.lengths):
        raise UserError(f"sequence {seq} has no cache slot (the cache has {len(cache.lengths)})")
    start = int(cache.lengths[seq])
    if n and (np.any(batch.seqs != seq) or np.any(batch.positions != np.arange(start, start + n))):
        raise UserError("a batch must continue one sequence's cached positions (one sequence per step)")
    if start + n > cache.capacity:
        raise UserError(f"context full: {start} + {n} tokens > context size {cache.capacity}")
    if n and (batch.tokens.min() < 0 or batch.tokens.max() >= cfg.vocab_size):
        raise UserError(f"token id out of range [0, {cfg.vocab_size})")
    return seq, start
