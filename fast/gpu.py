"""GPU kernels (numba.cuda), mirroring `fast.cpu` name for name and signature for signature (outputs first).

Every reduction goes through shared memory (no warp shuffles), so each kernel runs under the numba CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) exactly as on a device. No atomics: the down projection writes per-chunk
partial sums that a last pass adds in a fixed order, so results are bit-identical from run to run.
Launch constants are module globals read when a kernel is compiled; tests shrink them so several blocks run.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
N output rows, R predictor hidden size.
"""

import math

import numpy as np
from numba import cuda, float32

from fast.cpu import activation_py

THREADS = 256  # threads per block for row reductions (a power of two)
TILE = 256  # threads per block for elementwise and column kernels
CHUNKS = 64  # neuron chunks of the down pass: with D / TILE column tiles, enough blocks for every SM

_scratch: dict = {}


@cuda.jit(device=True, inline=True)
def block_reduce(buf, value, take_max):
    """Sum (or max) of `value` over the block through shared memory `buf` [THREADS]; every thread gets the result."""
    t = cuda.threadIdx.x
    buf[t] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf[t] = max(buf[t], buf[t + step]) if take_max else buf[t] + buf[t + step]
        cuda.syncthreads()
        step //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit
def _rmsnorm(out, x, w, eps):
    buf = cuda.shared.array(THREADS, float32)
    row, D = cuda.blockIdx.x, x.shape[1]
    ss = float32(0.0)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        ss += x[row, d] * x[row, d]
    r = 1.0 / math.sqrt(block_reduce(buf, ss, False) / D + eps)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        out[row, d] = x[row, d] * r * w[d]


@cuda.jit
def _rows_dot(out, x, w, relu):
    """out[t, n] = w[n] . x[t] (optionally relu'd): block n, threads stride over K (coalesced), tokens in turn."""
    buf = cuda.shared.array(THREADS, float32)
    n = cuda.blockIdx.x
    for t in range(x.shape[0]):
        s = float32(0.0)
        for k in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            s += w[n, k] * x[t, k]
        s = block_reduce(buf, s, False)
        if cuda.threadIdx.x == 0:
            out[t, n] = max(s, 0.0) if relu else s


@cuda.jit
def _rope(out, x, cos, sin, pos0):
    i = cuda.grid(1)
    T, nh, E = x.shape
    half = E // 2
    if i < T * nh * half:
        t, rest = i // (nh * half), i % (nh * half)
        h, j = rest // half, rest % half
        p = pos0 + t
        a, b = x[t, h, j], x[t, h, j + half]
        out[t, h, j] = a * cos[p, j] - b * sin[p, j]
        out[t, h, j + half] = b * cos[p, j] + a * sin[p, j]


@cuda.jit
def _attention(out, q, k, v, pos0, scores):
    """Block (t, h): scores over visible positions, softmax through shared reductions, then out = p v."""
    buf = cuda.shared.array(THREADS, float32)
    th = cuda.blockIdx.x
    T, H, E = q.shape
    S, K = k.shape[0], k.shape[1]
    t, h = th // H, th % H
    kv = h // (H // K)
    n = min(S, pos0 + t + 1)
    scale = 1.0 / math.sqrt(E)
    m = -math.inf
    for s in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        acc = float32(0.0)
        for e in range(E):
            acc += q[t, h, e] * k[s, kv, e]
        acc *= scale
        scores[th, s] = acc
        m = max(m, acc)
    m = block_reduce(buf, m, True)
    total = float32(0.0)
    for s in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        p = math.exp(scores[th, s] - m)
        scores[th, s] = p
        total += p
    total = block_reduce(buf, total, False)
    for e in range(cuda.threadIdx.x, E, cuda.blockDim.x):
        acc = float32(0.0)
        for s in range(n):
            acc += scores[th, s] * v[s, kv, e]
        out[t, h, e] = acc / total


activation = cuda.jit(device=True, inline=True)(activation_py)


@cuda.jit
def _ffn_gate_up(a, x, bundle, active, kind, thr):
    """Block j: a[j] = act(gate . x, up . x) of neuron active[j]; gate and up rows read coalesced."""
    buf = cuda.shared.array(THREADS, float32)
    j = cuda.blockIdx.x
    i = active[j]
    g = float32(0.0)
    u = float32(0.0)
    for d in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        g += bundle[i, 0, d] * x[d]
        u += bundle[i, 1, d] * x[d]
    g = block_reduce(buf, g, False)
    u = block_reduce(buf, u, False)
    if cuda.threadIdx.x == 0:
        a[j] = activation(kind, g, u, thr)


@cuda.jit
def _ffn_down(part, a, bundle, active, n_active):
    """Block (x, c): part[c, d] = sum over chunk c of j < n_active of a[j] down_j[d], down rows with a[j] == 0 not
    read (the branch is uniform over the block); consecutive threads read consecutive d of a row. Chunks give
    the GPU enough blocks to keep its memory busy."""
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c, C = cuda.blockIdx.y, cuda.gridDim.y
    if d < part.shape[1]:
        s = float32(0.0)
        for j in range(c * n_active // C, (c + 1) * n_active // C):
            if a[j] != 0:
                s += a[j] * bundle[active[j], 2, d]
        part[c, d] = s


@cuda.jit
def _sum_rows(out, part):
    """Thread d: out[d] = sum_c part[c, d], chunks in order (no atomics: the same bits every run)."""
    d = cuda.grid(1)
    if d < out.shape[0]:
        s = float32(0.0)
        for c in range(part.shape[0]):
            s += part[c, d]
        out[d] = s


def scratch(name: str, shape, dtype=np.float32):
    """A reused device buffer of `shape` (an int or a tuple): no allocation per call, since cuMemAlloc per layer and
    token would cost more than the kernels. Launches are ordered on one stream, so buffers are reused safely."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    size = int(np.prod(shape))
    buf = _scratch.get((name, dtype))
    if buf is None or buf.size < size:
        buf = _scratch[(name, dtype)] = cuda.device_array(max(size, 1), dtype)
    return buf[:size].reshape(shape)


def rmsnorm(out, x, w, eps):
    _rmsnorm[x.shape[0], THREADS](out, x, w, np.float32(eps))


def matmul(out, x, w):
    if out.size:
        _rows_dot[w.shape[0], THREADS](out, x, w, False)


def rope(out, x, cos, sin, pos0):
    n = x.shape[0] * x.shape[1] * (x.shape[2] // 2)
    if n:
        _rope[(n + TILE - 1) // TILE, TILE](out, x, cos, sin, pos0)


def attention(out, q, k, v, pos0, scores):
    _attention[q.shape[0] * q.shape[1], THREADS](out, q, k, v, pos0, scores)


def sparse_ffn(out, acc, x, bundle, active, n_active, kind, thr):
    """Same contract as fast.cpu.sparse_ffn; `acc` is unused here (activations and chunk sums live in scratch).
    The down pass writes per-chunk partial sums, then adds them in a fixed order."""
    D, C = out.shape[0], max(1, min(CHUNKS, n_active))
    a, part = scratch("ffn_a", max(n_active, 1)), scratch("ffn_part", (C, D))
    if n_active:
        _ffn_gate_up[n_active, THREADS](a, x, bundle, active, kind, np.float32(thr))
    _ffn_down[((D + TILE - 1) // TILE, C), TILE](part, a, bundle, active, n_active)
    _sum_rows[(D + TILE - 1) // TILE, TILE](out, part)


def predictor(out, hidden, h, fc1, fc2):
    """Same contract as fast.cpu.predictor."""
    _rows_dot[fc1.shape[0], THREADS](hidden.reshape(1, -1), h.reshape(1, -1), fc1, True)
    matmul(out.reshape(1, -1), hidden.reshape(1, -1), fc2)


def attention_block(out, h, attn_norm, wqkv, wo, k_cache, v_cache, cos, sin, pos0, eps):
    """Same contract as fast.cpu.attention_block. The projections read row blocks of wqkv into contiguous buffers
    (v straight into its cache rows), since a device array's column slices cannot be reshaped."""
    T, D = h.shape
    K, E = k_cache.shape[1], k_cache.shape[2]
    H = wo.shape[1] // E
    x = scratch("attn_x", (T, D))
    rmsnorm(x, h, attn_norm, eps)
    q, k = scratch("attn_q", (T, H * E)), scratch("attn_k", (T, K * E))
    matmul(q, x, wqkv[: H * E])
    matmul(k, x, wqkv[H * E:(H + K) * E])
    matmul(v_cache[pos0:pos0 + T].reshape(T, K * E), x, wqkv[(H + K) * E:])
    q3 = q.reshape(T, H, E)
    rope(q3, q3, cos, sin, pos0)
    rope(k_cache[pos0:pos0 + T], k.reshape(T, K, E), cos, sin, pos0)
    att = scratch("attn_att", (T, H, E))
    attention(att, q3, k_cache[: pos0 + T], v_cache[: pos0 + T], pos0, scratch("attn_scores", (T * H, pos0 + T)))
    matmul(out, att.reshape(T, H * E), wo)


def ffn_block(out, acc, h, ffn_norm, bundle, active, n_active, kind, thr, eps):
    """Same contract as fast.cpu.ffn_block: out = sparse_ffn(rmsnorm(h)) for one token h [D]."""
    x = scratch("ffn_block_x", (1, h.shape[0]))
    rmsnorm(x, h.reshape(1, h.shape[0]), ffn_norm, eps)
    sparse_ffn(out, acc, x[0], bundle, active, n_active, kind, thr)


@cuda.jit
def _add(out, a):
    """out += a, elementwise over [T, D] (residual updates)."""
    i = cuda.grid(1)
    T, D = out.shape
    if i < T * D:
        out[i // D, i % D] += a[i // D, i % D]


def add(out, a):
    """out += a (ref: h + o, h + y_gpu + y_cpu)."""
    if out.size:
        _add[(out.size + TILE - 1) // TILE, TILE](out, a)
