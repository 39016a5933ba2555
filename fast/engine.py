"""The fast engine: ref's model, laid out once for the numba kernels of `fast.cpu`.

Features are transforms: `apply_predictors` swaps the dense active-set source for PowerInfer's predictor;
the block code below does not know which one runs.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
V vocab, R predictor hidden size, C accumulator chunks.
"""

import time
from dataclasses import dataclass

import numba
import numpy as np

from fast import cpu
from ref.config import ModelConfig
from ref.errors import UserError
from ref.generate import generate
from ref.model import KVCache, check_ids, rope_angles, step_ids
from ref.sparse import Predictors, resolve_predictors
from ref.weights import Weights, upcast

DEVICES = ("cpu", "gpu", "hybrid")
POLICIES = ("hybrid", "layers")  # PowerInfer's neuron split; llama.cpp-style whole layers on the GPU
F32 = np.float32


@dataclass
class Layer:
    """One block's weights in kernel layout: float32, contiguous; FFN neuron-major with gate, up, down bundled."""

    attn_norm: np.ndarray  # [D]
    wqkv: np.ndarray  # [(H + 2K) E, D]
    wo: np.ndarray  # [D, H E]
    ffn_norm: np.ndarray  # [D]
    w3: np.ndarray  # [F, 3, D]: row i = (gate_i, up_i, down[:, i])


def layout_layer(w: Weights, l: int) -> Layer:
    p = f"layers.{l}."
    f32 = lambda name: np.ascontiguousarray(upcast(w[p + name], F32))  # noqa: E731
    wqkv = np.concatenate([f32("wq"), f32("wk"), f32("wv")])
    w3 = np.empty((w.config.d_ffn, 3, w.config.d_model), F32)
    w3[:, 0], w3[:, 1], w3[:, 2] = f32("wg"), f32("wu"), f32("wd").T
    return Layer(f32("attn_norm"), wqkv, f32("wo"), f32("ffn_norm"), w3)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [P, E/2] for every position, computed in float64 as ref.model.rope does."""
    ang = rope_angles(np.arange(cfg.max_seq_len), cfg.head_dim, cfg.rope_theta)  # [P, E/2]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


class DenseSelect:
    """Every neuron is active (dense FFN through the same neuron-aware kernel)."""

    def __init__(self, d_ffn: int):
        self.all = np.arange(d_ffn, dtype=np.int32)

    def __call__(self, l: int, h: np.ndarray) -> tuple[np.ndarray, int]:
        return self.all, len(self.all)


class PredictorSelect:
    """PowerInfer's predictor: P = {i : fc2 relu(fc1 h) >= θ}, h the residual entering the FFN block."""

    def __init__(self, pred: Predictors, threshold: float, d_ffn: int):
        self.fc1 = [np.ascontiguousarray(a, F32) for a in pred.fc1]  # [R, D]
        self.fc2 = [np.ascontiguousarray(b, F32) for b in pred.fc2]  # [F, R]
        self.threshold = F32(threshold)
        self.logits = np.empty(d_ffn, F32)
        self.hidden = np.empty(max(a.shape[0] for a in self.fc1), F32)
        self.active = np.empty(d_ffn, np.int32)

    def __call__(self, l: int, h: np.ndarray) -> tuple[np.ndarray, int]:
        cpu.predictor(self.logits, self.hidden[: self.fc1[l].shape[0]], h, self.fc1[l], self.fc2[l])
        return self.active, cpu.predicted_set(self.active, self.logits, self.threshold)


class Engine:
    """Prefill and decode with a preallocated KV cache; `ref.generate`'s contract through `generate`."""

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: np.ndarray, norm: np.ndarray,
                 lm_head: np.ndarray, threads: int | None = None):
        c = self.config = config
        self.layers, self.embed, self.norm, self.lm_head = layers, embed, norm, lm_head
        self.threads = set_threads(threads)
        self.cos, self.sin = rope_tables(c)
        self.kind, self.thr = cpu.KINDS[c.ffn_kind], F32(c.act_threshold)
        self.acc = np.empty((2 * self.threads, c.d_model), F32)  # per-chunk private accumulators
        self.select, self.predictor_threshold = DenseSelect(c.d_ffn), None
        self.compile_seconds = 0.0

    @staticmethod
    def load(path, device: str = "cpu", predictors=None, placement=None, vram_budget=None, threads=None,
             predictor_threshold: float | None = None, policy: str = "hybrid") -> "Engine":
        """Lay out an HF checkpoint; with `predictors`, the predictor-gated sparse FFN; on `gpu`/`hybrid`, the
        placement (a file, or solved for `vram_budget` GiB) applied by fast.hybrid. Compiles (or loads the
        cached) kernels with one warm-up token, timed as `compile_seconds`."""
        if device not in DEVICES:
            raise UserError(f"--device must be one of {', '.join(DEVICES)}, got '{device}'")
        cfg = ModelConfig.from_hf(path)
        w = Weights.load(path, cfg)
        f32 = lambda name: np.ascontiguousarray(upcast(w[name], F32))  # noqa: E731
        engine = Engine(cfg, [layout_layer(w, l) for l in range(cfg.n_layers)], f32("embed"), f32("norm"),
                        f32("embed" if cfg.tie_word_embeddings else "lm_head"), threads)
        if predictors is not None:
            apply_predictors(engine, predictors, predictor_threshold)
        if device != "cpu":
            from fast.hybrid import place_engine
            engine = place_engine(engine, path, device, placement, vram_budget, policy)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        t0 = time.perf_counter()
        self.forward([0], self.new_cache(1))
        self.compile_seconds = time.perf_counter() - t0

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, F32)

    def attention_block(self, l: int, h: np.ndarray, cache: KVCache) -> np.ndarray:
        """Pre-norm self-attention with RoPE; appends this step's keys and values to the cache.  h: [T, D]."""
        L, out = self.layers[l], np.empty_like(h)
        cpu.attention_block(out, h, L.attn_norm, L.wqkv, L.wo, cache.k[l], cache.v[l], self.cos, self.sin, cache.length,
                            self.config.rms_norm_eps)
        return out

    def ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = sum over the active set of a_i Wd[:, i], the set chosen per token by `self.select`.  h: [T, D]."""
        L, y = self.layers[l], np.empty_like(h)
        for t in range(h.shape[0]):
            active, n = self.select(l, h[t])
            cpu.ffn_block(y[t], self.acc, h[t], L.ffn_norm, L.w3, active, n, self.kind, self.thr, self.config.rms_norm_eps)
        return y

    def forward(self, ids, cache: KVCache) -> np.ndarray:
        """Logits [T, V] for `ids` following the cached positions; the cache grows by T."""
        c = self.config
        ids = step_ids(ids, cache, c)
        h = self.embed[ids]  # [T, D]
        for l in range(c.n_layers):
            h += self.attention_block(l, h, cache)
            h += self.ffn_block(l, h)
        cache.length += len(ids)
        return self.output(h)

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . rmsnorm(h)."""
        x = np.empty_like(h)
        cpu.rmsnorm(x, h, self.norm, self.config.rms_norm_eps)
        logits = np.empty((h.shape[0], self.config.vocab_size), F32)
        cpu.matmul(logits, x, self.lm_head)
        return logits

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_ids(ids, self.config)
        return self.forward(ids, self.new_cache(max(len(ids), 1)))

    def generate(self, ids, max_new_tokens, **kwargs) -> list[int]:
        return generate(self, ids, max_new_tokens, **kwargs)


def set_threads(threads: int | None) -> int:
    """Map -t/--threads onto numba's thread pool (default: every core numba sees)."""
    most = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        threads = most
    if not 1 <= threads <= most:
        raise UserError(f"-t/--threads must be in [1, {most}], got {threads}")
    numba.set_num_threads(threads)
    return threads


def apply_predictors(engine: Engine, predictors, threshold: float | None = None) -> Engine:
    """Predictor-gated sparse FFN (DESIGN section 2), from a file or a loaded `ref.sparse.Predictors`."""
    pred, theta = resolve_predictors(engine.config, predictors, threshold)
    engine.select = PredictorSelect(pred, theta, engine.config.d_ffn)
    engine.predictor_threshold = theta
    return engine
