"""q8_0 and q4_0 rows in runs (RUNS, the sparse FFN's layout): a row's blocks in runs of RUN, each laid out as an
interleaved group block with blocks for rows, so that fast.quant.groups' engine multiplies a run of the row by the
token's run eight lanes at a time (lanes are blocks; quantize_input lays the token out so), and an axpy is
fast.quant.blocks' with a run's words transposed back into its blocks. The row operations on rows in runs: `Runs`."""

import numpy as np
from llvmlite import ir
from numba import types

from fast.quant.blocks import _axpy_codegen, _axpy_t_codegen
from fast.quant.groups import _dot8_codegen
from fast.quant.ir import F32, I32, I64, I8, _lanes, _read, _splat, _vec
from fast.quant.layouts import BLOCK, RUN, RUN_FORMATS
from numba.extending import intrinsic


def _token_run(builder, xp, dp, sp, r, shared):
    """Token run r as a run of a row reads it (RUNS; quantize_input lays the token out so): its 8 word vectors (lane
    j: word k of block j), its correction lanes and its scales; loaded as _token_block loads words."""
    xw = builder.bitcast(builder.gep(xp, [builder.mul(r, I64(RUN * BLOCK))]), _vec(I32, 8).as_pointer())

    def word(k):
        return builder.load(builder.gep(xw, [I64(k)]), align=1)
    words = [word(k) for k in range(8)].__getitem__ if shared else word
    lanes = builder.mul(r, I64(RUN))
    corr = builder.load(builder.bitcast(builder.gep(sp, [lanes]), _vec(I32, 8).as_pointer()), align=4)
    return words, corr, builder.load(builder.bitcast(builder.gep(dp, [lanes]), _vec(F32, 8).as_pointer()), align=4)



def _transpose_words(builder, words):
    """A run's words (4 or 8 <8 x i32>, lane j of vector i: word i of block j) as each block's words in order (8
    vectors <4 x i32> or <8 x i32>): a butterfly of lane interleaves, 1 shuffle a block for q4_0, 3 for q8_0. An
    axpy over runs still costs more than over blocks (q8_0: 2.4 against 1.5 ns a row's block)."""
    def interleave(a, b, u, half):  # units of u lanes of a and b in turn, from lanes 4 half .. 4 half + 3
        idx = []
        for k in range(4 // u):
            base = 4 * half + k * u
            idx += [base + e for e in range(u)] + [8 + base + e for e in range(u)]
        return builder.shuffle_vector(a, b, _lanes(*idx))

    vecs, u = words, 1
    while u < len(words):  # a stage: units of u lanes of vector k and k + u of each group of 2u, in turn
        pairs = [(vecs[g + k], vecs[g + k + u]) for g in range(0, len(vecs), 2 * u) for k in range(u)]
        vecs = [interleave(a, b, u, half) for a, b in pairs for half in (0, 1)]
        u *= 2
    # each vector now holds 8 / W blocks of W words, blocks in order
    W = len(words)
    return [builder.shuffle_vector(v, v, _lanes(*range(k * W, (k + 1) * W))) for v in vecs for k in range(8 // W)]


def _run_blocks(builder, fmt, p):
    """The RUN blocks of the run at p as (thunk of block j's quant bytes, its scale d float32) each, for
    fast.quant.blocks' axpys: the run's words loaded once, block j's 16 (q4_0) or 32 (q8_0) bytes taken from lane j
    of each."""
    words = [_read(builder, builder.gep(p, [I64(2 * RUN + 32 * i)]), _vec(I32, 8))
             for i in range((fmt.block_bytes - 2) // 4)]
    d8 = builder.fpext(_read(builder, p, _vec(ir.HalfType(), RUN)), _vec(F32, RUN))
    blocks_ = _transpose_words(builder, words)  # block j's words: <4 x i32> (q4_0) or <8 x i32> (q8_0)

    def raw(j):
        raw = builder.bitcast(blocks_[j], _vec(I8, 4 * len(words)))
        return raw if fmt.name == "q4_0" else builder.xor(raw, _splat(I8, 32, -128))
    return [((lambda j=j: raw(j)), builder.extract_element(d8, I32(j))) for j in range(RUN)]


@intrinsic
def run_dot(typingctx, w, x, xd, xs, reach):
    """w . x for a row w [B / RUN] in RUNS and a Q8_0 token laid out for it (xq [K] int8, xd [B] scales, xs
    [B / RUN, RUN] correction lanes); prefetches up to `reach` runs from the row's start."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.float32(w, x, xd, xs, reach), _dot8_codegen(fmt, 1, 0, _token_run)


@intrinsic
def run_dot4(typingctx, w0, w1, w2, w3, x, xd, xs, reach):
    """run_dot of four rows at once (four streams), the token's runs loaded once for the four."""
    fmt = RUN_FORMATS.get(w0.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 4)(w0, w1, w2, w3, x, xd, xs, reach), _dot8_codegen(fmt, 4, 0, run_token=_token_run)


@intrinsic
def run_dot4_ahead(typingctx, w0, w1, w2, w3, a0, a1, a2, a3, x, xd, xs, reach):
    """run_dot4, hinting rows a0..a3 (the four read next) into L2 as these are read, line for line."""
    fmt = RUN_FORMATS.get(w0.dtype)
    if fmt is None or any(a.dtype != w0.dtype for a in (a0, a1, a2, a3)):
        return None
    return (types.UniTuple(types.float32, 4)(w0, w1, w2, w3, a0, a1, a2, a3, x, xd, xs, reach),
            _dot8_codegen(fmt, 4, 0, run_token=_token_run, ahead=True))


@intrinsic
def run_dot4t(typingctx, w, x, xd, xs, reach, t0, t1, t2, t3):
    """run_dot of one row against four tokens t0..t3 of x (xq [T, K], xd [T, B], xs [T, B / RUN, RUN]): each run
    unpacked once for the four."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return (types.UniTuple(types.float32, 4)(w, x, xd, xs, reach, t0, t1, t2, t3),
            _dot8_codegen(fmt, 1, 4, run_token=_token_run))


@intrinsic
def run_dot2t(typingctx, w, x, xd, xs, reach, t0, t1):
    """run_dot4t for two tokens."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 2)(w, x, xd, xs, reach, t0, t1), _dot8_codegen(fmt, 1, 2, run_token=_token_run)


@intrinsic
def run_axpy(typingctx, y, a, w):
    """y += a dequant(w): y [K] float32, w [B / RUN] in RUNS; prefetches within the row only."""
    fmt = RUN_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, a, w), _axpy_codegen(fmt, 1, _run_blocks))


@intrinsic
def run_axpy4(typingctx, y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 dequant(w0) + ... + a3 dequant(w3), rows in RUNS of equal length."""
    fmt = RUN_FORMATS.get(w0.dtype)
    return None if fmt is None else (types.void(y, a0, a1, a2, a3, w0, w1, w2, w3), _axpy_codegen(fmt, 4, _run_blocks))


@intrinsic
def run_axpy4t(typingctx, y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 dequant(w), ..., y[t3] += a3 dequant(w): y [T, K] float32, w [B / RUN] in RUNS."""
    fmt = RUN_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, t2, t3, a0, a1, a2, a3, w),
                                     _axpy_t_codegen(fmt, 4, _run_blocks))


@intrinsic
def run_axpy2t(typingctx, y, t0, t1, a0, a1, w):
    """run_axpy4t for two tokens."""
    fmt = RUN_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, a0, a1, w), _axpy_t_codegen(fmt, 2, _run_blocks))


class Runs:
    """fast.quant's row operations on rows in runs, against a token's Q8_0 blocks laid out as runs (xq [T, K],
    xd [T, B], xs [T, B / RUN, RUN]). A product's reach: the row and the next rows of its neuron's bundle."""

    def dot(w, x, xq, xd, xs):
        return run_dot(w, xq, xd, xs, np.int64(2 * w.shape[0]))

    def dot2(w0, w1, x, xq, xd, xs):
        return run_dot(w0, xq, xd, xs, np.int64(2 * w0.shape[0])), run_dot(w1, xq, xd, xs, np.int64(2 * w1.shape[0]))

    def dot4(w0, w1, w2, w3, x, xq, xd, xs):
        return run_dot4(w0, w1, w2, w3, xq, xd, xs, np.int64(2 * w0.shape[0]))

    def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
        return run_dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, xq, xd, xs, np.int64(w0.shape[0]))

    def hints_ahead(bundle):
        return True

    def dot2t(w, x, xq, xd, xs, t0, t1):
        return run_dot2t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0), np.int64(t1))

    def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
        return run_dot4t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0), np.int64(t1), np.int64(t2),
                         np.int64(t3))

    def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
        s0, s1 = run_dot2t(w0, xq, xd, xs, np.int64(2 * w0.shape[0]), np.int64(t0), np.int64(t1))
        r0, r1 = run_dot2t(w1, xq, xd, xs, np.int64(2 * w1.shape[0]), np.int64(t0), np.int64(t1))
        return s0, s1, r0, r1

    def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
        s0, s1, s2, s3 = run_dot4t(w0, xq, xd, xs, np.int64(2 * w0.shape[0]), np.int64(t0), np.int64(t1),
                                   np.int64(t2), np.int64(t3))
        r0, r1, r2, r3 = run_dot4t(w1, xq, xd, xs, np.int64(2 * w1.shape[0]), np.int64(t0), np.int64(t1),
                                   np.int64(t2), np.int64(t3))
        return s0, s1, s2, s3, r0, r1, r2, r3

    def axpy(y, a, w):
        run_axpy(y, a, w)

    def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
        run_axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3)

    def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
        run_axpy4t(y, np.int64(t0), np.int64(t1), np.int64(t2), np.int64(t3), a0, a1, a2, a3, w)

    def axpy2t(y, t0, t1, a0, a1, w):
        run_axpy2t(y, np.int64(t0), np.int64(t1), a0, a1, w)

    def prefetch_span(bundle):
        return bundle.shape[-1] * bundle.itemsize
