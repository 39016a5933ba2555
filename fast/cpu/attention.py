"""Attention: one sequence's run (attention, self_attention, attention_block), one new token of each of several
sequences (decode_attention, decode_attention_block); causal_logits and normalize_rows for fast.blas's prompt
attention."""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from fast.quant import n_rows
from fast.cpu.base import FASTMATH, add_bias, copy_rows, norm, prefetch, prefetch_row, rope
from fast.cpu.matmul import matmul


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
    Rows KV_AHEAD positions on are hinted into the cache: a kv head's rows are K E floats apart, which the hardware prefetcher does not follow.
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
def attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, qk_norms, wo, bo, k_cache, v_cache, cos, sin, pos0,
                    eps):
    """out = wo . attention(rope(q), rope(k), v) + bo, [q; k; v] = wqkv . norm(h) + bqkv (each head's q and k
    RMS-normed where qk_norms has rows: qk_norm), for one sequence's run; this step's keys and values are written to
    its caches at pos0..pos0+T-1.  out, h: [T, D]; wqkv: [(H + 2K) E, D]; wo: [D, H E]; k_cache, v_cache:
    [room, K, E]; norm and biases as `norm`, `add_bias` take them.

    One compiled call per layer instead of six calls from Python and the numpy glue between them: once a token's
    weights have streamed through the caches, every Python-side step runs from memory (an empty parallel kernel
    called from Python: 2 us warm, 17 us after a read pass)."""
    T = h.shape[0]
    K, E = k_cache.shape[1], k_cache.shape[2]
    qkv = np.empty((T, n_rows(wqkv)), np.float32)
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    qk_norm(qkv, qk_norms, K, eps)
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

    One call per layer instead of one per sequence (13 us each); tokens in parallel, each token's kv heads in turn
    (attend: a group's query heads together). A worker hints the next token's cached keys and values while it runs
    one: the slots are in no cache by the next step."""
    T = qkv.shape[0]
    for t in prange(T):
        decode_attention_token(att[t], qkv, k_caches, v_caches, seqs, positions, cos, sin, np.int64(t))


@njit(cache=True, nogil=True)
def decode_attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, qk_norms, wo, bo, k_caches, v_caches, seqs,
                           positions, cos, sin, eps):
    """attention_block for T sequences' one new token each (decode_attention), as one compiled call: token t of
    sequence seqs[t] at positions[t].  out, h: [T, D]; k_caches, v_caches: typed lists of every slot's [room, K, E].

    One compiled call instead of four calls from Python and the numpy glue between them per layer (with
    ffn_batch_block likewise, the shipped model's 16-sequence step 6 % faster)."""
    T = h.shape[0]
    K, E = k_caches[seqs[0]].shape[1], k_caches[seqs[0]].shape[2]
    qkv = np.empty((T, n_rows(wqkv)), np.float32)  # [T, (H + 2K) E]
    qkv_proj(qkv, h, attn_norm, attn_norm_b, wqkv, bqkv, eps)
    qk_norm(qkv, qk_norms, K, eps)
    att = np.empty((T, qkv.shape[1] - 2 * K * E), np.float32)  # [T, H E]
    decode_attention(att, qkv, k_caches, v_caches, seqs, positions, cos, sin)
    matmul(out, att, wo)
    add_bias(out, bo)
