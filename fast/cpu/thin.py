"""Training-free activation sparsity (ref.activation_sparsity): a linear layer's input thinned (thin), and the product
that reads only the rows of the stored transpose W^T that a non-zero input selects (sparse_rows), which is also the
dense layout's down half (ffn.dense_down) and the FFN's down rows."""

import numpy as np
from numba import njit, prange

from fast.cpu.base import FASTMATH, activation, chunk_bounds, prefetch_rows, sum_chunks
from fast.quant import axpy, axpy4, axpy4t
from fast.quant.target import ERROR_MODEL


def kept_py(x, w, t):
    """Whether an input survives: its score |x| w (TEAL: w = 1; WINA: its weight column's norm) above t. Compiled
    for the CPU here and for the GPU in fast.gpu."""
    return abs(x) * w > t


kept = njit(inline="always")(kept_py)


@njit(inline="always")
def union_of(ids, out):
    """ids[:n] the columns of out [T, K] with a non-zero entry, in order. -> n."""
    n = 0
    for i in range(out.shape[1]):
        ids[n] = i
        for t in range(out.shape[0]):
            if out[t, i] != 0:
                n += 1
                break
    return n


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def thin(out, ids, x, w, t):
    """out = x * (|x| w > t) per token (ref.activation_sparsity.Thinning.thin), and ids[:n] the inputs some token
    keeps (one token's: its own), in order. -> n.  out, x: [T, K]; w: [K] score weights; ids: [K] int32."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] if kept(x[r, i], w[i], t) else np.float32(0.0)
    return union_of(ids, out)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def thin_activations(a, ids, gu, bias, kind, thr, w, t):
    """a = the FFN's activations a(g, u) from gu [T, P F] (gated: [g | u]; not: g = gu + bias, u = 1), thinned as
    `thin` does, and the union of the neurons kept. -> n.  a: [T, F]; bias: [F] or [0]; w: [F]; ids: [F] int32."""
    T, F = a.shape
    for r in range(T):
        for i in range(F):
            if gu.shape[1] == 2 * F:
                v = activation(kind, gu[r, i], gu[r, F + i], thr)
            else:
                v = activation(kind, gu[r, i] + bias[i] if bias.size else gu[r, i], np.float32(1.0), thr)
            a[r, i] = v if kept(v, w[i], t) else np.float32(0.0)
    return union_of(ids, a)


@njit(fastmath=FASTMATH, inline="always")
def add_rows(y, vals, rows, n, w, p, span):
    """y += sum_{k < n} vals[k] w[rows[k], p] over the entries whose value is not 0 (vals and rows compacted to them
    in place), in their order (axpy's steps: the same bits as one at a time), four rows at a time, the next four
    hinted (their first `span` bytes) meanwhile.  y: [N]; w: [R, P, N / block]; vals, rows: [>= n]."""
    m = 0
    for k in range(n):
        vals[m], rows[m] = vals[k], rows[k]
        m += vals[k] != 0
    n = m
    for k in range(0, n - 3, 4):
        for r in range(k + 4, min(k + 8, n)):
            prefetch_rows(w, rows[r], p, p + 1, span)
        axpy4(y, vals[k], vals[k + 1], vals[k + 2], vals[k + 3], w[rows[k], p], w[rows[k + 1], p], w[rows[k + 2], p],
              w[rows[k + 3], p])
    for k in range(n - n % 4, n):
        axpy(y, vals[k], w[rows[k], p])


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_rows_chunk(y, x, wt, ids, lo, hi):
    """y = sparse_rows over ids[lo:hi] (one worker's chunk), each token's rows added in the list's order.  y: [T, N]."""
    T = y.shape[0]
    y[:] = 0.0
    if T == 1:  # the rows that add something, four at a time (add_rows)
        vals, rows = np.empty(hi - lo, np.float32), np.empty(hi - lo, np.int64)
        for j in range(lo, hi):
            vals[j - lo], rows[j - lo] = x[0, ids[j]], ids[j]
        add_rows(y[0], vals, rows, hi - lo, wt.reshape((wt.shape[0], 1, wt.shape[1])), 0, wt.shape[1] * wt.itemsize)
    else:  # each row read once for the tokens whose input selects it, four tokens at a time
        vals, toks = np.empty(T, np.float32), np.empty(T, np.int64)
        for j in range(lo, hi):
            i = ids[j]
            m = 0
            for t in range(T):
                vals[m], toks[m] = x[t, i], t
                m += vals[m] != 0
            for k in range(0, m - 3, 4):
                axpy4t(y, toks[k], toks[k + 1], toks[k + 2], toks[k + 3], vals[k], vals[k + 1], vals[k + 2],
                       vals[k + 3], wt[i])
            for k in range(m - m % 4, m):
                axpy(y[toks[k]], vals[k], wt[i])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_rows(out, acc, x, wt, ids, n):
    """out[t] = sum_{j < n} x[t, i] W^T[i], i = ids[j]: W x[t] reading only the rows of the stored transpose that the
    listed inputs select (their union, for several tokens), each row read once, a zero input skipping it (rows
    decoded as they are read: a product over W^T reads x as it is, ref.quant.Transposed). Worker chunks by row
    (chunk_bounds) and each token's rows in order: a token's result is the same bits alone or beside others.

    out: [T, N]; acc: [C, T, N] per-chunk private accumulators; x: [T, K]; wt: [K, N / block] rows of blocks;
    ids: [>= n] int32, sorted."""
    C, T, N = acc.shape
    for c in prange(C):
        lo, hi = chunk_bounds(ids, n, c, C, wt.shape[0])
        sparse_rows_chunk(acc[c], x, wt, ids, lo, hi)
    sum_chunks(out.reshape(T * N), acc.reshape((C, T * N)))
