"""matmul: x @ w.T for every weight format and layout, each weight row read once for all tokens."""


import numpy as np
from numba import njit, prange
from numba.extending import overload

from fast.quant import (ROWS, block_dot8, block_dot8_4t, block_dot8x2_4t, block_dot8x4, dot, dot4, dot4t, dot4x4,
                        interleaved, is_float, quantize_input)
from fast.cpu.base import FASTMATH
from fast.quant.target import ERROR_MODEL, JIT_OPTIONS


# Row chunks per matmul: one per MiB of weights (256 KiB per stream: 64 chunks lost 12 % on a predictor's fc1
# [512, 2048] and 4 % on its fc2 [5632, 512] against 8 or 16), at least 16 to keep 16 cores busy, at most 64.
MATMUL_CHUNKS = (16, 64, 1 << 18)  # fewest, most, weights per chunk

@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def matmul(out, x, w):
    """out = x @ w.T, each weight row read once for all T tokens.  out: [T, N], x: [T, K], w: [N, K] (or a block
    format's [N, K / 32], or its interleaved groups [N / 8, K / 32]: fast.quant.INTERLEAVED).

    Each chunk of rows streams as four quarters (STREAMS). A row's sum does not depend on the chunks, so neither do
    the results. Block formats with 4 or more tokens are compute-bound: a row goes against four tokens at a time
    (dot4t unpacks each block once: [8, 2048] x [5632, 2048] q4_0 in 1.0 ms instead of 1.85). Float formats with 4
    or more tokens: 4 x 4 tiles (tile4x4) whose rows come one from each quarter, so that the tiles stream too.
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
    (dot4x4), hinting the next four (n + 1, ...) into L2: twice the GFLOPS of one token at a time."""
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


def group_rows(out, x, w, xq, xd, xs, lo, hi):
    """matmul_rows of interleaved q8_0 / q4_0 groups lo..hi: four tokens against two groups at once (each group
    unpacked once per four tokens), or one token against four groups."""
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


def float_rows(out, x, w, xq, xd, xs, lo, hi):
    """matmul_rows of float rows: tiles of four rows by four tokens (tile4x4), fewer tokens as row streams."""
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


def block_rows(out, x, w, xq, xd, xs, lo, hi):
    """matmul_rows of plain q8_0 / q4_0 rows: each row unpacked once per four tokens (dot4t)."""
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


@overload(matmul_rows, jit_options=JIT_OPTIONS)
def _matmul_rows(out, x, w, xq, xd, xs, lo, hi):
    return group_rows if interleaved(w) else float_rows if is_float(w) else block_rows
