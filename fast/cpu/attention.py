"""Attention: one sequence's run (attention, self_attention, attention_block), one new token of each of several
sequences (decode_attention, decode_attention_block); causal_logits and normalize_rows for fast.blas's prompt
attention.

The cache is head-major (ref.common.batch.KVCache): a kv head's positions are contiguous. A query's positions are
cut into work items of SPLIT per kv head, each an online softmax over blocks of BLOCK (attend), merged in order
(merge): the cost is one pass over the keys and values at any depth, and a long context's items spread over the
threads even for one token."""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fast.quant import decoded, dot4x4, n_rows, store
from fast.quant.floats import HEADS, axpy_tile, scores_tile
from fast.quant.target import EXACT_MATH, ERROR_MODEL, FLOAT_LANES as LANES
from fast.cpu.base import add_bias, copy_rows, norm, prefetch_row, rope, sum8
from fast.cpu.matmul import matmul


@intrinsic
def bits_f32(typingctx, i):
    """The float32 whose bits are the int32 i (a bitcast, which LLVM vectorises)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a b + c rounded once (llvm.fma, which LLVM vectorises and fastmath's reassociation leaves whole)."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(fastmath=EXACT_MATH, inline="always")
def exp_le0(x):
    """exp(x) in float32 for x <= 0, within 1 ulp (6e-8 relative), in plain arithmetic so that a loop of it
    vectorises (numba's math.exp is a scalar libm call per element: 20 ns a score of decode attention): 2^n e^r with
    n = round(x log2 e), r = x - n ln 2 (|r| <= ln 2 / 2, Taylor to degree 7), 2^n by the exponent bits. Below -87
    (float32's smallest normal) it returns exp(-87), nothing beside a softmax's largest term, 1."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # float32 (math.floor's int64 made it float64)
    # ln 2 in two parts (Cody and Waite), each product subtracted in an fma: as x - n ln2_hi - n ln2_lo, fastmath
    # may fold them into x - n ln 2 (3 ulp at x = -87)
    r = fma_f32(n, np.float32(2.12194440e-4), fma_f32(n, np.float32(-0.693359375), x))  # the first exact
    p = np.float32(1 / 5040)
    p = p * r + np.float32(1 / 720)
    p = p * r + np.float32(1 / 120)
    p = p * r + np.float32(1 / 24)
    p = p * r + np.float32(1 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * bits_f32((np.int32(n) + np.int32(127)) << np.int32(23))


# Positions per work item of attention: each item's softmax over its share is partial, and a serial merge combines a
# query's items in order. A fixed length, so a query's result depends on its position only, not on the thread count
# or on what else the step computes; short contexts are one item per kv head.
SPLIT = 512
BLOCK = 64  # positions per pass of the online softmax: a group's scores [G, BLOCK] stay in L1
NONE = np.float32(-3.0e38)  # the running max before any score: finite, as fastmath assumes (exp_le0 of it is ~0)


@njit(inline="always")
def n_splits(n):
    """The work items of a query that sees n positions, per kv head."""
    return max(1, (n + SPLIT - 1) // SPLIT)


@njit(fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def attend(acc, ml, q, k, v, s0, s1):
    """The online softmax of one kv head's positions s0..s1 for the G query heads that read it (GQA's group):
    acc[g] = sum_s p_gs v[s] and ml[g] = (m_g, l_g), p_gs = exp(q[g] . k[s] / sqrt(E) - m_g) with m_g the largest
    scaled score and l_g = sum_s p_gs (merge turns partials into the softmax).

    Per block of BLOCK positions: the scores (scores_of); the running max, sum and acc rescaled where the max rises;
    the exponentials in one vectorised pass (exp_le0); the values, 4 heads' outputs held in registers over the block
    (axpy_tile), heads left over from the fours or a head dim off the vector lanes row by row. A head's rows are
    contiguous (the cache is head-major), so the reads are two forward streams; rows in f16, bf16 or q8_0 are decoded
    a block at a time (fast.quant.decoded).  acc, q: [G, E]; ml: [G, 2]; k, v: [>= s1, E / block] in the cache's
    formats."""
    G, E = q.shape
    scale = np.float32(1.0 / math.sqrt(E))
    qs, qt = np.empty((G, E), np.float32), np.empty((E, G), np.float32)  # the queries scaled, and transposed
    for g in range(G):
        for e in range(E):
            qs[g, e] = qt[e, g] = q[g, e] * scale
    scores = np.empty((G, BLOCK), np.float32)
    kbuf, vbuf = np.empty((BLOCK, E), np.float32), np.empty((BLOCK, E), np.float32)  # decoded rows
    G4 = G - G % 4 if E % LANES == 0 else 0  # heads in fours through the register tiles; the rest row by row
    for g in range(G):
        ml[g, 0], ml[g, 1] = NONE, 0.0
        for e in range(E):
            acc[g, e] = 0.0
    for b0 in range(s0, s1, BLOCK):
        nb = min(BLOCK, s1 - b0)
        scores_of(scores, qs, qt, decoded(k, b0, nb, kbuf), nb, k, v, b0 + BLOCK, s1)
        for g in range(G):
            m = ml[g, 0]
            for j in range(nb):
                m = max(m, scores[g, j])
            if m > ml[g, 0]:  # rescale what the earlier blocks summed
                c = exp_le0(ml[g, 0] - m)
                ml[g, 0], ml[g, 1] = m, ml[g, 1] * c
                for e in range(E):
                    acc[g, e] *= c
            for j in range(nb):
                scores[g, j] = exp_le0(scores[g, j] - m)
            ml[g, 1] += sum8(scores[g, :nb], np.float32(0.0))
        vb = decoded(v, b0, nb, vbuf)  # [nb, E]
        for g in range(0, G4, 4):  # four heads' outputs in registers over the block
            axpy_tile(acc, scores, vb, g, nb)
        for j in range(0, nb - 3, 4):
            for g in range(G4, G):
                p0, p1, p2, p3 = scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3]
                for e in range(E):
                    acc[g, e] += p0 * vb[j, e] + p1 * vb[j + 1, e] + p2 * vb[j + 2, e] + p3 * vb[j + 3, e]
        for j in range(nb - nb % 4, nb):
            for g in range(G4, G):
                p0 = scores[g, j]
                for e in range(E):
                    acc[g, e] += p0 * vb[j, e]


@njit(fastmath=EXACT_MATH, inline="always")
def scores_of(scores, qs, qt, kb, nb, k, v, ahead, s1):
    """scores[g, j] = qs[g] . kb[j] for j < nb: heads in eights against eight rows at a time (scores_tile: the heads
    in a vector's lanes, so no horizontal sums), the heads left over from the eights in fours against four rows
    (dot4x4: 16 products from 8 loaded rows, summed by one transpose), the rest four rows at a time. With each eight
    rows, the next block's eight rows of k and v (from `ahead`, before s1) are hinted into L2: the hardware prefetcher
    stops at each 4 KiB page (16 rows of a TinyLlama head), and hints spread over the block's work keep the reads
    going through it (a block's hints at once queued ahead of its own loads and lost time).  scores: [G, BLOCK];
    qs: [G, E]; qt: [E, G]; kb: [>= nb, E]; k, v: [S, E / block]."""
    G, E = qs.shape
    G8 = G - G % HEADS
    G4 = G8 + (G - G8) // 4 * 4 if E % LANES == 0 else G8
    n8, n4 = nb - nb % HEADS, nb - nb % 4
    for j in range(0, n8, HEADS):
        rows = max(min(HEADS, s1 - ahead - j), 0)  # the rows to hint, each a run of bytes of its own format
        prefetch_row(k, ahead + j, k.shape[1], rows * k.shape[1] * k.itemsize)
        prefetch_row(v, ahead + j, v.shape[1], rows * v.shape[1] * v.itemsize)
        for g in range(0, G8, HEADS):
            scores_tile(scores, qt, kb, j, g)
    for j in range(0, n4, 4):
        for g in range(G8, G4, 4):
            (s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33) = dot4x4(
                kb[j], kb[j + 1], kb[j + 2], kb[j + 3], qs[g], qs[g + 1], qs[g + 2], qs[g + 3],
                kb[j], kb[j + 1], kb[j + 2], kb[j + 3])  # s_ih: position j + i, head g + h
            scores[g, j], scores[g + 1, j], scores[g + 2, j], scores[g + 3, j] = s00, s01, s02, s03
            scores[g, j + 1], scores[g + 1, j + 1], scores[g + 2, j + 1], scores[g + 3, j + 1] = s10, s11, s12, s13
            scores[g, j + 2], scores[g + 1, j + 2], scores[g + 2, j + 2], scores[g + 3, j + 2] = s20, s21, s22, s23
            scores[g, j + 3], scores[g + 1, j + 3], scores[g + 2, j + 3], scores[g + 3, j + 3] = s30, s31, s32, s33
    for g in range(G4, G):  # heads past the fours, four rows at a time
        for j in range(0, n4, 4):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for e in range(E):
                qe = qs[g, e]
                a0 += qe * kb[j, e]
                a1 += qe * kb[j + 1, e]
                a2 += qe * kb[j + 2, e]
                a3 += qe * kb[j + 3, e]
            scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3] = a0, a1, a2, a3
    for g in range(G):  # the rows the tiles left: past the eights' last eight, or past the last four
        for j in range(n8 if g < G8 else n4, nb):
            a = np.float32(0.0)
            for e in range(E):
                a += qs[g, e] * kb[j, e]
            scores[g, j] = a


@njit(fastmath=EXACT_MATH, inline="always")
def merge(out, acc, ml, first, count):
    """out[g] = the softmax's weighted values from `count` partials acc[first + j], ml[first + j] (attend): each
    rescaled to the largest max, out = sum_j c_j acc_j / sum_j c_j l_j, c_j = exp(m_j - m).  out: [G, E]."""
    G, E = out.shape
    for g in range(G):
        m = NONE
        for j in range(first, first + count):
            m = max(m, ml[j, g, 0])
        total = np.float32(0.0)
        for e in range(E):
            out[g, e] = 0.0
        for j in range(first, first + count):
            c = exp_le0(ml[j, g, 0] - m)
            total += c * ml[j, g, 1]
            for e in range(E):
                out[g, e] += c * acc[j, g, e]
        inv = np.float32(1.0) / total
        for e in range(E):
            out[g, e] *= inv


@njit(inline="always")
def split_items(items, n, K):
    """items[t + 1] = items[t] + K n_splits(n[t]): query t's work items are items[t]..items[t + 1], kv head by kv
    head, each head's n_splits(n[t]) in turn."""
    items[0] = 0
    for t in range(len(n)):
        items[t + 1] = items[t] + K * n_splits(n[t])


@njit(inline="always")
def item(items, n, K, i):
    """Work item i (split_items) as (query t, kv head, first position, end position)."""
    t = np.searchsorted(items, i, side="right") - 1
    ns = n_splits(n[t])
    j = (i - items[t]) % ns
    return t, (i - items[t]) // ns, j * SPLIT, min(n[t], (j + 1) * SPLIT)


@njit(fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def merge_items(out, acc, ml, items, n):
    """out[t, h] = query t's head h from its work items' partials (merge).  out: [T, H, E]. One thread: a merge
    reads G E numbers per item where attend read a SPLIT of positions, less than a parallel launch costs (22 of them
    were a quarter of a decode step's dispatch time)."""
    T, H = out.shape[0], out.shape[1]
    G = acc.shape[1]
    K = H // G
    for tk in range(T * K):
        t, kv = tk // K, tk % K
        ns = n_splits(n[t])
        merge(out[t, kv * G:(kv + 1) * G], acc, ml, items[t] + kv * ns, ns)


@njit(parallel=True, fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def attention(out, q, k, v, pos0):
    """Causal softmax(q k^T / sqrt(E)) v; query head h reads kv head h // (H/K); query t at position pos0 + t.

    Each query's kv heads' positions in items of SPLIT (attend) in parallel, then each query's items merged in order.
    out, q: [T, H, E]; k, v: [K, S, E] (positions 0..S-1; a query sees those up to its own, so S may be a slot's
    whole room)."""
    T, H, E = q.shape
    K, S = k.shape[0], k.shape[1]
    G = H // K
    n = np.empty(T, np.int64)  # [T] positions each query sees (a loop: an array expression here would be one more
    for t in range(T):  # parallel launch)
        n[t] = min(S, pos0 + t + 1)
    items = np.empty(T + 1, np.int64)
    split_items(items, n, K)
    acc, ml = np.empty((items[T], G, E), np.float32), np.empty((items[T], G, 2), np.float32)
    for i in prange(items[T]):
        t, kv, s0, s1 = item(items, n, K, i)
        attend(acc[i], ml[i], q[t, kv * G:(kv + 1) * G], k[kv], v[kv], s0, s1)
    merge_items(out, acc, ml, items, n)


@njit(inline="always")
def store_kv(cache, x, pos0):
    """cache[:, pos0 + t] = x[t] stored in the cache's format (fast.quant.store): a run's keys or values into a
    head-major slot.  cache: [K, room, E / block]; x: [T, K, E]."""
    for t in range(x.shape[0]):
        for kv in range(x.shape[1]):
            store(cache[kv, pos0 + t], x[t, kv])


@njit(parallel=True, fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
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


@njit(parallel=True, fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def normalize_rows(p):
    """p[k, r] /= sum(p[k, r]).  p: [K, R, S]."""
    K, R, S = p.shape
    for kr in prange(K * R):
        row = p[kr // R, kr % R]
        inv = np.float32(1.0) / sum8(row, np.float32(0.0))
        for j in range(S):
            row[j] *= inv


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, qk_norms, wo, bo, k_cache, v_cache, cos, sin, pos0,
                    eps):
    """out = wo . attention(rope(q), rope(k), v) + bo, [q; k; v] = wqkv . norm(h) + bqkv (each head's q and k
    RMS-normed where qk_norms has rows: qk_norm), for one sequence's run; this step's keys and values are written to
    its caches at pos0..pos0+T-1.  out, h: [T, D]; wqkv: [(H + 2K) E, D]; wo: [D, H E]; k_cache, v_cache:
    [K, room, E / block]; norm and biases as `norm`, `add_bias` take them.

    One compiled call per layer instead of six calls from Python and the numpy glue between them: once a token's
    weights have streamed through the caches, every Python-side step runs from memory (an empty parallel kernel
    called from Python: 2 us warm, 17 us after a read pass)."""
    T = h.shape[0]
    K, E = k_cache.shape[0], 2 * cos.shape[1]  # the head dim from the rope tables (a q8_0 slot holds E / 32)
    qkv = np.empty((T, n_rows(wqkv)), np.float32)
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    qk_norm(qkv, qk_norms, K, eps)
    att = np.empty((T, qkv.shape[1] - 2 * K * E), np.float32)  # [T, H E]
    self_attention(att, qkv, k_cache, v_cache, cos, sin, pos0)
    matmul(out, att, wo)
    add_bias(out, bo)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps):
    """qkv = wqkv . norm(h) + bqkv, every token's row read once.  qkv: [T, (H + 2K) E]; h: [T, D]."""
    x = np.empty_like(h)
    norm(x, h, attn_norm, attn_norm_b, eps)
    matmul(qkv, x, wqkv)
    add_bias(qkv, bqkv)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def qk_norm(qkv, norms, K, eps):
    """Each head's q and k in the rows qkv [T, (H + 2K) E] RMS-normed in place, q's with norms[0] and k's with
    norms[1] (Qwen3's q_norm and k_norm, ref.model's qkv), where norms has rows.  norms: [2, E] or [0, 0]."""
    if norms.shape[0] == 0:
        return
    E = norms.shape[1]
    H = qkv.shape[1] // E - 2 * K
    for t in range(qkv.shape[0]):
        for head in range(H + K):
            w, x = norms[0 if head < H else 1], qkv[t, head * E:(head + 1) * E]
            ss = np.float32(0.0)
            for i in range(E):
                ss += x[i] * x[i]
            r = np.float32(1.0) / np.sqrt(ss / np.float32(E) + eps)
            for i in range(E):
                x[i] = x[i] * r * w[i]


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def self_attention(att, qkv, k_cache, v_cache, cos, sin, pos0):
    """att = attention(rope(q), rope(k), v) of one sequence's run at positions pos0..pos0+T-1, its keys and values
    appended to the sequence's caches.  att: [T, H E]; qkv: [T, (H + 2K) E]; k_cache, v_cache:
    [K, room, E / block]."""
    T = qkv.shape[0]
    K, E = k_cache.shape[0], 2 * cos.shape[1]  # the head dim from the rope tables (a q8_0 slot holds E / 32)
    H = qkv.shape[1] // E - 2 * K
    q = np.ascontiguousarray(qkv[:, : H * E]).reshape((T, H, E))  # [T, H, E]
    k = np.ascontiguousarray(qkv[:, H * E:(H + K) * E]).reshape((T, K, E))  # [T, K, E]
    rope(q, q, cos, sin, pos0)
    rope(k, k, cos, sin, pos0)
    store_kv(k_cache, k, pos0)
    store_kv(v_cache, np.ascontiguousarray(qkv[:, (H + K) * E:]).reshape((T, K, E)), pos0)
    out = np.empty((T, H, E), np.float32)
    attention(out, q, k_cache, v_cache, pos0)  # whole slots (C-contiguous rows: vectorised); a query reads up to itself
    copy_rows(att, out.reshape((T, H * E)))


@njit(parallel=True, fastmath=EXACT_MATH, cache=True, nogil=True, error_model=ERROR_MODEL)
def decode_attention(att, qkv, k_caches, v_caches, seqs, positions, cos, sin):
    """self_attention for T sequences' one new token each, in one call: token t of sequence seqs[t] at positions[t]
    appends its key and value to that sequence's caches and attends to them.  att: [T, H E]; qkv: [T, (H + 2K) E];
    k_caches, v_caches: typed lists of every slot's [K, room, E / block] arrays.

    One call per layer instead of one per sequence (13 us each): every token's kv heads' work items (attention's) in
    one parallel loop, then the merges."""
    T = qkv.shape[0]
    K, E = k_caches[seqs[0]].shape[0], 2 * cos.shape[1]  # the head dim (a q8_0 slot holds E / 32)
    H = qkv.shape[1] // E - 2 * K
    G = H // K
    q = np.empty((T, H, E), np.float32)
    k = np.empty((1, K, E), np.float32)
    for t in range(T):
        p = positions[t]
        rope(q[t:t + 1], qkv[t, : H * E].reshape((1, H, E)), cos, sin, p)
        rope(k, qkv[t, H * E:(H + K) * E].reshape((1, K, E)), cos, sin, p)
        store_kv(k_caches[seqs[t]], k, p)
        store_kv(v_caches[seqs[t]], qkv[t, (H + K) * E:].reshape((1, K, E)), p)
    n = positions + 1  # [T] positions each token sees
    items = np.empty(T + 1, np.int64)
    split_items(items, n, K)
    acc, ml = np.empty((items[T], G, E), np.float32), np.empty((items[T], G, 2), np.float32)
    for i in prange(items[T]):
        t, kv, s0, s1 = item(items, n, K, i)
        attend(acc[i], ml[i], q[t, kv * G:(kv + 1) * G], k_caches[seqs[t]][kv], v_caches[seqs[t]][kv], s0, s1)
    merge_items(att.reshape((T, H, E)), acc, ml, items, n)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def decode_attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, qk_norms, wo, bo, k_caches, v_caches, seqs,
                           positions, cos, sin, eps):
    """attention_block for T sequences' one new token each (decode_attention), as one compiled call: token t of
    sequence seqs[t] at positions[t].  out, h: [T, D]; k_caches, v_caches: typed lists of every slot's
    [K, room, E / block].

    One compiled call instead of four calls from Python and the numpy glue between them per layer (with
    ffn_batch_block likewise, the shipped model's 16-sequence step 6 % faster)."""
    T = h.shape[0]
    K, E = k_caches[seqs[0]].shape[0], 2 * cos.shape[1]  # the head dim (a q8_0 slot holds E / 32)
    qkv = np.empty((T, n_rows(wqkv)), np.float32)  # [T, (H + 2K) E]
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    qk_norm(qkv, qk_norms, K, eps)
    att = np.empty((T, qkv.shape[1] - 2 * K * E), np.float32)  # [T, H E]
    decode_attention(att, qkv, k_caches, v_caches, seqs, positions, cos, sin)
    matmul(out, att, wo)
    add_bias(out, bo)
