"""The dense reference model in plain NumPy: the semantics every engine is checked against.

A model is its family's block applied layer after layer to the residual stream. The LLaMA family (LLaMA, Mistral,
ReluLLaMA, ProSparse, Bamboo): pre-norm RMSNorm blocks, RoPE, GQA attention, a gated FFN, no biases. Another family
is another small `Model` subclass with its own `block`, registered in FAMILIES.

Dimensions: T new tokens, S cached + new tokens, D d_model, F FFN neurons, H/K query/key-value heads,
E head dim, V vocab, L layers.
"""

from pathlib import Path

import numpy as np

from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.safetensors import upcast
from ref.common.sampling import check_fits
from ref.common.weights import Weights
from ref.quant import input_values


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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal softmax(q k^T / sqrt(E)) v per head; query head h reads kv head h // (H/K) (GQA).

    q: [T, H, E] at `positions` [T]; k, v: [S, K, E] for positions 0..S-1; a query sees keys up to its position.
    """
    T, H, E = q.shape
    S, K, _ = k.shape
    out = np.empty_like(q)  # [T, H, E]
    visible = np.arange(S)[None, :] <= np.asarray(positions)[:, None]  # [T, S]
    q, k, v = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (q, k, v))  # head-major: BLAS needs contiguity
    for h in range(H):
        kv = h // (H // K)
        scores = q[h] @ k[kv].T / np.sqrt(E)  # [T, S]
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h, :] = (p / p.sum(-1, keepdims=True)) @ v[kv]  # [T, E]
    return out


def ffn_activation(kind: str, g: np.ndarray, u: np.ndarray, t: float = 0.0) -> np.ndarray:
    """The gated activation a(g, u) of each FFN kind, elementwise: relu(g) u (ReGLU), g [g > t] u (FATReLU),
    relu(g) relu(u) (dReLU), silu(g) u (SwiGLU)."""
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


class Model:
    """A decoder: embedding, the family's `block` per layer, `output`. `ffn_block` is a per-instance callable so that
    transforms (predictors, the oracle set, profiling) replace it without a branch in the block."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype=np.float32):
        self.config, self.weights, self.dtype = config, weights, np.dtype(dtype)
        self.ffn_block = self.dense_ffn_block

    @staticmethod
    def load(path: str | Path, dtype=np.float32) -> "Model":
        """The dense model of an HF folder or GGUF file, as its family defines it; nothing else (features are
        transforms; a PowerInfer file's predictors wait in `weights.predictors`)."""
        w = load_checkpoint(path)
        return FAMILIES[w.config.family](w.config, w, dtype)

    def w(self, name: str) -> np.ndarray:
        return upcast(self.weights[name], self.dtype)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T with W as stored; q8_0 and q4_0 weights read x rounded to Q8_0 (ref.quant.input_values)."""
        t = self.weights[name]
        return input_values(x, t) @ upcast(t, self.dtype).T

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, self.dtype, slots)

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each sequence's slot grows by its run."""
        runs = check_batch(batch, cache, self.config)
        h = upcast(self.weights["embed"][batch.tokens], self.dtype)  # [T, D]
        for l in range(self.config.n_layers):
            h = self.block(l, h, batch, cache)
        advance(cache, runs)
        return self.output(h[batch.output_rows()])

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_fits(len(ids), self.config.max_seq_len)
        cache = self.new_cache(max(len(ids), 1))
        return self.forward(Batch.single(ids, cache), cache).astype(np.float32)


class Llama(Model):
    """The LLaMA block: h += attention(rmsnorm(h)); h += ffn(rmsnorm(h)); logits = lm_head(rmsnorm(h))."""

    def block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        h = h + self.attention_block(l, h, batch, cache)
        return h + self.ffn_block(l, h)

    def attention_block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """Pre-norm self-attention with RoPE, each sequence's run attending to its own slot, to which it appends its
        keys and values.  h: [T, D]."""
        c, p, T = self.config, f"layers.{l}.", h.shape[0]
        x = rmsnorm(h, self.w(p + "attn_norm"), c.rms_norm_eps)  # [T, D]
        q = self.linear(x, p + "wq").reshape(T, c.n_heads, c.head_dim)  # [T, H, E]
        k = self.linear(x, p + "wk").reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, E]
        v = self.linear(x, p + "wv").reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, E]
        q, k = rope(q, batch.positions, c.rope_theta), rope(k, batch.positions, c.rope_theta)
        att = np.empty_like(q)  # [T, H, E]
        for seq, a, b in batch.runs():
            s0, s1 = batch.positions[a], batch.positions[a] + b - a
            keys, values = cache.k[l][seq], cache.v[l][seq]  # [room, K, E]
            keys[s0:s1], values[s0:s1] = k[a:b], v[a:b]
            att[a:b] = attention(q[a:b], keys[:s1], values[:s1], batch.positions[a:b])
        return self.linear(att.reshape(T, -1), p + "wo")  # [T, D]

    def ffn_gate_up(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gate and up pre-activations Wg x, Wu x [T, F] with x = rmsnorm(h).  h: [T, D]."""
        p = f"layers.{l}."
        x = rmsnorm(h, self.w(p + "ffn_norm"), self.config.rms_norm_eps)  # [T, D]
        return self.linear(x, p + "wg"), self.linear(x, p + "wu")

    def dense_ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = Wd a(Wg x, Wu x) with x = rmsnorm(h).  h: [T, D] residual stream entering the FFN block."""
        c = self.config
        g, u = self.ffn_gate_up(l, h)  # [T, F]
        return self.linear(ffn_activation(c.ffn_kind, g, u, c.act_threshold), f"layers.{l}.wd")  # [T, D]

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . rmsnorm(h)."""
        c = self.config
        x = rmsnorm(h, self.w("norm"), c.rms_norm_eps)  # [T, D]
        return self.linear(x, "embed" if c.tie_word_embeddings else "lm_head")  # [T, V]


FAMILIES = {"llama": Llama}
