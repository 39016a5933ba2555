"""The fast engine: ref's model, laid out once for the numba kernels of `fast.cpu`.

`Engine.load` only loads, keeping the checkpoint's weight format (no float32 copy of an f16 or bf16 model) unless
asked for another.
Features are transforms applied to a loaded engine: `convert` stores its matrices in another format (--type),
`apply_predictors` gives it a predicting `Selector`, `fast.hybrid.to_hybrid` puts a placement's share on the GPU;
the block code asks the selector which neurons to compute and does not know which one it has.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
V vocab, R predictor hidden size, C accumulator chunks.
"""

import math
import os
import time
import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import numba
import numpy as np
from numba.typed import List
from threadpoolctl import threadpool_limits

from fast import blas, cpu
from fast.kernel_cache import first_compile
from fast.quant import for_matmul, for_sparse, n_rows, plain
from ref import sparse
from ref.common.artifacts import Predictors, site_widths
from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format
from ref.common.safetensors import upcast
from ref.common.sampling import check_fits, generate
from ref.common.weights import Weights
from ref.model import ATTN_NORM, FFN_NORM, qkv_rows, rope_angles, shift_context
from ref.quant import Quantized, blocks, quantize, quantize_predictors, stored_format, tensor_format, values

F32 = np.float32
# Tokens per batched FFN call. As GEMMs (chunks that `kernels` sends to BLAS, before GEMM_SHARE), a chunk gained more
# than the union of its sets cost: TinyLlama pp512 at 90% sparsity, chunks of 128 / 256 / 512: 69 / 81 / 87 tok/s
# (f32), 58 / 74 / 82 (q4_0).
FFN_CHUNK = 512
# A chunk's FFN runs as GEMMs (kernels) only where its tokens compute at least this share of the union's
# (token, neuron) pairs; below, fast.cpu's kernel computes each token's own neurons only. Measured crossover, 512
# tokens, TinyLlama's FFN, random sets: 0.2 (f32) to 0.33 (q4_0); at 0.1, fast.cpu took 68 / 64 / 85 ms against the
# GEMMs' 213 / 219 / 180 (q8_0 / q4_0 / f32).
GEMM_SHARE = 0.25


EMPTY = np.zeros(0, F32)  # an absent norm or bias, as the kernels take it (fast.cpu.norm, add_bias)
NO_NORMS = np.zeros((0, 0), F32)  # cpu.qk_norm's norms where the family has none
NO_PICKS = np.zeros((0, 0), np.uint8)  # cpu.ffn_batch_block's sets by the predictor's threshold
NO_SETS, NO_BOUNDS = np.zeros(0, np.int32), np.zeros(0, np.int64)  # cpu.decode_step's given sets: none


def joined(sets: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer sets as one int32 array and the bounds [L + 1] of each layer's part (Selector.given_sets)."""
    return np.concatenate(sets).astype(np.int32, copy=False), np.array([0, *accumulate(len(s) for s in sets)])


@dataclass
class Layer:
    """One block's weights in kernel layout, contiguous: matrices as rows of their format's blocks
    (`Format.dtype`), norms and biases float32 (EMPTY where the family has none); FFN neuron-major with each
    neuron's rows bundled. Post-norm blocks keep their norms (applied after each residual add) in attn_norm and
    ffn_norm."""

    attn_norm: np.ndarray  # [D]
    wqkv: np.ndarray  # [(H + 2K) E, D]: all q rows, then k, then v
    wo: np.ndarray  # [D, H E]
    ffn_norm: np.ndarray  # [D] (EMPTY where the FFN shares attention's)
    bundle: np.ndarray  # [F, 3, D]: row i = (gate_i, up_i, down[:, i]); non-gated [F, 2, D]: (up_i, down[:, i]);
    # q8_0 / q4_0 rows in runs (for_sparse); in the dense layout (dense_ffn) [F, 1, D], the down rows only, as blocks
    attn_norm_b: np.ndarray = field(default_factory=lambda: EMPTY)  # [D] LayerNorm's bias
    bqkv: np.ndarray = field(default_factory=lambda: EMPTY)  # [(H + 2K) E]
    bo: np.ndarray = field(default_factory=lambda: EMPTY)  # [D]
    ffn_norm_b: np.ndarray = field(default_factory=lambda: EMPTY)  # [D]
    bu: np.ndarray = field(default_factory=lambda: EMPTY)  # [F] the up rows' bias (non-gated)
    bd: np.ndarray = field(default_factory=lambda: EMPTY)  # [D] the down matrix's bias
    gate_up: np.ndarray | None = None  # [2F, D] the gate rows, then the up rows, as one matmul (dense_ffn)
    qk_norms: np.ndarray = field(default_factory=lambda: NO_NORMS)  # [2, E] each head's q and k norm (Qwen3)
    down: np.ndarray | None = None  # [D, F] llama.cpp's quantized ffn_down as stored (blocks along F); the bundle
    # then holds no rows, gate_up the gate and up rows (bundled re-lays it for the sparse kernels)
    # activation sparsity (apply_sparsity): the thinned matrices stored transposed, rows = inputs (wqkv, wo, gate_up
    # then None; the down rows are the bundle's [F, 1, D]), and each site's score weights and threshold
    wqkv_t: np.ndarray | None = None  # [D, (H + 2K) E]
    wo_t: np.ndarray | None = None  # [H E, D]
    gate_up_t: np.ndarray | None = None  # [D, 2F] (non-gated: [D, F], the up columns)
    thin: "Thin | None" = None


@dataclass
class Thin:
    """A layer's activation sparsity (ref.activation_sparsity): per site (attn_in, attn_out, ffn_in, ffn_hidden) the
    score weights w (TEAL: ones; WINA: the weight columns' norms) and the threshold t, an input kept where |x| w > t."""

    w: tuple[np.ndarray, ...]  # [D], [H E], [D], [F]
    t: np.ndarray  # [4] float32
    cats: bool = False  # the FFN's neurons by CATS's criterion, t[3] on |f(g)| (bundles, kind + cpu.CATS)


def as_format(t, fmt: Format, name: str = "tensor") -> np.ndarray:
    """A stored tensor, or rows of blocks, as rows of fmt's blocks: itself (a view) where it is in fmt already."""
    b = plain(t) if isinstance(t, np.ndarray) and t.dtype.names else blocks(t)
    return b if b.dtype == fmt.dtype else blocks(quantize(values(b), fmt, name))


def as_matmul(t, fmt: Format, name: str = "tensor") -> np.ndarray:
    """A matrix in fmt, laid out for fast.cpu.matmul (for_matmul: q8_0/q4_0 rows interleaved)."""
    return for_matmul(as_format(t, fmt, name))


def tied_head(embed: np.ndarray, fmt: Format) -> np.ndarray:
    """The output head of a model whose head is its embedding: the table itself, or in q8_0 and q4_0 a copy laid
    out for matmul, as llama.cpp duplicates it for its repacked kernels (the head reads at the matmul's pace, where
    plain rows of blocks read at about half of it: Llama-3.2 1B's 128k-token head is a fifth of a token)."""
    return for_matmul(embed) if fmt.quantized else embed


def vector(w: Weights, name: str) -> np.ndarray:
    """A norm's or bias's float32 values; EMPTY where the checkpoint has none."""
    return np.ascontiguousarray(upcast(w[name], F32)) if name in w.tensors else EMPTY


def layout(w: Weights, l: int, fmt: Format) -> Layer:
    """Block l with its matrices in `fmt`: q, k, v fused as [q | k | v] (a fused checkpoint matrix reordered so,
    ref.model.qkv_rows); each neuron's gate row, up row and down column in one bundle (the down matrix transposed,
    as PowerInfer's ffn_down_t); norms and biases as the checkpoint has them."""
    c, p = w.config, f"layers.{l}."

    def vec(name):
        return vector(w, p + name)

    def mat(name):
        return as_format(w[p + name], fmt, p + name)

    if c.fused_qkv:
        rows = qkv_rows(c.n_heads, c.n_kv_heads, c.head_dim)
        wqkv, bqkv = for_matmul(mat("wqkv")[rows]), vec("wqkv.bias")[rows] if c.bias else EMPTY
    else:
        wqkv = for_matmul(mat("wq"), mat("wk"), mat("wv"))  # [q | k | v]
        bqkv = np.concatenate([vec("wq.bias"), vec("wk.bias"), vec("wv.bias")])
    qk_norms = np.stack([vec("q_norm"), vec("k_norm")]) if c.qk_norm else NO_NORMS
    if isinstance(w[p + "wd"], Quantized):  # llama.cpp's ffn_down, quantized along F: run as stored, dense
        return Layer(vec("attn_norm"), wqkv, as_matmul(w[p + "wo"], fmt, p + "wo"), vec("ffn_norm"),
                     np.empty((c.d_ffn, 0, c.d_model // fmt.block), fmt.dtype), vec("attn_norm.bias"), bqkv,
                     vec("wo.bias"), vec("ffn_norm.bias"), vec("wu.bias"), vec("wd.bias"),
                     gate_up=for_matmul(mat("wg"), mat("wu")), qk_norms=qk_norms,
                     down=as_matmul(w[p + "wd"], fmt, p + "wd"))
    rows = ["wg", "wu"] if c.gated else ["wu"]
    bundle = np.empty((c.d_ffn, len(rows) + 1, c.d_model // fmt.block), fmt.dtype)
    for i, name in enumerate(rows):
        bundle[:, i] = mat(name)
    bundle[:, -1] = as_format(w[p + "wd"].T, fmt, p + "wd")
    return Layer(vec("attn_norm"), wqkv, as_matmul(w[p + "wo"], fmt, p + "wo"), vec("ffn_norm"), for_sparse(bundle),
                 vec("attn_norm.bias"), bqkv, vec("wo.bias"), vec("ffn_norm.bias"), vec("wu.bias"), vec("wd.bias"),
                 qk_norms=qk_norms)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [P, E/2] for every position, computed in float64 as ref.model.rope does; a family without RoPE
    rotates by 0 (cos 1, sin 0), so that one attention kernel serves all."""
    ang = rope_angles(np.arange(cfg.max_seq_len), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [P, E/2]
    if cfg.positions != "rope":
        ang = np.zeros_like(ang)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


class Selector(sparse.Selector):
    """ref's active-set seam with the pick as a kernel: predictor weights as rows of their format's blocks
    (float32 as trained, or as `ref.quant.quantize_predictors` stored them), plus the host scratch an engine runs
    the predictor into (`logits` [F], `hidden` [max R])."""

    def __init__(self, d_ffn: int, predictors: Predictors | None = None, threshold: float = 0.0):
        super().__init__(d_ffn, predictors, threshold)
        self.formats = self.params = ()  # the formats the predictor matrices are stored in; each layer's parameters
        if self.predicts:
            self.formats = tuple(dict.fromkeys(tensor_format(t) for t in (*self.fc1, *self.fc2)))
            self.params = tuple(math.prod(a.shape) + math.prod(b.shape) for a, b in zip(self.fc1, self.fc2))
            self.fc1 = [for_matmul(blocks(a)) for a in self.fc1]  # [R, D]
            self.fc2 = [for_matmul(blocks(b)) for b in self.fc2]  # [F, R]
            self.hidden = np.empty(max(n_rows(a) for a in self.fc1), F32)
        self.threshold = F32(threshold)
        self.logits, self.active = np.empty(d_ffn, F32), np.empty(d_ffn, np.int32)

    ahead = False  # a subclass whose pick ignores the logits (sets drawn in advance): a step may ask before it runs

    def given_sets(self, n_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
        """One token's sets of every layer before its predictor runs, where the pick does not read the logits (no
        predictor: every neuron; a subclass's `ahead` pick), as one array and where each layer's starts: layer l's
        set is sets[bounds[l]:bounds[l + 1]] (what cpu.decode_step reads); None where the predictor's threshold
        decides."""
        if self.predicts and not self.ahead:
            return None
        return joined([self.pick(l, None) for l in range(n_layers)])

    @property
    def by_threshold(self) -> bool:
        """Whether the picks are the plain threshold of the predictor's logits, which a kernel may then apply itself
        (a subclass's own pick decides otherwise)."""
        return self.predicts and type(self).pick is Selector.pick and type(self).pick_rows is Selector.pick_rows

    def pick(self, l: int, logits: np.ndarray | None) -> np.ndarray:
        return self.all if logits is None else self.active[: cpu.predicted_set(self.active, logits, self.threshold)]

    def pick_rows(self, l: int, logits: np.ndarray | None, T: int) -> np.ndarray:
        if type(self).pick is not Selector.pick:  # a subclass's own pick decides
            return super().pick_rows(l, logits, T)
        return np.ones((T, len(self.all)), np.uint8) if logits is None else (logits >= self.threshold).view(np.uint8)


class Decoder:
    """ref's contracts on top of an engine's `config`, `new_cache` and `forward(batch, cache)`."""

    compile_seconds = 0.0
    kv_types = ("f32", "f32")  # the formats new caches store keys and values in (fast.load.set_kv_types)
    # Whether a prompt chunk may run GEMMs (fast.engine.kernels): faster from a few dozen tokens of a wide model, but
    # a GEMM's blocking makes a token's bits depend on the chunk around it; the server turns it off.
    gemm = True

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_fits(len(ids), self.config.max_seq_len)
        cache = self.new_cache(max(len(ids), 1))
        return self.forward(Batch.single(ids, cache), cache)

    def generate(self, ids, max_new_tokens, **kwargs) -> list[int]:
        return generate(self, ids, max_new_tokens, **kwargs)

    def shift(self, cache: KVCache, seq: int, keep: int, discard: int) -> None:
        """ref.model.shift_context on this engine's cache (a rare step: numpy's rope, as ref's, on float32 keys)."""
        shift_context(self.config, cache, seq, keep, discard)

    def warm_up(self, notice=None) -> None:
        """Compile (or load the cached) kernels of a short prompt and of a decode step, timed as `compile_seconds`
        (llama.cpp warms up too): the first prompt otherwise paid for loading its kernels, 50 ms of the shipped
        model's 5-token prompt against 1 ms after. notice(self), if given, is called once if a kernel must compile."""
        t0 = time.perf_counter()
        with first_compile(lambda: notice and notice(self)):
            cache = self.new_cache(3)
            self.forward(Batch.single([0, 0], cache), cache)
            self.forward(Batch.single([0], cache), cache)
        self.compile_seconds = time.perf_counter() - t0


class Engine(Decoder):
    """Prefill and decode on the CPU with a preallocated KV cache."""

    file_predictors = None  # the checkpoint's own predictors (a PowerInfer file's, TurboSparse's)

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: np.ndarray, norm: np.ndarray,
                 lm_head: np.ndarray, threads: int | None = None, fmt: Format = FORMATS["f32"], norm_b=EMPTY,
                 pos_embed=None, project_in=None, project_out=None):
        c = self.config = config
        self.layers, self.embed, self.norm, self.lm_head, self.format = layers, embed, norm, lm_head, fmt
        self.norm_b = norm_b  # [D] the final LayerNorm's bias (norm and norm_b EMPTY: no final norm)
        self.pos_embed = pos_embed  # [P + 2, D] OPT's learned positions, float32
        self.project_in, self.project_out = project_in, project_out  # OPT-350m's [D, W], [W, D]
        self.block = BLOCKS[c.block].__get__(self)
        self.threads = set_threads(threads)
        self.cos, self.sin = rope_tables(c)
        self.kind, self.thr = cpu.KINDS[c.ffn_kind], F32(c.act_threshold)
        self.eps = F32(c.norm_eps)  # one type for every kernel's eps: a float64 compiles each kernel a second time
        self.acc = np.empty((2 * self.threads, c.d_model), F32)  # per-chunk private accumulators
        self.selector = Selector(c.d_ffn)
        self.no_picks = np.zeros((c.n_layers, 0, 0), np.uint8)  # decode_step's picks where the threshold decides
        self._step = None  # (selector, step_layers' list) until a transform changes the layers (layers_changed)
        self._slots = self._rows = None  # slot_lists' and step_rows' lists, with the cache and version they are of
        self.run = None  # the longest run of the step `forward` runs (kernels); None outside one

    @staticmethod
    def load(path: str | Path | Weights, threads: int | None = None, fmt: Format | None = None) -> "Engine":
        """Lay out an HF folder or GGUF file for the kernels, dense, its matrices in the format they are stored in or
        in `fmt` (--type: converted a layer at a time as they are laid out, so that memory never holds the model
        twice). Features are transforms applied to the result; a PowerInfer file's predictors wait in
        `file_predictors`. `path` may be a checkpoint loaded already (ref.common.checkpoint.load_checkpoint)."""
        w = path if isinstance(path, Weights) else load_checkpoint(path)
        cfg, path = w.config, w.source
        fmt = fmt or stored_format(w)
        layers = []
        for l in range(cfg.n_layers):
            layers.append(layout(w, l, fmt))
            w.release()  # the layout is a copy: keep one, not the file's pages too

        embed = as_format(w["embed"], fmt, "embed")
        lm_head = tied_head(embed, fmt) if cfg.tie_word_embeddings else as_matmul(w["lm_head"], fmt, "lm_head")
        projections = [as_matmul(w[n], fmt, n) for n in ("project_in", "project_out")] if cfg.embed_dim else [None, None]
        w.release()  # interleaved, lm_head is a copy too
        engine = Engine(cfg, layers, embed, vector(w, "norm"), lm_head, threads, fmt, vector(w, "norm.bias"),
                        vector(w, "pos_embed") if cfg.positions == "learned" else None, *projections)
        engine.file_predictors = w.predictors
        return engine

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, F32, slots, formats=self.kv_types)

    def active_set(self, l: int, h: np.ndarray) -> np.ndarray:
        """Ids of the neurons layer l computes for one token h [D]: the selector's pick from the predictor run here."""
        sel = self.selector
        if not sel.predicts:
            return sel.pick(l, None)
        cpu.predictor(sel.logits.reshape(1, -1), sel.hidden[: n_rows(sel.fc1[l])].reshape(1, -1), h.reshape(1, -1),
                      sel.fc1[l], sel.fc2[l])
        return sel.pick(l, sel.logits)

    def active_sets(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer l's sets for T tokens h [T, D] as their union (sorted ids [U]) and which token computes which union
        neuron (mask [T, F] uint8: its first U columns); the predictor reads its weights once for all T."""
        sel, T, F = self.selector, h.shape[0], self.config.d_ffn
        if sel.predicts:
            logits = np.empty((T, F), F32)
            self.kernels(T, h.shape[1]).predictor(logits, np.empty((T, n_rows(sel.fc1[l])), F32), h, sel.fc1[l],
                                                  sel.fc2[l])
        picked = sel.pick_rows(l, logits if sel.predicts else None, T)  # [T, F]: token t computes neuron i
        union, mask = np.empty(F, np.int32), np.empty((T, F), np.uint8)
        n = cpu.union_mask(union, mask, np.ascontiguousarray(picked, np.uint8))
        return union[:n], mask  # mask [T, F]: its first n columns are the union's, the others undefined

    def attention_block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """Self-attention of the block input h [T, D] after its norm (ATTN_NORM: none in a post-norm block), RoPE
        where the family has it, each sequence's run attending to its own slot, to which it appends its keys and
        values.

        One short run (a decode step), or one token of each of several sequences (decoding together) in a step that
        `kernels` keeps on fast.cpu: one compiled call. Otherwise the projections read each weight row once for all
        tokens (in BLAS for steps that `kernels` sends there), the attention runs per sequence."""
        L, out, runs, eps, T = self.layers[l], np.empty_like(h), batch.runs(), self.eps, h.shape[0]
        w, b = self.norm_weights(L, ATTN_NORM)
        k = self.kernels(T, h.shape[1])
        if L.wqkv is None:  # thinned (apply_sparsity): the projections read their inputs' kept rows
            return self.thinned_attention(l, L, h, w, b, batch, cache)
        if len(runs) == 1 and k is cpu:
            seq = runs[0][0]
            cpu.attention_block(out, h, w, b, L.wqkv, L.bqkv, L.qk_norms, L.wo, L.bo, cache.k[l][seq], cache.v[l][seq],
                                self.cos, self.sin, batch.positions[0], eps)
            return out
        decoding = len(runs) == T  # one new token per sequence: their attention in one call
        if decoding and k is cpu:
            k_caches, v_caches = self.slot_lists(cache)[l]
            cpu.decode_attention_block(out, h, w, b, L.wqkv, L.bqkv, L.qk_norms, L.wo, L.bo, k_caches, v_caches,
                                       batch.seqs, batch.positions, self.cos, self.sin, eps)
            return out
        c = self.config
        qkv = np.empty((T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), F32)  # [T, (H + 2K) E]
        k.qkv_proj(qkv, h, w, b, L.wqkv, L.bqkv, eps)
        att = self.attend(l, L, qkv, batch, cache)  # [T, H E]
        k.matmul(out, att, L.wo)
        cpu.add_bias(out, L.bo)
        return out

    def thinned_attention(self, l: int, L: Layer, h: np.ndarray, w, b, batch: Batch, cache: KVCache) -> np.ndarray:
        """attention_block with activation sparsity: q, k, v from the normed input thinned, o from the attention
        output thinned, each product reading only the rows of its stored transpose that some token keeps."""
        c, T = self.config, h.shape[0]
        x = np.empty_like(h)
        cpu.norm(x, h, w, b, self.eps)
        qkv = np.empty((T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), F32)  # [T, (H + 2K) E]
        self.thinned_product(qkv, x, L.wqkv_t, L.thin, 0)
        cpu.add_bias(qkv, L.bqkv)
        att = self.attend(l, L, qkv, batch, cache)  # [T, H E]
        out = np.empty_like(h)
        self.thinned_product(out, att, L.wo_t, L.thin, 1)
        cpu.add_bias(out, L.bo)
        return out

    def thinned_product(self, out: np.ndarray, x: np.ndarray, wt: np.ndarray, thin: Thin, site: int) -> None:
        """out = W thin(x) per token (site's weights and threshold), reading the rows of the stored transpose wt
        [K, N] that some token keeps (fast.cpu.sparse_rows; in BLAS for steps that `kernels` sends there).
        out: [T, N]; x: [T, K]."""
        T, K = x.shape
        xt, ids = np.empty_like(x), np.empty(K, np.int32)
        n = cpu.thin(xt, ids, x, thin.w[site], thin.t[site])
        self.kernels(T, K).sparse_rows(out, np.empty((len(self.acc), T, out.shape[1]), F32), xt, wt, ids, n)

    def attend(self, l: int, L: Layer, qkv: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """The attention of projected rows qkv [T, (H + 2K) E] (each head's q and k normed where the family says so,
        RoPE, each sequence's keys and values appended to its slot).  -> [T, H E]."""
        c, T, runs = self.config, qkv.shape[0], batch.runs()
        cpu.qk_norm(qkv, L.qk_norms, c.n_kv_heads, self.eps)
        att = np.empty((T, c.n_heads * c.head_dim), F32)  # [T, H E]
        if len(runs) == T > 1:  # one token of each of several sequences (one run reads its own slot: a hybrid
            # engine's cache holds device arrays for the layers attending on the GPU)
            k_caches, v_caches = self.slot_lists(cache)[l]
            cpu.decode_attention(att, qkv, k_caches, v_caches, batch.seqs, batch.positions, self.cos, self.sin)
        else:
            for seq, a, b in runs:
                self.kernels(b - a, c.d_model).self_attention(att[a:b], qkv[a:b], cache.k[l][seq],
                                                              cache.v[l][seq], self.cos, self.sin, batch.positions[a])
        return att

    def ffn_kind(self, L: Layer) -> tuple[int, float]:
        """The (kind, threshold) a layer's neuron bundles are computed with: CATS's criterion (cpu.CATS, the
        layer's ffn_hidden threshold) where activation sparsity chose it, else the model's activation."""
        return (self.kind + cpu.CATS, L.thin.t[3]) if L.thin is not None and L.thin.cats else (self.kind, self.thr)

    def norm_weights(self, L: Layer, table: dict) -> tuple[np.ndarray, np.ndarray]:
        """The (weight, bias) of the norm before attention or the FFN in this block (ref.model's ATTN_NORM or
        FFN_NORM); EMPTY twice for none."""
        name = table[self.config.block]
        return (EMPTY, EMPTY) if name is None else (getattr(L, name), getattr(L, name + "_b"))

    def slot_lists(self, cache: KVCache) -> list[tuple[List, List]]:
        """Per layer, the cache's key and value slot arrays as numba typed lists (an empty array for a free slot), kept
        for the cache the engine last ran until its arrays change (KVCache.version)."""
        kept = self._slots
        if kept is None or kept[0]() is not cache or kept[1] != cache.version:
            empty = [np.zeros((cache.shape[0], 0, n), dtype) for n, dtype in map(cache.storage, cache.formats)]
            lists = [tuple(List([a if a is not None else none for a in arrays[l]])
                           for arrays, none in zip((cache.k, cache.v), empty)) for l in range(len(cache.k))]
            kept = self._slots = (weakref.ref(cache), cache.version, lists)
        return kept[2]

    def ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """y = sum over the active set of a_i Wd[:, i] (+ bd), the set chosen per token by the selector from the block
        input h [T, D] (before the FFN's norm, FFN_NORM).

        One token: the fused decode kernel. Several (a prompt, or one token of each of several sequences): per chunk
        of FFN_CHUNK tokens, each neuron of the union of their sets read once for all of them, each token computing
        only its own (`sparse_ffn_batch`; in BLAS for chunks that `kernels` sends there and that compute GEMM_SHARE of
        the union's pairs); one chunk that `kernels` keeps on fast.cpu, its sets the predictor's threshold: predictor,
        sets and FFN as one compiled call (`ffn_batch_block`). The dense layout (dense_ffn: every neuron): [g | u] =
        x [Wg | Wu]^T as one matmul, then `dense_down`; one token's as one compiled call."""
        L, y, T, eps = self.layers[l], np.empty_like(h), h.shape[0], self.eps
        w, b = self.norm_weights(L, FFN_NORM)
        if L.gate_up_t is not None:  # thinned (apply_sparsity): y = Wd thin(a(g, u)), g, u = [Wg | Wu] thin(x)
            x, F = np.empty_like(h), self.config.d_ffn
            cpu.norm(x, h, w, b, eps)
            gu = np.empty((T, F * (2 if self.config.gated else 1)), F32)  # [T, 2F]
            self.thinned_product(gu, x, L.gate_up_t, L.thin, 2)
            a, ids = np.empty((T, F), F32), np.empty(F, np.int32)
            n = cpu.thin_activations(a, ids, gu, L.bu, self.kind, self.thr, L.thin.w[3], L.thin.t[3])
            self.kernels(T, h.shape[1]).sparse_rows(y, np.empty((len(self.acc), T, h.shape[1]), F32), a,
                                                    L.bundle[:, 0], ids, n)
            cpu.add_bias(y, L.bd)
            return y
        if L.down is not None:  # llama.cpp's ffn_down as stored: y = Wd a(g, u)
            x, gu = np.empty_like(h), np.empty((T, n_rows(L.gate_up)), F32)  # [T, D], [T, 2F]
            cpu.norm(x, h, w, b, eps)
            k = self.kernels(T, h.shape[1])
            k.matmul(gu, x, L.gate_up)
            a = np.empty((T, gu.shape[1] // 2), F32)  # [T, F]
            cpu.activations(a, gu, self.kind, self.thr)
            k.matmul(y, a, L.down)
            cpu.add_bias(y, L.bd)
            return y
        if L.gate_up is not None:  # the dense layout: every neuron, gate and up rows as one matmul
            down = L.bundle[:, 0]
            if T == 1:
                cpu.dense_ffn_block(y[0], self.acc, h[0], w, b, L.gate_up, down, L.bd, self.kind, self.thr, eps)
                return y
            x, gu = np.empty_like(h), np.empty((T, n_rows(L.gate_up)), F32)  # [T, D], [T, 2F]
            cpu.norm(x, h, w, b, eps)
            k = self.kernels(T, h.shape[1])
            k.matmul(gu, x, L.gate_up)
            k.dense_down(y, np.empty((len(self.acc), T, h.shape[1]), F32), gu, down, self.kind, self.thr)
            cpu.add_bias(y, L.bd)
            return y
        kind, thr = self.ffn_kind(L)
        if T == 1:
            active = self.active_set(l, h[0])
            cpu.ffn_block(y[0], self.acc, h[0], w, b, L.bundle, L.bu, L.bd, active, len(active), kind, thr, eps)
            return y
        sel = self.selector
        if self.ffn_in_one_call(h):
            given = np.ascontiguousarray(sel.pick_rows(l, None, T), np.uint8) if sel.ahead else NO_PICKS
            cpu.ffn_batch_block(y, h, w, b, sel.fc1[l], sel.fc2[l], sel.threshold, given, L.bundle, L.bu, L.bd,
                                len(self.acc), self.kind, self.thr, eps)
            return y
        x = np.empty_like(h)
        cpu.norm(x, h, w, b, eps)
        for t0 in range(0, T, FFN_CHUNK):
            n = min(FFN_CHUNK, T - t0)
            union, mask = self.active_sets(l, h[t0:t0 + n])
            pairs = mask[:, :len(union)]  # [n, U]: the defined columns
            k = cpu if np.count_nonzero(pairs) < GEMM_SHARE * pairs.size else self.kernels(n, h.shape[1])
            k.sparse_ffn_batch(y[t0:t0 + n], np.empty((len(self.acc), n, h.shape[1]), F32), x[t0:t0 + n],
                               L.bundle, L.bu, union, len(union), mask, kind, thr)
        cpu.add_bias(y, L.bd)
        return y

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each sequence's slot grows by its run. Every block in one
        compiled call (cpu.decode_step) where the step, the layout and the selector allow it (one_call)."""
        runs = check_batch(batch, cache, self.config)
        self.run = max(b - a for _, a, b in runs)
        try:
            h = self.embed_tokens(batch)  # [T, D]
            layers = self.step_layers() if self.one_call(h, runs) else None
            logits = None
            if layers is not None:
                logits = self.decode_step(h, batch, cache, layers)
            else:
                for l in range(self.config.n_layers):
                    self.block(l, h, batch, cache)
            advance(cache, runs)
            return self.output(np.ascontiguousarray(h[batch.output_rows()])) if logits is None else logits
        finally:
            self.run = None

    def kernels(self, T: int, D: int):
        """The module `kernels` of the step `forward` runs (outside one: of T tokens in one run), width D; fast.cpu's
        where `gemm` is off."""
        return kernels(self.run or T, D) if self.gemm else cpu

    def one_call(self, h: np.ndarray, runs: list) -> bool:
        """Whether a step of h [T, D] may run as cpu.decode_step: one token, or one token of each of several
        sequences whose blocks the per-layer path would run as one compiled call each (attention_block's decoding
        case, ffn_block's ffn_batch_block case)."""
        return h.shape[0] == 1 or (len(runs) == h.shape[0] and self.ffn_in_one_call(h))

    def ffn_in_one_call(self, h: np.ndarray) -> bool:
        """Whether the FFN block of several tokens h [T, D] runs as cpu.ffn_batch_block: one chunk on fast.cpu's
        kernels, its sets the predictor's threshold or a pick drawn ahead."""
        sel, T = self.selector, h.shape[0]
        return ((sel.by_threshold or sel.predicts and sel.ahead) and T <= FFN_CHUNK
                and self.kernels(T, h.shape[1]) is cpu)

    def step_layers(self) -> list | None:
        """The per-layer arrays cpu.decode_step reads (cpu.StepLayer's fields but the cache's slots), kept until a
        transform changes the layers (layers_changed) or the selector is replaced; None where the step does not
        apply: the dense layout (dense_ffn), activation sparsity, a selector whose own pick reads the logits, or
        layers whose arrays differ in type (a format per layer: one compiled step takes one type per field)."""
        sel, c, L0 = self.selector, self.config, self.layers[0]
        if L0.gate_up is not None or L0.wqkv is None or (sel.predicts and not sel.by_threshold and not sel.ahead):
            return None
        if self._step is None or self._step[0] is not sel:
            none = np.zeros((0, 0), F32)  # fc1, fc2 without a predictor
            parts = []
            for l, L in enumerate(self.layers):
                post = (L.attn_norm, L.attn_norm_b, L.ffn_norm, L.ffn_norm_b) if c.block == "post_norm" else (EMPTY,) * 4
                parts.append((*self.norm_weights(L, ATTN_NORM), *self.norm_weights(L, FFN_NORM), *post, L.wqkv, L.bqkv,
                              L.qk_norms, L.wo, L.bo, L.bundle, L.bu, L.bd,
                              *((sel.fc1[l], sel.fc2[l]) if sel.predicts else (none, none))))
            uniform = len({tuple(numba.typeof(a) for a in p) for p in parts}) == 1
            self._step = (sel, parts if uniform else None)
        return self._step[1]

    def layers_changed(self) -> None:
        """Forget what was built from the layers' arrays: every transform that replaces one calls it."""
        self._step = self._rows = None

    def decode_step(self, h: np.ndarray, batch: Batch, cache: KVCache, layers: list) -> np.ndarray | None:
        """Every block for one token of each sequence of the batch, h [T, D], in place, as cpu.decode_step; and the
        output head where the step returns every row's logits and nothing projects before the head (-> [T, V]),
        else None (Engine.output then runs it)."""
        sel, L, T = self.selector, self.config.n_layers, h.shape[0]
        given, bounds = (sel.given_sets(L) if T == 1 else None) or (NO_SETS, NO_BOUNDS)  # one array (a list: 0.2 ms)
        picks = (np.stack([sel.pick_rows(l, None, T) for l in range(L)]).view(np.uint8) if T > 1 and sel.ahead
                 else self.no_picks)  # several tokens' sets [L, T, F], or none: the threshold's
        head = self.project_out is None and (batch.logits is None or len(batch.output_rows()) == T)
        logits = np.empty((T, n_rows(self.lm_head)) if head else (0, 0), F32)
        cpu.decode_step(logits, h, self.step_rows(layers, cache), batch.seqs, batch.positions, self.cos, self.sin,
                        self.eps, sel.threshold, given, bounds, picks, self.acc, self.kind, self.thr,
                        cpu.BLOCKS[self.config.block], self.norm, self.norm_b, self.lm_head)
        return logits if head else None

    def step_rows(self, layers: list, cache: KVCache) -> List:
        """step_layers' arrays with each layer's key and value slots (slot_lists), as one typed list of cpu.StepLayer:
        what cpu.decode_step reads, kept until the cache's arrays or the layers change."""
        kept = self._rows
        if kept is None or kept[0]() is not cache or kept[1] != cache.version or kept[2] is not layers:
            rows = List()
            for parts, slots in zip(layers, self.slot_lists(cache)):
                rows.append(cpu.StepLayer(*parts, *slots))
            kept = self._rows = (weakref.ref(cache), cache.version, layers, rows)
        return kept[3]

    def embed_tokens(self, batch: Batch) -> np.ndarray:
        """The residual stream entering layer 0 (ref.model's embed): embeddings, projected where narrower, plus the
        learned positions where the family has them.  -> [T, D]."""
        h = np.empty((len(batch.tokens), self.config.embed_dim or self.config.d_model), F32)  # [T, W]
        cpu.embed(h, self.embed, batch.tokens)
        if self.project_in is not None:
            h = self.project(h, self.project_in)
        if self.pos_embed is not None:
            h += self.pos_embed[np.asarray(batch.positions) + 2]
        return h

    def project(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T [T, N] with the kernels for T tokens (the embedding's projections, the output head)."""
        out = np.empty((x.shape[0], n_rows(w)), F32)
        self.kernels(*x.shape).matmul(out, x, w)
        return out

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . norm(h) (no norm where the config has none; OPT-350m projects first)."""
        x = np.empty_like(h)
        cpu.norm(x, h, self.norm, self.norm_b, self.eps)
        if self.project_out is not None:
            x = self.project(x, self.project_out)
        return self.project(x, self.lm_head)


def pre_norm_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """LLaMA's block (and OPT's, Falcon-RW's) on the residual stream h [T, D], in place: h += attention(norm(h));
    h += ffn(norm(h))."""
    h += e.attention_block(l, h, batch, cache)
    h += e.ffn_block(l, h)


def post_norm_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """OPT-350m's block: h = norm(h + attention(h)); h = norm(h + ffn(h))."""
    L, eps = e.layers[l], e.eps
    h += e.attention_block(l, h, batch, cache)
    cpu.norm(h, h, L.attn_norm, L.attn_norm_b, eps)
    h += e.ffn_block(l, h)
    cpu.norm(h, h, L.ffn_norm, L.ffn_norm_b, eps)


def parallel_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """Falcon's block: attention and FFN both read the layer input, h += attention(norm(h)) + ffn(norm'(h))."""
    y = e.ffn_block(l, h)
    h += e.attention_block(l, h, batch, cache)
    h += y


BLOCKS = {"pre_norm": pre_norm_block, "post_norm": post_norm_block, "parallel": parallel_block,
          "parallel_shared": parallel_block}


def kernels(run: int, D: int):
    """The kernels of a step whose longest run (one sequence's consecutive tokens) is `run` tokens of width D
    (d_model): fast.cpu's, or where the run (a prompt chunk) reaches blas.MIN_TOKENS and run D blas.MIN_WORK,
    fast.blas's (same contracts). Decided by the run, not the step's tokens: on fast.cpu's kernels a token's result
    is the same bits beside any others and as a prompt's or a decode's, which a GEMM's blocking does not promise, so
    decodes, however many sequences run together, keep that."""
    return blas if run >= blas.MIN_TOKENS and run * D >= blas.MIN_WORK else cpu


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
    # A decode token launches about 130 parallel kernels a few microseconds apart, between which libgomp's workers
    # went to sleep (an empty launch: 5 to 9 us, 1.6 us with workers spinning); spinning up to 300000 times (libgomp's
    # default where it does not throttle) bridges the gaps and still sleeps when idle (0.009 CPU-seconds per idle
    # second either way). libgomp reads it when numba first starts its workers (set_num_threads below); a value in
    # the environment wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")
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
        L.wqkv, L.wo = as_matmul(L.wqkv, fmt), as_matmul(L.wo, fmt)
        L.bundle = for_sparse(as_format(L.bundle, fmt))
        L.gate_up = None if L.gate_up is None else as_matmul(L.gate_up, fmt)
        L.down = None if L.down is None else as_matmul(L.down, fmt)
    engine.embed = as_format(engine.embed, fmt)
    engine.lm_head = (tied_head(engine.embed, fmt) if engine.config.tie_word_embeddings
                      else as_matmul(engine.lm_head, fmt))
    engine.project_in, engine.project_out = (None if w is None else as_matmul(w, fmt)
                                             for w in (engine.project_in, engine.project_out))
    engine.format = fmt
    engine.layers_changed()
    return engine


def dense_ffn(engine: Engine) -> Engine:
    """The dense layout, for an engine without predictors: each layer's gate and up rows as one matrix [2F, D]
    (interleaved groups in q8_0 and q4_0, which fast.cpu.matmul reads at the memory's pace where a neuron's rows
    one by one did not), its bundles reduced to the down rows. TinyLlama's FFN, q4_0, 2 threads: 28 -> 18 ms a
    token. Float formats and non-gated FFNs keep their bundles (their row products are as fast); apply_predictors
    bundles the rows again."""
    if not engine.format.quantized:
        return engine
    for L in engine.layers:
        if L.gate_up is None and L.bundle.shape[1] == 3:
            rows = plain(L.bundle)  # [F, 3, B]
            L.gate_up = for_matmul(rows[:, 0], rows[:, 1])
            L.bundle = np.ascontiguousarray(rows[:, 2:])
    engine.layers_changed()
    return engine


def ffn_rows(L: Layer, fmt: Format) -> list[np.ndarray]:
    """A layer's FFN as plain rows of blocks in whichever layout it has: [gate, up, down^T] (non-gated: [up,
    down^T]), each [F, B]; llama.cpp's ffn_down (blocks along F) quantized again along D in `fmt` (the shipped model
    in q4_0: perplexity +0.07 %)."""
    if L.gate_up is None:
        rows = plain(L.bundle)  # [F, P, B]
        return [rows[:, p] for p in range(rows.shape[1])]
    gu, F = plain(L.gate_up), L.bundle.shape[0]  # [2F, B]
    down_t = L.bundle[:, 0] if L.down is None else as_format(values(plain(L.down)).T, fmt)  # [F, B]
    return [gu[:F], gu[F:], down_t]


def bundled(engine: Engine) -> Engine:
    """Each neuron's rows bundled again (the layout the sparse kernels read), undoing dense_ffn; llama.cpp's ffn_down
    re-laid as PowerInfer's ffn_down_t (ffn_rows)."""
    for L in engine.layers:
        if L.gate_up is not None:
            L.bundle = for_sparse(np.stack(ffn_rows(L, engine.format), axis=1))
            L.gate_up = L.down = None
    engine.layers_changed()
    return engine


def transposed(rows: np.ndarray, fmt: Format, name: str) -> np.ndarray:
    """Plain rows of blocks [N, K / block] as the rows of their transpose [K, N / block] in fmt: the same values in a
    float format, quantized again along N in q8_0 and q4_0 (ref.activation_sparsity.transposed)."""
    return as_format(np.ascontiguousarray(values(rows).T), fmt, name)


def column_norms(wt: np.ndarray) -> np.ndarray:
    """||W[:, i]||_2 from the stored transpose's rows, in float64 as ref's (WINA's score weights).  -> [K]."""
    v = values(wt).astype(np.float64)
    return np.sqrt((v * v).sum(1)).astype(F32)


def apply_sparsity(engine: Engine, method: str, cut: np.ndarray, ffn: bool = True) -> Engine:
    """Training-free activation sparsity (ref.activation_sparsity.apply_sparsity) with thresholds cut [L, 4]: the
    attention's matrices, and for TEAL and WINA the FFN's where `ffn` (not beside predictors), stored transposed and
    read input-sparse; CATS's FFN as neuron bundles whose kind skips a neuron by its gate's activation (cpu.CATS)."""
    c, fmt = engine.config, engine.format
    cats = method == "cats" and ffn
    if cats:
        if c.ffn_kind == "fatrelu":
            raise UserError("--sparsity-method cats: a FATReLU FFN has a threshold of its own; use teal or wina")
        bundled(engine)
    for l, L in enumerate(engine.layers):
        L.wqkv_t = transposed(plain(L.wqkv), fmt, f"layers.{l}.wqkv")
        L.wo_t = transposed(plain(L.wo), fmt, f"layers.{l}.wo")
        L.wqkv = L.wo = None
        sites = [L.wqkv_t, L.wo_t]
        t = np.array(cut[l], F32)
        if ffn and not cats:
            *gate_up, down_t = ffn_rows(L, fmt)
            L.gate_up_t = transposed(np.concatenate(gate_up), fmt, f"layers.{l}.gate_up")
            L.bundle, L.gate_up, L.down = np.ascontiguousarray(down_t[:, None]), None, None  # [F, 1, B]
            sites += [L.gate_up_t, down_t]
        elif not cats:
            t[2:] = np.inf  # the predictors' FFN: no site of it thinned
        widths = site_widths(c)
        w = [column_norms(m) if method == "wina" else np.ones(n, F32) for m, n in zip(sites, widths)]
        L.thin = Thin(tuple(w + [np.ones(n, F32) for n in widths[len(w):]]), t, cats)
    engine.layers_changed()
    return engine


def apply_predictors(engine: Engine, predictors, threshold: float | None = None, fmt: Format | None = None) -> Engine:
    """Predictor-gated sparse FFN, from a predictors file or loaded `Predictors` (the stored threshold unless given),
    their weights stored in `fmt` if given (--predictor-type)."""
    pred, threshold = sparse.resolve_predictors(engine.config, predictors, threshold)
    bundled(engine)
    engine.selector = Selector(engine.config.d_ffn, pred if fmt is None else quantize_predictors(pred, fmt), threshold)
    return engine
