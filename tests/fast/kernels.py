"""Each fast kernel beside its ref twin: fresh random inputs -> (run the fast kernel from a module, ref's answer).

One table (SHAPES) serves the CPU kernels and the GPU kernels, which mirror the same names and signatures; its
`sim` entries are small enough for the CUDA simulator, and a device runs them all (scripts/device_check.sh).
"""

import numpy as np

from fast.cpu import KINDS, TILE_SHARE
from fast.quant import INTERLEAVED, ROWS, for_sparse, interleave, layout_of
from ref.model import attention as ref_attention
from ref.model import ffn_activation
from ref.quant import blocks, input_values, quantize, values
from ref.model import layernorm as ref_layernorm
from ref.model import rmsnorm as ref_rmsnorm
from ref.model import rope as ref_rope
from ref.sparse import predicted_set as ref_predicted_set
from ref.sparse import predictor_logits, sparse_ffn as ref_sparse_ffn

F32 = np.float32
EMPTY = np.zeros(0, F32)  # an absent norm or bias, as the kernels take it


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def stored(w, fmt):
    """Weights w [..., n] in a format's kernel storage (its blocks), the values they mean in float64, and what a
    product with them reads of an input x (ref.quant.input_values)."""
    t = quantize(w, fmt)
    b = blocks(t)
    return b, values(b).astype(np.float64), lambda x: input_values(np.asarray(x, np.float64), t)


def case_rmsnorm(rng, T, D):
    x, w = randn(rng, T, D, scale=3), randn(rng, D)
    out = np.empty_like(x)
    return lambda k: (k.rmsnorm(out, x, w, 1e-5), out)[1], ref_rmsnorm(x, w, 1e-5)


NORMS = ("none", "rms", "layer")


def norm_weights(rng, D, norm):
    """A layout's norm weights (fast.cpu.norm: none, RMSNorm, LayerNorm) and ref's function of x [T, D]."""
    w, b = randn(rng, D), randn(rng, D)
    if norm == "none":
        return EMPTY, EMPTY, lambda x: x
    if norm == "rms":
        return w, EMPTY, lambda x: ref_rmsnorm(x, w.astype(np.float64), 1e-5)
    return w, b, lambda x: ref_layernorm(x, w.astype(np.float64), b.astype(np.float64), 1e-5)


def case_norm(rng, T, D, norm):
    x = randn(rng, T, D, scale=3) + 1
    w, b, want = norm_weights(rng, D, norm)
    out = np.empty_like(x)
    return lambda k: (k.norm(out, x, w, b, 1e-5), out)[1], want(x.astype(np.float64))


def case_add_bias(rng, T, N, bias=True):
    x, b = randn(rng, T, N), randn(rng, N) if bias else EMPTY
    return lambda k: (lambda out: (k.add_bias(out, b), out)[1])(x.copy()), x + (b if bias else 0)


def case_embed(rng, T, V, W, fmt="f32"):
    """Rows ids [T] of an embedding table [V, W] in a format, as the values they mean (ref.quant.values)."""
    (table, values_, _), ids = stored(randn(rng, V, W), fmt), rng.integers(0, V, T)
    out = np.empty((T, W), F32)
    return lambda k: (k.embed(out, table, ids), out)[1], values_[ids]


def case_matmul(rng, T, N, K, fmt="f32", interleaved=False):
    x, (w, wv, read) = randn(rng, T, K), stored(randn(rng, N, K), fmt)
    w = interleave(w) if interleaved else w  # fast.quant.INTERLEAVED: the CPU engine's q8_0 and q4_0 matrices
    out = np.empty((T, N), F32)
    return lambda k: (k.matmul(out, x, w), out)[1], read(x) @ wv.T


def rope_tables_for(E, theta=500.0):
    """fast.engine's cos, sin tables [P, E/2] for head dim E."""
    from fast.engine import rope_tables
    from ref.common.config import ModelConfig
    from tests.helpers import SMALL_CONFIG
    return rope_tables(ModelConfig.from_dict({**SMALL_CONFIG, "hidden_size": 2 * E, "num_attention_heads": 2,
                                              "num_key_value_heads": 2, "rope_theta": theta,
                                              "max_position_embeddings": 2048}))


def case_rope(rng, T, h, E, pos0):
    cos, sin = rope_tables_for(E)
    x = randn(rng, T, h, E)
    out = np.empty_like(x)
    return lambda k: (k.rope(out, x, cos, sin, pos0), out)[1], ref_rope(x.astype(np.float64), np.arange(pos0, pos0 + T), 500.0)


def case_attention(rng, T, S, H, K, E, kv=("f32", "f32")):
    """Keys and values head-major, each in a KV cache format (stored: ref attends over the values they mean)."""
    q = randn(rng, T, H, E)
    (kc, kf, _), (vc, vf, _) = stored(randn(rng, K, S, E), kv[0]), stored(randn(rng, K, S, E), kv[1])
    pos0 = S - T
    out = np.empty_like(q)
    return (lambda k: (k.attention(out, q, kc, vc, pos0), out)[1],
            ref_attention(q.astype(np.float64), kf, vf, np.arange(pos0, S)))


def case_store_kv(rng, T, K, E, room, pos0, kv="f32"):
    """A run's keys into a head-major slot in a KV format at pos0..pos0+T-1 (rounded, or quantized, as ref.quant
    stores them: compared as the values they mean); the other positions untouched."""
    cache, x = stored(randn(rng, K, room, E), kv)[0], randn(rng, T, K, E, scale=3)
    want = values(cache).copy()
    want[:, pos0:pos0 + T] = stored(x.transpose(1, 0, 2), kv)[1]
    return lambda k: (lambda c: (k.store_kv(c, x, pos0), values(c))[1])(cache.copy()), want


def attention_weights(rng, H, K, E, D, fmt="f32", norm="rms", bias=False, qk_norm=False):
    """A block's attention weights in a format's storage (norm, q k v and o projections, biases where asked, each
    head's q and k norms where asked, rope tables) and ref's block for one sequence's run h [T, D] whose positions
    before pos0 are cached in kc, vc."""
    w, wb, normed = norm_weights(rng, D, norm)
    (wqkv_b, wqkv, read_qkv), (wo_b, wo, read_o) = stored(randn(rng, (H + 2 * K) * E, D), fmt), stored(randn(rng, D, H * E), fmt)
    bqkv, bo = (randn(rng, (H + 2 * K) * E), randn(rng, D)) if bias else (EMPTY, EMPTY)
    qk_norms = 1 + randn(rng, 2, E, scale=0.3) if qk_norm else np.zeros((0, 0), F32)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731

    def want(h, kc, vc, pos0, kv_round=None, kv=None):
        T = h.shape[0]
        qkv = read_qkv(normed(f64(h))) @ wqkv.T + (bqkv if bias else 0)  # [T, (H + 2K) E]
        q, k, v = np.split(qkv, [H * E, (H + K) * E], axis=1)
        q, k = q.reshape(T, H, E), k.reshape(T, K, E)
        if qk_norm:  # ref.model's qkv
            q, k = ref_rmsnorm(q, f64(qk_norms[0]), 1e-5), ref_rmsnorm(k, f64(qk_norms[1]), 1e-5)
        pos = np.arange(pos0, pos0 + T)
        q, k = ref_rope(q, pos, 500.0), ref_rope(k, pos, 500.0)
        k, v = k.transpose(1, 0, 2), v.reshape(T, K, E).transpose(1, 0, 2)  # [K, T, E]
        if kv_round is not None:  # this run's keys and values as a cache in formats kv stores them
            k, v = kv_round(k, kv[0]), kv_round(v, kv[1])
        keys = np.concatenate([f64(kc[:, :pos0]), k], axis=1)  # [K, pos0 + T, E]
        values = np.concatenate([f64(vc[:, :pos0]), v], axis=1)
        return read_o(ref_attention(q, keys, values, pos).reshape(T, H * E)) @ wo.T + (bo if bias else 0)  # [T, D]
    return (w, wb, wqkv_b, bqkv, qk_norms, wo_b, bo, *rope_tables_for(E)), want


def case_attention_block(rng, T, S, H, K, E, D, fmt="f32", norm="rms", bias=False, qk_norm=False):
    """The fast block against ref's norm, projections (with biases where asked), q and k norms (where asked), rope
    and attention; positions before S - T are cached."""
    h = randn(rng, T, D)
    (w, wb, wqkv, bqkv, qk_norms, wo, bo, cos, sin), want = attention_weights(rng, H, K, E, D, fmt, norm, bias, qk_norm)
    kc, vc = randn(rng, K, S + 2, E), randn(rng, K, S + 2, E)  # capacity S + 2: the rows after S stay unread
    out = np.empty((T, D), F32)
    return (lambda k: (k.attention_block(out, h, w, wb, wqkv, bqkv, qk_norms, wo, bo, kc.copy(), vc.copy(), cos, sin,
                                         S - T, 1e-5), out)[1], want(h, kc, vc, S - T))


def case_decode_attention_block(rng, T, S, H, K, E, D, fmt="f32", norm="rms", bias=False, qk_norm=False,
                                kv=("f32", "f32")):
    """T sequences' one new token each, in slots given out of order beside a free slot (an empty array), at positions
    0 to S - 1, keys and values in KV formats `kv`: each token's row as ref's block of its own sequence."""
    from numba.typed import List
    h = randn(rng, T, D)
    (w, wb, wqkv, bqkv, qk_norms, wo, bo, cos, sin), want = attention_weights(rng, H, K, E, D, fmt, norm, bias, qk_norm)
    seqs = rng.permutation(T + 1)[:T].astype(np.int64)  # slot T + 1's one left free
    positions = rng.integers(0, S, T).astype(np.int64)
    kcs, vcs = ([stored(randn(rng, K, S + 1, E), f)[0] for _ in range(T + 1)] for f in kv)
    free = next(s for s in range(T + 1) if s not in seqs)
    kcs[free], vcs[free] = (stored(np.zeros((K, 1, E)), f)[0][:, :0] for f in kv)
    out = np.empty((T, D), F32)
    # the new token's key and value are stored in the slot's format too: ref reads them back rounded
    kv_round = (lambda x, f: stored(x, f)[1])
    return (lambda k: (k.decode_attention_block(out, h, w, wb, wqkv, bqkv, qk_norms, wo, bo, List([a.copy() for a in kcs]),
                                                List([a.copy() for a in vcs]), seqs, positions, cos, sin, 1e-5), out)[1],
            np.concatenate([want(h[t:t + 1], values(kcs[seqs[t]]), values(vcs[seqs[t]]), positions[t],
                                 kv_round if kv != ("f32", "f32") else None, kv) for t in range(T)]))


def ffn_weights(rng, F, D, fmt, gated, runs=False):
    """A neuron bundle in a format's storage ([F, 3, D] gated, [F, 2, D] not; rows scaled so activations stay O(1);
    q8_0 / q4_0 rows in runs where asked, as the engine lays them out: fast.quant.for_sparse), the non-gated up rows'
    bias, and ref.sparse.sparse_ffn of one token x over a set."""
    bundle, bv, read = stored(randn(rng, F, 3 if gated else 2, D, scale=0.5), fmt)
    if runs:
        bundle = for_sparse(bundle)
        assert layout_of(bundle).name == "runs"
    bu = EMPTY if gated else randn(rng, F, scale=0.5)

    def want(x, active, kind):
        return ref_sparse_ffn(read(x), bv[:, 0] if gated else None, bv[:, -2], bv[:, -1].T, active, kind, 0.1,
                              np.float64, None if gated else bu)
    return bundle, bu, want


def case_sparse_ffn(rng, F, D, n_active, kind, chunks=3, fmt="f32", gated=True, runs=False):
    x = randn(rng, D)
    bundle, bu, want = ffn_weights(rng, F, D, fmt, gated, runs)
    active = np.sort(rng.choice(F, n_active, replace=False)).astype(np.int32)
    out, acc = np.empty(D, F32), np.empty((chunks, D), F32)
    return (lambda k: (k.sparse_ffn(out, acc, x, bundle, bu, active, n_active, KINDS[kind], F32(0.1)), out)[1],
            want(x, active, kind))


def case_sparse_ffn_batch(rng, T, F, D, kind, chunks=3, fmt="f32", empty=False, full=False, gated=True, runs=False,
                          sizes=(0.0, 1.0)):
    """T tokens, each with its own predicted set of a share of the F neurons drawn from `sizes` (one empty, one full
    where asked), over the union of the sets. Float formats run sets denser than fast.cpu.TILE_SHARE of the union in
    tiles, sparser ones a neuron at a time: sizes (0.7, 1) ask for the one, (0, 0.15) for the other."""
    x = randn(rng, T, D)
    bundle, bu, want = ffn_weights(rng, F, D, fmt, gated, runs)
    sets = [np.sort(rng.choice(F, rng.integers(int(sizes[0] * F), int(sizes[1] * F) + 1), replace=False)).astype(np.int32)
            for _ in range(T)]
    if empty:
        sets[0] = np.empty(0, np.int32)
    if full:
        sets[-1] = np.arange(F, dtype=np.int32)
    union = np.unique(np.concatenate(sets)).astype(np.int32)
    mask = np.zeros((T, max(len(union), 1)), np.uint8)
    for t, a in enumerate(sets):
        mask[t, np.searchsorted(union, a)] = 1
    density = mask.sum() / mask.size  # the case runs the path it asks for
    assert (sizes[0] < 0.7 or density >= TILE_SHARE) and (sizes[1] > 0.15 or density < TILE_SHARE), density
    out, acc = np.empty((T, D), F32), np.empty((chunks, T, D), F32)
    return (lambda k: (k.sparse_ffn_batch(out, acc, x, bundle, bu, union, len(union), mask, KINDS[kind], F32(0.1)),
                       out)[1],
            np.stack([want(x[t], sets[t], kind) for t in range(T)]))


def case_ffn_block(rng, F, D, n_active, kind, chunks=3, fmt="f32", norm="rms", gated=True, runs=False):
    h = randn(rng, D, scale=3)
    w, b, normed = norm_weights(rng, D, norm)
    bundle, bu, want = ffn_weights(rng, F, D, fmt, gated, runs)
    bd = EMPTY if gated else randn(rng, D)
    active = np.sort(rng.choice(F, n_active, replace=False)).astype(np.int32)
    out, acc = np.empty(D, F32), np.empty((chunks, D), F32)
    return (lambda k: (k.ffn_block(out, acc, h, w, b, bundle, bu, bd, active, n_active, KINDS[kind], F32(0.1), 1e-5),
                       out)[1],
            want(normed(h[None].astype(np.float64))[0], active, kind) + (0 if gated else bd))


def case_ffn_batch_block(rng, T, F, D, R, kind, share=0.3, chunks=3, fmt="f32", norm="rms", gated=True, runs=False,
                         given=False):
    """T tokens through the predictor, its threshold (each token about `share` of the neurons: the threshold in the
    widest gap between logits near that quantile, so that float32 and float64 logits pick alike; 0 and 1: none and
    all), the FFN's norm and each token's sparse FFN over its own set; `given`: random sets instead of the threshold's
    (a selector that picks without the logits)."""
    h = randn(rng, T, D, scale=3)
    w, b, normed = norm_weights(rng, D, norm)
    bundle, bu, want = ffn_weights(rng, F, D, fmt, gated, runs)
    bd = EMPTY if gated else randn(rng, D)
    fc1, fc2 = randn(rng, R, D), randn(rng, F, R)
    logits = predictor_logits(h.astype(np.float64), fc1.astype(np.float64), fc2.astype(np.float64))  # [T, F]
    v = np.sort(logits.ravel())
    if share in (0, 1):
        threshold = v[-1] + 1 if share == 0 else v[0] - 1
    else:
        lo = max(0, int((1 - share) * v.size) - 4)
        i = lo + int(np.argmax(np.diff(v)[lo:lo + 8]))
        threshold = (v[i] + v[i + 1]) / 2
    picks = (rng.random((T, F)) < share) if given else logits >= threshold  # [T, F]
    x = normed(h.astype(np.float64))
    out = np.empty((T, D), F32)
    return (lambda k: (k.ffn_batch_block(out, h, w, b, fc1, fc2, F32(threshold),
                                         picks.astype(np.uint8) if given else np.zeros((0, 0), np.uint8), bundle, bu,
                                         bd, chunks, KINDS[kind], F32(0.1), 1e-5), out)[1],
            np.stack([want(x[t], np.flatnonzero(picks[t]).astype(np.int32), kind) for t in range(T)])
            + (0 if gated else bd))


def case_dense_down(rng, T, F, D, kind, chunks=3, fmt="f32"):
    """The dense layout's down half: a(g, u) of one matmul's [g | u] per token, times the down rows."""
    gu = randn(rng, T, 2 * F)
    down, dv, _ = stored(randn(rng, F, D, scale=0.5), fmt)
    out, acc = np.empty((T, D), F32), np.empty((chunks, T, D), F32)
    a = ffn_activation(kind, gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64), 0.1)  # [T, F]
    return (lambda k: (k.dense_down(out, acc, gu, down, KINDS[kind], F32(0.1)), out)[1], a @ dv)


def case_thin(rng, T, K, share):
    """Tokens thinned by their scores |x| w (w = 1: TEAL) against t, a share of them above, some at t (a tie drops),
    and the union of the inputs kept."""
    x, w, t = randn(rng, T, K), np.abs(randn(rng, K)) + 0.5, F32(0.7)
    keep = rng.random((T, K)) < share
    x = np.where(keep, t / w * 1.5, np.where(rng.random((T, K)) < 0.5, t / w, t / w * 0.5)).astype(F32) * np.sign(x)
    score = np.abs(x) * w  # float32, as ref computes it
    out, ids = np.empty_like(x), np.empty(K, np.int32)

    def run(k):
        n = k.thin(out, ids, x, w, t)
        return np.concatenate([out.ravel(), ids[:n].astype(F32)])
    return run, np.concatenate([np.where(score > t, x, 0).ravel(), np.flatnonzero((score > t).any(0)).astype(F32)])


def case_thin_activations(rng, T, F, kind, share, gated=True):
    """The FFN's activations (gated, or g plus the up rows' bias) thinned by |a| w > t, and their union."""
    gu, bias, w = randn(rng, T, (2 if gated else 1) * F), randn(rng, F), np.abs(randn(rng, F)) + 0.5
    g = gu[:, :F].astype(np.float64) + (0 if gated else bias)
    a = ffn_activation(kind, g, gu[:, F:].astype(np.float64) if gated else np.ones_like(g), 0.1).astype(F32)
    scores = np.sort(np.abs(a) * w, axis=None)
    k = int(len(scores) * (1 - share))  # t halfway between two scores: no entry near it
    t = F32(np.inf) if share == 0 else F32(-1) if share == 1 else F32((scores[k - 1] + scores[k]) / 2)
    keep = np.abs(a) * w > t
    out, ids = np.empty((T, F), F32), np.empty(F, np.int32)

    def run(k):
        n = k.thin_activations(out, ids, gu, EMPTY if gated else bias, KINDS[kind], F32(0.1), w, t)
        return np.concatenate([out.ravel(), ids[:n].astype(F32)])
    return run, np.concatenate([np.where(keep, a, 0).ravel(), np.flatnonzero(keep.any(0)).astype(F32)])


def case_sparse_rows(rng, T, K, N, share, chunks=3, fmt="f32"):
    """W x over the stored transpose's rows that the listed inputs select (their union), zero inputs skipped: empty,
    partial and full sets."""
    wt, wv, _ = stored(randn(rng, K, N, scale=0.5), fmt)  # [K, N] rows of W^T
    x = randn(rng, T, K) * (rng.random((T, K)) < share)  # each token's thinned input
    ids = np.flatnonzero((x != 0).any(axis=0)).astype(np.int32)  # the union
    out, acc = np.empty((T, N), F32), np.empty((chunks, T, N), F32)
    return (lambda k: (k.sparse_rows(out, acc, x, wt, ids, len(ids)), out)[1], x.astype(np.float64) @ wv)


def case_dense_ffn_block(rng, F, D, kind, chunks=3, fmt="f32", norm="rms"):
    """One token through the dense layout: norm, [gate | up] rows as one (interleaved) matrix, the down rows."""
    h = randn(rng, D, scale=3)
    w, b, normed = norm_weights(rng, D, norm)
    bundle, bu, want = ffn_weights(rng, F, D, fmt, True)
    gate_up = np.concatenate([bundle[:, 0], bundle[:, 1]])
    gate_up = interleave(gate_up) if fmt in INTERLEAVED and (2 * F) % ROWS == 0 else gate_up
    out, acc = np.empty(D, F32), np.empty((chunks, D), F32)
    return (lambda k: (k.dense_ffn_block(out, acc, h, w, b, gate_up, np.ascontiguousarray(bundle[:, 2]), EMPTY,
                                         KINDS[kind], F32(0.1), 1e-5), out)[1],
            want(normed(h[None].astype(np.float64))[0], np.arange(F), kind))


def case_predictor(rng, T, D, R, F):
    h, fc1, fc2 = randn(rng, T, D, scale=2), randn(rng, R, D), randn(rng, F, R)
    out, hidden = np.empty((T, F), F32), np.empty((T, R), F32)
    return (lambda k: (k.predictor(out, hidden, h, fc1, fc2), out)[1],
            predictor_logits(h.astype(np.float64), fc1.astype(np.float64), fc2.astype(np.float64)))


def case_predicted_set(rng, F, threshold):
    logits = randn(rng, F)
    active = np.full(F, -1, np.int32)
    want = ref_predicted_set(logits, threshold)
    return lambda k: active[: k.predicted_set(active, logits, F32(threshold))], want


def case_union_mask(rng, T, F, share):
    """Tokens' picks of `share` density (one token's empty): the union's ids, then the mask's columns of them, as the
    plain numpy definition has them (any, flatnonzero, the columns)."""
    picked = (rng.random((T, F)) < share).astype(np.uint8)
    picked[0] = 0
    union, mask = np.full(F, -1, np.int32), np.full((T, F), 7, np.uint8)
    ids = np.flatnonzero(picked.any(axis=0))

    def run(k):
        n = k.union_mask(union, mask, picked)
        return np.concatenate([union[:n], mask[:, :n].ravel()])
    return run, np.concatenate([ids, picked[:, ids].ravel()])


CASES = {
    "rmsnorm": case_rmsnorm, "norm": case_norm, "add_bias": case_add_bias, "embed": case_embed, "matmul": case_matmul, "rope": case_rope, "attention": case_attention,
    "store_kv": case_store_kv,
    "sparse_ffn": case_sparse_ffn, "predictor": case_predictor, "predicted_set": case_predicted_set, "union_mask": case_union_mask,
    "attention_block": case_attention_block, "ffn_block": case_ffn_block, "sparse_ffn_batch": case_sparse_ffn_batch,
    "dense_down": case_dense_down, "dense_ffn_block": case_dense_ffn_block, "thin": case_thin,
    "thin_activations": case_thin_activations,
    "sparse_rows": case_sparse_rows,
    "decode_attention_block": case_decode_attention_block, "ffn_batch_block": case_ffn_batch_block,
}

# (kernel, shape, sim): tails (sizes off every block), single tokens, GQA, MHA and MQA, empty and full active sets.
# The CUDA simulator runs every thread as a Python thread: its entries (sim) keep to few blocks, still with tails
# off every block of the shrunk launches (tests/fast/conftest.py), several blocks per launch and reduction steps.
SHAPES = [
    ("rmsnorm", dict(T=1, D=7), False), ("rmsnorm", dict(T=5, D=100), False),
    ("rmsnorm", dict(T=2, D=19), True), ("rmsnorm", dict(T=1, D=5), True),
    *[("norm", dict(T=T, D=D, norm=n), sim) for n in NORMS for T, D, sim in ((1, 7, False), (5, 100, False), (2, 19, True))],
    ("add_bias", dict(T=3, N=17), False), ("add_bias", dict(T=2, N=5, bias=False), False),
    ("add_bias", dict(T=2, N=9), True), ("add_bias", dict(T=1, N=4, bias=False), True),
    *[("embed", dict(T=T, V=9, W=W, fmt=fmt), False) for fmt in ("f32", "f16", "bf16", "q8_0", "q4_0")
      for T, W in ((3, 96), (0, 32))],
    ("matmul", dict(T=1, N=33, K=17), False), ("matmul", dict(T=4, N=100, K=65), False),
    ("matmul", dict(T=3, N=1, K=5), False),
    ("matmul", dict(T=2, N=301, K=9), False),  # >= 4 rows per chunk: the four-stream path
    ("matmul", dict(T=9, N=211, K=33), False),  # 4 x 4 tiles, a tail token, chunks with tail rows
    ("matmul", dict(T=8, N=64, K=48), False), ("matmul", dict(T=5, N=40, K=7), False),  # tiles: no tail, all tail
    ("matmul", dict(T=130, N=9, K=17), False),  # fast.blas's GEMM (from GEMM_TOKENS on)
    ("matmul", dict(T=1, N=9, K=19), True), ("matmul", dict(T=2, N=5, K=3), True),
    ("rope", dict(T=1, h=3, E=8, pos0=11), False), ("rope", dict(T=6, h=2, E=16, pos0=0), False),
    ("rope", dict(T=2, h=2, E=8, pos0=5), True),
    ("attention", dict(T=1, S=9, H=4, K=2, E=8), False), ("attention", dict(T=5, S=5, H=6, K=3, E=16), False),
    ("attention", dict(T=3, S=10, H=4, K=4, E=8), False), ("attention", dict(T=1, S=1, H=8, K=1, E=4), False),
    ("attention", dict(T=1, S=11, H=4, K=2, E=4), True), ("attention", dict(T=3, S=3, H=2, K=2, E=8), True),
    ("attention", dict(T=300, S=310, H=4, K=2, E=8), False),  # fast.blas's query blocks, the last a tail
    ("store_kv", dict(T=3, K=2, E=8, room=9, pos0=4), False), ("store_kv", dict(T=1, K=1, E=4, room=1, pos0=0), False),
    ("store_kv", dict(T=2, K=3, E=4, room=7, pos0=5), True),
    *[("store_kv", dict(T=3, K=2, E=64, room=9, pos0=4, kv=kv), False) for kv in ("f16", "bf16", "q8_0")],
    *[("store_kv", dict(T=2, K=2, E=64, room=5, pos0=3, kv=kv), True) for kv in ("f16", "bf16", "q8_0")],
    *[("attention", dict(T=2, S=9, H=2, K=1, E=64, kv=kv), True) for kv in (("f16", "bf16"), ("q8_0", "q8_0"))],
    # KV formats in two pairs (each pair compiles its own kernels): every format as keys or values
    *[("attention", dict(T=T, S=S, H=4, K=2, E=64, kv=kv), False) for kv in (("f16", "bf16"), ("q8_0", "q8_0"))
      for T, S in ((1, 70), (3, 600))],
    ("attention", dict(T=200, S=330, H=4, K=2, E=32, kv=("q8_0", "q8_0")), False),  # fast.blas's, decoded per chunk
    # groups of 4 and 5 query heads: the register tiles (E a multiple of the lanes), and one head beside them
    ("attention", dict(T=2, S=150, H=8, K=2, E=32), False), ("attention", dict(T=1, S=67, H=10, K=2, E=64), False),
    ("attention", dict(T=1, S=600, H=8, K=1, E=96, kv=("q8_0", "q8_0")), False),
    ("attention", dict(T=2, S=70, H=4, K=1, E=8, kv=("f16", "bf16")), False),  # halves widened element by element
    # groups of 8, 12 and 10 query heads: eights with the heads in the lanes (scores_tile), then fours, then the rest;
    # positions past the last eight and the last four
    ("attention", dict(T=1, S=75, H=8, K=1, E=64), False), ("attention", dict(T=2, S=134, H=24, K=2, E=32), False),
    ("attention", dict(T=1, S=70, H=10, K=1, E=64, kv=("f16", "f16")), False),
    ("attention", dict(T=1, S=13, H=16, K=1, E=12, kv=("bf16", "f32")), False),
    ("attention", dict(T=3, S=1100, H=4, K=2, E=8), False),  # several work items (SPLIT), blocks with a tail
    ("attention", dict(T=1, S=1024, H=2, K=1, E=4), False),  # items and blocks without a tail
    ("sparse_ffn", dict(F=77, D=19, n_active=0, kind="relu"), False),
    ("sparse_ffn", dict(F=77, D=19, n_active=77, kind="relu"), False),
    ("sparse_ffn", dict(F=100, D=33, n_active=1, kind="relu"), False),
    ("sparse_ffn", dict(F=100, D=33, n_active=37, kind="fatrelu"), False),
    ("sparse_ffn", dict(F=64, D=16, n_active=50, kind="drelu"), False),
    ("sparse_ffn", dict(F=50, D=8, n_active=50, kind="silu"), False),
    ("sparse_ffn", dict(F=9, D=5, n_active=2, kind="relu", chunks=7), False),
    # non-gated FFNs (OPT, Falcon): up and down rows, the up rows' bias; ReLU, and GELU (dense only)
    ("sparse_ffn", dict(F=100, D=33, n_active=37, kind="relu", gated=False), False),
    ("sparse_ffn", dict(F=77, D=19, n_active=0, kind="relu", gated=False), False),
    ("sparse_ffn", dict(F=50, D=8, n_active=50, kind="gelu", gated=False), False),
    ("sparse_ffn", dict(F=50, D=8, n_active=50, kind="gelu"), False),
    ("sparse_ffn", dict(F=12, D=9, n_active=7, kind="relu", gated=False), True),
    ("sparse_ffn", dict(F=6, D=9, n_active=6, kind="gelu", gated=False), True),
    ("sparse_ffn", dict(F=20, D=19, n_active=0, kind="relu"), True),
    ("sparse_ffn", dict(F=12, D=19, n_active=12, kind="relu"), True),
    ("sparse_ffn", dict(F=30, D=9, n_active=7, kind="fatrelu"), True),
    ("sparse_ffn", dict(F=16, D=9, n_active=5, kind="drelu"), True), ("sparse_ffn", dict(F=6, D=9, n_active=6, kind="silu"), True),
    ("predictor", dict(T=1, D=19, R=5, F=77), False), ("predictor", dict(T=3, D=64, R=16, F=100), False),
    ("predictor", dict(T=1, D=8, R=1, F=9), False), ("predictor", dict(T=5, D=9, R=40, F=300), False),
    ("predictor", dict(T=1, D=19, R=5, F=11), True), ("predictor", dict(T=2, D=5, R=12, F=7), True),
    ("predicted_set", dict(F=77, threshold=0.0), False), ("predicted_set", dict(F=10, threshold=-5.0), False),
    ("predicted_set", dict(F=10, threshold=5.0), False),
    ("union_mask", dict(T=5, F=40, share=0.1), False), ("union_mask", dict(T=3, F=9, share=0.0), False),
    ("union_mask", dict(T=16, F=33, share=1.0), False),
    ("attention_block", dict(T=1, S=9, H=4, K=2, E=8, D=19), False),
    ("attention_block", dict(T=4, S=4, H=2, K=2, E=4, D=7), False),
    ("attention_block", dict(T=2, S=7, H=6, K=1, E=8, D=33), False),
    ("attention_block", dict(T=1, S=6, H=2, K=1, E=4, D=9), True),
    ("attention_block", dict(T=3, S=3, H=2, K=2, E=4, D=5), True),
    ("attention_block", dict(T=2, S=7, H=4, K=4, E=8, D=19, norm="layer", bias=True), False),
    ("attention_block", dict(T=3, S=5, H=2, K=2, E=4, D=9, norm="none", bias=True), False),
    ("attention_block", dict(T=2, S=4, H=2, K=1, E=4, D=9, norm="layer", bias=True), True),
    ("attention_block", dict(T=3, S=8, H=4, K=2, E=8, D=19, bias=True, qk_norm=True), False),  # Qwen2's, Qwen3's
    ("attention_block", dict(T=2, S=5, H=4, K=2, E=8, D=9, qk_norm=True), True),
    ("ffn_block", dict(F=50, D=19, n_active=13, kind="relu"), False),
    ("ffn_block", dict(F=20, D=8, n_active=20, kind="silu"), False),
    ("ffn_block", dict(F=9, D=5, n_active=0, kind="relu"), False),
    ("ffn_block", dict(F=12, D=9, n_active=5, kind="relu"), True), ("ffn_block", dict(F=6, D=5, n_active=0, kind="relu"), True),
    ("ffn_block", dict(F=40, D=19, n_active=13, kind="relu", norm="layer", gated=False), False),
    ("ffn_block", dict(F=20, D=8, n_active=20, kind="gelu", norm="none", gated=False), False),
    ("ffn_block", dict(F=12, D=9, n_active=5, kind="relu", norm="layer", gated=False), True),
    ("sparse_ffn_batch", dict(T=5, F=40, D=19, kind="relu", empty=True, full=True), False),
    ("sparse_ffn_batch", dict(T=1, F=9, D=8, kind="drelu"), False),
    ("sparse_ffn_batch", dict(T=3, F=30, D=33, kind="fatrelu", chunks=7), False),
    ("sparse_ffn_batch", dict(T=6, F=40, D=19, kind="relu", empty=True, full=True, gated=False), False),
    ("sparse_ffn_batch", dict(T=2, F=9, D=8, kind="gelu", gated=False), False),
    # float formats' tiles (dense sets: four neurons by four tokens, tail neurons and tail tokens) and neurons (sparse)
    ("sparse_ffn_batch", dict(T=7, F=30, D=19, kind="relu", sizes=(0.7, 1.0), chunks=4), False),
    ("sparse_ffn_batch", dict(T=9, F=41, D=33, kind="silu", sizes=(0.7, 1.0), gated=False, full=True), False),
    ("sparse_ffn_batch", dict(T=8, F=60, D=19, kind="relu", sizes=(0.0, 0.15), empty=True), False),
    ("dense_down", dict(T=1, F=37, D=19, kind="relu"), False), ("dense_down", dict(T=1, F=9, D=8, kind="drelu", chunks=7), False),
    ("dense_down", dict(T=5, F=40, D=19, kind="fatrelu"), False), ("dense_down", dict(T=6, F=30, D=33, kind="silu"), False),
    ("dense_ffn_block", dict(F=50, D=19, kind="relu"), False), ("dense_ffn_block", dict(F=9, D=8, kind="silu"), False),
    ("thin", dict(T=1, K=37, share=0.5), False), ("thin", dict(T=1, K=8, share=0.0), False),
    ("thin", dict(T=1, K=9, share=1.0), False), ("thin", dict(T=4, K=33, share=0.3), False),
    ("thin_activations", dict(T=1, F=40, kind="silu", share=0.5), False),
    ("thin_activations", dict(T=3, F=37, kind="relu", share=0.2), False),
    ("thin_activations", dict(T=2, F=9, kind="gelu", share=0.0), False),
    ("thin_activations", dict(T=1, F=20, kind="silu", share=1.0), False),
    ("thin_activations", dict(T=3, F=30, kind="relu", share=0.4, gated=False), False),
    *[("sparse_rows", dict(T=T, K=K, N=N, share=share, fmt=fmt), False) for fmt in ("f32", "f16", "bf16", "q8_0", "q4_0")
      for T, K, N, share in ((1, 37, 64, 0.5), (1, 9, 32, 0.0), (1, 40, 96, 1.0), (5, 30, 64, 0.3), (6, 7, 32, 1.0))],
    ("sparse_rows", dict(T=1, K=9, N=19, share=0.6, chunks=7), False), ("sparse_rows", dict(T=3, K=5, N=3, share=0.5), False),
    ("thin", dict(T=1, K=11, share=0.5), True), ("thin", dict(T=3, K=9, share=0.3), True),
    ("thin", dict(T=1, K=5, share=0.0), True), ("thin", dict(T=2, K=6, share=1.0), True),
    ("thin_activations", dict(T=2, F=9, kind="silu", share=0.5), True),
    ("thin_activations", dict(T=1, F=7, kind="relu", share=0.4, gated=False), True),
    ("sparse_rows", dict(T=1, K=9, N=7, share=0.5), True), ("sparse_rows", dict(T=3, K=6, N=5, share=0.4), True),
    ("sparse_rows", dict(T=1, K=5, N=6, share=0.0), True),
    ("sparse_rows", dict(T=40, K=33, N=64, share=0.4, fmt="q4_0"), False), ("sparse_rows", dict(T=37, K=9, N=5, share=0.0), False),
    ("dense_ffn_block", dict(F=20, D=19, kind="relu", norm="layer"), False),
    ("decode_attention_block", dict(T=1, S=9, H=4, K=2, E=8, D=19), False),
    ("decode_attention_block", dict(T=5, S=12, H=6, K=3, E=8, D=33), False),
    ("decode_attention_block", dict(T=3, S=1300, H=4, K=2, E=8, D=19), False),  # tokens of one and several items
    ("decode_attention_block", dict(T=3, S=700, H=8, K=2, E=32, D=19, kv=("f16", "bf16")), False),
    ("decode_attention_block", dict(T=3, S=6, H=2, K=2, E=4, D=9, norm="layer", bias=True), False),
    ("decode_attention_block", dict(T=4, S=9, H=4, K=2, E=8, D=19, qk_norm=True), False),
    ("ffn_batch_block", dict(T=5, F=40, D=19, R=8, kind="relu"), False),
    ("ffn_batch_block", dict(T=1, F=20, D=8, R=5, kind="relu", share=0.5), False),
    ("ffn_batch_block", dict(T=6, F=30, D=19, R=7, kind="fatrelu", share=0.9), False),  # float tiles
    ("ffn_batch_block", dict(T=4, F=9, D=8, R=3, kind="relu", share=0), False),  # empty sets: no union
    ("ffn_batch_block", dict(T=3, F=12, D=9, R=4, kind="relu", share=1, chunks=7), False),
    ("ffn_batch_block", dict(T=5, F=40, D=19, R=6, kind="relu", norm="layer", gated=False), False),
    ("ffn_batch_block", dict(T=6, F=30, D=19, R=5, kind="relu", given=True), False),  # a pick without the logits
    ("ffn_batch_block", dict(T=3, F=12, D=9, R=4, kind="relu", share=0, given=True), False),
    # every weight-reading kernel in every format fast.cpu reads
    *[(name, {**shape, "fmt": fmt}, False) for fmt in ("f16", "bf16") for name, shape in (
        ("matmul", dict(T=2, N=301, K=9)), ("matmul", dict(T=1, N=7, K=40)), ("matmul", dict(T=6, N=150, K=20)),
        ("matmul", dict(T=130, N=5, K=40)), ("matmul", dict(T=8, N=64, K=48)), ("matmul", dict(T=5, N=40, K=7)),
        ("sparse_ffn", dict(F=100, D=33, n_active=37, kind="relu")), ("sparse_ffn", dict(F=77, D=19, n_active=77, kind="drelu")),
        ("sparse_ffn", dict(F=20, D=19, n_active=0, kind="relu")),
        ("ffn_block", dict(F=50, D=19, n_active=13, kind="fatrelu")),
        ("dense_down", dict(T=2, F=30, D=19, kind="relu")), ("dense_ffn_block", dict(F=20, D=19, kind="relu")),
        ("sparse_ffn_batch", dict(T=6, F=23, D=33, kind="relu", sizes=(0.7, 1.0), empty=True)),
        ("sparse_ffn_batch", dict(T=5, F=30, D=19, kind="fatrelu", sizes=(0.7, 1.0), gated=False)),
        ("sparse_ffn_batch", dict(T=7, F=40, D=19, kind="relu", sizes=(0.0, 0.15))),
        ("attention_block", dict(T=2, S=7, H=6, K=1, E=8, D=33)))],
    # the shipped model's formats through the several-sequence blocks
    ("decode_attention_block", dict(T=3, S=7, H=4, K=2, E=8, D=33, fmt="f16"), False),
    ("ffn_batch_block", dict(T=5, F=30, D=19, R=6, kind="relu", fmt="f16"), False),
    # block formats: rows of whole 32-element blocks; one block, several, row counts off the four streams
    *[(name, {**shape, "fmt": fmt}, False) for fmt in ("q8_0", "q4_0") for name, shape in (
        ("matmul", dict(T=2, N=301, K=64)), ("matmul", dict(T=1, N=7, K=32)), ("matmul", dict(T=3, N=1, K=96)),
        ("matmul", dict(T=9, N=37, K=64)),  # rows against four tokens at a time, and a tail token
        ("sparse_ffn", dict(F=100, D=64, n_active=37, kind="relu")), ("sparse_ffn", dict(F=77, D=32, n_active=77, kind="drelu")),
        ("sparse_ffn", dict(F=20, D=32, n_active=0, kind="relu")), ("sparse_ffn", dict(F=9, D=64, n_active=2, kind="relu", chunks=7)),
        ("dense_down", dict(T=1, F=40, D=64, kind="relu")), ("dense_down", dict(T=6, F=30, D=64, kind="relu")),
        ("dense_ffn_block", dict(F=40, D=64, kind="relu")),  # [gate | up] interleaved: 80 rows
        ("dense_ffn_block", dict(F=9, D=32, kind="drelu")),  # 18 rows: not whole groups of 8, plain rows
        ("ffn_block", dict(F=50, D=64, n_active=13, kind="fatrelu")),
        ("sparse_ffn_batch", dict(T=4, F=20, D=64, kind="relu", empty=True, full=True)),
        ("sparse_ffn_batch", dict(T=5, F=20, D=64, kind="relu", full=True, gated=False)),
        ("sparse_ffn_batch", dict(T=7, F=30, D=64, kind="relu")),  # neurons of 4 + 2 + 1 tokens (dot2t, axpy2t)
        ("sparse_ffn", dict(F=30, D=64, n_active=11, kind="relu", gated=False)),
        ("attention_block", dict(T=2, S=7, H=4, K=1, E=8, D=64)))],
    # bundles of rows in runs of 8 blocks (fast.quant.RUNS, as the engine lays out q8_0 and q4_0 bundles): one run and
    # two, neurons four lanes at a time and a tail, empty and full sets, tokens 4 + 2 + 1 at a time
    *[(name, {**shape, "fmt": fmt, "runs": True}, False) for fmt in ("q8_0", "q4_0") for name, shape in (
        ("sparse_ffn", dict(F=100, D=256, n_active=37, kind="relu")), ("sparse_ffn", dict(F=20, D=512, n_active=0, kind="relu")),
        ("sparse_ffn", dict(F=9, D=256, n_active=6, kind="drelu", chunks=7)),
        ("sparse_ffn", dict(F=12, D=512, n_active=12, kind="silu")),
        ("sparse_ffn", dict(F=30, D=512, n_active=11, kind="relu", gated=False)),
        ("ffn_block", dict(F=50, D=256, n_active=13, kind="fatrelu")),
        ("sparse_ffn_batch", dict(T=7, F=30, D=256, kind="relu", empty=True, full=True)),
        ("sparse_ffn_batch", dict(T=5, F=20, D=512, kind="relu", gated=False)))],
    ("ffn_batch_block", dict(T=6, F=30, D=256, R=8, kind="relu", fmt="q4_0", runs=True), False),
    # their rows interleaved in groups of 8: one group, groups four streams at a time and tails, 4+ tokens (with 49
    # groups in 16 chunks: two at a time and an odd one)
    *[("matmul", {**shape, "fmt": fmt, "interleaved": True}, False) for fmt in ("q8_0", "q4_0") for shape in (
        dict(T=1, N=8, K=32), dict(T=2, N=64, K=96), dict(T=3, N=520, K=64), dict(T=9, N=40, K=64),
        dict(T=6, N=392, K=64))],
]
# Every weight format under the CUDA simulator too, on few blocks: one or two rows of whole 32-element blocks.
SIM_FORMATS = [(name, {**shape, "fmt": fmt}, True) for fmt in ("f16", "bf16", "q8_0", "q4_0") for name, shape in (
    ("matmul", dict(T=2, N=5, K=32)), ("sparse_ffn", dict(F=6, D=32, n_active=3, kind="relu")),
    ("ffn_block", dict(F=5, D=32, n_active=5, kind="drelu")), ("sparse_rows", dict(T=2, K=5, N=32, share=0.6)))]
# Kernels that only the CPU has: the engines pick the active set on the host (fast.engine.Selector), the GPU's
# share included, so fast.gpu has no predicted_set; the embeddings too; batched prefill runs on the CPU so far.
CPU_ONLY = {"embed", "predicted_set", "union_mask", "sparse_ffn_batch", "dense_down", "dense_ffn_block", "ffn_batch_block",
            "decode_attention_block"}
DEVICE_SHAPES = [(n, s, sim) for n, s, sim in SHAPES + SIM_FORMATS if n not in CPU_ONLY and not s.get("interleaved")]


def case_id(name, shape, sim=False):
    return f"{name}-{'-'.join(map(str, shape.values()))}"


KV_UNIT = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}  # a KV format's relative rounding step
COMPUTES_KV = {"decode_attention_block"}  # cases whose kernel computes the keys and values it stores in `kv`


def check_kernel(module, name, shape, rtol=1e-5, seed=None):
    """Run `module.<name>` and its ref twin on fresh random inputs; compare with the one tolerance helper (exactly
    where ref's answer is integers: neuron ids)."""
    from tests.helpers import assert_close
    rng = np.random.default_rng(seed)
    run, want = CASES[name](rng, **shape)
    got = run(module)
    exact = np.issubdtype(np.asarray(want).dtype, np.integer)
    if name in COMPUTES_KV:  # a key or value that float32 and ref's float64 round to either side of a tie in a KV
        rtol = max([rtol, *(KV_UNIT[f] for f in shape.get("kv", ()))])  # format: the format's error, not the kernel's
    # atol: inputs are O(1), so float32 sums carry ~1e-6 absolute error even where a result is near 0 by cancellation
    assert_close(got, want, rtol=0 if exact else rtol, atol=0 if exact else 1e-5, name=f"{module.__name__}.{name}{shape}")
