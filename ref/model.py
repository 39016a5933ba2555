"""The dense reference model: LLaMA-family decoder with a gated ReLU-family FFN, in plain NumPy.

Dimensions: T new tokens, S cached + new tokens, D d_model, F FFN neurons, H/K query/key-value heads,
E head dim, V vocab, L layers.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ref.config import ModelConfig
from ref.errors import UserError
from ref.weights import Weights, upcast


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, per row.  x: [T, D], w: [D]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_angles(pos: np.ndarray, E: int, theta: float) -> np.ndarray:
    """pos * theta^(-2i/E) in float64.  pos: [T] -> [T, E/2]."""
    inv_freq = theta ** (-np.arange(0, E, 2, dtype=np.float64) / E)  # [E/2]
    return np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding, HF rotate-half convention: x*cos + rotate_half(x)*sin.  x: [T, h, E], pos: [T]."""
    E = x.shape[-1]
    ang = rope_angles(pos, E, theta)  # [T, E/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :].astype(x.dtype)  # [T, 1, E]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :].astype(x.dtype)
    rotated = np.concatenate([-x[..., E // 2:], x[..., : E // 2]], -1)  # rotate_half
    return x * cos + rotated * sin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    """Causal softmax(q k^T / sqrt(E)) v per head; query head h reads kv head h // (H/K) (GQA).

    q: [T, H, E] for positions pos0..pos0+T-1; k, v: [S, K, E] for positions 0..S-1.
    """
    T, H, E = q.shape
    S, K, _ = k.shape
    out = np.empty_like(q)  # [T, H, E]
    visible = np.arange(S)[None, :] <= (pos0 + np.arange(T))[:, None]  # [T, S]
    q, k, v = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (q, k, v))  # head-major: BLAS needs contiguity
    for h in range(H):
        kv = h // (H // K)
        scores = q[h] @ k[kv].T / np.sqrt(E)  # [T, S]
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h, :] = (p / p.sum(-1, keepdims=True)) @ v[kv]  # [T, E]
    return out


def ffn_activation(kind: str, g: np.ndarray, u: np.ndarray, t: float = 0.0) -> np.ndarray:
    """The gated activation a(g, u) of DESIGN section 2, elementwise."""
    if kind == "relu":
        return np.maximum(g, 0) * u
    if kind == "fatrelu":
        return np.where(g > t, g, 0) * u
    if kind == "drelu":
        return np.maximum(g, 0) * np.maximum(u, 0)
    if kind == "silu":
        return g / (1 + np.exp(-g)) * u
    raise ValueError(f"unknown FFN kind {kind!r}")


def fired(kind: str, g: np.ndarray, u: np.ndarray, t: float = 0.0) -> np.ndarray:
    """Which neurons fire (their activation can be non-zero): the oracle active set."""
    if kind == "relu":
        return g > 0
    if kind == "fatrelu":
        return g > t
    if kind == "drelu":
        return (g > 0) & (u > 0)
    raise UserError(f"FFN kind '{kind}' has no activation sparsity (sparse execution needs relu, fatrelu or drelu)")


def require_sparse(kind: str) -> None:
    """Sparse execution, profiling and predictors need an FFN kind with activation sparsity."""
    fired(kind, np.zeros(1), np.zeros(1))


@dataclass
class KVCache:
    """Keys and values of every layer for positions 0..length-1, preallocated to `capacity`."""

    k: np.ndarray  # [L, capacity, K, E]
    v: np.ndarray  # [L, capacity, K, E]
    length: int = 0

    @staticmethod
    def empty(cfg: ModelConfig, capacity: int, dtype) -> "KVCache":
        shape = (cfg.n_layers, capacity, cfg.n_kv_heads, cfg.head_dim)
        return KVCache(np.zeros(shape, dtype), np.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


class Model:
    """Dense LLaMA-family forward pass. `ffn_block` is a per-instance callable so transforms can replace it."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype=np.float32):
        self.config, self.weights, self.dtype = config, weights, np.dtype(dtype)
        self.ffn_block = self.dense_ffn_block

    def w(self, name: str) -> np.ndarray:
        return upcast(self.weights[name], self.dtype)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, self.dtype)

    def attention_block(self, l: int, h: np.ndarray, cache: KVCache) -> np.ndarray:
        """Pre-norm self-attention with RoPE, appending this step's keys and values to the cache.  h: [T, D]."""
        c, p = self.config, f"layers.{l}."
        T, s0 = h.shape[0], cache.length
        x = rmsnorm(h, self.w(p + "attn_norm"), c.rms_norm_eps)  # [T, D]
        pos = np.arange(s0, s0 + T)
        q = (x @ self.w(p + "wq").T).reshape(T, c.n_heads, c.head_dim)  # [T, H, E]
        k = (x @ self.w(p + "wk").T).reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, E]
        v = (x @ self.w(p + "wv").T).reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, E]
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        cache.k[l, s0:s0 + T], cache.v[l, s0:s0 + T] = k, v
        att = attention(q, cache.k[l, :s0 + T], cache.v[l, :s0 + T], s0)  # [T, H, E]
        return att.reshape(T, -1) @ self.w(p + "wo").T  # [T, D]

    def ffn_gate_up(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gate and up pre-activations Wg x, Wu x [T, F] with x = rmsnorm(h).  h: [T, D]."""
        p = f"layers.{l}."
        x = rmsnorm(h, self.w(p + "ffn_norm"), self.config.rms_norm_eps)  # [T, D]
        return x @ self.w(p + "wg").T, x @ self.w(p + "wu").T

    def dense_ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = Wd a(Wg x, Wu x) with x = rmsnorm(h).  h: [T, D] residual stream entering the FFN block."""
        c = self.config
        g, u = self.ffn_gate_up(l, h)  # [T, F]
        return ffn_activation(c.ffn_kind, g, u, c.act_threshold) @ self.w(f"layers.{l}.wd").T  # [T, D]

    def forward(self, ids, cache: KVCache) -> np.ndarray:
        """Logits [T, V] for `ids` following the cached positions; the cache grows by T."""
        c = self.config
        ids = step_ids(ids, cache, c)
        h = upcast(self.weights["embed"][ids], self.dtype)  # [T, D]
        for l in range(c.n_layers):
            h = h + self.attention_block(l, h, cache)
            h = h + self.ffn_block(l, h)
        cache.length += len(ids)
        x = rmsnorm(h, self.w("norm"), c.rms_norm_eps)  # [T, D]
        return x @ self.w("embed" if c.tie_word_embeddings else "lm_head").T  # [T, V]

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_ids(ids, self.config)
        return self.forward(ids, self.new_cache(max(len(ids), 1))).astype(np.float32)


def step_ids(ids, cache: KVCache, cfg: ModelConfig) -> np.ndarray:
    """The ids of one forward step as int64 [T], checked to fit the cache and the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if cache.length + len(ids) > cache.capacity:
        raise UserError(f"context full: {cache.length} + {len(ids)} tokens > context size {cache.capacity}")
    if len(ids) and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise UserError(f"token id out of range [0, {cfg.vocab_size})")
    return ids


def check_ids(ids: np.ndarray, cfg: ModelConfig) -> None:
    if len(ids) > cfg.max_seq_len:
        raise UserError(f"prompt of {len(ids)} tokens is longer than the context ({cfg.max_seq_len})")


def load_model(path: str | Path, predictors: str | Path | None = None, dtype=np.float32) -> Model:
    """Dense model from an HF folder; with `predictors`, the predictor-gated sparse FFN is applied as a transform."""
    cfg = ModelConfig.from_hf(path)
    model = Model(cfg, Weights.load(path, cfg), dtype)
    if predictors is not None:
        from ref.sparse import apply_predictors
        apply_predictors(model, predictors)
    return model
