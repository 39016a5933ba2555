"""A block's attention and FFN as named variants: one dataclass per layout, holding its arrays in kernel layout and
running its CPU call. A transform replaces a layer's variant (fast.engine's convert, dense_ffn, bundled,
apply_activation_sparsity); the engine calls whichever the layer holds and never asks which it is. fast.hybrid keeps
each variant's GPU half (hybrid.GPU_FFN).

    attention   Fused          q, k, v as one matrix [q | k | v], then o (fast.cpu.matmul's layout)
                Thinned        activation sparsity (TEAL, WINA): q, k, v and o stored transposed, read input-sparse
    FFN         Bundles        each neuron's rows together, the sparse kernels over the selector's sets (predictors;
                               without, every neuron)
                CatsBundles    Bundles skipping a neuron by its gate's activation (CATS)
                Dense          every neuron: [gate | up] as one matmul, then the down rows (q8_0, q4_0, no predictors)
                StoredDown     llama.cpp's ffn_down as stored (blocks along F): [gate | up], then down, dense
                ThinnedFFN     activation sparsity (TEAL, WINA): [gate | up] and down stored transposed, input-sparse

A mixture of experts is one more FFN variant: its router's matrix and its experts, each an FFN variant above, its
forward sending each token to its top experts.

Dimensions: T tokens, D d_model, F FFN neurons, P rows of a bundle, H/K query/key-value heads, E head dim, B blocks
of a row.
"""

from dataclasses import dataclass, field, replace

import numpy as np

from fast import cpu
from fast.quant import for_matmul, for_sparse, n_rows, plain
from ref.quant import blocks, quantize, values

F32 = np.float32
EMPTY = np.zeros(0, F32)  # an absent norm or bias, as the kernels take it (fast.cpu.norm, add_bias)
NO_NORMS = np.zeros((0, 0), F32)  # cpu.qk_norm's norms where the family has none
NO_PICKS = np.zeros((0, 0), np.uint8)  # cpu.ffn_batch_block's sets by the predictor's threshold
# Tokens per batched FFN call. As GEMMs (chunks that `kernels` sends to BLAS, before GEMM_SHARE), a chunk gained more
# than the union of its sets cost: TinyLlama pp512 at 90% sparsity, chunks of 128 / 256 / 512: 69 / 81 / 87 tok/s
# (f32), 58 / 74 / 82 (q4_0).
FFN_CHUNK = 512
# A chunk's FFN runs as GEMMs (kernels) only where its tokens compute at least this share of the union's
# (token, neuron) pairs; below, fast.cpu's kernel computes each token's own neurons only. Measured crossover, 512
# tokens, TinyLlama's FFN, random sets: 0.2 (f32) to 0.33 (q4_0); at 0.1, fast.cpu took 68 / 64 / 85 ms against the
# GEMMs' 213 / 219 / 180 (q8_0 / q4_0 / f32).
GEMM_SHARE = 0.25


def empty():
    return field(default_factory=lambda: EMPTY)


def as_format(t, fmt, name: str = "tensor") -> np.ndarray:
    """A stored tensor, or rows of blocks, as rows of fmt's blocks: itself (a view) where it is in fmt already."""
    b = plain(t) if isinstance(t, np.ndarray) and t.dtype.names else blocks(t)
    return b if b.dtype == fmt.dtype else blocks(quantize(values(b), fmt, name))


def as_matmul(t, fmt, name: str = "tensor") -> np.ndarray:
    """A matrix in fmt, laid out for fast.cpu.matmul (for_matmul: q8_0/q4_0 rows interleaved)."""
    return for_matmul(as_format(t, fmt, name))


def transposed(rows: np.ndarray, fmt, name: str) -> np.ndarray:
    """Plain rows of blocks [N, K / block] as the rows of their transpose [K, N / block] in fmt: the same values in a
    float format, quantized again along N in q8_0 and q4_0 (ref.activation_sparsity.transposed)."""
    return as_format(np.ascontiguousarray(values(rows).T), fmt, name)


@dataclass
class Thin:
    """A layer's activation sparsity (ref.activation_sparsity): per site (attn_in, attn_out, ffn_in, ffn_hidden) the
    score weights w (TEAL: ones; WINA: the weight columns' norms) and the threshold t, an input kept where |x| w > t."""

    w: tuple[np.ndarray, ...]  # [D], [H E], [D], [F]
    t: np.ndarray  # [4] float32

    def inputs(self, out: np.ndarray, ids: np.ndarray, x: np.ndarray, site: int) -> int:
        """out = x * (|x| w > t) at `site` (cpu.thin): ids[:n] the inputs some token keeps.  -> n."""
        return cpu.thin(out, ids, x, self.w[site], self.t[site])

    def activations(self, a: np.ndarray, ids: np.ndarray, gu: np.ndarray, bu: np.ndarray, kind: int, thr) -> int:
        """a = thin(a(g, u)) at ffn_hidden (cpu.thin_activations).  -> n."""
        return cpu.thin_activations(a, ids, gu, bu, kind, thr, self.w[3], self.t[3])


def normed(e, h: np.ndarray, w, b) -> np.ndarray:
    """norm(h) [T, D] with a block's norm weights w, b (EMPTY: none; cpu.norm)."""
    x = np.empty_like(h)
    cpu.norm(x, h, w, b, e.eps)
    return x


def gate_up(e, x: np.ndarray, matrix: np.ndarray):
    """([g | u] = x [Wg | Wu]^T [T, 2F], the kernels that ran it) for a dense FFN's one matrix (Dense, StoredDown)."""
    gu, k = np.empty((x.shape[0], n_rows(matrix)), F32), e.kernels(*x.shape)
    k.matmul(gu, x, matrix)
    return gu, k


def thinned_product(e, out: np.ndarray, x: np.ndarray, wt: np.ndarray, thin: Thin, site: int) -> None:
    """out = W thin(x) per token (site's weights and threshold), reading the rows of the stored transpose wt [K, N]
    that some token keeps (fast.cpu.sparse_rows; in BLAS for steps that the engine `e` sends there).
    out: [T, N]; x: [T, K]."""
    T, K = x.shape
    xt, ids = np.empty_like(x), np.empty(K, np.int32)
    n = thin.inputs(xt, ids, x, site)
    e.kernels(T, K).sparse_rows(out, np.empty((len(e.acc), T, out.shape[1]), F32), xt, wt, ids, n)


# --- attention ------------------------------------------------------------------------------------------------------

@dataclass
class Fused:
    """Attention with q, k, v as one matrix; each head's q and k normed where the family says so (Qwen3)."""

    wqkv: np.ndarray  # [(H + 2K) E, D]: all q rows, then k, then v
    wo: np.ndarray  # [D, H E]
    bqkv: np.ndarray = empty()  # [(H + 2K) E]
    bo: np.ndarray = empty()  # [D]
    qk_norms: np.ndarray = field(default_factory=lambda: NO_NORMS)  # [2, E]
    thin = None  # no site thinned (fast.gpu.attention_block's `thin`)
    steps = True  # cpu.decode_step runs it

    def forward(self, e, l: int, h: np.ndarray, w, b, batch, cache) -> np.ndarray:
        """attention(norm(h)) [T, D] (w, b the norm's). One short run (a decode step), or one token of each of several
        sequences, in one compiled call where `e.kernels` keeps the step on fast.cpu; otherwise the projections read
        each weight row once for all tokens, the attention runs per sequence (Engine.attend)."""
        out, runs, T = np.empty_like(h), batch.runs(), h.shape[0]
        k = e.kernels(T, h.shape[1])
        if len(runs) == 1 and k is cpu:
            seq = runs[0][0]
            cpu.attention_block(out, h, w, b, self.wqkv, self.bqkv, self.qk_norms, self.wo, self.bo, cache.k[l][seq],
                                cache.v[l][seq], e.cos, e.sin, batch.positions[0], e.eps)
            return out
        if len(runs) == T and k is cpu:  # one new token per sequence
            k_caches, v_caches = e.slot_lists(cache)[l]
            cpu.decode_attention_block(out, h, w, b, self.wqkv, self.bqkv, self.qk_norms, self.wo, self.bo, k_caches,
                                       v_caches, batch.seqs, batch.positions, e.cos, e.sin, e.eps)
            return out
        qkv = np.empty((T, n_rows(self.wqkv)), F32)  # [T, (H + 2K) E]
        k.qkv_proj(qkv, h, w, b, self.wqkv, self.bqkv, e.eps)
        att = e.attend(l, self.qk_norms, qkv, batch, cache)  # [T, H E]
        k.matmul(out, att, self.wo)
        cpu.add_bias(out, self.bo)
        return out

    def convert(self, fmt) -> "Fused":
        return replace(self, wqkv=as_matmul(self.wqkv, fmt), wo=as_matmul(self.wo, fmt))

    def thinned(self, fmt, l: int, thin: Thin) -> "Thinned":
        return Thinned(wqkv=transposed(plain(self.wqkv), fmt, f"layers.{l}.wqkv"),
                       wo=transposed(plain(self.wo), fmt, f"layers.{l}.wo"), thin=thin, bqkv=self.bqkv, bo=self.bo,
                       qk_norms=self.qk_norms)

    def nbytes(self, kept: float = 1.0) -> float:
        """Bytes a token reads (bench.bytes_per_token)."""
        return self.wqkv.nbytes + self.wo.nbytes

    def step_fields(self) -> dict:
        """Its fields of cpu.StepLayer."""
        return dict(wqkv=self.wqkv, bqkv=self.bqkv, qk_norms=self.qk_norms, wo=self.wo, bo=self.bo)


@dataclass
class Thinned:
    """Attention with activation sparsity: the normed input and the attention's output thinned (sites attn_in and
    attn_out), each product reading only the rows of its stored transpose that some token keeps."""

    wqkv: np.ndarray  # [D, (H + 2K) E] the transpose of Fused's
    wo: np.ndarray  # [H E, D]
    thin: Thin
    bqkv: np.ndarray = empty()
    bo: np.ndarray = empty()
    qk_norms: np.ndarray = field(default_factory=lambda: NO_NORMS)
    steps = False

    def forward(self, e, l: int, h: np.ndarray, w, b, batch, cache) -> np.ndarray:
        c, T, x = e.config, h.shape[0], normed(e, h, w, b)
        qkv = np.empty((T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), F32)  # [T, (H + 2K) E]
        thinned_product(e, qkv, x, self.wqkv, self.thin, 0)
        cpu.add_bias(qkv, self.bqkv)
        att = e.attend(l, self.qk_norms, qkv, batch, cache)  # [T, H E]
        out = np.empty_like(h)
        thinned_product(e, out, att, self.wo, self.thin, 1)
        cpu.add_bias(out, self.bo)
        return out

    def convert(self, fmt) -> "Thinned":
        return replace(self, wqkv=as_format(self.wqkv, fmt), wo=as_format(self.wo, fmt))

    def nbytes(self, kept: float = 1.0) -> float:
        return kept * (self.wqkv.nbytes + self.wo.nbytes)


# --- FFN ------------------------------------------------------------------------------------------------------------

class FFN:
    """What every FFN variant answers; forward(e, l, h, w, b) -> y [T, D] = the FFN of norm(h) (w, b the norm's)."""

    steps = False  # whether cpu.decode_step runs it

    def kind(self, e) -> tuple[int, float]:
        """The (kind, threshold) its neurons' activation is computed with (cpu.KINDS)."""
        return e.kind, e.thr

    def bundled(self, fmt) -> "Bundles":
        """The same neurons as bundles (the layout the sparse kernels read)."""
        return Bundles(bundle=for_sparse(np.stack(self.rows(fmt), axis=1)), bu=self.bu, bd=self.bd)

    def dense(self) -> "FFN":
        """The layout for every neuron at once (dense_ffn): itself where no other is faster."""
        return self


@dataclass
class Bundles(FFN):
    """Neuron bundles: row i = (gate_i, up_i, down[:, i]) (non-gated: (up_i, down[:, i]), the down matrix transposed
    as PowerInfer's ffn_down_t), q8_0 / q4_0 rows in runs (for_sparse); each token computes the neurons the engine's
    selector picks."""

    bundle: np.ndarray  # [F, P, B]
    bu: np.ndarray = empty()  # [F] the up rows' bias (non-gated)
    bd: np.ndarray = empty()  # [D] the down matrix's bias
    steps = True

    def forward(self, e, l: int, h: np.ndarray, w, b) -> np.ndarray:
        """y = sum over the active set of a_i Wd[:, i] + bd, the set chosen per token by the selector.

        One token: the fused decode kernel. Several (a prompt, or one token of each of several sequences): one
        chunk that `e.kernels` keeps on fast.cpu, its sets the predictor's threshold (or drawn ahead), as one
        compiled call (ffn_batch_block); else per chunk of FFN_CHUNK tokens, each neuron of the union of their sets
        read once for all of them, each token computing only its own (in BLAS for chunks that `e.kernels` sends there
        and that compute GEMM_SHARE of the union's pairs)."""
        y, T, sel = np.empty_like(h), h.shape[0], e.selector
        kind, thr = self.kind(e)
        if T == 1:
            active = e.active_set(l, h[0])
            cpu.ffn_block(y[0], e.acc, h[0], w, b, self.bundle, self.bu, self.bd, active, len(active), kind, thr, e.eps)
            return y
        if e.ffn_in_one_call(h):
            given = np.ascontiguousarray(sel.pick_rows(l, None, T), np.uint8) if sel.ahead else NO_PICKS
            cpu.ffn_batch_block(y, h, w, b, sel.fc1[l], sel.fc2[l], sel.threshold, given, self.bundle, self.bu, self.bd,
                                len(e.acc), kind, thr, e.eps)
            return y
        x = normed(e, h, w, b)
        for t0 in range(0, T, FFN_CHUNK):
            n = min(FFN_CHUNK, T - t0)
            union, mask = e.active_sets(l, h[t0:t0 + n])
            pairs = mask[:, :len(union)]  # [n, U]: the defined columns
            k = cpu if np.count_nonzero(pairs) < GEMM_SHARE * pairs.size else e.kernels(n, h.shape[1])
            k.sparse_ffn_batch(y[t0:t0 + n], np.empty((len(e.acc), n, h.shape[1]), F32), x[t0:t0 + n], self.bundle,
                               self.bu, union, len(union), mask, kind, thr)
        cpu.add_bias(y, self.bd)
        return y

    def rows(self, fmt) -> list[np.ndarray]:
        """[gate, up, down^T] (non-gated [up, down^T]) as plain rows of blocks, each [F, B]."""
        rows = plain(self.bundle)  # [F, P, B]
        return [rows[:, p] for p in range(rows.shape[1])]

    def convert(self, fmt) -> "Bundles":
        return replace(self, bundle=for_sparse(as_format(self.bundle, fmt)))

    def bundled(self, fmt) -> "Bundles":
        return self

    def dense(self) -> FFN:
        """Dense where gated (non-gated bundles read as fast as their rows)."""
        if self.bundle.shape[1] != 3:
            return self
        rows = plain(self.bundle)  # [F, 3, B]
        return Dense(gate_up=for_matmul(rows[:, 0], rows[:, 1]), down=np.ascontiguousarray(rows[:, 2]), bu=self.bu,
                     bd=self.bd)

    def nbytes(self, active: float = 1.0, kept: float = 1.0) -> float:
        """Bytes a token reads of an `active` share of its neurons (bench.bytes_per_token)."""
        return active * self.bundle.nbytes

    def step_fields(self) -> dict:
        """Its fields of cpu.StepLayer."""
        return dict(bundle=self.bundle, bu=self.bu, bd=self.bd)


@dataclass
class CatsBundles(Bundles):
    """Bundles whose neurons are skipped by CATS's criterion, |f(g)| <= the layer's ffn_hidden threshold (cpu.CATS),
    beside any selector's sets."""

    thin: Thin = None
    steps = False

    def kind(self, e) -> tuple[int, float]:
        return e.kind + cpu.CATS, self.thin.t[3]

    def dense(self) -> FFN:
        return self


@dataclass
class Dense(FFN):
    """Every neuron: [g | u] = x [Wg | Wu]^T as one matmul (interleaved groups in q8_0 and q4_0, which
    fast.cpu.matmul reads at the memory's pace), then y = sum_i a_i Wd[:, i] over the down rows (dense_down); one
    token's as one compiled call."""

    gate_up: np.ndarray  # [2F, D] the gate rows, then the up rows
    down: np.ndarray  # [F, B] the down matrix's columns as rows
    bu: np.ndarray = empty()
    bd: np.ndarray = empty()

    def forward(self, e, l: int, h: np.ndarray, w, b) -> np.ndarray:
        y, T = np.empty_like(h), h.shape[0]
        if T == 1:
            cpu.dense_ffn_block(y[0], e.acc, h[0], w, b, self.gate_up, self.down, self.bd, e.kind, e.thr, e.eps)
            return y
        gu, k = gate_up(e, normed(e, h, w, b), self.gate_up)  # [T, 2F]
        k.dense_down(y, np.empty((len(e.acc), T, h.shape[1]), F32), gu, self.down, e.kind, e.thr)
        cpu.add_bias(y, self.bd)
        return y

    def rows(self, fmt) -> list[np.ndarray]:
        gu, F = plain(self.gate_up), self.down.shape[0]  # [2F, B]
        return [gu[:F], gu[F:], self.down]

    def convert(self, fmt) -> "Dense":
        return replace(self, gate_up=as_matmul(self.gate_up, fmt), down=as_format(self.down, fmt))

    def nbytes(self, active: float = 1.0, kept: float = 1.0) -> float:
        return active * (self.gate_up.nbytes + self.down.nbytes)


@dataclass
class StoredDown(FFN):
    """llama.cpp's quantized ffn_down as stored (blocks along F): y = Wd a(g, u) + bd, [g | u] = x [Wg | Wu]^T, both
    as matmuls over every neuron."""

    gate_up: np.ndarray  # [2F, D]
    down: np.ndarray  # [D, F]
    bu: np.ndarray = empty()
    bd: np.ndarray = empty()

    def forward(self, e, l: int, h: np.ndarray, w, b) -> np.ndarray:
        y, T = np.empty_like(h), h.shape[0]
        gu, k = gate_up(e, normed(e, h, w, b), self.gate_up)  # [T, 2F]
        a = np.empty((T, gu.shape[1] // 2), F32)  # [T, F]
        cpu.activations(a, gu, e.kind, e.thr)
        k.matmul(y, a, self.down)
        cpu.add_bias(y, self.bd)
        return y

    def rows(self, fmt) -> list[np.ndarray]:
        """ffn_down quantized again along D in `fmt` (the shipped model in q4_0: perplexity +0.07 %)."""
        gu = plain(self.gate_up)  # [2F, B]
        F = gu.shape[0] // 2
        return [gu[:F], gu[F:], as_format(values(plain(self.down)).T, fmt)]

    def convert(self, fmt) -> "StoredDown":
        return replace(self, gate_up=as_matmul(self.gate_up, fmt), down=as_matmul(self.down, fmt))

    def nbytes(self, active: float = 1.0, kept: float = 1.0) -> float:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class ThinnedFFN(FFN):
    """Activation sparsity (TEAL, WINA): y = Wd thin(a(g, u)) + bd, [g | u] = [Wg | Wu] thin(x) (sites ffn_in and
    ffn_hidden), each product reading the rows of its stored transpose that some token keeps."""

    gate_up_t: np.ndarray  # [D, 2F] (non-gated: [D, F], the up columns)
    down_t: np.ndarray  # [F, B] the down matrix's columns as rows
    thin: Thin
    bu: np.ndarray = empty()
    bd: np.ndarray = empty()

    def forward(self, e, l: int, h: np.ndarray, w, b) -> np.ndarray:
        y, T, F = np.empty_like(h), h.shape[0], self.down_t.shape[0]
        x = normed(e, h, w, b)
        gu = np.empty((T, F * (2 if e.config.gated else 1)), F32)  # [T, 2F]
        thinned_product(e, gu, x, self.gate_up_t, self.thin, 2)
        a, ids = np.empty((T, F), F32), np.empty(F, np.int32)
        n = self.thin.activations(a, ids, gu, self.bu, e.kind, e.thr)
        e.kernels(T, h.shape[1]).sparse_rows(y, np.empty((len(e.acc), T, h.shape[1]), F32), a, self.down_t, ids, n)
        cpu.add_bias(y, self.bd)
        return y

    def convert(self, fmt) -> "ThinnedFFN":
        return replace(self, gate_up_t=as_format(self.gate_up_t, fmt), down_t=as_format(self.down_t, fmt))

    def bundled(self, fmt) -> "ThinnedFFN":
        return self  # its input is read whole: no neuron bundles to split

    def nbytes(self, active: float = 1.0, kept: float = 1.0) -> float:
        return kept * (self.gate_up_t.nbytes + self.down_t.nbytes)


@dataclass
class Layer:
    """One block: its norms (float32; EMPTY where the family has none; post-norm blocks keep the norms applied after
    each residual add in attn_norm and ffn_norm) and its attention's and FFN's variants."""

    attn_norm: np.ndarray  # [D]
    attn_norm_b: np.ndarray  # [D] LayerNorm's bias
    ffn_norm: np.ndarray  # [D] (EMPTY where the FFN shares attention's)
    ffn_norm_b: np.ndarray  # [D]
    attn: Fused | Thinned
    ffn: FFN  # Bundles, CatsBundles, Dense, StoredDown or ThinnedFFN
