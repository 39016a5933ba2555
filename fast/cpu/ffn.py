"""The FFN: PowerInfer's neuron-aware sparse operator for one token (sparse_ffn) and for several over their sets'
union (sparse_ffn_batch), the dense layout's down half (dense_down), the predictor and its sets, and each as one
compiled block (ffn_block, ffn_batch_block, dense_ffn_block)."""


import numpy as np
from numba import njit, prange
from numba.extending import overload

from fast.quant import (BLOCK, axpy, axpy2t, axpy4, axpy4t, dot, dot2, dot2_2t, dot2_4t, dot2t, dot4, dot4_ahead,
                        dot4t, dot4x4, f16_round, fma, hints_ahead, is_float, load, n_rows, prefetch_span, q8_0_block,
                        quantize_input)
from fast.cpu.base import CATS, FASTMATH, activation, add_bias, chunk_bounds, norm, prefetch_rows, sum_chunks
from fast.cpu.matmul import matmul, put16
from fast.quant.target import ERROR_MODEL, JIT_OPTIONS
from fast.cpu.thin import add_rows, sparse_rows


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
    """Whether a(g, u) (activation) can be nonzero whatever u is: ReLU and dReLU need g > 0, FATReLU g > thr, CATS
    |f(g)| > thr (a(g, 1) != 0); the smooth kinds always."""
    if kind >= CATS:
        return activation(kind, g, np.float32(1.0), thr) != 0
    if kind == 0 or kind == 2:
        return g > 0
    if kind == 1:
        return g > thr
    return True


@njit(inline="always")
def queue_up(gates, up, m, g, j, bundle, active, span):
    """Neuron active[j], whose gate g is open, joins the neurons whose up rows are read next (gates, up [12]: m of
    them, by their place j in the set); its up row is hinted now. -> m + 1."""
    gates[m], up[m] = g, j
    prefetch_rows(bundle, active[j], 1, 2, span)
    return m + 1


@njit(inline="always")
def gated(gates, up, m, a, lo, g, j, bundle, active, bias, span, kind, thr):
    """Neuron active[j] after its first row's product g: a gated neuron whose gate is open waits for its up row
    (queue_up), a non-gated one's activation a(g + bias_i, 1) is a[j - lo]. -> m."""
    if bundle.shape[1] == 3:
        if gate_open(kind, g, thr):
            m = queue_up(gates, up, m, g, j, bundle, active, span)
        return m
    a[j - lo] = activation(kind, g + bias[active[j]] if bias.size else g, np.float32(1.0), thr)
    return m


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def read_up4(gates, up, m, a, lo, bundle, active, x, xq, xd, xs, kind, thr):
    """The four oldest of the m >= 4 waiting up rows read at once, their neurons' activations into a. -> m - 4.
    Compiled once, not inlined at both of chunk_activations' calls: each inlined copy cost a second to compile."""
    u = dot4(bundle[active[up[0]], 1], bundle[active[up[1]], 1], bundle[active[up[2]], 1], bundle[active[up[3]], 1],
             x, xq, xd, xs)
    for k in range(4):  # one inlined activation, not four: each copy costs numba's front end a second to compile
        a[up[k] - lo] = activation(kind, gates[k], u[k], thr)
    for k in range(4, m):
        gates[k - 4], up[k - 4] = gates[k], up[k]
    return m - 4


@njit(fastmath=FASTMATH, inline="always")
def chunk_activations(a, x, xq0, xd0, xs0, bundle, bias, active, lo, hi, kind, thr):
    """a[j - lo] = a(g_i, u_i) (pre_activations) for i = active[j], lo <= j < hi, where the gate is open; the others'
    entries are left as they are (0).  a: [hi - lo]."""
    span = prefetch_span(bundle)
    q = (hi - lo) // 4
    gates, up = np.empty(12, np.float32), np.empty(12, np.int64)  # up rows waiting to be read, < 12
    m = 0
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
        g = (g0, g1, g2, g3)
        for k in range(4):
            m = gated(gates, up, m, a, lo, g[k], j + k * q, bundle, active, bias, span, kind, thr)
        if m >= 8:
            m = read_up4(gates, up, m, a, lo, bundle, active, x, xq0, xd0, xs0, kind, thr)
    for j in range(lo + 4 * q, hi):  # the chunk's last neurons, one at a time
        m = gated(gates, up, m, a, lo, dot(bundle[active[j], 0], x, xq0, xd0, xs0), j, bundle, active, bias, span,
                  kind, thr)
    while m >= 4:
        m = read_up4(gates, up, m, a, lo, bundle, active, x, xq0, xd0, xs0, kind, thr)
    for k in range(m):
        a[up[k] - lo] = activation(kind, gates[k], dot(bundle[active[up[k]], 1], x, xq0, xd0, xs0), thr)


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_ffn_chunk(y, x, xq0, xd0, xs0, bundle, bias, active, lo, hi, kind, thr):
    """y = sparse_ffn over active[lo:hi] (one worker's chunk): the neurons' activations (chunk_activations), then the
    down rows of those whose activation is not 0, in the set's order (add_rows)."""
    a, rows = np.zeros(hi - lo, np.float32), np.empty(hi - lo, np.int64)
    chunk_activations(a, x, xq0, xd0, xs0, bundle, bias, active, lo, hi, kind, thr)
    for j in range(lo, hi):
        rows[j - lo] = active[j]
    y[:] = 0.0
    add_rows(y, a, rows, hi - lo, bundle, bundle.shape[1] - 1, prefetch_span(bundle))


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_ffn(out, acc, x, bundle, bias, active, n_active, kind, thr):
    """out = sum_{j < n_active} a_i down_i, i = active[j], a_i = a(g_i, u_i) (pre_activations): PowerInfer's
    neuron-aware operator, a neuron's rows read as one contiguous bundle.

    out: [D]; acc: [C, D] per-chunk private accumulators; x: [D]; bundle: [F, 3, D] (gate, up, down^T) or [F, 2, D]
    (a non-gated FFN's up, down^T); bias: [F] the non-gated up rows' bias, or [0]; active: [>= n_active].
    Four neurons stream at once, one from each quarter of the chunk (STREAMS), their gate rows first. A lane whose
    next neuron is not adjacent prefetches its gate row; rows in runs have the products hint the next gate rows line
    for line instead (dot4_ahead), so that their misses spread over the step rather than come at once. The rest of a
    bundle is read only where it adds something, four rows at a time: a gated neuron's up row where its gate is open
    (gate_open: a predicted neuron whose ReLU gate is shut has a = 0 whatever u is), hinted as soon as it is known
    to be needed and read a step later; then the down rows where a != 0 (ReLU's zeros in a dense FFN, a predicted
    neuron that does not fire), in the set's order, the next four hinted meanwhile. Worker chunks by neuron
    (chunk_bounds) and down rows in order: a token's sums are sparse_ffn_batch's for it, the same bits.
    """
    C, D = acc.shape
    xq, xd, xs = quantize_input(x.reshape((1, D)), bundle)
    for c in prange(C):
        lo, hi = chunk_bounds(active, n_active, c, C, bundle.shape[0])
        sparse_ffn_chunk(acc[c], x, xq[0], xd[0], xs[0], bundle, bias, active, lo, hi, kind, thr)
    sum_chunks(out, acc)


@njit(fastmath=FASTMATH, inline="always")
def axpy4x4(y, t, a, w0, w1, w2, w3):
    """y[t + k] += sum_n a[4 n + k] w_n for four tokens and four float32 rows (a: dot4x4's order), the rows in order
    (axpy's steps): each row element loaded once for four tokens and each output element once for four rows (a row
    at a time into four tokens, axpy4t, loads and stores the four outputs per row).  y: [T, D]."""
    a00, a01, a02, a03, a10, a11, a12, a13 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    a20, a21, a22, a23, a30, a31, a32, a33 = a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]
    y0, y1, y2, y3 = y[t], y[t + 1], y[t + 2], y[t + 3]
    for d in range(y.shape[1]):
        v0, v1, v2, v3 = w0[d], w1[d], w2[d], w3[d]
        y0[d] = fma(a30, v3, fma(a20, v2, fma(a10, v1, fma(a00, v0, y0[d]))))
        y1[d] = fma(a31, v3, fma(a21, v2, fma(a11, v1, fma(a01, v0, y1[d]))))
        y2[d] = fma(a32, v3, fma(a22, v2, fma(a12, v1, fma(a02, v0, y2[d]))))
        y3[d] = fma(a33, v3, fma(a23, v2, fma(a13, v1, fma(a03, v0, y3[d]))))


TILE_SHARE = 0.45  # pairs of (token, union neuron) computed, from which a float format's batch FFN runs in tiles


def ffn_tiles(y, x, bundle, bias, active, lo, hi, mask, kind, thr):
    """y[t] += the FFN of token t over union neurons lo..hi it computes (sparse_ffn_batch's chunk), in tiles of four
    neurons by four tokens: every token's gate and up products (dot4x4), the activations of those outside a token's
    set zeroed, and the four down rows (decoded once to float32) added for the four tokens at once (axpy4x4). Float
    formats only."""


@overload(ffn_tiles, jit_options=JIT_OPTIONS)
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


@overload(tiled, jit_options=JIT_OPTIONS)
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


@njit(fastmath=FASTMATH, inline="always")
def add_down(y, tokens, acts, n, down):
    """y[tokens[k]] += acts[k] down for the k < n whose activation is not 0 (only they add the down row), the row read
    once for four tokens (axpy4t), then two, then one."""
    m = 0
    for k in range(n):
        tokens[m], acts[m] = tokens[k], acts[k]
        m += acts[k] != 0
    for k in range(0, m - 3, 4):
        axpy4t(y, tokens[k], tokens[k + 1], tokens[k + 2], tokens[k + 3], acts[k], acts[k + 1], acts[k + 2], acts[k + 3],
               down)
    k = m - m % 4
    if m - k >= 2:
        axpy2t(y, tokens[k], tokens[k + 1], acts[k], acts[k + 1], down)
        k += 2
    if k < m:
        axpy(y[tokens[k]], acts[k], down)


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def ffn_neurons(y, x, xq, xd, xs, bundle, bias, active, lo, hi, mask, kind, thr, span):
    """y[t] += the FFN of token t over union neurons lo..hi it computes (sparse_ffn_batch's chunk), a neuron at a
    time: its tokens four at a time (each row element loaded once for four tokens). Block formats read the gate row,
    then the up row only against the tokens whose gate is open (gate_open), float formats the gate and up rows in one
    pass (dot2_4t, which shares the loop); the down row goes only into the tokens whose activation is not 0
    (add_down)."""
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
                gs, us = (g0, g1, g2, g3), (u0, u1, u2, u3)
                for s in range(4):  # one inlined activation (read_up4)
                    acts[k + s] = activation(kind, gs[s] + bi, us[s], thr)
            k = n - n % 4
            if n - k >= 2:  # two more tokens: the power law's usual case at a few sequences
                t0, t1 = tokens[k], tokens[k + 1]
                if P == 3:
                    g0, g1, u0, u1 = dot2_2t(b[0], b[1], x, xq, xd, xs, t0, t1)
                else:
                    g0, g1 = dot2t(b[0], x, xq, xd, xs, t0, t1)
                    u0 = u1 = one
                gs2, us2 = (g0, g1), (u0, u1)
                for s in range(2):
                    acts[k + s] = activation(kind, gs2[s] + bi, us2[s], thr)
                k += 2
            if k < n:
                t = tokens[k]
                g, u = pre_activations(b, bias, i, x[t], xq[t], xd[t], xs[t])
                acts[k] = activation(kind, g, u, thr)
        add_down(y, tokens, acts, n, b[P - 1])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_ffn_batch(out, acc, x, bundle, bias, active, n_active, mask, kind, thr):
    """out[t] = sum over j < n_active with mask[t, j] of a_tj down_i, i = active[j]: each token's sparse FFN
    over its own predicted set, the chunk's neurons (the union of the sets) each read once for all T tokens.

    out: [T, D]; acc: [C, T, D] per-chunk private accumulators; x: [T, D]; bundle, bias: as sparse_ffn's;
    mask: [T, >= n_active] uint8 (token t computes union neuron j). A neuron at a time (ffn_neurons), or where a
    float format's tokens compute TILE_SHARE of the union's pairs, in tiles of four neurons by four tokens
    (ffn_tiles: every pair of a tile computed, the others' activations zeroed): a tile's pair costs about 25 ns
    where a neuron's costs 55 (D = 256), hence TILE_SHARE."""
    C, T, D = acc.shape
    pairs = 0
    if tiled(bundle) and T >= 4:
        for t in range(T):
            for j in range(n_active):
                pairs += mask[t, j] != 0
    tiles = tiled(bundle) and T >= 4 and pairs >= TILE_SHARE * T * n_active
    xq, xd, xs = quantize_input(x, bundle)
    for c in prange(C):
        sparse_ffn_batch_chunk(acc[c], x, xq, xd, xs, bundle, bias, active, n_active, mask, kind, thr, tiles, np.int64(c),
                               C)
    sum_chunks(out.reshape(T * D), acc.reshape((C, T * D)))


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def sparse_ffn_batch_chunk(y, x, xq, xd, xs, bundle, bias, active, n_active, mask, kind, thr, tiles, c, C):
    """y = sparse_ffn_batch's chunk c of C (one worker's, chunk_bounds): tiles, or neurons.  y: [T, D]."""
    y[:] = 0.0
    lo, hi = chunk_bounds(active, n_active, c, C, bundle.shape[0])
    if tiles:
        ffn_tiles(y, x, bundle, bias, active, lo, hi, mask, kind, thr)
    else:
        ffn_neurons(y, x, xq, xd, xs, bundle, bias, active, lo, hi, mask, kind, thr, prefetch_span(bundle))


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def dense_down(out, acc, gu, down, kind, thr):
    """out[t] = sum_i a_ti down_i, a_ti = a(g_ti, u_ti) from gu[t] = (g_t, u_t) over all F neurons: the down half of
    a dense FFN whose gate and up rows ran as one matmul (Engine's dense layout, dense_ffn), as thin.sparse_rows over
    every neuron: a zero activation skips its down row; one token's rows go four at a time, the next four hinted
    meanwhile (the rows that add something are known first: TinyLlama's q4_0 down rows 9.3 -> 6.2 ms a token),
    several tokens' four tokens at a time.

    out: [T, D]; acc: [C, T, D] per-chunk private accumulators; gu: [T, 2F]; down: [F, D] rows of down^T."""
    F = down.shape[0]
    a = np.empty((gu.shape[0], F), np.float32)  # [T, F]
    activations(a, gu, kind, thr)
    sparse_rows(out, acc, a, down, np.arange(F).astype(np.int32), F)


@njit(parallel=True, cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def activations(a, gu, kind, thr):
    """a[t, i] = a(g_ti, u_ti) from gu[t] = (g_t, u_t) over all F neurons (ref.model.ffn_activation): what a down
    matrix stored as llama.cpp's ffn_down [D, F] (rows of down, not of down^T) multiplies.  a: [T, F]; gu: [T, 2F]."""
    T, F = a.shape
    for t in prange(T):
        for i in range(F):
            a[t, i] = activation(kind, gu[t, i], gu[t, F + i], thr)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
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


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
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


@njit(parallel=True, cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
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


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def masked_activation(a, g, u, mask, kind, thr):
    """a[t, j] = a(g[t, j], u[t, j]) where token t computes neuron j (mask), else 0.  a, g, u: [T, U]; mask: [T, >= U]."""
    T, U = g.shape
    for t in prange(T):
        for j in range(U):
            a[t, j] = activation(kind, g[t, j], u[t, j], thr) if mask[t, j] != 0 else 0.0

@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def ffn_block(out, acc, h, ffn_norm, ffn_norm_b, bundle, bias, bd, active, n_active, kind, thr, eps):
    """out = sparse_ffn(norm(h)) + bd for one token over the given active set, as one compiled call.
    out, h: [D]; bd: [D] or [0]."""
    x = np.empty_like(h)
    norm(x.reshape((1, x.size)), h.reshape((1, h.size)), ffn_norm, ffn_norm_b, eps)
    sparse_ffn(out, acc, x, bundle, bias, active, n_active, kind, thr)
    add_bias(out.reshape((1, out.size)), bd)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
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

@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def relu_(x):
    for i in range(x.size):
        x.flat[i] = max(x.flat[i], 0.0)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def predictor(out, hidden, h, fc1, fc2):
    """out = fc2 . relu(fc1 . h) per token, two matmuls (each weight row read once for all T tokens).
    out: [T, F]; hidden: [T, R] scratch; h: [T, D]; fc1: [R, D]; fc2: [F, R].

    fc2 is read whole: trained predictors keep about 96 % of hidden units live (the shipped model's, weighted by
    size), and skipping the dead ones' rows of a transposed fc2 streamed 15 % slower than this matmul saves."""
    matmul(hidden, h, fc1)
    relu_(hidden)
    matmul(out, hidden, fc2)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
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


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def predicted_set(active, logits, threshold):
    """Sorted neuron ids with logit >= threshold into active[:n]; returns n.  active: [>= F].

    Branch-free: whether a neuron passes is a coin toss the branch predictor loses; measured 0.06 vs 0.6 ms per
    TinyLlama token (22 x 5632 fresh logits), 1.5 % of a sparse token."""
    n = 0
    for i in range(logits.shape[0]):
        active[n] = i
        n += logits[i] >= threshold
    return n
