"""ref.common.sampling's sampler for many rows in one numba call: the server samples every request of a step at once.
Numpy's per-call overhead made one draw from V = 4096 logits cost 50 us in `ref.common.sampling.sample`, a fifth of
the server's per-token time at 16 requests; here it is a few microseconds.

Same chain, same candidates and order (most likely first, ties by id): top-k -> top-p -> min-p -> temperature ->
draw. A request's logits processors (`ref.common.sampling.Processor`: its penalties, which read its history) are
applied to its row before. The draw is the caller's `rng.random()`, one
per row whose temperature is above 0 (the one draw `sample` makes), so a request's tokens follow its own seed.

Dimensions: B rows, V vocab, K candidates (top-k, or V).
"""

import numpy as np
from numba import njit, prange

from fast import kernel_cache
from fast.quant.target import ERROR_MODEL

kernel_cache.install()


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def top_candidates(z, k):
    """Ids of the k largest of z [V], most likely first, ties by id: the first k of a stable descending sort."""
    ids = np.empty(k, np.int64)  # [K]
    vals = np.empty(k, np.float64)  # [K]
    n = 0
    for i in range(z.size):
        v = z[i]
        if n == k and not v > vals[k - 1]:  # a later id loses a tie
            continue
        j = n if n < k else k - 1
        while j > 0 and vals[j - 1] < v:
            vals[j], ids[j] = vals[j - 1], ids[j - 1]
            j -= 1
        vals[j], ids[j] = v, i
        n = min(n + 1, k)
    return ids


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def softmax_of(z, order, n, scale):
    """softmax(z[order[:n]] * scale) [n], as ref's softmax: exp(x - max x) / sum."""
    e = np.empty(n, np.float64)
    top = z[order[0]] * scale  # order is most likely first
    s = 0.0
    for i in range(n):
        e[i] = np.exp(z[order[i]] * scale - top)
        s += e[i]
    return e / s


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def sample_row(z, u, temperature, top_k, top_p, min_p):
    """One token id from z [V] (float64, penalties applied) and the draw u in [0, 1): ref's `sample`."""
    V = z.size
    if temperature == 0:
        return np.argmax(z)
    if 0 < top_k < V:
        order = top_candidates(z, top_k)  # [K]
    else:
        order = np.argsort(-z, kind="mergesort")  # [V] stable: ties by id
    n = order.size
    if top_p < 1:  # smallest prefix whose probability reaches top_p
        p = softmax_of(z, order, n, 1.0)
        cum, m = 0.0, n
        for i in range(n):
            cum += p[i]
            if cum >= top_p:
                m = i + 1
                break
        n = m
    if min_p > 0:  # p is non-increasing along the order: the kept candidates are a prefix
        p = softmax_of(z, order, n, 1.0)
        m = 0
        while m < n and p[m] >= min_p * p[0]:
            m += 1
        n = m
    p = softmax_of(z, order, n, 1.0 / temperature)
    target = u * p.sum()
    cum = 0.0
    for i in range(n):  # searchsorted(cumsum(p), target, side="right")
        cum += p[i]
        if cum > target:
            return order[i]
    return order[n - 1]


@njit(parallel=True, cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def sample(out, logits, u, temperature, top_k, top_p, min_p):
    """out[b] = ref's sample(logits[b], u[b], temperature[b], top_k[b], top_p[b], min_p[b]) for each row b of B, the
    rows in parallel (each writes its own out[b]). logits: [B, V] float64, or float32 as the model gives them (the
    same tokens: every value converts exactly, and each operation on one has a float64 operand).

    A row's top-k scan over V logits is the sampler's cost (16 rows of V = 32,000: 0.31 ms in one thread)."""
    for b in prange(logits.shape[0]):
        out[b] = sample_row(logits[b], u[b], temperature[b], top_k[b], top_p[b], min_p[b])
