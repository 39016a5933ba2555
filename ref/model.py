"""The dense reference model in plain NumPy: the semantics every engine is checked against.

A model is its family's block applied layer after layer to the residual stream; each family is a small `Model`
subclass registered in FAMILIES. LLaMA (LLaMA 1 to 3, Mistral, Qwen2 and 3, ReluLLaMA, ProSparse, Bamboo): pre-norm
RMSNorm blocks, RoPE (scaled as Llama-3's where the config says), GQA attention (Qwen2: q/k/v biases; Qwen3: each
head's q and k RMS-normed), a gated FFN. OPT: LayerNorm, learned positions, biases, a non-gated ReLU FFN, pre-norm or
(350m) post-norm. Falcon: LayerNorm, RoPE, one fused q/k/v matrix, attention and FFN side by side from the same input.
A non-gated FFN act(Wu x + bu) is the gated one a(g, u) with g = Wu x + bu and u = 1, so one activation table
serves both.

Dimensions: T new tokens, S cached + new tokens, D d_model, F FFN neurons, H/K query/key-value heads,
E head dim, V vocab, L layers.
"""

import math
from pathlib import Path

import numpy as np

from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig, rope_frequencies
from ref.common.errors import UserError
from ref.common.safetensors import upcast
from ref.common.sampling import check_fits
from ref.common.weights import Weights
from ref.common.formats import Format
from ref.quant import blocks, input_values, quantize, values


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, per row.  x: [T, D], w: [D]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean(x)) / sqrt(var(x) + eps) * w + b, per row.  x: [T, D], w, b: [D]."""
    c = x - np.mean(x, axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * w + b


def rope_angles(pos: np.ndarray, E: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """pos * f_i (rope_frequencies) in float64.  pos: [T] -> [T, E/2]."""
    return np.asarray(pos, dtype=np.float64)[:, None] * rope_frequencies(E, theta, scaling)[None, :]


def rope(x: np.ndarray, pos: np.ndarray, theta: float, scaling: tuple = ()) -> np.ndarray:
    """Rotary embedding, HF rotate-half convention: x*cos + rotate_half(x)*sin.  x: [T, h, E], pos: [T]."""
    E = x.shape[-1]
    ang = rope_angles(pos, E, theta, scaling)  # [T, E/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :].astype(x.dtype)  # [T, 1, E]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :].astype(x.dtype)
    rotated = np.concatenate([-x[..., E // 2:], x[..., : E // 2]], -1)  # rotate_half
    return x * cos + rotated * sin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal softmax(q k^T / sqrt(E)) v per head; query head h reads kv head h // (H/K) (GQA).

    q: [T, H, E] at `positions` [T]; k, v: [K, S, E] (head-major, as the cache holds them) for positions 0..S-1; a
    query sees keys up to its position.
    """
    T, H, E = q.shape
    K, S, _ = k.shape
    out = np.empty_like(q)  # [T, H, E]
    visible = np.arange(S)[None, :] <= np.asarray(positions)[:, None]  # [T, S]
    q = np.ascontiguousarray(q.transpose(1, 0, 2))  # [H, T, E]: BLAS needs contiguity
    for h in range(H):
        kv = h // (H // K)
        scores = q[h] @ k[kv].T / np.sqrt(E)  # [T, S]
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h, :] = (p / p.sum(-1, keepdims=True)) @ v[kv]  # [T, E]
    return out


def kv_store(x: np.ndarray, fmt: Format, dtype) -> np.ndarray:
    """Keys or values x [..., E] as a cache in `fmt` holds them: rounded on write (f16, bf16), or rows of q8_0 blocks
    [..., E / 32]; f32 keeps the model's dtype."""
    return x.astype(dtype) if fmt.name == "f32" else blocks(quantize(x, fmt))


def kv_values(b: np.ndarray, dtype) -> np.ndarray:
    """What cached keys or values b [..., E / block] (kv_store) mean, in `dtype`."""
    return b.astype(dtype) if b.dtype == dtype else values(b).astype(dtype)


def shift_context(cfg: ModelConfig, cache: KVCache, seq: int, keep: int, discard: int) -> None:
    """Context shift (llama.cpp's): sequence `seq` forgets its positions keep..keep+discard-1 and its later ones
    move down by `discard`, their keys rotated back by as many positions (rope at -discard: a rotation composes, so
    a key at p becomes one at p - discard; stored again in the cache's format); learned positions leave the keys as
    they are."""
    def rotate(keys):  # [K, m, E / block]
        if cfg.positions != "rope":
            return keys.copy()
        x = kv_values(keys, cache.dtype).transpose(1, 0, 2)  # [m, K, E]
        x = rope(x, np.full(x.shape[0], -discard), cfg.rope_theta, cfg.rope_scaling)
        return kv_store(x.transpose(1, 0, 2), cache.formats[0], cache.dtype)
    cache.shift(seq, keep, discard, rotate)


def ffn_activation(kind: str, g: np.ndarray, u: np.ndarray, t: float = 0.0) -> np.ndarray:
    """The gated activation a(g, u) of each FFN kind, elementwise: relu(g) u (ReGLU), g [g > t] u (FATReLU),
    relu(g) relu(u) (dReLU), silu(g) u (SwiGLU), gelu(g) u with the exact erf GELU."""
    if kind == "relu":
        return np.maximum(g, 0) * u
    if kind == "fatrelu":
        return np.where(g > t, g, 0) * u
    if kind == "drelu":
        return np.maximum(g, 0) * np.maximum(u, 0)
    if kind == "silu":
        return g / (1 + np.exp(-g)) * u
    if kind == "gelu":
        return 0.5 * g * (1 + erf(g / np.sqrt(2))) * u
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


def erf(x: np.ndarray) -> np.ndarray:
    """The error function elementwise (math.erf; NumPy has none)."""
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(np.result_type(x, np.float32))


def qkv_rows(H: int, K: int, E: int) -> np.ndarray:
    """Row order that turns a fused q/k/v matrix into [all q | all k | all v]: Falcon stores per kv head group its
    H/K query heads, then its key head, then its value head (multi-query: one group; otherwise one group per head,
    i.e. q, k, v interleaved).  -> [(H + 2K) E] row ids."""
    G = H // K
    group = np.arange(K)[:, None] * (G + 2) * E  # [K, 1] first row of each group
    q = (group[:, :, None] + np.arange(G)[None, :, None] * E + np.arange(E)).reshape(-1)  # [H E]
    k = (group + G * E + np.arange(E)).reshape(-1)  # [K E]
    return np.concatenate([q, k, k + E])


# The norm each block input goes through (ref.common.config.BLOCKS); None: the residual as it is (post-norm).
ATTN_NORM = {"pre_norm": "attn_norm", "post_norm": None, "parallel": "attn_norm", "parallel_shared": "attn_norm"}
FFN_NORM = {"pre_norm": "ffn_norm", "post_norm": None, "parallel": "ffn_norm", "parallel_shared": "attn_norm"}


def require_sparse(kind: str) -> None:
    """Sparse execution, profiling and predictors need an FFN kind with activation sparsity."""
    fired(kind, np.zeros(1), np.zeros(1))


class Model:
    """A decoder: embedding, the family's `block` per layer, `output`. `ffn_block` is a per-instance callable so that
    transforms (predictors, the oracle set, profiling) replace it without a branch in the block."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype=np.float32):
        self.config, self.weights, self.dtype = config, weights, np.dtype(dtype)
        self.ffn_block = self.dense_ffn_block
        self.kv_types = ("f32", "f32")  # the formats new caches store keys and values in (-ctk, -ctv)

    @staticmethod
    def load(path: str | Path, dtype=np.float32) -> "Model":
        """The dense model of an HF folder or GGUF file, as its family defines it; nothing else (features are
        transforms; the predictors a checkpoint carries wait in `weights.predictors`)."""
        w = load_checkpoint(path)
        return FAMILIES[w.config.family](w.config, w, dtype)

    def w(self, name: str) -> np.ndarray:
        return upcast(self.weights[name], self.dtype)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T (+ b where the checkpoint has one) with W as stored; q8_0 and q4_0 weights read x rounded to Q8_0
        (ref.quant.input_values)."""
        t = self.weights[name]
        y = input_values(x, t) @ upcast(t, self.dtype).T
        return y + self.w(name + ".bias") if name + ".bias" in self.weights.tensors else y

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """The family's norm (config.norm) with the weights `name`: RMSNorm, or LayerNorm with its bias."""
        c = self.config
        if c.norm == "layer":
            return layernorm(x, self.w(name), self.w(name + ".bias"), c.norm_eps)
        return rmsnorm(x, self.w(name), c.norm_eps)

    def norm_in(self, x: np.ndarray, name: str | None, l: int) -> np.ndarray:
        """Layer l's norm `name` of x, or x itself where the block has none there (ATTN_NORM, FFN_NORM)."""
        return x if name is None else self.norm(x, f"layers.{l}.{name}")

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, self.dtype, slots,
                             formats=self.kv_types)

    def shift(self, cache: KVCache, seq: int, keep: int, discard: int) -> None:
        shift_context(self.config, cache, seq, keep, discard)

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each sequence's slot grows by its run."""
        runs = check_batch(batch, cache, self.config)
        h = self.embed(batch)  # [T, D]
        for l in range(self.config.n_layers):
            h = self.block(l, h, batch, cache)
        advance(cache, runs)
        return self.output(h[batch.output_rows()])

    def embed(self, batch: Batch) -> np.ndarray:
        """The residual stream entering layer 0: the tokens' embeddings.  -> [T, D]."""
        return upcast(self.weights["embed"][batch.tokens], self.dtype)

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . norm(h) (no norm where the config has none; OPT-350m projects back to its
        narrower embedding first)."""
        c = self.config
        x = self.norm(h, "norm") if c.final_norm else h  # [T, D]
        if c.embed_dim:
            x = self.linear(x, "project_out")  # [T, W]
        return self.linear(x, "embed" if c.tie_word_embeddings else "lm_head")  # [T, V]

    def qkv(self, l: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries [T, H, E], keys and values [T, K, E] of the normed input x [T, D] (each head's q and k RMS-normed
        where the config says: Qwen3)."""
        c, p, T = self.config, f"layers.{l}.", x.shape[0]
        q = self.linear(x, p + "wq").reshape(T, c.n_heads, c.head_dim)
        k = self.linear(x, p + "wk").reshape(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rmsnorm(q, self.w(p + "q_norm"), c.norm_eps), rmsnorm(k, self.w(p + "k_norm"), c.norm_eps)
        return q, k, self.linear(x, p + "wv").reshape(T, c.n_kv_heads, c.head_dim)

    def attention_block(self, l: int, x: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """Self-attention of the block's input x [T, D] (RoPE where the config has it), each sequence's run attending
        to its own slot, to which it appends its keys and values."""
        c, T = self.config, x.shape[0]
        q, k, v = self.qkv(l, x)  # [T, H, E], [T, K, E], [T, K, E]
        if c.positions == "rope":
            q, k = (rope(a, batch.positions, c.rope_theta, c.rope_scaling) for a in (q, k))
        att = np.empty_like(q)  # [T, H, E]
        for seq, a, b in batch.runs():
            s0, s1 = batch.positions[a], batch.positions[a] + b - a
            keys, vals = cache.k[l][seq], cache.v[l][seq]  # [K, room, E / block]
            keys[:, s0:s1] = kv_store(k[a:b].transpose(1, 0, 2), cache.formats[0], cache.dtype)
            vals[:, s0:s1] = kv_store(v[a:b].transpose(1, 0, 2), cache.formats[1], cache.dtype)
            att[a:b] = attention(q[a:b], kv_values(keys[:, :s1], self.dtype), kv_values(vals[:, :s1], self.dtype),
                                 batch.positions[a:b])
        return self.linear(att.reshape(T, -1), f"layers.{l}.wo")  # [T, D]

    def ffn_gate_up(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The FFN's pre-activations (g, u) [T, F] for the block input h [T, D]: Wg x, Wu x with x its FFN norm; a
        non-gated FFN's g = Wu x + bu, u = 1."""
        x = self.norm_in(h, FFN_NORM[self.config.block], l)  # [T, D]
        p = f"layers.{l}."
        if self.config.gated:
            return self.linear(x, p + "wg"), self.linear(x, p + "wu")
        g = self.linear(x, p + "wu")
        return g, np.ones_like(g)

    def dense_ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = Wd a(g, u) (+ bd) for the block input h [T, D] (before the FFN's norm: what the predictor reads)."""
        c = self.config
        g, u = self.ffn_gate_up(l, h)  # [T, F]
        return self.linear(ffn_activation(c.ffn_kind, g, u, c.act_threshold), f"layers.{l}.wd")  # [T, D]

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_fits(len(ids), self.config.max_seq_len)
        cache = self.new_cache(max(len(ids), 1))
        return self.forward(Batch.single(ids, cache), cache).astype(np.float32)


class Llama(Model):
    """The LLaMA block: h += attention(rmsnorm(h)); h += ffn(rmsnorm(h))."""

    def block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        h = h + self.attention_block(l, self.norm(h, f"layers.{l}.attn_norm"), batch, cache)
        return h + self.ffn_block(l, h)


class OPT(Model):
    """The OPT block, pre-norm as LLaMA's with LayerNorm, or post-norm (350m): h = LN(h + attention(h));
    h = LN(h + ffn(h)). Learned positions join the embedding; biases everywhere."""

    def embed(self, batch: Batch) -> np.ndarray:
        """Token embedding (projected to D where it is narrower) + the position table's row position + 2."""
        h = super().embed(batch)  # [T, W]
        if self.config.embed_dim:
            h = self.linear(h, "project_in")  # [T, D]
        return h + self.w("pos_embed")[np.asarray(batch.positions) + 2]

    def block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        p = f"layers.{l}."
        if self.config.block == "post_norm":
            h = self.norm(h + self.attention_block(l, h, batch, cache), p + "attn_norm")
            return self.norm(h + self.ffn_block(l, h), p + "ffn_norm")
        h = h + self.attention_block(l, self.norm(h, p + "attn_norm"), batch, cache)
        return h + self.ffn_block(l, h)


class Falcon(Model):
    """The Falcon block: attention and FFN read the same input, h += attention(LN_attn h) + ffn(LN_mlp h) (one
    shared LN unless the new decoder architecture has two); Falcon-RW's sequential block is LLaMA's. The FFN block
    gets the layer input, which is also what the predictor reads (PowerInfer)."""

    def qkv(self, l: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c, T = self.config, x.shape[0]
        H, K, E = c.n_heads, c.n_kv_heads, c.head_dim
        qkv = self.linear(x, f"layers.{l}.wqkv")[:, qkv_rows(H, K, E)]  # [T, (H + 2K) E] as [q | k | v]
        return (qkv[:, : H * E].reshape(T, H, E), qkv[:, H * E:(H + K) * E].reshape(T, K, E),
                qkv[:, (H + K) * E:].reshape(T, K, E))

    def block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        attn = self.attention_block(l, self.norm(h, f"layers.{l}.attn_norm"), batch, cache)
        if self.config.block == "pre_norm":
            h = h + attn
            return h + self.ffn_block(l, h)
        return h + attn + self.ffn_block(l, h)


FAMILIES = {"llama": Llama, "opt": OPT, "falcon": Falcon}
