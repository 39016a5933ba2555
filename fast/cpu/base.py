"""The small kernels every block uses: norms, embeddings, biases, RoPE, the FFN activations, prefetch hints, the
serial reduction of workers' chunks; and the read-bandwidth probe."""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fast.quant import axpy
from fast.quant.target import ERROR_MODEL, EXACT_MATH, FASTMATH


# FFN kinds as kernel constants (ref.model.ffn_activation's names).
KINDS = {"relu": 0, "fatrelu": 1, "drelu": 2, "silu": 3, "gelu": 4}
BLOCKS = {"pre_norm": 0, "post_norm": 1, "parallel": 2, "parallel_shared": 2}  # decode_step's block codes

# Every kernel releases the GIL (nogil=True): fast.serve's engine thread runs them while the HTTP event loop answers
# /health and streams other requests' tokens.

@njit(fastmath=EXACT_MATH, inline="always")
def dot8(x, y, zero):
    """sum_i x[i] y[i] over eight running sums (sum k takes i = k, k + 8, ...; the tail sum 0), then added in one
    fixed tree; the sums start at `zero`, whose type they take. An order of its own, the same in every kernel it is
    compiled into (EXACT_MATH: no reassociation), which LLVM still vectorises: eight independent lanes.  x, y: [n]."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    for i in range(0, n - n % 8, 8):
        s0 += x[i] * y[i]
        s1 += x[i + 1] * y[i + 1]
        s2 += x[i + 2] * y[i + 2]
        s3 += x[i + 3] * y[i + 3]
        s4 += x[i + 4] * y[i + 4]
        s5 += x[i + 5] * y[i + 5]
        s6 += x[i + 6] * y[i + 6]
        s7 += x[i + 7] * y[i + 7]
    for i in range(n - n % 8, n):
        s0 += x[i] * y[i]
    return ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))


@njit(fastmath=EXACT_MATH, inline="always")
def sum8(x, zero):
    """sum_i x[i] in dot8's order.  x: [n]."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    for i in range(0, n - n % 8, 8):
        s0 += x[i]
        s1 += x[i + 1]
        s2 += x[i + 2]
        s3 += x[i + 3]
        s4 += x[i + 4]
        s5 += x[i + 5]
        s6 += x[i + 6]
        s7 += x[i + 7]
    for i in range(n - n % 8, n):
        s0 += x[i]
    return ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))


# rmsnorm and rope run serially: waking the other workers costs 8 to 16 us, more than their whole work at decode.
@njit(fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def rmsnorm(out, x, w, eps):
    """out = x / sqrt(mean(x^2) + eps) * w.  out, x: [T, D], w: [D]."""
    T, D = x.shape
    for t in range(T):
        r = 1.0 / math.sqrt(dot8(x[t], x[t], 0.0) / D + eps)
        for d in range(D):
            out[t, d] = x[t, d] * r * w[d]


@njit(fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def layernorm(out, x, w, b, eps):
    """out = (x - mean(x)) / sqrt(var(x) + eps) * w + b.  out, x: [T, D], w, b: [D]."""
    T, D = x.shape
    for t in range(T):
        m = sum8(x[t], 0.0) / D
        for d in range(D):
            out[t, d] = x[t, d] - m  # out may be x
        r = 1.0 / math.sqrt(dot8(out[t], out[t], 0.0) / D + eps)
        for d in range(D):
            out[t, d] = out[t, d] * r * w[d] + b[d]


@njit(inline="always")
def copy_rows(out, x):
    """out[t, j] = x[t, j], element by element: an array assigned to a slice (out[:] = x) compiles numba's shape
    error message, a few seconds of the first run's compile for each kernel that has one.  out, x: [T, N]."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[t, j] = x[t, j]


@njit(fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def norm(out, x, w, b, eps):
    """The norm a layout stores (fast.layers.Layer): none (w empty: out = x), RMSNorm (w), LayerNorm (w and b).
    out may be x.  out, x: [T, D]; w, b: [D] or [0]."""
    if w.size == 0:
        copy_rows(out, x)
    elif b.size == 0:
        rmsnorm(out, x, w, eps)
    else:
        layernorm(out, x, w, b, eps)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def embed(out, table, ids):
    """out[t] = table[ids[t]] as float32 values: rows of an embedding in any format, the values ref.quant.values
    gives (a q4_0 row through numpy: 80 to 130 us a token, TinyLlama's 2048 wide).  out: [T, W]; ids: [T]."""
    for t in range(ids.size):
        out[t] = 0.0
        axpy(out[t], np.float32(1.0), table[ids[t]])


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def add_bias(out, b):
    """out[t] += b for every row, where there is a bias (b: [N] or [0]).  out: [T, N]."""
    if b.size:
        for t in range(out.shape[0]):
            for n in range(b.size):
                out[t, n] += b[n]

@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
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

CATS = 8  # added to a kind: CATS's criterion on it (ref.activation_sparsity), a(g, u) where |a(g, 1)| > thr, else 0


def activation_py(kind, g, u, thr):
    """a(g, u) of ref.model.ffn_activation for one neuron, f(g) u (dReLU: f(g) relu(u)); a kind plus CATS: that
    where |f(g)| > thr, else 0 (ref.activation_sparsity.cats_ffn_block; its base kind's own threshold 0). Compiled
    for the CPU here and for the GPU in fast.gpu."""
    base, t = kind % CATS, thr if kind < CATS else 0.0
    if base == 0 or base == 2:
        f = g if g > 0 else 0.0
    elif base == 1:
        f = g if g > t else 0.0
    elif base == 3:
        f = g / (1.0 + math.exp(-g))
    else:
        f = 0.5 * g * (1.0 + math.erf(g * 0.7071067811865476))
    if kind >= CATS and not abs(f) > thr:
        return 0.0
    if base == 2:
        return f * u if u > 0 else 0.0
    return f * u


activation = njit(inline="always")(activation_py)


@njit(inline="always")
def chunk_bounds(ids, n, c, C, N):
    """(lo, hi): the part of the sorted list ids[:n] of N rows that worker chunk c of C takes, the rows c N / C <= i <
    (c + 1) N / C. Chunks fixed by row, not by list position, so that a row's product joins the same partial sum
    (sum_chunks) whichever rows the other tokens of a step list, and a token's result is the same bits beside any."""
    return np.searchsorted(ids[:n], c * N // C), np.searchsorted(ids[:n], (c + 1) * N // C)


@njit(fastmath=FASTMATH, inline="always")
def sum_chunks(out, acc):
    """out = sum over chunks of acc, in chunk order (the serial reduction after the workers).  out: [N]; acc: [C, N].
    Chunk by chunk, so that the loop over N vectorises."""
    C, N = acc.shape
    for n in range(N):
        out[n] = acc[0, n]
    for c in range(1, C):
        for n in range(N):
            out[n] += acc[c, n]

@njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model=ERROR_MODEL)
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
