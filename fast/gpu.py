"""GPU kernels (numba.cuda), mirroring `fast.cpu` name for name and signature for signature (outputs first).

Every reduction goes through shared memory (no warp shuffles), so each kernel runs under the numba CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) exactly as on a device. No atomics: the down projection writes per-chunk
partial sums that a last pass adds in a fixed order, so results are bit-identical from run to run.
Launch constants are module globals read when a kernel is compiled; tests shrink them so several blocks run.

FORMATS: a weight matrix reaches the kernels as a `Weight` (q, d, kind): f32 as float32 rows; f16 and bf16 as their
16-bit patterns, decoded exactly with integer arithmetic and ldexp (no bit casts: the simulator has none); q8_0 as
int8 quants and q4_0 as nibble bytes (llama.cpp's order), each with float32 block scales split out once when the
weight is built. One source per kernel: the format is a runtime argument, uniform over a launch, and every branch
types for every q (float32 or an integer). As in fast.cpu, products with q8_0 and q4_0 weights read the token
rounded to Q8_0 (ref.quant.input_values), here as float values.
A KV cache slot on the device holds the host's bytes (ref.common.batch.KVCache) in a plain dtype that names the
format (`KV_DTYPES`): float32, float16 (f16: the hardware's round-to-nearest-even conversion, numpy's), uint16 bits
(bf16) or bytes (q8_0 blocks of 34: the scale's f16 bits little-endian, then 32 int8 quants).

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
N output rows, R predictor hidden size.
"""

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32

from fast.cpu import activation_py, kept_py
from fast.quant import layout_of, plain
from ref.common.formats import FORMATS, Format

KINDS = {"f32": 0, "q8_0": 1, "q4_0": 2, "f16": 3, "bf16": 4}  # a Weight's kind, per ref.common.formats name
QUANTIZED = (1, 2)
# Powers of two that decode 16-bit floats exactly (constant arrays on the device): entry e is the scale of a value
# with biased exponent e, entry 0 that of the subnormals. Multiplying by them is exact (no FTZ without fastmath).
POW2_F16 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], np.float32)
POW2_BF16 = np.array([2.0 ** -133] + [2.0 ** (e - 134) for e in range(1, 256)], np.float32)

KV_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "q8_0": np.uint8}  # a device KV slot's, per format
KV_KIND = {np.dtype(t): KINDS[name] for name, t in KV_DTYPES.items()}

THREADS = 256  # threads per block for row reductions (a power of two)
TILE = 256  # threads per block for elementwise and column kernels
CHUNKS = 64  # neuron chunks of the down pass: with D / TILE column tiles, enough blocks for every SM

_scratch: dict = {}


@dataclass
class Weight:
    """A matrix [N, n] as the GPU kernels read it: q [N, n] (float32; f16/bf16 bits as uint16; q8_0 int8) or
    [N, n/2] (q4_0 nibble bytes), d [N, n/32] float32 block scales (block formats; else [1, 1] unused), kind."""

    q: object
    d: object
    kind: int
    parts: int = 1  # rows per neuron of a bundle (3 gated, 2 not), 1 for a matrix

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def cols(self) -> int:
        return self.q.shape[1] * (2 if self.kind == KINDS["q4_0"] else 1)

    def slice(self, lo: int, hi: int) -> "Weight":
        return Weight(self.q[lo:hi], self.d[lo:hi] if self.kind in QUANTIZED else self.d, self.kind, self.parts)

    def to_device(self) -> "Weight":
        return Weight(cuda.to_device(self.q), cuda.to_device(self.d), self.kind, self.parts)


def weight(w) -> Weight:
    """Host rows of blocks [..., B] in any format (`Format.dtype`), leading dimensions flattened into rows, as a
    host Weight (views where the layout allows; a neuron bundle [F, P, B] keeps P as `parts`); a Weight as it is."""
    if isinstance(w, Weight):
        return w
    w = plain(w)  # the CPU's interleaved rows (fast.quant.INTERLEAVED) in their own order
    fmt = layout_of(w).format
    parts = w.shape[1] if w.ndim == 3 else 1
    w = np.ascontiguousarray(w).reshape(-1, w.shape[-1])
    none = np.zeros((1, 1), np.float32)
    if fmt.name == "f32":
        return Weight(w, none, KINDS["f32"], parts)
    if fmt.name in ("f16", "bf16"):
        return Weight(w.view(np.uint16), none, KINDS[fmt.name], parts)
    d = w["d"].view(np.float16).astype(np.float32)  # [N, B]
    return Weight(np.ascontiguousarray(w["qs"]).reshape(w.shape[0], -1), d, KINDS[fmt.name], parts)


@cuda.jit(device=True, inline=True)
def elem(q, d, kind, r, k):
    """Element k of row r of a Weight, as float32 (ref.quant's values of each format)."""
    if kind == 0:
        return float32(q[r, k])
    if kind == 1:
        return float32(q[r, k]) * d[r, k // 32]
    if kind == 2:  # element k of a block: low nibble of byte k % 16 for k % 32 < 16, else the high one
        b = int32(q[r, (k // 32) * 16 + k % 16])
        return float32(((b >> (4 * ((k % 32) // 16))) & 15) - 8) * d[r, k // 32]
    return half(int32(q[r, k]), kind)


@cuda.jit(device=True, inline=True)
def half(b, kind):
    """The float32 value of 16 bits b: an IEEE half (kind 3) or a bf16 (kind 4)."""
    if kind == 3:  # IEEE half: sign, 5 exponent bits e, 10 mantissa bits m; (1024 + m) 2^(e - 25), or m 2^-24
        e, m = (b >> 10) & 31, b & 1023
        v = float32(m) * POW2_F16[0] if e == 0 else float32(1024 + m) * POW2_F16[e]
    else:  # bf16, a float32's upper half: 8 exponent bits, 7 mantissa bits; (128 + m) 2^(e - 134), or m 2^-133
        e, m = (b >> 7) & 255, b & 127
        v = float32(m) * POW2_BF16[0] if e == 0 else float32(128 + m) * POW2_BF16[e]
    return -v if b & 32768 else v


@cuda.jit(device=True, inline=True)
def half_bits(x, kind):
    """The 16 bits of float32 x rounded to nearest even as an IEEE half (kind 3) or a bf16 (kind 4), without bit
    casts: |x| = f 2^n (frexp), the significand rounded to the format's M bits, ties to even (a carry raises the
    exponent); subnormals in steps of the format's least value; beyond its range, infinity."""
    M, bias, top = (10, 15, 31) if kind == 3 else (7, 127, 255)
    sign = 32768 if math.copysign(float32(1.0), x) < 0 else 0
    f, n = math.frexp(abs(float64(x)))  # f in [0.5, 1)
    if f == 0:
        return sign
    exp = max(n - 1 + bias, 0)
    y = f * float64(2 << M) if exp else math.ldexp(f, n + bias + M - 1)  # 1.m 2^M, or m at the least step: exact
    r = math.floor(y + 0.5)
    if r - y == 0.5 and int32(r) % 2 == 1:
        r -= 1.0
    bits = exp * (1 << M) + int32(r) - (1 << M if exp else 0)
    return sign + min(bits, top << M)


@cuda.jit
def _quantize_rows(out, x):
    """Thread (t, block): out = x rounded to Q8_0 along rows (ref.quant.quantize_q8_0, then its values)."""
    i = cuda.grid(1)
    T, K = x.shape
    if i < T * (K // 32):
        t, b = i // (K // 32), i % (K // 32)
        amax = float32(0.0)
        for k in range(b * 32, b * 32 + 32):
            amax = max(amax, abs(x[t, k]))
        dq = amax / float32(127.0)
        inv = float32(1.0) / dq if dq != 0 else float32(0.0)
        dr = float32(np.float16(dq))  # the scale as stored: fp16
        for k in range(b * 32, b * 32 + 32):
            v = x[t, k] * inv
            r = math.floor(abs(v) + float32(0.5))
            out[t, k] = (r if v >= 0 else -r) * dr


def input_rows(x, W: Weight, name: str):
    """x [T, K] as products with W read it: itself, or rounded to Q8_0 (in scratch `name`) for block formats."""
    if W.kind not in QUANTIZED:
        return x
    out = scratch(name, x.shape)
    n = x.shape[0] * (x.shape[1] // 32)
    if n:
        _quantize_rows[(n + TILE - 1) // TILE, TILE](out, x)
    return out


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
def _layernorm(out, x, w, b, eps):
    buf = cuda.shared.array(THREADS, float32)
    row, D = cuda.blockIdx.x, x.shape[1]
    m = float32(0.0)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        m += x[row, d]
    m = block_reduce(buf, m, False) / D
    ss = float32(0.0)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        ss += (x[row, d] - m) * (x[row, d] - m)
    r = 1.0 / math.sqrt(block_reduce(buf, ss, False) / D + eps)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        out[row, d] = (x[row, d] - m) * r * w[d] + b[d]


@cuda.jit
def _copy(out, x):
    """out = x, elementwise over [T, D]."""
    i = cuda.grid(1)
    T, D = out.shape
    if i < T * D:
        out[i // D, i % D] = x[i // D, i % D]


@cuda.jit
def _add_bias(out, b):
    """out[t] += b, elementwise over [T, N]."""
    i = cuda.grid(1)
    T, N = out.shape
    if i < T * N:
        out[i // N, i % N] += b[i % N]


@cuda.jit
def _rows_dot(out, x, q, d, kind, relu):
    """out[t, n] = w[n] . x[t] (optionally relu'd): block n, threads stride over K (coalesced), tokens in turn."""
    buf = cuda.shared.array(THREADS, float32)
    n = cuda.blockIdx.x
    for t in range(x.shape[0]):
        s = float32(0.0)
        for k in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            s += elem(q, d, kind, n, k) * x[t, k]
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


@cuda.jit(device=True, inline=True)
def kv_elem(c, kind, kv, s, e):
    """Element e of position s of head kv of a device KV slot in its format (`KV_DTYPES`), as float32: what
    ref.model.kv_values says it means."""
    if kind == 0 or kind == 3:  # f32, or float16 (converted exactly)
        return float32(c[kv, s, e])
    if kind == 4:
        return half(int32(c[kv, s, e]), 4)
    o = (e // 32) * 34  # q8_0: the block's scale bits, then its quants
    q = int32(c[kv, s, o + 2 + e % 32])
    return float32(q - 256 if q > 127 else q) * half(int32(c[kv, s, o]) + (int32(c[kv, s, o + 1]) << 8), 3)


@cuda.jit
def _attention(out, q, k, v, kk, vk, pos0, scores):
    """Block (t, h): scores over visible positions, softmax through shared reductions, then out = p v; keys and
    values read in their formats (kinds kk, vk)."""
    buf = cuda.shared.array(THREADS, float32)
    th = cuda.blockIdx.x
    T, H, E = q.shape
    K, S = k.shape[0], k.shape[1]
    t, h = th // H, th % H
    kv = h // (H // K)
    n = min(S, pos0 + t + 1)
    scale = 1.0 / math.sqrt(E)
    m = -math.inf
    for s in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        acc = float32(0.0)
        for e in range(E):
            acc += q[t, h, e] * kv_elem(k, kk, kv, s, e)
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
            acc += scores[th, s] * kv_elem(v, vk, kv, s, e)
        out[t, h, e] = acc / total


activation = cuda.jit(device=True, inline=True)(activation_py)
kept = cuda.jit(device=True, inline=True)(kept_py)  # fast.cpu.thin's criterion; scores in float32 as ref's


@cuda.jit
def _ffn_gate_up(a, x, q, dq, wk, P, bias, active, kind, thr):
    """Block j: a[j] = act(g, u) of neuron active[j] (fast.cpu.pre_activations): bundle rows P i (gate, or a
    non-gated FFN's up plus its bias) and P i + 1 (up; u = 1 when P = 2); rows read coalesced."""
    buf = cuda.shared.array(THREADS, float32)
    j = cuda.blockIdx.x
    i = active[j]
    g = float32(0.0)
    u = float32(0.0)
    for d in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        g += elem(q, dq, wk, P * i, d) * x[d]
        if P == 3:
            u += elem(q, dq, wk, P * i + 1, d) * x[d]
    g = block_reduce(buf, g, False)
    u = block_reduce(buf, u, False) if P == 3 else float32(1.0)
    if bias.size:
        g += bias[i]
    if cuda.threadIdx.x == 0:
        a[j] = activation(kind, g, u, thr)


@cuda.jit
def _ffn_down(part, a, q, dq, wk, P, active, n_active):
    """Block (x, c): part[c, d] = sum over chunk c of j < n_active of a[j] down_j[d] (bundle row P i + P - 1), down
    rows with a[j] == 0 not read (the branch is uniform over the block); consecutive threads read consecutive d of a
    row. Chunks give the GPU enough blocks to keep its memory busy."""
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c, C = cuda.blockIdx.y, cuda.gridDim.y
    if d < part.shape[1]:
        s = float32(0.0)
        for j in range(c * n_active // C, (c + 1) * n_active // C):
            if a[j] != 0:
                s += a[j] * elem(q, dq, wk, P * active[j] + P - 1, d)
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


@cuda.jit
def _store_kv(cache, x, pos0, kind):
    """Thread (t, kv): cache[kv, pos0 + t] = x[t, kv] in the cache's format (fast.cpu.store_kv, ref.model.kv_store;
    a row a thread: a step writes T K rows, too few to spread wider): f32 as is, f16 by the hardware's conversion,
    bf16 bits rounded to nearest even, q8_0 blocks as _quantize_rows rounds them.  cache: [K, room, E']; x: [T, K, E]."""
    i = cuda.grid(1)
    T, K, E = x.shape
    if i < T * K:
        t, kv = i // K, i % K
        p = pos0 + t
        if kind == 0 or kind == 3:
            for e in range(E):
                cache[kv, p, e] = x[t, kv, e]
        elif kind == 4:
            for e in range(E):
                cache[kv, p, e] = half_bits(x[t, kv, e], 4)
        else:
            for b in range(E // 32):
                amax = float32(0.0)
                for e in range(b * 32, b * 32 + 32):
                    amax = max(amax, abs(x[t, kv, e]))
                dq = amax / float32(127.0)
                inv = float32(1.0) / dq if dq != 0 else float32(0.0)
                bits = half_bits(dq, 3)
                cache[kv, p, b * 34] = bits & 255
                cache[kv, p, b * 34 + 1] = bits >> 8
                for j in range(32):
                    y = x[t, kv, b * 32 + j] * inv
                    r = int32(math.floor(abs(y) + float32(0.5)))
                    cache[kv, p, b * 34 + 2 + j] = (r if y >= 0 else -r) & 255


@cuda.jit
def _copy_cols(out, x, lo):
    """out = x[:, lo:lo + N], elementwise over out [T, N] (a projection's q, k or v columns)."""
    i = cuda.grid(1)
    T, N = out.shape
    if i < T * N:
        out[i // N, i % N] = x[i // N, lo + i % N]


@cuda.jit
def _thin(out, x, w, t):
    """Thread (r, i): out = x * (|x| w > t) (fast.cpu.thin's values)."""
    k = cuda.grid(1)
    T, K = x.shape
    if k < T * K:
        v = x[k // K, k % K]
        out[k // K, k % K] = v if kept(v, w[k % K], t) else float32(0.0)


@cuda.jit
def _thin_activations(a, gu, bias, kind, thr, w, t):
    """Thread (r, i): a = a(g, u) thinned (fast.cpu.thin_activations' values); gu [T, 2F] gated, else [T, F] with the
    up rows' bias added to g (bias [F] or [0]) and u = 1."""
    k = cuda.grid(1)
    T, F = a.shape
    if k < T * F:
        r, i = k // F, k % F
        if gu.shape[1] == 2 * F:
            v = float32(activation(kind, gu[r, i], gu[r, F + i], thr))
        else:
            g = gu[r, i] + bias[i] if bias.shape[0] else gu[r, i]
            v = float32(activation(kind, g, float32(1.0), thr))
        a[r, i] = v if kept(v, w[i], t) else float32(0.0)


@cuda.jit
def _union(ids, count, out):
    """One block: ids[:n] the columns of out [T, K] with a non-zero entry, in order, count[0] = n; a tile of
    THREADS columns at a time, each column's place its inclusive scan of the tile's flags in shared memory."""
    flags = cuda.shared.array(THREADS, int32)
    total = cuda.shared.array(1, int32)
    j, n = cuda.threadIdx.x, cuda.blockDim.x
    T, K = out.shape
    if j == 0:
        total[0] = 0
    for base in range(0, K, n):
        i = base + j
        f = 0
        if i < K:
            for r in range(T):
                if out[r, i] != 0:
                    f = 1
        flags[j] = f
        cuda.syncthreads()
        step = 1
        while step < n:  # Hillis-Steele: after it, flags[j] = sum of the tile's flags up to j
            v = flags[j - step] if j >= step else 0
            cuda.syncthreads()
            flags[j] += v
            cuda.syncthreads()
            step *= 2
        if f:
            ids[total[0] + flags[j] - 1] = i
        cuda.syncthreads()
        if j == n - 1:
            total[0] += flags[j]
        cuda.syncthreads()
    if j == 0:
        count[0] = total[0]


@cuda.jit
def _sparse_rows(part, x, q, d, kind, ids, n):
    """Block (x, c): part[c, t, o] = sum over chunk c of j < n of x[t, i] W^T[i, o], i = ids[j], a zero input not
    reading its row (the branch is uniform over the block); consecutive threads read consecutive o of a row."""
    o = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c, C = cuda.blockIdx.y, cuda.gridDim.y
    if o < part.shape[2]:
        for t in range(x.shape[0]):
            s = float32(0.0)
            for j in range(c * n // C, (c + 1) * n // C):
                v = x[t, ids[j]]
                if v != 0:
                    s += v * elem(q, d, kind, ids[j], o)
            part[c, t, o] = s


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


def norm(out, x, w, b, eps):
    """Same contract as fast.cpu.norm: none (w empty), RMSNorm (w), LayerNorm (w and b); out may be x."""
    if w.size == 0:
        if out is not x and out.size:
            _copy[(out.size + TILE - 1) // TILE, TILE](out, x)
    elif b.size == 0:
        rmsnorm(out, x, w, eps)
    else:
        _layernorm[x.shape[0], THREADS](out, x, w, b, np.float32(eps))


def add_bias(out, b):
    """Same contract as fast.cpu.add_bias."""
    if b.size and out.size:
        _add_bias[(out.size + TILE - 1) // TILE, TILE](out, b)


def matmul(out, x, w):
    """Same contract as fast.cpu.matmul; w: host rows of blocks or a Weight."""
    W = weight(w)
    if out.size:
        _rows_dot[W.rows, THREADS](out, input_rows(x, W, "mm_x"), W.q, W.d, W.kind, False)


def rope(out, x, cos, sin, pos0):
    n = x.shape[0] * x.shape[1] * (x.shape[2] // 2)
    if n:
        _rope[(n + TILE - 1) // TILE, TILE](out, x, cos, sin, pos0)


def kv_plain(a):
    """A host KV array in its format's storage (KVCache's) as the device holds it: the same bytes in `KV_DTYPES`'
    dtype; a device array as it is."""
    if not isinstance(a, np.ndarray) or a.dtype.names is None:
        return a
    return a.view(KV_DTYPES[next(f.name for f in FORMATS.values() if f.dtype == a.dtype)])


def kv_host(a, fmt: Format) -> np.ndarray:
    """A device KV array copied to the host in `fmt`'s storage (KVCache's)."""
    return a.copy_to_host() if fmt.name == "f32" else a.copy_to_host().view(fmt.dtype)


def attention(out, q, k, v, pos0):
    """Same contract as fast.cpu.attention.  k, v: [K, S, E'] in KV formats."""
    T, H = q.shape[0], q.shape[1]
    k, v = kv_plain(k), kv_plain(v)
    _attention[T * H, THREADS](out, q, k, v, KV_KIND[k.dtype], KV_KIND[v.dtype], pos0,
                               scratch("attn_scores", (T * H, min(k.shape[1], pos0 + T))))


def store_kv(cache, x, pos0):
    """Same contract as fast.cpu.store_kv."""
    rows = x.shape[0] * x.shape[1]
    cache = kv_plain(cache)
    if rows:
        _store_kv[(rows + TILE - 1) // TILE, TILE](cache, x, pos0, KV_KIND[cache.dtype])


def sparse_ffn(out, acc, x, bundle, bias, active, n_active, kind, thr):
    """Same contract as fast.cpu.sparse_ffn; `acc` is unused here (activations and chunk sums live in scratch).
    The down pass writes per-chunk partial sums, then adds them in a fixed order."""
    W = weight(bundle)  # rows P i .. P i + P - 1: neuron i's gate (gated), up and down
    D, C = out.shape[0], max(1, min(CHUNKS, n_active))
    a, part = scratch("ffn_a", max(n_active, 1)), scratch("ffn_part", (C, D))
    if n_active:
        xq = input_rows(x.reshape(1, D), W, "ffn_xq")[0]
        _ffn_gate_up[n_active, THREADS](a, xq, W.q, W.d, W.kind, W.parts, bias, active, kind, np.float32(thr))
    _ffn_down[((D + TILE - 1) // TILE, C), TILE](part, a, W.q, W.d, W.kind, W.parts, active, n_active)
    _sum_rows[(D + TILE - 1) // TILE, TILE](out, part)


def union(ids, out) -> int:
    """ids[:n] the columns of out [T, K] with a non-zero entry, in order. -> n (read back: the host waits for it)."""
    count = scratch("union_count", 1, np.int32)
    _union[1, THREADS](ids, count, out)
    return int(count.copy_to_host()[0])


def thin(out, ids, x, w, t):
    """Same contract as fast.cpu.thin; with ids None the values only (-> None): sparse_rows over every input skips
    a zero itself, so a step on the device needs no count back on the host."""
    if x.size:
        _thin[(x.size + TILE - 1) // TILE, TILE](out, x, w, np.float32(t))
    return None if ids is None else union(ids, out)


def thin_activations(a, ids, gu, bias, kind, thr, w, t):
    """Same contract as fast.cpu.thin_activations; ids None as in `thin`."""
    if a.size:
        _thin_activations[(a.size + TILE - 1) // TILE, TILE](a, gu, bias, kind, np.float32(thr), w, np.float32(t))
    return None if ids is None else union(ids, a)


def sparse_rows(out, acc, x, wt, ids, n):
    """Same contract as fast.cpu.sparse_rows (wt: host rows of blocks of the transpose, or a Weight); `acc` is
    unused (the chunks' partial sums live in scratch, added in a fixed order)."""
    W, (T, N) = weight(wt), out.shape
    C = max(1, min(CHUNKS, n))
    part = scratch("rows_part", (C, T, N))
    if out.size:
        _sparse_rows[((N + TILE - 1) // TILE, C), TILE](part, x, W.q, W.d, W.kind, ids, n)
        _sum_rows[(T * N + TILE - 1) // TILE, TILE](out.reshape(T * N), part.reshape(C, T * N))


def every_input(K: int):
    """Device ids 0..K-1 (sparse_rows over every input, the zeros skipped), uploaded once per K."""
    ids = _scratch.get(("every_input", K))
    if ids is None:
        ids = _scratch[("every_input", K)] = cuda.to_device(np.arange(max(K, 1), dtype=np.int32))
    return ids


def thinned_product(out, x, W: Weight, w, t):
    """out = W thin(x) per token (fast.layers.thinned_product), W the stored transpose as a Weight: thin(x)'s zeros
    skip their rows.  out: [T, N]; x: [T, K]."""
    xt = scratch("thin_x", x.shape)
    thin(xt, None, x, w, t)
    sparse_rows(out, None, xt, W, every_input(x.shape[1]), x.shape[1])


def predictor(out, hidden, h, fc1, fc2):
    """Same contract as fast.cpu.predictor."""
    W1 = weight(fc1)
    _rows_dot[W1.rows, THREADS](hidden, input_rows(h, W1, "pred_hq"), W1.q, W1.d, W1.kind, True)
    matmul(out, hidden, fc2)


def attention_block(out, h, attn_norm, attn_norm_b, wqkv, bqkv, qk_norms, wo, bo, k_cache, v_cache, cos, sin, pos0,
                    eps, thin=None):
    """Same contract as fast.cpu.attention_block. The projections read row blocks of wqkv into contiguous buffers,
    since a device array's column slices cannot be reshaped; keys and values go to the head-major cache (store_kv). With `thin` (device
    score weights and thresholds of attn_in and attn_out: w0, t0, w1, t1), activation sparsity as
    fast.layers.Thinned: wqkv and wo are the stored transposes, each read input-sparse."""
    T, D = h.shape
    K, E = k_cache.shape[0], 2 * cos.shape[1]
    W = weight(wqkv)
    H = (W.rows if thin is None else W.cols) // E - 2 * K
    x = scratch("attn_x", (T, D))
    norm(x, h, attn_norm, attn_norm_b, eps)
    q, k, v = scratch("attn_q", (T, H * E)), scratch("attn_k", (T, K * E)), scratch("attn_v", (T, K * E))
    if thin is None:
        matmul(q, x, W.slice(0, H * E))
        matmul(k, x, W.slice(H * E, (H + K) * E))
        matmul(v, x, W.slice((H + K) * E, W.rows))
    else:
        qkv = scratch("attn_qkv", (T, (H + 2 * K) * E))
        thinned_product(qkv, x, W, thin[0], thin[1])
        for part, lo in ((q, 0), (k, H * E), (v, (H + K) * E)):
            _copy_cols[(part.size + TILE - 1) // TILE, TILE](part, qkv, lo)
    if bqkv.size:
        add_bias(q, bqkv[: H * E])
        add_bias(k, bqkv[H * E:(H + K) * E])
        add_bias(v, bqkv[(H + K) * E:])
    if qk_norms.shape[0]:  # each head's q and k RMS-normed (fast.cpu.qk_norm)
        rmsnorm(q.reshape(T * H, E), q.reshape(T * H, E), qk_norms[0], eps)
        rmsnorm(k.reshape(T * K, E), k.reshape(T * K, E), qk_norms[1], eps)
    q3 = q.reshape(T, H, E)
    rope(q3, q3, cos, sin, pos0)
    k3 = k.reshape(T, K, E)
    rope(k3, k3, cos, sin, pos0)
    store_kv(k_cache, k3, pos0)
    store_kv(v_cache, v.reshape(T, K, E), pos0)
    att = scratch("attn_att", (T, H, E))
    attention(att, q3, k_cache, v_cache, pos0)  # whole slots: a query reads positions up to its own
    if thin is None:
        matmul(out, att.reshape(T, H * E), wo)
    else:
        thinned_product(out, att.reshape(T, H * E), weight(wo), thin[2], thin[3])
    add_bias(out, bo)


def ffn_block(out, acc, h, ffn_norm, ffn_norm_b, bundle, bias, bd, active, n_active, kind, thr, eps):
    """Same contract as fast.cpu.ffn_block: out = sparse_ffn(norm(h)) + bd for one token h [D]."""
    x = scratch("ffn_block_x", (1, h.shape[0]))
    norm(x, h.reshape(1, h.shape[0]), ffn_norm, ffn_norm_b, eps)
    sparse_ffn(out, acc, x[0], bundle, bias, active, n_active, kind, thr)
    add_bias(out.reshape(1, out.shape[0]), bd)


def thinned_ffn_block(out, h, ffn_norm, ffn_norm_b, gate_up_t, down_t, bu, bd, kind, thr, thin, eps):
    """fast.layers.ThinnedFFN for tokens h [T, D]: out = Wd thin(a(g, u)) + bd, [g | u] = [Wg | Wu] thin(norm(h));
    gate_up_t [D, 2F] (non-gated [D, F]) and down_t [F, D] the stored transposes, thin the device score weights
    and thresholds of ffn_in and ffn_hidden (w2, t2, w3, t3)."""
    T, D = h.shape
    G, Wd = weight(gate_up_t), weight(down_t)
    x, gu, a = scratch("ffn_block_x", (T, D)), scratch("ffn_gu", (T, G.cols)), scratch("ffn_thin_a", (T, Wd.rows))
    norm(x, h, ffn_norm, ffn_norm_b, eps)
    thinned_product(gu, x, G, thin[0], thin[1])
    thin_activations(a, None, gu, bu, kind, thr, thin[2], thin[3])
    sparse_rows(out, None, a, Wd, every_input(Wd.rows), Wd.rows)
    add_bias(out, bd)


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
