"""Kernels for many tokens at once (a prompt chunk) through numpy's BLAS, with fast.cpu's contracts name for name.

Where a step has enough tokens, a product is compute-bound and a BLAS GEMM wins: on 2 cores here OpenBLAS's sgemm
ran x [64, 2048] @ W.T [2048, 5632] at 199 GFLOPS and [512, ...] at 318, fast.cpu.matmul (row dot products, bound
by its loads) at 66 and 90; at 8 tokens fast.cpu won (85 vs 50 GFLOPS). So the engine runs a step whose longest
run (a prompt chunk) has at least `MIN_TOKENS` tokens (and `MIN_WORK` tokens x d_model) with these kernels, others
with fast.cpu's, and the server none (engine.kernels: a GEMM's sums for a row depend on the rows beside it). Since then fast.cpu
gained 4 x 4 tiles for float products and int8 kernels for q8_0/q4_0, so `matmul` hands a float product of fewer
than GEMM_TOKENS tokens, and every q8_0/q4_0 one, back to fast.cpu (and the engine keeps a sparse chunk's FFN there,
fast.layers.GEMM_SHARE). Weights in another format than float32 are decoded to float32 first (`fast.cpu.gather_values`:
only the rows used, a neuron bundle's union rows), and a q8_0 or q4_0 product reads its input rounded to Q8_0 as ref
defines (`fast.cpu.round_q8_0`); sums then run in float32 in BLAS's order.

Threads: BLAS runs single-threaded, and each product is split into -t parts (rows of its tokens, or kv heads) run on
a pool of Python threads (numpy releases the GIL). OpenBLAS's own workers spin after each call and took the cores
from numba's next kernel: a Q8_0 rounding of [512, 2048] ran in 0.56 ms alone and 2.83 ms right after a GEMM.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, U neurons of a chunk's union, H/K query/key-value
heads, E head dim, N output rows, K inputs, R predictor hidden size.
"""

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from fast import cpu
from fast.quant import layout_of
from ref.quant import values

F32 = np.float32
MIN_TOKENS = 32  # tokens from which a step's products run here (measured crossover: between 8 and 64)
# ... and a run's tokens x d_model from which they do: a narrow model's products are too small for the pool and the
# decoded copies to pay. The shipped model (d_model 256, f16), fast.cpu's kernels against these: one sequence's 64 /
# 128 / 256-token prompt 6.8 / 15.5 / 39.5 ms against 9.8 / 21.5 / 40.0. TinyLlama's crossover (32 tokens of 2048)
# is this product too.
MIN_WORK = 32 * 2048
# Tokens from which a float matrix's product is a GEMM here rather than fast.cpu.matmul's 4 x 4 tiles: on 2 cores,
# f32 [T, 2048] x [2048, 5632] at 32 / 144 / 512 tokens ran at 152 / 124 / 91 GFLOPS in fast.cpu, 73 / 174 / 245 in
# sgemm; f16, decoded first, 27 / 115 / 206. q8_0 and q4_0 products stay in fast.cpu at every size: its int8 products
# beat decoding to float32 (a q8_0 [512, 2048] x [2048, 5632]: 225 against 106 GFLOPS).
GEMM_TOKENS = 128
# A float32 chunk's FFN reads the whole bundle in place (no gathered copy of the union), its outside neurons masked,
# when the outside's extra products cost less than the copy: (F - U) 6 D T flops at ~300 GFLOPS against U 24 D bytes
# copied at ~20 GB/s, i.e. (F - U) T < 60 U.
IN_PLACE = 60
# Queries per block of a chunk's attention: a block's scores stop at its last query's position, so that a prompt's
# GEMMs and exponentials cover the causal triangle (and the blocks' diagonals) instead of the square, and a block's
# scores (K x 8 x 128 x S floats at TinyLlama's heads) stay nearer the cache. TinyLlama's heads, 512 queries, 2
# threads: 43 to 48 ms a layer in one block, 25 to 29 with blocks of 256, 25 with 128 or 64; 512 queries after 512
# cached positions: 70, 64, 57, 65.
QUERY_BLOCK = 128


_pool: list = [None, 0]  # the executor and its thread count


def split(fn, n: int) -> None:
    """fn(i, n) for i < n parts, on the pool's threads (one per numba thread: -t)."""
    if n <= 1:
        fn(0, 1)
        return
    if _pool[1] != n:
        if _pool[0] is not None:
            _pool[0].shutdown()
        _pool[:] = [ThreadPoolExecutor(n, thread_name_prefix="blas"), n]
    for f in [_pool[0].submit(fn, i, n) for i in range(n)]:
        f.result()


def gemm(out, a, b) -> None:
    """out = a @ b, the rows of a (tokens) split among the threads.  out: [T, N]; a: [T, K]; b: [K, N]."""
    T = a.shape[0]

    def part(i, n):
        lo, hi = i * T // n, (i + 1) * T // n
        np.matmul(a[lo:hi], b, out=out[lo:hi])
    split(part, min(numba.get_num_threads(), T))


def dense(w: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """Rows of w (all, or `ids`) as float32 values [n, ..., K]; a float32 matrix's rows as they are."""
    lay = layout_of(w)
    if lay.format.name == "f32":
        return w if ids is None else w[ids]
    w3 = w.reshape(w.shape[0], -1, w.shape[-1])  # [N, P, K / block]
    ids = np.arange(w.shape[0], dtype=np.int32) if ids is None else ids
    out = np.empty((len(ids), w3.shape[1], w.shape[-1] * lay.elements), F32)  # [n, P, K]
    cpu.gather_values(out, w3, ids, len(ids))
    return out.reshape((len(ids), *w.shape[1:-1], out.shape[-1]))


def inputs(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] as a product with w reads it."""
    if not layout_of(w).format.quantized:
        return x
    out = np.empty_like(x)
    cpu.round_q8_0(out, x)
    return out


def matmul(out, x, w):
    """Same contract as fast.cpu.matmul: out = x @ w.T.  out: [T, N], x: [T, K], w: [N, K] rows of blocks; run by
    fast.cpu.matmul itself for q8_0 and q4_0 and below GEMM_TOKENS tokens."""
    if layout_of(w).format.quantized or x.shape[0] < GEMM_TOKENS:
        cpu.matmul(out, x, w)
        return
    gemm(out, inputs(x, w), dense(w).T)


def qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps):
    """Same contract as fast.cpu.qkv_proj."""
    x = np.empty_like(h)
    cpu.norm(x, h, attn_norm, attn_norm_b, eps)
    matmul(qkv, x, wqkv)
    cpu.add_bias(qkv, bqkv)


def attention(out, q, k, v, pos0):
    """Same contract as fast.cpu.attention: causal softmax(q k^T / sqrt(E)) v per head, query head h reading kv
    head h // (H / K), query t at position pos0 + t.  out, q: [T, H, E]; k, v: [K, S, E / block] (head-major, in a
    KV format: decoded once per call).

    Per block of QUERY_BLOCK queries and per kv head, one GEMM for its group's queries against the keys the block
    sees (none after its last query's position: the causal triangle's far side is never computed), the causal
    softmax in place (numba's exp is scalar, numpy's vectorised: 0.65 vs 0.2 s of a TinyLlama pp512), one GEMM with
    the values."""
    T, H, E = q.shape
    K = k.shape[0]
    G = H // K
    k, v = floats(k), floats(v)  # [K, S, E] float32
    heads = (lambda fn: split(lambda i, n: [fn(h) for h in range(i * K // n, (i + 1) * K // n)],
                              min(numba.get_num_threads(), K)))
    for t0 in range(0, T, QUERY_BLOCK):
        n, S = min(QUERY_BLOCK, T - t0), min(k.shape[1], pos0 + t0 + QUERY_BLOCK)  # queries, keys they see
        qg = np.ascontiguousarray(q[t0:t0 + n].reshape(n, K, G, E).transpose(1, 2, 0, 3)).reshape(K, G * n, E)
        s = np.empty((K, G * n, S), F32)  # row g n + t
        o = np.empty((K, G * n, E), F32)
        heads(lambda h: np.matmul(qg[h], k[h, :S].T, out=s[h]))
        cpu.causal_logits(s, n, pos0 + t0, F32(1 / np.sqrt(E)))
        heads(lambda h: np.exp(s[h], out=s[h]))
        cpu.normalize_rows(s)
        heads(lambda h: np.matmul(s[h], v[h, :S], out=o[h]))
        out[t0:t0 + n] = o.reshape(K, G, n, E).transpose(2, 0, 1, 3).reshape(n, H, E)


def self_attention(att, qkv, k_cache, v_cache, cos, sin, pos0):
    """Same contract as fast.cpu.self_attention."""
    T = qkv.shape[0]
    K, E = k_cache.shape[0], 2 * cos.shape[1]  # the head dim from the rope tables (a q8_0 slot holds E / 32)
    H = qkv.shape[1] // E - 2 * K
    q = np.ascontiguousarray(qkv[:, : H * E]).reshape(T, H, E)  # [T, H, E]
    k = np.ascontiguousarray(qkv[:, H * E:(H + K) * E]).reshape(T, K, E)  # [T, K, E]
    cpu.rope(q, q, cos, sin, pos0)
    cpu.rope(k, k, cos, sin, pos0)
    cpu.store_kv(k_cache, k, pos0)
    cpu.store_kv(v_cache, np.ascontiguousarray(qkv[:, (H + K) * E:]).reshape(T, K, E), pos0)
    out = np.empty((T, H, E), F32)
    attention(out, q, k_cache[:, : pos0 + T], v_cache[:, : pos0 + T], pos0)
    att[:] = out.reshape(T, H * E)


def floats(slot: np.ndarray) -> np.ndarray:
    """A slot's keys or values [K, S, E] as float32 (decoded from f16, bf16 or q8_0: once per prompt chunk)."""
    return slot if slot.dtype == F32 else values(slot)


def predictor(out, hidden, h, fc1, fc2):
    """Same contract as fast.cpu.predictor: out = fc2 . relu(fc1 . h) per token."""
    matmul(hidden, h, fc1)
    np.maximum(hidden, 0, out=hidden)
    matmul(out, hidden, fc2)


def sparse_ffn_batch(out, acc, x, bundle, bias, active, n_active, mask, kind, thr):
    """Same contract as fast.cpu.sparse_ffn_batch (acc unused): the union's bundles decoded once (a float32 model's
    whole bundle read in place, the outside masked, when the union is nearly all of it: IN_PLACE), then a GEMM per
    row of the bundle with each token's activations masked to its own set: out = (mask * a(g, u)) Wd_U, with
    g, u = x Wg_U^T, x Wu_U^T (gated) or x Wu_U^T + bu_U, 1."""
    F, T, P = bundle.shape[0], x.shape[0], bundle.shape[1]
    ids = active[:n_active]
    if bundle.dtype == F32 and (F - n_active) * T < IN_PLACE * n_active:
        b = bundle  # [F, P, D]: strided views are BLAS operands as they are; the neurons outside the union masked
        whole = np.zeros((T, F), np.uint8)
        whole[:, ids] = mask[:, :n_active]
        mask = whole
        ids = slice(None)
    else:
        b = dense(bundle, ids)  # [U, P, D]
    xin = inputs(x, bundle)  # [T, D]
    g = np.empty((T, b.shape[0]), F32)  # [T, U]
    gemm(g, xin, b[:, 0, :].T)
    if bias.size:
        g += bias[ids]
    if P == 3:
        u = np.empty_like(g)
        gemm(u, xin, b[:, 1, :].T)
    else:
        u = np.ones_like(g)
    cpu.masked_activation(g, g, u, mask, kind, thr)
    gemm(out, g, b[:, P - 1, :])


def sparse_rows(out, acc, x, wt, ids, n):
    """Same contract as fast.cpu.sparse_rows (acc unused): the rows of the kept inputs decoded once, then one GEMM,
    out = x[:, ids] W^T[ids]."""
    if n == 0:
        out[:] = 0
        return
    kept = ids[:n]
    gemm(out, np.ascontiguousarray(x[:, kept]), dense(wt, kept))


def dense_down(out, acc, gu, down, kind, thr):
    """Same contract as fast.cpu.dense_down (acc unused): the down rows decoded once, then one GEMM,
    out = a(g, u) Wd."""
    T, F = gu.shape[0], down.shape[0]
    a = np.empty((T, F), F32)
    cpu.masked_activation(a, gu[:, :F], gu[:, F:], np.ones((T, F), np.uint8), kind, thr)  # every pair
    gemm(out, a, dense(down))
