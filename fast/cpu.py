"""CPU kernels (numba); outputs first in every signature. Each computes a ref function, under its name where ref has
one, or composes several (docs/design.md, "What mirrors what").

Parallel loops are race-free by construction: each `prange` iteration writes only its own rows or its own
private accumulator, and any reduction over workers is a separate loop (stumpy's rule). Work is cut into a
fixed number of chunks, not per thread, so results are bit-identical from run to run.

STREAMS: the weight kernels split each chunk's rows (or neurons) into four equal quarters and step through them
together, so a worker reads four long forward streams, as the read probe does, instead of a few adjacent rows.
With two cores the kernels are bound by the reads one core keeps in flight, not by the bus, whenever the bus is
fast; there, side by side against adjacent rows (median of 600+ interleaved calls): matmul +4 %, sparse_ffn +10 %
over all neurons and +10 % over a 10 % set. When the bus is slow all variants match the probe.

FORMATS: the weight kernels read rows in every format of ref.common.formats (its `dtype`: float32, f16 and bf16 bits
as uint16 records, q8_0 and q4_0 blocks) through the row operations of `fast.quant` (dot4, dot, axpy4, axpy, and
quantize_input for the token), which numba resolves per format when it compiles the kernel; everything else is
float32.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
N output rows, R predictor hidden size, C accumulator chunks.
"""

import math
from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from fast import kernel_cache
from fast.quant import (BLOCK, ROWS, axpy, axpy2t, axpy4, axpy4t, block_dot8, block_dot8_4t, block_dot8x2_4t,
                        block_dot8x4, dot, dot2, dot2_2t, dot2_4t, dot2t, dot4, dot4_ahead, dot4t, dot4x4, f16_round,
                        hints_ahead, interleaved, is_float, load, n_rows, prefetch_span, q8_0_block, quantize_input)

kernel_cache.install()

# One layer of a decode step as cpu.decode_step reads it (fast.engine.Engine.step_rows builds a typed list of them):
# the norms' weights and biases before attention, before the FFN, after attention and after the FFN (EMPTY where the
# block has none), the matrices and biases, the predictor (fc1, fc2: no rows where there is none), and the layer's
# key and value slots (typed lists: [seq] -> [room, K, E]).
StepLayer = namedtuple("StepLayer", ["attn_w", "attn_b", "ffn_w", "ffn_b", "post_attn_w", "post_attn_b", "post_ffn_w",
                                     "post_ffn_b", "wqkv", "bqkv", "wo", "bo", "bundle", "bu", "bd", "fc1", "fc2",
                                     "k_slots", "v_slots"])

# FFN kinds as kernel constants (ref.model.ffn_activation's names).
KINDS = {"relu": 0, "fatrelu": 1, "drelu": 2, "silu": 3, "gelu": 4}
BLOCKS = {"pre_norm": 0, "post_norm": 1, "parallel": 2, "parallel_shared": 2}  # decode_step's block codes
# Row chunks per matmul: one per MiB of weights (256 KiB per stream: 64 chunks lost 12 % on a predictor's fc1
# [512, 2048] and 4 % on its fc2 [5632, 512] against 8 or 16), at least 16 to keep 16 cores busy, at most 64.
MATMUL_CHUNKS = (16, 64, 1 << 18)  # fewest, most, weights per chunk
FASTMATH = True  # vectorised dot products reorder sums; well inside the 1e-4 tolerance (tests check)
# Every kernel releases the GIL (nogil=True): fast.serve's engine thread runs them while the HTTP event loop answers
# /health and streams other requests' tokens.


# rmsnorm and rope run serially: waking the other workers costs 8 to 16 us, more than their whole work at decode
# (measured: 1.1 ms of a 72 ms TinyLlama token for 89 calls).
@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rmsnorm(out, x, w, eps):
    """out = x / sqrt(mean(x^2) + eps) * w.  out, x: [T, D], w: [D]."""
    T, D = x.shape
    for t in range(T):
        ss = 0.0
        for d in range(D):
            ss += x[t, d] * x[t, d]
        r = 1.0 / math.sqrt(ss / D + eps)
        for d in range(D):
            out[t, d] = x[t, d] * r * w[d]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def layernorm(out, x, w, b, eps):
    """out = (x - mean(x)) / sqrt(var(x) + eps) * w + b.  out, x: [T, D], w, b: [D]."""
    T, D = x.shape
    for t in range(T):
        m = 0.0
        for d in range(D):
            m += x[t, d]
        m /= D
        ss = 0.0
        for d in range(D):
            ss += (x[t, d] - m) * (x[t, d] - m)
        r = 1.0 / math.sqrt(ss / D + eps)
        for d in range(D):
            out[t, d] = (x[t, d] - m) * r * w[d] + b[d]


@njit(inline="always")
def copy_rows(out, x):
    """out[t, j] = x[t, j], element by element: an array assigned to a slice (out[:] = x) compiles numba's shape
    error message, a few seconds of the first run's compile for each kernel that has one.  out, x: [T, N]."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[t, j] = x[t, j]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def norm(out, x, w, b, eps):
    """The norm a layout stores (fast.engine.Layer): none (w empty: out = x), RMSNorm (w), LayerNorm (w and b).
    out may be x.  out, x: [T, D]; w, b: [D] or [0]."""
    if w.size == 0:
        copy_rows(out, x)
    elif b.size == 0:
        rmsnorm(out, x, w, eps)
    else:
        layernorm(out, x, w, b, eps)


@njit(cache=True, nogil=True)
def embed(out, table, ids):
    """out[t] = table[ids[t]] as float32 values: rows of an embedding in any format, the values ref.quant.values
    gives (a q4_0 row through numpy: 80 to 130 us a token, TinyLlama's 2048 wide).  out: [T, W]; ids: [T]."""
    for t in range(ids.size):
        out[t] = 0.0
        axpy(out[t], np.float32(1.0), table[ids[t]])


@njit(cache=True, nogil=True)
def add_bias(out, b):
    """out[t] += b for every row, where there is a bias (b: [N] or [0]).  out: [T, N]."""
    if b.size:
        for t in range(out.shape[0]):
            for n in range(b.size):
                out[t, n] += b[n]


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def matmul(out, x, w):
    """out = x @ w.T, each weight row read once for all T tokens.  out: [T, N], x: [T, K], w: [N, K] (or a block
    format's [N, K / 32], or its interleaved groups [N / 8, K / 32]: fast.quant.INTERLEAVED).

    Each chunk of rows streams as four quarters (STREAMS); one row at a time was 21 vs 28 GB/s. A row's sum does
    not depend on the chunks, so neither do the results. Block formats with 4 or more tokens are compute-bound: a
    row against four tokens at a time (dot4t unpacks each block once) ran [8, 2048] x [5632, 2048] in 1.0 ms instead
    of 1.85 (q4_0, 2 threads). Float formats with 4 or more tokens: 4 x 4 tiles (tile4x4) whose rows come one from
    each quarter, so that the tiles stream too: TinyLlama's 22 layers at 8 tokens, 2 threads, qkv + wo + predictors
    + output in f32 67.5 -> 58.4 ms (fc2, [5632, 512]: 15.9 -> 10.3), in f16 33.7 -> 27.0 (against adjacent rows).
    """
    T, K = x.shape
    units = w.shape[0]  # rows, or groups of ROWS rows
    fewest, most, size = MATMUL_CHUNKS
    C = min(most, max(fewest, out.shape[1] * K // size))
    xq, xd, xs = quantize_input(x, w)
    for c in prange(C):
        matmul_rows(out, x, w, xq, xd, xs, c * units // C, (c + 1) * units // C)


@njit(fastmath=FASTMATH, inline="always")
def tile4x4(out, x, w, n, q, t):
    """out[t:t + 4, (n, n + q, n + 2 q, n + 3 q)] = x[t:t + 4] @ those rows of w.T for a float format's rows
    (dot4x4), hinting the next four (n + 1, ...) into L2. [8, 2048] x [5632, 2048], 2 threads: f32 63 -> 127
    GFLOPS, f16 94 -> 156; 16 tokens: 93 -> 158, 99 -> 161 (against one token at a time, adjacent rows, q = 1)."""
    a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = dot4x4(
        w[n], w[n + q], w[n + 2 * q], w[n + 3 * q], x[t], x[t + 1], x[t + 2], x[t + 3],
        w[n + 1], w[n + 1 + q], w[n + 1 + 2 * q], w[min(n + 1 + 3 * q, w.shape[0] - 1)])
    out[t, n], out[t + 1, n], out[t + 2, n], out[t + 3, n] = a00, a01, a02, a03
    m = n + q
    out[t, m], out[t + 1, m], out[t + 2, m], out[t + 3, m] = a10, a11, a12, a13
    m += q
    out[t, m], out[t + 1, m], out[t + 2, m], out[t + 3, m] = a20, a21, a22, a23
    m += q
    out[t, m], out[t + 1, m], out[t + 2, m], out[t + 3, m] = a30, a31, a32, a33


@njit(inline="always")
def put16(out, v):
    """out[:16] = the 16-tuple v, unpacked by name (see dot4x4)."""
    out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7] = v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
    out[8], out[9], out[10], out[11], out[12], out[13], out[14], out[15] = v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]


@njit(fastmath=FASTMATH, inline="always")
def row_streams(out, x, w, xq, xd, xs, lo, hi):
    """out[:, lo:hi] = x @ w[lo:hi].T with the rows as four streams (STREAMS), a token at a time: few tokens."""
    q = (hi - lo) // 4
    for n in range(lo, lo + q):
        for t in range(x.shape[0]):
            s0, s1, s2, s3 = dot4(w[n], w[n + q], w[n + 2 * q], w[n + 3 * q], x[t], xq[t], xd[t], xs[t])
            out[t, n], out[t, n + q], out[t, n + 2 * q], out[t, n + 3 * q] = s0, s1, s2, s3
    for m in range(lo + 4 * q, hi):
        for t in range(x.shape[0]):
            out[t, m] = dot(w[m], x[t], xq[t], xd[t], xs[t])


@njit(inline="always")
def group_dot(out, w, g, xq, xd, xs, t, reach):
    """out[t, the 8 rows of group g] = interleaved group g of w against token t (block_dot8)."""
    r = block_dot8(w[g], xq[t], xd[t], xs[t], reach)
    for i in range(ROWS):
        out[t, g * ROWS + i] = r[i]


def matmul_rows(out, x, w, xq, xd, xs, lo, hi):
    """out[:, rows] = x @ w[rows].T for w's rows lo..hi, or its interleaved groups lo..hi (matmul's chunk)."""


@overload(matmul_rows)
def _matmul_rows(out, x, w, xq, xd, xs, lo, hi):
    if interleaved(w):
        def groups(out, x, w, xq, xd, xs, lo, hi):
            reach = np.int64(w.shape[1] + 8)  # the next group's first blocks too
            T = x.shape[0]
            if T >= 4:  # 4+ tokens: each group block unpacked once per four tokens, two groups (halves) at once
                half = (hi - lo) // 2
                for g in range(lo, lo + half):
                    for t in range(0, T - 3, 4):
                        r = block_dot8x2_4t(w[g], w[g + half], xq, xd, xs, reach, t, t + 1, t + 2, t + 3)
                        for s in range(2):
                            for k in range(4):
                                for i in range(ROWS):
                                    out[t + k, (g + s * half) * ROWS + i] = r[(4 * s + k) * ROWS + i]
                    for t in range(T - T % 4, T):
                        group_dot(out, w, g, xq, xd, xs, t, reach)
                        group_dot(out, w, g + half, xq, xd, xs, t, reach)
                if (hi - lo) % 2:
                    g = hi - 1
                    for t in range(0, T - 3, 4):
                        r = block_dot8_4t(w[g], xq, xd, xs, reach, t, t + 1, t + 2, t + 3)
                        for k in range(4):
                            for i in range(ROWS):
                                out[t + k, g * ROWS + i] = r[k * ROWS + i]
                    for t in range(T - T % 4, T):
                        group_dot(out, w, g, xq, xd, xs, t, reach)
                return
            q = (hi - lo) // 4
            for g in range(lo, lo + q):
                for t in range(x.shape[0]):
                    r = block_dot8x4(w[g], w[g + q], w[g + 2 * q], w[g + 3 * q], xq[t], xd[t], xs[t], reach)
                    for s in range(4):
                        for i in range(ROWS):
                            out[t, (g + s * q) * ROWS + i] = r[s * ROWS + i]
            for g in range(lo + 4 * q, hi):
                for t in range(x.shape[0]):
                    group_dot(out, w, g, xq, xd, xs, t, reach)
        return groups

    if is_float(w):
        def float_rows(out, x, w, xq, xd, xs, lo, hi):
            T = x.shape[0]
            if T < 4:
                row_streams(out, x, w, xq, xd, xs, lo, hi)
                return
            q = (hi - lo) // 4
            for n in range(lo, lo + q):  # 4 rows, one from each quarter (STREAMS), x 4 tokens: 16 sums in registers
                for t in range(0, T - 3, 4):
                    tile4x4(out, x, w, n, q, t)
                for t in range(T - T % 4, T):
                    s0, s1, s2, s3 = dot4(w[n], w[n + q], w[n + 2 * q], w[n + 3 * q], x[t], xq[t], xd[t], xs[t])
                    out[t, n], out[t, n + q], out[t, n + 2 * q], out[t, n + 3 * q] = s0, s1, s2, s3
            for m in range(lo + 4 * q, hi):
                for t in range(T):
                    out[t, m] = dot(w[m], x[t], xq[t], xd[t], xs[t])
        return float_rows

    def rows(out, x, w, xq, xd, xs, lo, hi):
        T = x.shape[0]
        if T < 4:
            row_streams(out, x, w, xq, xd, xs, lo, hi)
            return
        for n in range(lo, hi):  # q8_0/q4_0: each row unpacked once per four tokens (dot4t)
            for t in range(0, T - 3, 4):
                s0, s1, s2, s3 = dot4t(w[n], x, xq, xd, xs, t, t + 1, t + 2, t + 3)
                out[t, n], out[t + 1, n], out[t + 2, n], out[t + 3, n] = s0, s1, s2, s3
            for t in range(T - T % 4, T):
                out[t, n] = dot(w[n], x[t], xq[t], xd[t], xs[t])
    return rows


@njit(cache=True, nogil=True)
def rope(out, x, cos, sin, pos0):
    """Rotate-half RoPE at positions pos0..pos0+T-1 from precomputed tables.  out, x: [T, h, E]; cos, sin: [P, E/2]."""
    T, nh, E = x.shape
    half = E // 2
    for t in range(T):
        p = pos0 + t
        for h in range(nh):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = a * cos[p, i] - b * sin[p, i]
                out[t, h, i + half] = b * cos[p, i] + a * sin[p, i]


KV_AHEAD = 16  # positions


@intrinsic
def bits_f32(typingctx, i):
    """The float32 whose bits are the int32 i (a bitcast, which LLVM vectorises)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(fastmath=FASTMATH, inline="always")
def exp_le0(x):
    """exp(x) in float32 for x <= 0, within 1 ulp (6e-8 relative), in plain arithmetic so that a loop of it
    vectorises (numba's math.exp is a scalar libm call per element: 20 ns a score of decode attention): 2^n e^r with
    n = round(x log2 e), r = x - n ln 2 (|r| <= ln 2 / 2, Taylor to degree 7), 2^n by the exponent bits. Below -87
    (float32's smallest normal) it returns exp(-87), nothing beside a softmax's largest term, 1."""
    x = max(x, np.float32(-87.0))
    n = math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)  # ln 2 in two parts (Cody and Waite)
    p = np.float32(1 / 5040)
    p = p * r + np.float32(1 / 720)
    p = p * r + np.float32(1 / 120)
    p = p * r + np.float32(1 / 24)
    p = p * r + np.float32(1 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * bits_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def attend(out, q, k, v, kv, n, scores):
    """out[g] = softmax(q[g] k[:n, kv]^T / sqrt(E)) v[:n, kv] for the G query heads that read kv head kv (GQA's
    group): each key and value row is loaded once for the G of them, where a head at a time read the cache G times.
    Float32 throughout; four positions per pass over a head's E lanes (four dot products in flight; one load and
    store of the output row for four value rows), the exponentials in one vectorised pass per head (exp_le0).
    TinyLlama's heads, 1,000 cached positions, in cache: 466 -> 170 us a layer. Rows KV_AHEAD positions on are
    hinted into the cache: a kv head's rows are K E floats apart, which the hardware prefetcher does not follow.
    out, q: [G, E]; k, v: [S, K, E]; scores: [G, >= n] scratch."""
    G, E = q.shape
    K = k.shape[1]
    scale = np.float32(1.0 / math.sqrt(E))
    for s in range(0, n, 4):
        for a in range(s + KV_AHEAD, min(s + KV_AHEAD + 4, n)):
            for off in range(0, 4 * E, 64):
                prefetch(k, (a * K + kv) * E, off)
        if s + 4 <= n:
            for g in range(G):
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for e in range(E):
                    qe = q[g, e]
                    a0 += qe * k[s, kv, e]
                    a1 += qe * k[s + 1, kv, e]
                    a2 += qe * k[s + 2, kv, e]
                    a3 += qe * k[s + 3, kv, e]
                scores[g, s], scores[g, s + 1], scores[g, s + 2], scores[g, s + 3] = a0, a1, a2, a3
        else:
            for t in range(s, n):
                for g in range(G):
                    acc = np.float32(0.0)
                    for e in range(E):
                        acc += q[g, e] * k[t, kv, e]
                    scores[g, t] = acc
    for g in range(G):
        m = np.float32(-np.inf)
        for s in range(n):
            m = max(m, scores[g, s])
        total = np.float32(0.0)
        for s in range(n):
            p = exp_le0((scores[g, s] - m) * scale)
            scores[g, s] = p
            total += p
        inv = np.float32(1.0) / total
        for s in range(n):
            scores[g, s] *= inv
        for e in range(E):
            out[g, e] = 0.0
    for s in range(0, n, 4):  # value rows accumulated whole: v[s] is contiguous, v[:, e] strided
        for a in range(s + KV_AHEAD, min(s + KV_AHEAD + 4, n)):
            for off in range(0, 4 * E, 64):
                prefetch(v, (a * K + kv) * E, off)
        if s + 4 <= n:
            for g in range(G):
                p0, p1, p2, p3 = scores[g, s], scores[g, s + 1], scores[g, s + 2], scores[g, s + 3]
                for e in range(E):
                    out[g, e] += p0 * v[s, kv, e] + p1 * v[s + 1, kv, e] + p2 * v[s + 2, kv, e] + p3 * v[s + 3, kv, e]
        else:
            for t in range(s, n):
                for g in range(G):
                    p = scores[g, t]
                    for e in range(E):
                        out[g, e] += p * v[t, kv, e]


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def attention(out, q, k, v, pos0, scores):
    """Causal softmax(q k^T / sqrt(E)) v; query head h reads kv head h // (H/K).

    out, q: [T, H, E]; k, v: [S, K, E] (positions 0..S-1); scores: [T*H, S] scratch, one row per (t, h).
    """
    T, H, E = q.shape
    S, K = k.shape[0], k.shape[1]
    G = H // K
    for tk in prange(T * K):
        t, kv = tk // K, tk % K
        attend(out[t, kv * G:(kv + 1) * G], q[t, kv * G:(kv + 1) * G], k, v, kv, min(S, pos0 + t + 1),
               scores[t * H + kv * G:t * H + (kv + 1) * G])


@intrinsic
def prefetch(typingctx, a, i, offset):
    """Hint the cache line `offset` bytes past a.flat[i] (a C-contiguous) into L2 ahead of use: llvm.prefetch, read,
    locality 2. Only a hint: it never faults and changes no result."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        line = builder.gep(builder.bitcast(builder.gep(data, [args[1]]), i8p), [args[2]])
        builder.call(fn, [line, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()
    return types.void(a, i, offset), codegen


@njit(inline="always")
def prefetch_row(a, r, n, span):
    """Hint the first `span` bytes of row r of a C-contiguous array whose rows hold n items."""
    for off in range(0, span, 64):
        prefetch(a, r * n, off)


@njit(inline="always")
def prefetch_rows(bundle, i, first, last, span):
    """Hint the first `span` bytes of rows first..last - 1 of neuron i's bundle (bundle: [F, P, n])."""
    P = bundle.shape[1]
    for part in range(first, last):
        prefetch_row(bundle, i * P + part, bundle.shape[2], span)


def activation_py(kind, g, u, thr):
    """a(g, u) of ref.model.ffn_activation for one neuron; compiled for the CPU here and for the GPU in fast.gpu."""
    if kind == 0:
        return g * u if g > 0 else 0.0
    if kind == 1:
        return g * u if g > thr else 0.0
    if kind == 2:
        return g * u if (g > 0 and u > 0) else 0.0
    if kind == 3:
        return g / (1.0 + math.exp(-g)) * u
    return 0.5 * g * (1.0 + math.erf(g * 0.7071067811865476)) * u


activation = njit(inline="always")(activation_py)


@njit(fastmath=FASTMATH, inline="always")
def sum_chunks(out, acc):
    """out = sum over chunks of acc, in chunk order (the serial reduction after the workers).  out: [N]; acc: [C, N].
    Chunk by chunk, so that the loop over N vectorises: element by element it ran [4, 8 x 2048] in 65 us."""
    C, N = acc.shape
    for n in range(N):
        out[n] = acc[0, n]
    for c in range(1, C):
        for n in range(N):
            out[n] += acc[c, n]


@njit(fastmath=FASTMATH, inline="always")
def pre_activations(b, bias, i, x, xq, xd, xs):
    """(g, u) of neuron i with bundle b for one token (ref.model.Model.ffn_gate_up): gate and up rows, or a
    non-gated bundle's up row plus its bias and u = 1."""
    if b.shape[0] == 3:
        g, u = dot2(b[0], b[1], x, xq, xd, xs)
    else:
        g, u = dot(b[0], x, xq, xd, xs), np.float32(1.0)
    if bias.size:
        g += bias[i]
    return g, u


@njit(inline="always")
def gate_open(kind, g, thr):
    """Whether a(g, u) (activation) can be nonzero whatever u is: ReLU and dReLU need g > 0, FATReLU g > thr; the
    smooth kinds always."""
    if kind == 0 or kind == 2:
        return g > 0
    if kind == 1:
        return g > thr
    return True


@njit(inline="always")
def queue_up(gates, ids, m, g, i, bundle, span):
    """Neuron i, whose gate g is open, joins the neurons whose up rows are read next (gates, ids [12]: m of them);
    its up row is hinted now. -> m + 1."""
    gates[m], ids[m] = g, i
    prefetch_rows(bundle, i, 1, 2, span)
    return m + 1


@njit(inline="always")
def queue_down(acts, ids, n, a, i):
    """Neuron i with activation a joins the neurons whose down rows are added next (acts, ids [12]: n of them),
    unless a is 0: it adds nothing. -> n."""
    acts[n], ids[n] = a, i
    return n + (a != 0)


@njit(inline="always")
def gated(gates, up_ids, m, acts, ids, n, g, i, bundle, bias, span, kind, thr):
    """Neuron i after its first row's product g: a gated neuron whose gate is open waits for its up row (queue_up),
    a non-gated one's activation a(g + bias_i, 1) for its down row (queue_down). -> (m, n)."""
    if bundle.shape[1] == 3:
        if gate_open(kind, g, thr):
            m = queue_up(gates, up_ids, m, g, i, bundle, span)
        return m, n
    return m, queue_down(acts, ids, n, activation(kind, g + bias[i] if bias.size else g, np.float32(1.0), thr), i)


@njit(fastmath=FASTMATH, inline="always")
def read_up4(gates, up_ids, m, acts, ids, n, bundle, x, xq, xd, xs, kind, thr):
    """The four oldest of the m >= 4 waiting up rows read at once, their neurons' activations queued for their down
    rows. -> (m - 4, n)."""
    u0, u1, u2, u3 = dot4(bundle[up_ids[0], 1], bundle[up_ids[1], 1], bundle[up_ids[2], 1], bundle[up_ids[3], 1], x,
                          xq, xd, xs)
    n = queue_down(acts, ids, n, activation(kind, gates[0], u0, thr), up_ids[0])
    n = queue_down(acts, ids, n, activation(kind, gates[1], u1, thr), up_ids[1])
    n = queue_down(acts, ids, n, activation(kind, gates[2], u2, thr), up_ids[2])
    n = queue_down(acts, ids, n, activation(kind, gates[3], u3, thr), up_ids[3])
    for k in range(4, m):
        gates[k - 4], up_ids[k - 4] = gates[k], up_ids[k]
    return m - 4, n


@njit(fastmath=FASTMATH, inline="always")
def add_down4(y, acts, ids, n, bundle):
    """y += a_i down_i for the four oldest of the n >= 4 waiting down rows, read at once. -> n - 4."""
    P = bundle.shape[1]
    axpy4(y, acts[0], acts[1], acts[2], acts[3], bundle[ids[0], P - 1], bundle[ids[1], P - 1], bundle[ids[2], P - 1],
          bundle[ids[3], P - 1])
    for k in range(4, n):
        acts[k - 4], ids[k - 4] = acts[k], ids[k]
    return n - 4


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def sparse_ffn_chunk(y, x, xq0, xd0, xs0, bundle, bias, active, lo, hi, kind, thr):
    """y = sparse_ffn over active[lo:hi] (one worker's chunk)."""
    D = y.shape[0]
    P = bundle.shape[1]
    span = prefetch_span(bundle)
    q = (hi - lo) // 4
    for d in range(D):
        y[d] = 0.0
    gates, up_ids = np.empty(12, np.float32), np.empty(12, np.int64)  # up rows waiting to be read, < 12
    acts, ids = np.empty(12, np.float32), np.empty(12, np.int64)  # down rows waiting to be read, < 12
    m = n = 0
    fired = 0  # acts[:fired] hinted already
    for j in range(lo, lo + q):
        i0, i1, i2, i3 = active[j], active[j + q], active[j + 2 * q], active[j + 3 * q]
        if j + 1 < lo + q and not hints_ahead(bundle):  # each lane's next gate row, unless it is adjacent
            for k in range(4):
                nxt = active[j + 1 + k * q]
                if nxt != active[j + k * q] + 1:
                    prefetch_rows(bundle, nxt, 0, 1, span)
        jn = min(j + 1, lo + q - 1)  # each lane's next neuron, whose gate row the products may hint
        g0, g1, g2, g3 = dot4_ahead(bundle[i0, 0], bundle[i1, 0], bundle[i2, 0], bundle[i3, 0],
                                    bundle[active[jn], 0], bundle[active[jn + q], 0], bundle[active[jn + 2 * q], 0],
                                    bundle[active[jn + 3 * q], 0], x, xq0, xd0, xs0)
        m, n = gated(gates, up_ids, m, acts, ids, n, g0, i0, bundle, bias, span, kind, thr)
        m, n = gated(gates, up_ids, m, acts, ids, n, g1, i1, bundle, bias, span, kind, thr)
        m, n = gated(gates, up_ids, m, acts, ids, n, g2, i2, bundle, bias, span, kind, thr)
        m, n = gated(gates, up_ids, m, acts, ids, n, g3, i3, bundle, bias, span, kind, thr)
        if m >= 8:
            m, n = read_up4(gates, up_ids, m, acts, ids, n, bundle, x, xq0, xd0, xs0, kind, thr)
        for k in range(fired, n):  # a down row that adds something, hinted a step before it is read
            prefetch_rows(bundle, ids[k], P - 1, P, span)
        if n >= 8:
            n = add_down4(y, acts, ids, n, bundle)
        fired = n
    for j in range(lo + 4 * q, hi):  # the chunk's last neurons, one at a time
        i = active[j]
        m, n = gated(gates, up_ids, m, acts, ids, n, dot(bundle[i, 0], x, xq0, xd0, xs0), i, bundle, bias, span,
                     kind, thr)
    while m >= 4:
        m, n = read_up4(gates, up_ids, m, acts, ids, n, bundle, x, xq0, xd0, xs0, kind, thr)
        if n >= 8:
            n = add_down4(y, acts, ids, n, bundle)
    for k in range(m):
        n = queue_down(acts, ids, n, activation(kind, gates[k], dot(bundle[up_ids[k], 1], x, xq0, xd0, xs0), thr),
                       up_ids[k])
        if n >= 8:
            n = add_down4(y, acts, ids, n, bundle)
    while n >= 4:
        n = add_down4(y, acts, ids, n, bundle)
    for k in range(n):
        axpy(y, acts[k], bundle[ids[k], P - 1])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def sparse_ffn(out, acc, x, bundle, bias, active, n_active, kind, thr):
    """out = sum_{j < n_active} a_i down_i, i = active[j], a_i = a(g_i, u_i) (pre_activations): PowerInfer's
    neuron-aware operator, a neuron's rows read as one contiguous bundle.

    out: [D]; acc: [C, D] per-chunk private accumulators; x: [D]; bundle: [F, 3, D] (gate, up, down^T) or [F, 2, D]
    (a non-gated FFN's up, down^T); bias: [F] the non-gated up rows' bias, or [0]; active: [>= n_active].
    Four neurons stream at once, one from each quarter of the chunk (STREAMS), their gate rows first (+3 % over all
    neurons and +6 % over a 10 % set against gate and up in one pass). A lane whose next neuron is not adjacent
    prefetches its gate row (+5 % over a 10 % set; prefetching adjacent ones: -3 %); rows in runs have the products
    hint the next gate rows line for line instead (dot4_ahead), so that their misses spread over the step rather
    than 72 lines at once: TinyLlama q4_0, 22 layers' FFN from memory, 2 threads, 2.49 to 2.59 -> 2.36 to 2.39 ms.
    The rest of a bundle is read only where it adds something, four rows at a time, each row hinted as soon as it
    is known to be needed and read a step later: a gated neuron's up row where its gate is open (gate_open: a
    predicted neuron whose ReLU gate is shut has a = 0 whatever u is), its down row where a != 0 (ReLU's zeros in a
    dense FFN, a predicted neuron that does not fire; TinyLlama's 22 layers at 10 %, 2 threads: q8_0 3.7 -> 3.5 ms,
    q4_0 -1 to -3 %).
    """
    C, D = acc.shape
    xq, xd, xs = quantize_input(x.reshape((1, D)), bundle)
    for c in prange(C):
        sparse_ffn_chunk(acc[c], x, xq[0], xd[0], xs[0], bundle, bias, active, c * n_active // C,
                         (c + 1) * n_active // C, kind, thr)
    sum_chunks(out, acc)


@njit(fastmath=FASTMATH, inline="always")
def axpy4x4(y, t, a, w0, w1, w2, w3):
    """y[t + k] += sum_n a[4 n + k] w_n for four tokens and four float32 rows (a: dot4x4's order): each row element
    loaded once for four tokens and each output element once for four rows (a row at a time into four tokens, axpy4t,
    loads and stores the four outputs per row).  y: [T, D]."""
    a00, a01, a02, a03, a10, a11, a12, a13 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    a20, a21, a22, a23, a30, a31, a32, a33 = a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]
    y0, y1, y2, y3 = y[t], y[t + 1], y[t + 2], y[t + 3]
    for d in range(y.shape[1]):
        v0, v1, v2, v3 = w0[d], w1[d], w2[d], w3[d]
        y0[d] += a00 * v0 + a10 * v1 + a20 * v2 + a30 * v3
        y1[d] += a01 * v0 + a11 * v1 + a21 * v2 + a31 * v3
        y2[d] += a02 * v0 + a12 * v1 + a22 * v2 + a32 * v3
        y3[d] += a03 * v0 + a13 * v1 + a23 * v2 + a33 * v3


TILE_SHARE = 0.45  # pairs of (token, union neuron) computed, from which a float format's batch FFN runs in tiles


def ffn_tiles(y, x, bundle, bias, active, lo, hi, mask, kind, thr):
    """y[t] += the FFN of token t over union neurons lo..hi it computes (sparse_ffn_batch's chunk), in tiles of four
    neurons by four tokens: every token's gate and up products (dot4x4), the activations of those outside a token's
    set zeroed, and the four down rows (decoded once to float32) added for the four tokens at once (axpy4x4). Float
    formats only."""


@overload(ffn_tiles)
def _ffn_tiles(y, x, bundle, bias, active, lo, hi, mask, kind, thr):
    if not is_float(bundle):
        return lambda y, x, bundle, bias, active, lo, hi, mask, kind, thr: None

    def tiles(y, x, bundle, bias, active, lo, hi, mask, kind, thr):
        T, P, D = x.shape[0], bundle.shape[1], x.shape[1]
        a = np.zeros(16, np.float32)  # a[4 n + k]: neuron n of the four, token k of the four
        g, u = np.empty(16, np.float32), np.ones(16, np.float32)  # gate and up products (u: 1 where there is none)
        down = np.empty((4, D), np.float32)  # the four down rows as float32, decoded once for all tokens
        for j in range(lo, hi - 3, 4):
            i0, i1, i2, i3 = active[j], active[j + 1], active[j + 2], active[j + 3]
            b0, b1, b2, b3 = bundle[i0], bundle[i1], bundle[i2], bundle[i3]
            nx = min(j + 4, hi - 4)  # the next four neurons, whose gate rows the up products prefetch
            n0, n1, n2, n3 = bundle[active[nx]], bundle[active[nx + 1]], bundle[active[nx + 2]], bundle[active[nx + 3]]
            for n in range(4):
                row = bundle[active[j + n], P - 1]
                for d in range(D):
                    down[n, d] = load(row, d)
            for t in range(0, T, 4):
                k4 = min(4, T - t)  # tokens in this group: four, or the tail
                if not mask[t:t + k4, j:j + 4].any():
                    continue
                if k4 == 4:
                    x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
                    put16(g, dot4x4(b0[0], b1[0], b2[0], b3[0], x0, x1, x2, x3, b0[1], b1[1], b2[1], b3[1]))
                    if P == 3:
                        put16(u, dot4x4(b0[1], b1[1], b2[1], b3[1], x0, x1, x2, x3, n0[0], n1[0], n2[0], n3[0]))
                else:  # tail tokens: the four neurons at once against each
                    for k in range(k4):
                        xk = x[t + k]
                        g[k], g[4 + k], g[8 + k], g[12 + k] = dot4(b0[0], b1[0], b2[0], b3[0], xk, xk, xk, xk)
                        if P == 3:
                            u[k], u[4 + k], u[8 + k], u[12 + k] = dot4(b0[1], b1[1], b2[1], b3[1], xk, xk, xk, xk)
                for n in range(4):
                    bn = bias[active[j + n]] if bias.size else np.float32(0.0)
                    for k in range(4):
                        a[4 * n + k] = activation(kind, g[4 * n + k] + bn, u[4 * n + k], thr) \
                            if k < k4 and mask[t + k, j + n] else np.float32(0.0)
                if k4 == 4:
                    axpy4x4(y, t, a, down[0], down[1], down[2], down[3])
                else:
                    for k in range(k4):
                        axpy4(y[t + k], a[k], a[4 + k], a[8 + k], a[12 + k], down[0], down[1], down[2], down[3])
        for j in range(hi - (hi - lo) % 4, hi):  # fewer than four neurons left: a token at a time
            b = bundle[active[j]]
            for t in range(T):
                if mask[t, j]:
                    gj, uj = pre_activations(b, bias, active[j], x[t], x[t], x[t], x[t])
                    axpy(y[t], activation(kind, gj, uj, thr), b[P - 1])

    return tiles


def tiled(bundle):
    """Whether sparse_ffn_batch may run a bundle's rows in tiles (ffn_tiles): float formats."""


@overload(tiled)
def _tiled(bundle):
    return (lambda bundle: True) if is_float(bundle) else (lambda bundle: False)


@njit(fastmath=FASTMATH, inline="always")
def row_products(out, w, x, xq, xd, xs, tokens, n):
    """out[k] = w . x[tokens[k]] for k < n: four tokens at a time (dot4t: the row read once for four), then two,
    then one."""
    for k in range(0, n - 3, 4):
        out[k], out[k + 1], out[k + 2], out[k + 3] = dot4t(w, x, xq, xd, xs, tokens[k], tokens[k + 1], tokens[k + 2],
                                                           tokens[k + 3])
    k = n - n % 4
    if n - k >= 2:
        out[k], out[k + 1] = dot2t(w, x, xq, xd, xs, tokens[k], tokens[k + 1])
        k += 2
    if k < n:
        t = tokens[k]
        out[k] = dot(w, x[t], xq[t], xd[t], xs[t])


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def ffn_neurons(y, x, xq, xd, xs, bundle, bias, active, lo, hi, mask, kind, thr, span):
    """y[t] += the FFN of token t over union neurons lo..hi it computes (sparse_ffn_batch's chunk), a neuron at a
    time: its tokens four at a time (each row element loaded once for four tokens). Block formats read the gate row,
    then the up row only against the tokens whose gate is open (gate_open: TinyLlama's shape, 8 sequences, 2
    threads, q8_0 159 to 161 -> 164 tok/s, q4_0 226 to 231 -> 230 to 238), float formats the gate and up rows in one
    pass (dot2_4t, which shares the loop); the down row goes only into the tokens whose activation is not 0."""
    T, P = x.shape[0], bundle.shape[1]
    tokens, acts = np.empty(T, np.int64), np.empty(T, np.float32)  # a neuron's tokens and their activations
    gates = np.empty(T, np.float32)
    for j in range(lo, hi):
        i = active[j]
        b = bundle[i]
        if j + 1 < hi:  # the next neuron's rows but its down row
            prefetch_rows(bundle, active[j + 1], 0, P - 1, span)
        n = 0
        for t in range(T):
            tokens[n] = t
            n += mask[t, j] != 0
        if n > 1:  # its down row too, while its dot products run: one of several tokens likely fires
            prefetch_rows(bundle, i, P - 1, P, span)
        if P == 3 and not tiled(bundle):  # block formats: the up row only against the tokens whose gate is open
            row_products(gates, b[0], x, xq, xd, xs, tokens, n)
            m = 0
            for k in range(n):
                tokens[m], gates[m] = tokens[k], gates[k]
                m += gate_open(kind, gates[k], thr)
            n = m
            row_products(acts, b[1], x, xq, xd, xs, tokens, n)
            for k in range(n):
                acts[k] = activation(kind, gates[k], acts[k], thr)
        else:  # float formats: gate and up rows in one pass (dot2_4t); a non-gated bundle's one row
            bi = bias[i] if bias.size else np.float32(0.0)
            one = np.float32(1.0)
            for k in range(0, n - 3, 4):  # gate and up rows read once for four tokens
                t0, t1, t2, t3 = tokens[k], tokens[k + 1], tokens[k + 2], tokens[k + 3]
                if P == 3:
                    g0, g1, g2, g3, u0, u1, u2, u3 = dot2_4t(b[0], b[1], x, xq, xd, xs, t0, t1, t2, t3)
                else:
                    g0, g1, g2, g3 = dot4t(b[0], x, xq, xd, xs, t0, t1, t2, t3)
                    u0 = u1 = u2 = u3 = one
                acts[k], acts[k + 1] = activation(kind, g0 + bi, u0, thr), activation(kind, g1 + bi, u1, thr)
                acts[k + 2], acts[k + 3] = activation(kind, g2 + bi, u2, thr), activation(kind, g3 + bi, u3, thr)
            k = n - n % 4
            if n - k >= 2:  # two more tokens: the power law's usual case at a few sequences
                t0, t1 = tokens[k], tokens[k + 1]
                if P == 3:
                    g0, g1, u0, u1 = dot2_2t(b[0], b[1], x, xq, xd, xs, t0, t1)
                else:
                    g0, g1 = dot2t(b[0], x, xq, xd, xs, t0, t1)
                    u0 = u1 = one
                acts[k], acts[k + 1] = activation(kind, g0 + bi, u0, thr), activation(kind, g1 + bi, u1, thr)
                k += 2
            if k < n:
                t = tokens[k]
                g, u = pre_activations(b, bias, i, x[t], xq[t], xd[t], xs[t])
                acts[k] = activation(kind, g, u, thr)
        m = 0  # the tokens whose activation is not 0: only they add the down row
        for k in range(n):
            tokens[m], acts[m] = tokens[k], acts[k]
            m += acts[k] != 0
        for k in range(0, m - 3, 4):  # the down row read once for four tokens
            axpy4t(y, tokens[k], tokens[k + 1], tokens[k + 2], tokens[k + 3], acts[k], acts[k + 1], acts[k + 2],
                   acts[k + 3], b[P - 1])
        k = m - m % 4
        if m - k >= 2:
            axpy2t(y, tokens[k], tokens[k + 1], acts[k], acts[k + 1], b[P - 1])
            k += 2
        if k < m:
            axpy(y[tokens[k]], acts[k], b[P - 1])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def sparse_ffn_batch(out, acc, x, bundle, bias, active, n_active, mask, kind, thr):
    """out[t] = sum over j < n_active with mask[t, j] of a_tj down_i, i = active[j]: each token's sparse FFN
    over its own predicted set, the chunk's neurons (the union of the sets) each read once for all T tokens.

    out: [T, D]; acc: [C, T, D] per-chunk private accumulators; x: [T, D]; bundle, bias: as sparse_ffn's;
    mask: [T, >= n_active] uint8 (token t computes union neuron j). A neuron at a time (ffn_neurons), or where a
    float format's tokens compute TILE_SHARE of the union's pairs, in tiles of four neurons by four tokens
    (ffn_tiles: every pair of a tile computed, the others' activations zeroed). The shipped model's 16-sequence
    step, float16, 1 thread: its first layer (union all 1,024 neurons, 83 % of the pairs) 740 -> 370 us; a tile
    pair costs about 25 ns there, a neuron's pair 55, hence TILE_SHARE (its other layers, 21 to 29 %: neurons)."""
    C, T, D = acc.shape
    pairs = 0
    if tiled(bundle) and T >= 4:
        for t in range(T):
            for j in range(n_active):
                pairs += mask[t, j] != 0
    tiles = tiled(bundle) and T >= 4 and pairs >= TILE_SHARE * T * n_active
    quads = n_active // 4
    xq, xd, xs = quantize_input(x, bundle)
    span = prefetch_span(bundle)
    for c in prange(C):
        y = acc[c]
        y[:] = 0.0
        if tiles:  # chunks of whole tiles; the last takes the neurons left over
            ffn_tiles(y, x, bundle, bias, active, c * quads // C * 4, (c + 1) * quads // C * 4 if c < C - 1 else n_active,
                      mask, kind, thr)
        else:
            ffn_neurons(y, x, xq, xd, xs, bundle, bias, active, c * n_active // C, (c + 1) * n_active // C, mask, kind,
                        thr, span)
    sum_chunks(out.reshape(T * D), acc.reshape((C, T * D)))


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def dense_down_chunk(y, gu, down, lo, hi, kind, thr):
    """y = dense_down over neurons lo..hi (one worker's chunk).  y: [T, D]."""
    T, F = y.shape[0], down.shape[0]
    y[:] = 0.0
    if T == 1:  # the neurons that add something, then their rows four at a time, the next four hinted ahead
        acts, ids = np.empty(hi - lo + 1, np.float32), np.empty(hi - lo + 1, np.int64)
        n = 0
        for i in range(lo, hi):
            acts[n], ids[n] = activation(kind, gu[0, i], gu[0, F + i], thr), i
            n += acts[n] != 0
        span = down.shape[1] * down.itemsize
        for k in range(0, n - 3, 4):
            for m in range(k + 4, min(k + 8, n)):
                prefetch_row(down, ids[m], down.shape[1], span)
            axpy4(y[0], acts[k], acts[k + 1], acts[k + 2], acts[k + 3], down[ids[k]], down[ids[k + 1]],
                  down[ids[k + 2]], down[ids[k + 3]])
        for k in range(n - n % 4, n):
            axpy(y[0], acts[k], down[ids[k]])
    else:
        acts, ids = np.empty(T, np.float32), np.empty(T, np.int64)
        for i in range(lo, hi):
            m = 0  # the tokens whose activation is not 0
            for t in range(T):
                acts[m], ids[m] = activation(kind, gu[t, i], gu[t, F + i], thr), t
                m += acts[m] != 0
            for k in range(0, m - 3, 4):
                axpy4t(y, ids[k], ids[k + 1], ids[k + 2], ids[k + 3], acts[k], acts[k + 1], acts[k + 2],
                       acts[k + 3], down[i])
            for k in range(m - m % 4, m):
                axpy(y[ids[k]], acts[k], down[i])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def dense_down(out, acc, gu, down, kind, thr):
    """out[t] = sum_i a_ti down_i, a_ti = a(g_ti, u_ti) from gu[t] = (g_t, u_t) over all F neurons: the down half of
    a dense FFN whose gate and up rows ran as one matmul (Engine's dense layout, dense_ffn). A zero activation skips
    its down row; one token's rows go four at a time (axpy4), the next four hinted meanwhile (the rows that add
    something are known first: TinyLlama's 22 layers, half the neurons firing, 2 threads, q4_0 9.3 -> 6.2 ms, q8_0
    10.7 -> 9.0), several tokens' four tokens at a time (axpy4t).

    out: [T, D]; acc: [C, T, D] per-chunk private accumulators; gu: [T, 2F]; down: [F, D] rows of down^T."""
    C, T, D = acc.shape
    F = down.shape[0]
    for c in prange(C):
        dense_down_chunk(acc[c], gu, down, c * F // C, (c + 1) * F // C, kind, thr)
    sum_chunks(out.reshape(T * D), acc.reshape((C, T * D)))


@njit(cache=True, nogil=True)
def dense_ffn_block(out, acc, h, ffn_norm, ffn_norm_b, gate_up, down, bd, kind, thr, eps):
    """out = dense_down(matmul(norm(h), gate_up)) + bd for one token, as one compiled call.  out, h: [D]; acc: [C, D];
    gate_up: [2F, D] (interleaved groups where its rows allow, fast.quant.for_matmul); down: [F, D]."""
    D = h.size
    x = np.empty((1, D), np.float32)
    norm(x, h.reshape((1, D)), ffn_norm, ffn_norm_b, eps)
    gu = np.empty((1, 2 * down.shape[0]), np.float32)
    matmul(gu, x, gate_up)
    dense_down(out.reshape((1, D)), acc.reshape((acc.shape[0], 1, D)), gu, down, kind, thr)
    add_bias(out.reshape((1, D)), bd)


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def gather_values(out, w, ids, n):
    """out[j] = the float32 values of w[ids[j]] for j < n: rows (or neuron bundles) of any format decoded for a BLAS
    product.  out: [>= n, P, K]; w: [N, P, K / block] rows of blocks; ids: [>= n]."""
    P = w.shape[1]
    for j in prange(n):
        for p in range(P):
            y = out[j, p]
            for d in range(y.shape[0]):
                y[d] = 0.0
            axpy(y, np.float32(1.0), w[ids[j], p])


@njit(parallel=True, cache=True, nogil=True)
def round_q8_0(out, x):
    """out = x rounded to Q8_0 blocks along its rows (ref.quant.quantize_q8_0, then its values; fast.quant's
    quantize_input rounds with the same q8_0_block): what a q8_0 or q4_0 product reads.  out, x: [T, K]."""
    T, K = x.shape
    for t in prange(T):
        row, q = np.ascontiguousarray(x[t]), np.empty(BLOCK, np.int8)
        for b in range(K // BLOCK):
            d = f16_round(q8_0_block(q, np.int64(0), np.int64(4), row, np.int64(b * BLOCK))[0])
            for i in range(BLOCK):
                out[t, b * BLOCK + i] = np.float32(q[i]) * d


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def masked_activation(a, g, u, mask, kind, thr):
    """a[t, j] = a(g[t, j], u[t, j]) where token t computes neuron j (mask), else 0.  a, g, u: [T, U]; mask: [T, >= U]."""
    T, U = g.shape
    for t in prange(T):
        for j in range(U):
            a[t, j] = activation(kind, g[t, j], u[t, j], thr) if mask[t, j] != 0 else 0.0


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def causal_logits(s, T, pos0, scale):
    """Row r of each s[k] (query t = r % T at position pos0 + t): scale s - its max over the visible keys 0..pos0+t,
    -inf after them; exp then normalize_rows make it the causal softmax.  s: [K, G T, S] raw scores."""
    K, R, S = s.shape
    for kr in prange(K * R):
        row = s[kr // R, kr % R]
        n = min(S, pos0 + kr % R % T + 1)
        m = -np.inf
        for j in range(n):
            m = max(m, row[j] * scale)
        for j in range(n):
            row[j] = row[j] * scale - m
        for j in range(n, S):
            row[j] = -np.inf


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def normalize_rows(p):
    """p[k, r] /= sum(p[k, r]).  p: [K, R, S]."""
    K, R, S = p.shape
    for kr in prange(K * R):
        row = p[kr // R, kr % R]
        total = np.float32(0.0)
        for j in range(S):
            total += row[j]
        inv = np.float32(1.0) / total
        for j in range(S):
            row[j] *= inv


@njit(cache=True, nogil=True)
def attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, wo, bo, k_cache, v_cache, cos, sin, pos0, eps):
    """out = wo . attention(rope(q), rope(k), v) + bo, [q; k; v] = wqkv . norm(h) + bqkv, for one sequence's run;
    this step's keys and values are written to its caches at pos0..pos0+T-1.  out, h: [T, D];
    wqkv: [(H + 2K) E, D]; wo: [D, H E]; k_cache, v_cache: [room, K, E]; norm and biases as `norm`, `add_bias` take
    them.

    One compiled call per layer instead of six calls from Python and the numpy glue between them: once a token's
    weights have streamed through the caches, every Python-side step runs from memory (an empty parallel kernel
    called from Python: 2 us warm, 17 us after a read pass). Measured with ffn_block: Python overhead 0.38 to
    0.28 ms per TinyLlama token, sparse tokens 0.5 to 1.4 % faster."""
    T = h.shape[0]
    K, E = k_cache.shape[1], k_cache.shape[2]
    qkv = np.empty((T, n_rows(wqkv)), np.float32)
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    att = np.empty((T, qkv.shape[1] - 2 * K * E), np.float32)  # [T, H E]
    self_attention(att, qkv, k_cache, v_cache, cos, sin, pos0)
    matmul(out, att, wo)
    add_bias(out, bo)


@njit(cache=True, nogil=True)
def qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps):
    """qkv = wqkv . norm(h) + bqkv, every token's row read once.  qkv: [T, (H + 2K) E]; h: [T, D]."""
    x = np.empty_like(h)
    norm(x, h, attn_norm, attn_norm_b, eps)
    matmul(qkv, x, wqkv)
    add_bias(qkv, bqkv)


@njit(cache=True, nogil=True)
def self_attention(att, qkv, k_cache, v_cache, cos, sin, pos0):
    """att = attention(rope(q), rope(k), v) of one sequence's run at positions pos0..pos0+T-1, its keys and values
    appended to the sequence's caches.  att: [T, H E]; qkv: [T, (H + 2K) E]; k_cache, v_cache: [room, K, E]."""
    T = qkv.shape[0]
    K, E = k_cache.shape[1], k_cache.shape[2]
    H = qkv.shape[1] // E - 2 * K
    q = np.ascontiguousarray(qkv[:, : H * E]).reshape((T, H, E))  # [T, H, E]
    k = np.ascontiguousarray(qkv[:, H * E:(H + K) * E]).reshape((T, K, E))  # [T, K, E]
    rope(q, q, cos, sin, pos0)
    rope(k_cache[pos0:pos0 + T], k, cos, sin, pos0)
    for t in range(T):
        copy_rows(v_cache[pos0 + t], qkv[t, (H + K) * E:].reshape((K, E)))
    out = np.empty((T, H, E), np.float32)
    attention(out, q, k_cache[: pos0 + T], v_cache[: pos0 + T], pos0, np.empty((T * H, pos0 + T), np.float32))
    copy_rows(att, out.reshape((T, H * E)))


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def decode_attention_token(att_t, qkv, k_caches, v_caches, seqs, positions, cos, sin, t):
    """decode_attention's token t (one worker's share).  att_t: [H E]."""
    kc, vc, p = k_caches[seqs[t]], v_caches[seqs[t]], positions[t]
    if t + 1 < qkv.shape[0]:
        kn, vn = k_caches[seqs[t + 1]], v_caches[seqs[t + 1]]
        span = positions[t + 1] * kn.shape[1] * kn.shape[2] * kn.itemsize
        prefetch_row(kn, 0, 0, span)
        prefetch_row(vn, 0, 0, span)
    K, E = kc.shape[1], kc.shape[2]
    H = qkv.shape[1] // E - 2 * K
    q = np.empty((1, H, E), np.float32)
    rope(q, qkv[t, : H * E].reshape((1, H, E)), cos, sin, p)
    rope(kc[p:p + 1], qkv[t, H * E:(H + K) * E].reshape((1, K, E)), cos, sin, p)
    copy_rows(vc[p], qkv[t, (H + K) * E:].reshape((K, E)))
    G = H // K
    scores = np.empty((G, p + 1), np.float32)
    out = att_t.reshape((H, E))
    for kv in range(K):
        attend(out[kv * G:(kv + 1) * G], q[0, kv * G:(kv + 1) * G], kc, vc, kv, p + 1, scores)


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def decode_attention(att, qkv, k_caches, v_caches, seqs, positions, cos, sin):
    """self_attention for T sequences' one new token each, in one call: token t of sequence seqs[t] at positions[t]
    appends its key and value to that sequence's caches and attends to them.  att: [T, H E]; qkv: [T, (H + 2K) E];
    k_caches, v_caches: typed lists of every slot's [room, K, E] arrays.

    One call per layer instead of one per sequence (13 us each: 1.2 of the 4.3 ms of a 16-sequence step of the
    shipped model); tokens in parallel, each token's kv heads in turn (attend: a group's query heads together). A
    worker hints the next token's cached keys and values while it runs one: the slots are in no cache by the next
    step (the shipped model, 16 sequences decoding real text, 2 threads, its 6 layers: 0.44 to 0.71 -> 0.36 to 0.67
    ms a step at 20 to 60 positions in five runs, 0.95 -> 0.88 and 1.47 -> 1.39 at 20 to 200)."""
    T = qkv.shape[0]
    for t in prange(T):
        decode_attention_token(att[t], qkv, k_caches, v_caches, seqs, positions, cos, sin, t)


@njit(cache=True, nogil=True)
def decode_attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, wo, bo, k_caches, v_caches, seqs, positions, cos,
                           sin, eps):
    """attention_block for T sequences' one new token each (decode_attention), as one compiled call: token t of
    sequence seqs[t] at positions[t].  out, h: [T, D]; k_caches, v_caches: typed lists of every slot's [room, K, E].

    Several sequences decoding together made four calls from Python and the numpy glue between them per layer; as one
    call (with ffn_batch_block, likewise) the shipped model's 16-sequence step took 2.85 instead of 3.24 ms and 3.51
    instead of 3.73 in a busier hour (2 threads; 7 rounds each, old and new interleaved in one process: new / old
    0.82 to 1.01, median 0.94)."""
    T = h.shape[0]
    K, E = k_caches[seqs[0]].shape[1], k_caches[seqs[0]].shape[2]
    qkv = np.empty((T, n_rows(wqkv)), np.float32)  # [T, (H + 2K) E]
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    att = np.empty((T, qkv.shape[1] - 2 * K * E), np.float32)  # [T, H E]
    decode_attention(att, qkv, k_caches, v_caches, seqs, positions, cos, sin)
    matmul(out, att, wo)
    add_bias(out, bo)


@njit(cache=True, nogil=True)
def ffn_block(out, acc, h, ffn_norm, ffn_norm_b, bundle, bias, bd, active, n_active, kind, thr, eps):
    """out = sparse_ffn(norm(h)) + bd for one token over the given active set, as one compiled call.
    out, h: [D]; bd: [D] or [0]."""
    x = np.empty_like(h)
    norm(x.reshape((1, x.size)), h.reshape((1, h.size)), ffn_norm, ffn_norm_b, eps)
    sparse_ffn(out, acc, x, bundle, bias, active, n_active, kind, thr)
    add_bias(out.reshape((1, out.size)), bd)


@njit(cache=True, nogil=True)
def ffn_batch_block(out, h, ffn_norm, ffn_norm_b, fc1, fc2, threshold, given, bundle, bias, bd, chunks, kind, thr,
                    eps):
    """out = sparse_ffn_batch(norm(h)) + bd for T tokens, token t over its predicted set {i : (fc2 . relu(fc1 .
    h_t))_i >= threshold} (ref.sparse.Selector.pick), or over given[t] where the selector picks without reading the
    logits (the predictor still runs), the union of the sets read once for all, as one compiled call.
    out, h: [T, D]; fc1: [R, D]; fc2: [F, R]; given: [T, F] uint8, or no rows; bd: [D] or [0]; chunks:
    sparse_ffn_batch's accumulators."""
    T, D = h.shape
    F = bundle.shape[0]
    x = np.empty_like(h)
    norm(x, h, ffn_norm, ffn_norm_b, eps)
    logits = np.empty((T, F), np.float32)
    predictor(logits, np.empty((T, n_rows(fc1)), np.float32), h, fc1, fc2)
    if given.shape[0]:
        picked = given  # token t computes neuron i
    else:
        picked = np.empty((T, F), np.uint8)
        for t in range(T):
            for i in range(F):
                picked[t, i] = logits[t, i] >= threshold
    union, mask = np.empty(F, np.int32), np.empty((T, F), np.uint8)
    n = union_mask(union, mask, picked)
    sparse_ffn_batch(out, np.empty((chunks, T, D), np.float32), x, bundle, bias, union, n, mask, kind, thr)
    add_bias(out, bd)


@njit(cache=True, nogil=True)
def decode_step(out, h, layers, seqs, positions, cos, sin, eps, threshold, given, bounds, picks, acc, kind, thr, block,
                out_w, out_b, lm_head):
    """One new token of each of T sequences (token t of sequence seqs[t] at positions[t]) through every block, in
    place on their residual streams h [T, D] (fast.engine's pre_norm_block, post_norm_block or parallel_block by
    the code `block`, BLOCKS): the attention (attention_block for one token, decode_attention_block for several),
    then the FFN over each token's set (step_ffn); then, where `out` has rows, the output head: logits out [T, V] =
    lm_head . norm(h) (Engine.output; out_w, out_b the final norm's, as `norm` takes them).
    layers: a typed list of StepLayer; given, bounds, picks: the sets a pick gives without reading the logits
    (step_ffn).

    One compiled call per step instead of four per layer from Python: once a token's weights have streamed through
    the caches, each return to the interpreter runs from memory (TinyLlama q4_0, 90 % sparse, a 1 GiB read between
    tokens: 1.2 ms of an 11.2 ms token outside the kernels; 8 sequences decoding together, 2 threads, old and new
    processes alternating: q4_0 29.8 to 30.5 -> 29.2 to 29.7 ms a step, f32 106.8 to 108.7 -> 105.4 to 106.4).
    One typed list, since numba types a tuple of typed lists slowly (80 us a call against 1 us) and unboxes each
    typed list argument from cold code after a read pass (about 33 us each); the output head runs here where it can,
    for the same reason."""
    T, F = h.shape[0], layers[0].bundle.shape[0]  # tokens, the bundle's neurons
    a, y = np.empty_like(h), np.empty_like(h)  # [T, D]
    logits, active = np.empty((1, F), np.float32), np.empty(F, np.int32)
    for l in range(len(layers)):
        L = layers[l]
        if block == 2:  # parallel: the FFN reads the layer input too
            step_ffn(y, h, l, L, threshold, given, bounds, picks, logits, active, acc, kind, thr, eps)
        if T == 1:
            attention_block(a, h, L.attn_w, L.attn_b, L.wqkv, L.bqkv, L.wo, L.bo, L.k_slots[seqs[0]],
                            L.v_slots[seqs[0]], cos, sin, positions[0], eps)
        else:
            decode_attention_block(a, h, L.attn_w, L.attn_b, L.wqkv, L.bqkv, L.wo, L.bo, L.k_slots, L.v_slots, seqs,
                                   positions, cos, sin, eps)
        h += a
        norm(h, h, L.post_attn_w, L.post_attn_b, eps)
        if block != 2:
            step_ffn(y, h, l, L, threshold, given, bounds, picks, logits, active, acc, kind, thr, eps)
        h += y
        norm(h, h, L.post_ffn_w, L.post_ffn_b, eps)
    if out.shape[0]:
        x = np.empty_like(h)
        norm(x, h, out_w, out_b, eps)
        matmul(out, x, lm_head)


@njit(inline="always")
def step_ffn(y, h, l, L, threshold, given, bounds, picks, logits, active, acc, kind, thr, eps):
    """y = the FFN block of layer l (L, a StepLayer) of h [T, D] over each token's set: one token's ffn_block over
    the predictor's threshold where `bounds` is empty, else over layer l's given set given[bounds[l]:bounds[l + 1]]
    (a pick that does not read the logits; the predictor still runs where there is one); several tokens'
    ffn_batch_block over picks[l] [T, F], or the threshold where it has no rows (picks [L, 0, 0])."""
    if h.shape[0] > 1:
        ffn_batch_block(y, h, L.ffn_w, L.ffn_b, L.fc1, L.fc2, threshold, picks[l], L.bundle, L.bu, L.bd, acc.shape[0],
                        kind, thr, eps)
        return
    if L.fc1.shape[0]:
        predictor(logits, np.empty((1, n_rows(L.fc1)), np.float32), h, L.fc1, L.fc2)
    if len(bounds):
        ids = given[bounds[l]:bounds[l + 1]]
        n = len(ids)
    else:
        ids = active
        n = predicted_set(active, logits[0], threshold)
    ffn_block(y[0], acc, h[0], L.ffn_w, L.ffn_b, L.bundle, L.bu, L.bd, ids, n, kind, thr, eps)


@njit(cache=True, nogil=True)
def relu_(x):
    for i in range(x.size):
        x.flat[i] = max(x.flat[i], 0.0)


@njit(cache=True, nogil=True)
def predictor(out, hidden, h, fc1, fc2):
    """out = fc2 . relu(fc1 . h) per token, two matmuls (each weight row read once for all T tokens).
    out: [T, F]; hidden: [T, R] scratch; h: [T, D]; fc1: [R, D]; fc2: [F, R].

    fc2 is read whole: trained predictors keep about 96 % of hidden units live (the shipped model's, weighted by
    size), and skipping the dead ones' rows of a transposed fc2 streamed 15 % slower than this matmul saves."""
    matmul(hidden, h, fc1)
    relu_(hidden)
    matmul(out, hidden, fc2)


@njit(cache=True, nogil=True)
def union_mask(union, mask, picked):
    """The union of T tokens' sets as sorted ids into union[:n], and mask[:, :n] = picked's columns of those ids;
    returns n (Engine.active_sets: one call where numpy's any, flatnonzero and take were four; row by row, as picked
    is laid out).  union: [>= F] int32; mask: [T, >= F] uint8; picked: [T, F] uint8 (token t computes neuron i)."""
    T, F = picked.shape
    hit = np.zeros(F, np.uint8)
    for t in range(T):
        for i in range(F):
            hit[i] |= picked[t, i]
    n = 0
    for i in range(F):
        union[n] = i
        n += hit[i] != 0
    for t in range(T):
        for j in range(n):
            mask[t, j] = picked[t, union[j]]
    return n


@njit(cache=True, nogil=True)
def predicted_set(active, logits, threshold):
    """Sorted neuron ids with logit >= threshold into active[:n]; returns n.  active: [>= F].

    Branch-free: whether a neuron passes is a coin toss the branch predictor loses; measured 0.06 vs 0.6 ms per
    TinyLlama token (22 x 5632 fresh logits), 1.5 % of a sparse token."""
    n = 0
    for i in range(logits.shape[0]):
        active[n] = i
        n += logits[i] >= threshold
    return n


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def read_bandwidth_probe(out, a):
    """Sum every row of a [rows, cols] float32 array, several rows in flight per worker: a streaming-read probe."""
    rows, cols = a.shape
    for b in prange(rows // 4):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        r = 4 * b
        for j in range(cols):
            s0 += a[r, j]
            s1 += a[r + 1, j]
            s2 += a[r + 2, j]
            s3 += a[r + 3, j]
        out[b] = s0 + s1 + s2 + s3
