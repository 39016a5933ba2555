"""The fast engine: ref's model, laid out once for the numba kernels of `fast.cpu`.

`Engine.load` only loads, keeping the checkpoint's weight format (no float32 copy of an f16 or bf16 model) unless
asked for another.
Features are transforms applied to a loaded engine: `convert` stores its matrices in another format (--type),
`apply_predictors` gives it a predicting `Selector`, `fast.hybrid.to_hybrid` puts a placement's share on the GPU;
the block code asks the selector which neurons to compute and does not know which one it has.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
V vocab, R predictor hidden size, C accumulator chunks.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from numba.typed import List
from threadpoolctl import threadpool_limits

from fast import blas, cpu
from ref import sparse
from ref.common.artifacts import Predictors
from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format
from ref.common.safetensors import upcast
from ref.common.sampling import check_fits, generate
from ref.common.weights import Weights
from ref.model import rope_angles
from ref.quant import Quantized, blocks, format_of_blocks, quantize, quantize_predictors, values

F32 = np.float32
# Tokens per batched FFN call. Chunks of blas.MIN_TOKENS or more run as GEMMs, which gain with the chunk more than the
# union of the chunk's sets costs: TinyLlama pp512 at 90% sparsity, chunks of 128 / 256 / 512: 69 / 81 / 87 tok/s
# (f32), 58 / 74 / 82 (q4_0).
FFN_CHUNK = 512


@dataclass
class Layer:
    """One block's weights in kernel layout, contiguous: matrices as rows of their format's blocks
    (`Format.dtype`), norms float32; FFN neuron-major with each neuron's rows bundled."""

    attn_norm: np.ndarray  # [D]
    wqkv: np.ndarray  # [(H + 2K) E, D]
    wo: np.ndarray  # [D, H E]
    ffn_norm: np.ndarray  # [D]
    bundle: np.ndarray  # [F, 3, D]: row i = (gate_i, up_i, down[:, i])


def as_format(t, fmt: Format) -> np.ndarray:
    """A stored tensor, or rows of blocks, as rows of fmt's blocks: itself (a view) where it is in fmt already."""
    b = t if isinstance(t, np.ndarray) and t.dtype.names else blocks(t)
    return b if b.dtype == fmt.dtype else blocks(quantize(values(b), fmt))


def layout_llama(w: Weights, l: int, fmt: Format) -> Layer:
    """A LLaMA block with its matrices in `fmt`: q, k, v fused; gate row, up row and down column of each neuron in
    one bundle (the down matrix transposed, as PowerInfer's ffn_down_t)."""
    p = f"layers.{l}."

    def vec(name):
        return np.ascontiguousarray(upcast(w[p + name], F32))

    def mat(name):
        return as_format(w[p + name], fmt)

    bundle = np.empty((w.config.d_ffn, 3, w.config.d_model // fmt.block), fmt.dtype)
    bundle[:, 0], bundle[:, 1], bundle[:, 2] = mat("wg"), mat("wu"), as_format(w[p + "wd"].T, fmt)
    return Layer(vec("attn_norm"), np.concatenate([mat("wq"), mat("wk"), mat("wv")]), mat("wo"), vec("ffn_norm"), bundle)


LAYOUTS = {"llama": layout_llama}  # family -> its block's kernel layout


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [P, E/2] for every position, computed in float64 as ref.model.rope does."""
    ang = rope_angles(np.arange(cfg.max_seq_len), cfg.head_dim, cfg.rope_theta)  # [P, E/2]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


class Selector(sparse.Selector):
    """ref's active-set seam with the pick as a kernel: predictor weights as rows of their format's blocks
    (float32 as trained, or as `ref.quant.quantize_predictors` stored them), plus the host scratch an engine runs
    the predictor into (`logits` [F], `hidden` [max R])."""

    def __init__(self, d_ffn: int, predictors: Predictors | None = None, threshold: float = 0.0):
        super().__init__(d_ffn, predictors, threshold)
        if self.predicts:
            self.fc1 = [blocks(a) for a in self.fc1]  # [R, D]
            self.fc2 = [blocks(b) for b in self.fc2]  # [F, R]
            self.hidden = np.empty(max(a.shape[0] for a in self.fc1), F32)
        self.threshold = F32(threshold)
        self.logits, self.active = np.empty(d_ffn, F32), np.empty(d_ffn, np.int32)

    def pick(self, l: int, logits: np.ndarray | None) -> np.ndarray:
        return self.all if logits is None else self.active[: cpu.predicted_set(self.active, logits, self.threshold)]

    def pick_rows(self, l: int, logits: np.ndarray | None, T: int) -> np.ndarray:
        if type(self).pick is not Selector.pick:  # a subclass's own pick decides
            return super().pick_rows(l, logits, T)
        return np.ones((T, len(self.all)), np.uint8) if logits is None else (logits >= self.threshold).view(np.uint8)


class Decoder:
    """ref's contracts on top of an engine's `config`, `new_cache` and `forward(batch, cache)`."""

    compile_seconds = 0.0

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_fits(len(ids), self.config.max_seq_len)
        cache = self.new_cache(max(len(ids), 1))
        return self.forward(Batch.single(ids, cache), cache)

    def generate(self, ids, max_new_tokens, **kwargs) -> list[int]:
        return generate(self, ids, max_new_tokens, **kwargs)

    def warm_up(self) -> None:
        """Compile (or load the cached) kernels with one token, timed as `compile_seconds`."""
        t0 = time.perf_counter()
        self.logits([0])
        self.compile_seconds = time.perf_counter() - t0


def stored_format(w: Weights) -> Format:
    """The format a checkpoint's matrices are stored in: its embedding's."""
    return format_of_blocks(blocks(w["embed"][:1]).dtype)


class Engine(Decoder):
    """Prefill and decode on the CPU with a preallocated KV cache."""

    file_predictors = None  # a PowerInfer file's own predictors

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: np.ndarray, norm: np.ndarray,
                 lm_head: np.ndarray, threads: int | None = None, fmt: Format = FORMATS["f32"]):
        c = self.config = config
        self.layers, self.embed, self.norm, self.lm_head, self.format = layers, embed, norm, lm_head, fmt
        self.threads = set_threads(threads)
        self.cos, self.sin = rope_tables(c)
        self.kind, self.thr = cpu.KINDS[c.ffn_kind], F32(c.act_threshold)
        self.acc = np.empty((2 * self.threads, c.d_model), F32)  # per-chunk private accumulators
        self.selector = Selector(c.d_ffn)

    @staticmethod
    def load(path: str | Path | Weights, threads: int | None = None, fmt: Format | None = None) -> "Engine":
        """Lay out an HF folder or GGUF file for the kernels, dense, its matrices in the format they are stored in or
        in `fmt` (--type: converted a layer at a time as they are laid out, so that memory never holds the model
        twice). Features are transforms applied to the result; a PowerInfer file's predictors wait in
        `file_predictors`. `path` may be a checkpoint loaded already (ref.common.checkpoint.load_checkpoint)."""
        w = path if isinstance(path, Weights) else load_checkpoint(path)
        cfg, path = w.config, w.source
        if cfg.family not in LAYOUTS:
            raise UserError(f"{path}: the fast engine has no layout for the {cfg.family} family")
        fmt = fmt or stored_format(w)
        if isinstance(w["layers.0.wd"], Quantized):  # llama.cpp's layout: blocks run along F, the bundle needs D
            raise UserError(f"{path}: its FFN down matrices are quantized along the FFN dimension (llama.cpp's layout, "
                            "ffn_down); the fast engine's neuron bundles need them along d_model (PowerInfer's "
                            "ffn_down_t): convert the original checkpoint with python -m fast.convert, or run this file "
                            "with python -m ref")
        layers = []
        for l in range(cfg.n_layers):
            layers.append(LAYOUTS[cfg.family](w, l, fmt))
            w.release()  # the layout is a copy: keep one, not the file's pages too
        embed = as_format(w["embed"], fmt)
        lm_head = embed if cfg.tie_word_embeddings else as_format(w["lm_head"], fmt)
        engine = Engine(cfg, layers, embed, np.ascontiguousarray(upcast(w["norm"], F32)), lm_head, threads, fmt)
        engine.file_predictors = w.predictors
        return engine

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, F32, slots)

    def active_set(self, l: int, h: np.ndarray) -> np.ndarray:
        """Ids of the neurons layer l computes for one token h [D]: the selector's pick from the predictor run here."""
        sel = self.selector
        if not sel.predicts:
            return sel.pick(l, None)
        cpu.predictor(sel.logits.reshape(1, -1), sel.hidden[: sel.fc1[l].shape[0]].reshape(1, -1), h.reshape(1, -1),
                      sel.fc1[l], sel.fc2[l])
        return sel.pick(l, sel.logits)

    def active_sets(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer l's sets for T tokens h [T, D] as their union (sorted ids [U]) and which token computes which union
        neuron (mask [T, max(U, 1)] uint8); the predictor reads its weights once for all T."""
        sel, T, F = self.selector, h.shape[0], self.config.d_ffn
        if sel.predicts:
            logits = np.empty((T, F), F32)
            kernels(T).predictor(logits, np.empty((T, sel.fc1[l].shape[0]), F32), h, sel.fc1[l], sel.fc2[l])
        picked = sel.pick_rows(l, logits if sel.predicts else None, T)  # [T, F]: token t computes neuron i
        union = np.flatnonzero(picked.any(axis=0)).astype(np.int32)
        return union, (np.ascontiguousarray(picked[:, union]) if len(union) else np.zeros((T, 1), np.uint8))

    def attention_block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """Pre-norm self-attention with RoPE, each sequence's run attending to its own slot, to which it appends its
        keys and values.  h: [T, D].

        One short run (a decode step): one compiled call. Otherwise the projections read each weight row once for all
        tokens (in BLAS from blas.MIN_TOKENS on), the attention runs per sequence."""
        L, out, runs, eps, T = self.layers[l], np.empty_like(h), batch.runs(), self.config.rms_norm_eps, h.shape[0]
        k = kernels(T)
        if len(runs) == 1 and k is cpu:
            seq = runs[0][0]
            cpu.attention_block(out, h, L.attn_norm, L.wqkv, L.wo, cache.k[l][seq], cache.v[l][seq], self.cos,
                                self.sin, batch.positions[0], eps)
            return out
        c = self.config
        qkv = np.empty((T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), F32)  # [T, (H + 2K) E]
        k.qkv_proj(qkv, h, L.attn_norm, L.wqkv, eps)
        att = np.empty((T, c.n_heads * c.head_dim), F32)  # [T, H E]
        if len(runs) == T:  # one new token per sequence (decoding together): one call for all of them
            k_caches, v_caches = self.slot_views(cache, l)
            cpu.decode_attention(att, qkv, k_caches, v_caches, batch.seqs, batch.positions, self.cos, self.sin)
        else:
            for seq, a, b in runs:
                kernels(b - a).self_attention(att[a:b], qkv[a:b], cache.k[l][seq], cache.v[l][seq], self.cos,
                                              self.sin, batch.positions[a])
        k.matmul(out, att, L.wo)
        return out

    @staticmethod
    def slot_views(cache: KVCache, l: int):
        """Layer l's slot arrays as numba typed lists (an empty array for a free slot), kept with the cache and
        rebuilt only when its arrays change (cache.version)."""
        views = getattr(cache, "typed_views", None)
        if views is None or views[0] != cache.version:
            empty = np.zeros((0, *cache.shape), F32)
            lists = [tuple(List([a if a is not None else empty for a in arrays[i]]) for arrays in (cache.k, cache.v))
                     for i in range(len(cache.k))]
            views = cache.typed_views = (cache.version, lists)
        return views[1][l]

    def ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = sum over the active set of a_i Wd[:, i], the set chosen per token by the selector.  h: [T, D].

        One token: the fused decode kernel. Several (a prompt, or one token of each of several sequences): per chunk
        of FFN_CHUNK tokens, each neuron of the union of their sets read once for all of them, each token computing
        only its own (`sparse_ffn_batch`, in BLAS for chunks of blas.MIN_TOKENS or more)."""
        L, y, T = self.layers[l], np.empty_like(h), h.shape[0]
        if T == 1:
            active = self.active_set(l, h[0])
            cpu.ffn_block(y[0], self.acc, h[0], L.ffn_norm, L.bundle, active, len(active), self.kind, self.thr,
                          self.config.rms_norm_eps)
            return y
        x = np.empty_like(h)
        cpu.rmsnorm(x, h, L.ffn_norm, self.config.rms_norm_eps)
        for t0 in range(0, T, FFN_CHUNK):
            n = min(FFN_CHUNK, T - t0)
            union, mask = self.active_sets(l, h[t0:t0 + n])
            kernels(n).sparse_ffn_batch(y[t0:t0 + n], np.empty((len(self.acc), n, h.shape[1]), F32), x[t0:t0 + n], L.bundle,
                                 union, len(union), mask, self.kind, self.thr)
        return y

    def block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
        """The LLaMA block on the residual stream h [T, D], in place."""
        h += self.attention_block(l, h, batch, cache)
        h += self.ffn_block(l, h)

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each sequence's slot grows by its run."""
        runs = check_batch(batch, cache, self.config)
        h = values(self.embed[batch.tokens])  # [T, D]
        for l in range(self.config.n_layers):
            self.block(l, h, batch, cache)
        advance(cache, runs)
        return self.output(np.ascontiguousarray(h[batch.output_rows()]))

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . rmsnorm(h)."""
        x = np.empty_like(h)
        cpu.rmsnorm(x, h, self.norm, self.config.rms_norm_eps)
        logits = np.empty((h.shape[0], self.config.vocab_size), F32)
        kernels(h.shape[0]).matmul(logits, x, self.lm_head)
        return logits


def kernels(T: int):
    """The kernels for a step of T tokens: fast.cpu's, or from blas.MIN_TOKENS on, fast.blas's (same contracts)."""
    return blas if T >= blas.MIN_TOKENS else cpu


def free_cores(sample_seconds: float = 0.1) -> int:
    """How many of this process's cores other processes leave idle, from /proc/stat over `sample_seconds`: the
    default -t. A kernel cuts its work into equal shares per thread and waits for the last, so one thread on a core
    that another process keeps busy makes every kernel wait for it (measured on 2 cores with one busy: the default
    of every core was 2 to 5 times slower than -t 1)."""
    cpus = os.sched_getaffinity(0)

    def idle_and_total() -> dict[int, tuple[int, int]]:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    fields = [int(v) for v in line.split()[1:8]]
                    out[int(line.split()[0][3:])] = (fields[3] + fields[4], sum(fields))  # idle + iowait, all
        return out

    try:
        a = idle_and_total()
        time.sleep(sample_seconds)
        b = idle_and_total()
    except OSError:  # no /proc: every core
        return len(cpus)
    idle = sum((b[c][0] - a[c][0]) / max(b[c][1] - a[c][1], 1) for c in cpus if c in a and c in b)
    return max(1, min(len(cpus), round(idle)))


def set_threads(threads: int | None) -> int:
    """Map -t/--threads onto numba's thread pool and fast.blas's (default: the cores other processes leave idle,
    `free_cores`)."""
    most = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        threads = min(most, free_cores())
    if not 1 <= threads <= most:
        raise UserError(f"-t/--threads must be in [1, {most}], got {threads}")
    numba.set_num_threads(threads)
    threadpool_limits(1, user_api="blas")  # fast.blas splits its products among -t threads itself
    return threads


def convert(engine: Engine, fmt: Format) -> Engine:
    """Store the engine's matrices in another format (--type), a layer at a time, so that memory holds one layer in
    both formats at most."""
    for L in engine.layers:
        L.wqkv, L.wo, L.bundle = as_format(L.wqkv, fmt), as_format(L.wo, fmt), as_format(L.bundle, fmt)
    tied = engine.lm_head is engine.embed
    engine.embed = as_format(engine.embed, fmt)
    engine.lm_head = engine.embed if tied else as_format(engine.lm_head, fmt)
    engine.format = fmt
    return engine


def apply_predictors(engine: Engine, predictors, threshold: float | None = None, fmt: Format | None = None) -> Engine:
    """Predictor-gated sparse FFN, from a predictors file or loaded `Predictors` (the stored threshold unless given),
    their weights stored in `fmt` if given (--predictor-type)."""
    pred, threshold = sparse.resolve_predictors(engine.config, predictors, threshold)
    engine.selector = Selector(engine.config.d_ffn, pred if fmt is None else quantize_predictors(pred, fmt), threshold)
    return engine
