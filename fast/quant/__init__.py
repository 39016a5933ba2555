"""How the CPU kernels read a weight row in each format of ref.common.formats: the row operations `fast.cpu` is
written in, resolved per row type when a kernel compiles (numba overloads), so each kernel stays one source.

  dot4(w0, w1, w2, w3, x, xq, xd, xs) -> (w0 . x, ..., w3 . x)   four rows against one token
  dot(w, x, xq, xd, xs)                -> w . x
  axpy4(y, a0..a3, w0..w3)             y += a0 w0 + ... + a3 w3
  axpy(y, a, w)                        y += a w
  dot4t / dot2t(w, x, ..., t0, ...)    -> (w . x[t0], ...)          one row against four / two tokens
  axpy4t / axpy2t(y, t0, ..., a0, ..., w)  y[t0] += a0 w, ...       one row into four / two tokens' outputs
  quantize_input(x, w)                 -> (xq, xd, xs): the token rows as the dot products with w read them

Float formats (f32; f16 and bf16 bits decoded to float32) read the float32 token x, every dot product of them in one
arithmetic whatever the rows and tokens it shares a call with (fast.quant.floats._float_products: a row's product with
a token is the same bits in every kernel, so a token's result does not depend on its neighbours in a step). Block
formats' integer sums per block are exact, hence the same in every variant. Block formats (q8_0, q4_0) read
it rounded to Q8_0 blocks, as llama.cpp's vec_dot_q8_0_q8_0 and vec_dot_q4_0_q8_0 do and ref.quant.input_values
defines: xq int8 quants, xd float32 scales (fp16-rounded), xs each block's correction lanes (block_dot). Their dot
products are integer sums per block, scaled and accumulated in float32 lanes: LLVM IR written here (`@intrinsic`),
because numba widens int8 arithmetic to int64 and its loops then stay scalar (measured: 2 GB/s on one core). Axpy
never quantizes: y += a dequant(w), one fma per element (`fma`; a block format's a d rounded first), several rows in
their order, so that a row adds the same bits into a token's output in every variant.

The package by concern: `layouts` (plain rows, interleaved groups, runs, and the transforms between them), `floats`
(f16 and bf16 decoding, float tiles), `blocks` (q8_0 and q4_0 block by block), `groups` (eight lanes at a time: groups
and runs), `ir` and `target` (the LLVM helpers and the instruction set they generate for). fast.quant_ref is the
plain reference of every row operation per format and layout.

Dimensions: T tokens, K row length, B = K / 32 blocks per row.
"""

import numpy as np
from numba import types
from numba.extending import overload

from fast.quant.blocks import (AHEAD, OFFSET, block_axpy, block_axpy2t, block_axpy4, block_axpy4t, block_dot,
                               block_dot2t, block_dot4t, q8_0_block)
from fast.quant.floats import (bf16_bits, bf16_to_f32, dot4x4, f16_bits, f16_round, f16_to_f32, fdot, fdot2, fdot2_2t,
                               fdot2_4t, fdot2t, fdot4, fdot4t, fma, load, widen)
from fast.quant.groups import (block_dot8, block_dot8_4t, block_dot8x2_4t, block_dot8x4, run_dot, run_dot2t, run_dot4,
                               run_dot4_ahead, run_dot4t)
from fast.quant.layouts import (BLOCK, BLOCK_FORMATS, INTERLEAVED, INTERLEAVED_FORMATS, ROWS, RUN, RUN_FORMATS, RUNS,
                                LAYOUTS, TYPES, Layout, for_matmul, for_sparse, in_runs, interleave, interleaved,
                                float_kind, is_float, layout_of, n_rows, plain, to_runs)
import fast.quant.target as target
from fast.quant.target import JIT_OPTIONS

# The row operations below, and what the kernels and tests take from the modules.
__all__ = ["AHEAD", "BLOCK", "BLOCK_FORMATS", "INPUT_FORMATS", "INTERLEAVED", "INTERLEAVED_FORMATS", "LAYOUTS",
           "OFFSET", "ROWS", "RUN", "RUN_FORMATS", "RUNS", "TYPES", "axpy", "axpy2t", "axpy4", "axpy4t", "bf16_bits",
           "bf16_to_f32", "block_axpy", "block_axpy2t", "block_axpy4", "block_axpy4t", "block_dot", "block_dot2t",
           "block_dot4t", "block_dot8", "block_dot8_4t", "block_dot8x2_4t", "block_dot8x4", "decoded", "dot", "dot2",
           "dot2_2t", "dot2_4t", "dot2t", "dot4", "dot4_ahead", "dot4t", "dot4x4", "f16_bits", "f16_round",
           "f16_to_f32", "float_input", "fma", "for_matmul", "for_sparse", "hints_ahead", "in_runs", "interleave",
           "interleaved", "is_float", "Layout", "layout_of", "load", "n_rows", "plain", "prefetch_span", "q8_0_block",
           "q8_0_input", "quantize_input", "run_dot", "run_dot2t", "run_dot4", "run_dot4_ahead", "run_dot4t", "store",
           "to_runs"]


# ---------------------------------------------------------------------------------------------------- the row operations

def quantize_input(x, w):
    """(xq [T, K] int8, xd [T, B] float32, xs [T, B, 8] int32): x [T, K] as products with w read it (empty for
    float formats); xs holds each block's correction -OFFSET sum(xq) in lane 0 (block_dot's vpdpbusd form). For rows
    in RUNS, each run of the token laid out as theirs (word k of its blocks in turn) and xs [T, B / RUN, RUN] the
    corrections of its blocks."""


def float_input(w):
    """quantize_input for a float format's rows (Format.vec_dot None): they read the float32 token as it is."""
    return lambda x, w: (np.empty((x.shape[0], 0), np.int8), np.empty((x.shape[0], 0), np.float32),
                         np.empty((x.shape[0], 0, 8), np.int32))


def q8_0_input(w):
    """quantize_input for rows that read their token as Q8_0 blocks (q8_0, q4_0: ref.quant.quantize_q8_0, per block
    of 32, q8_0_block), laid out as w's rows are (plain blocks, or runs)."""
    offset = OFFSET[TYPES[w.dtype].format.name]
    span = RUN if in_runs(w) else 1  # blocks whose words interleave

    def q8_0(x, w):
        T, K = x.shape
        xq, xd = np.empty((T, K), np.int8), np.empty((T, K // BLOCK), np.float32)
        xs = np.zeros((T, K // BLOCK // span, 8), np.int32)
        for t in range(T):
            v = np.ascontiguousarray(x[t])
            for b in range(K // BLOCK):
                r, j = b // span, b % span  # run r, its block j (blocks: r = b, j = 0)
                d, total = q8_0_block(xq[t], np.int64(r * BLOCK * span + 4 * j), np.int64(4 * span), v,
                                      np.int64(b * BLOCK))
                xd[t, b] = f16_round(d)
                xs[t, r, j] = -offset * total
        return xq, xd, xs
    return q8_0


# Each input format (ref.common.formats.Format.vec_dot: what a product rounds its token to) as quantize_input makes
# it for a weight's rows: a format whose products read another input format (K-quants: Q8_K) adds its entry here.
INPUT_FORMATS = {None: float_input, "q8_0": q8_0_input}


@overload(quantize_input, jit_options=JIT_OPTIONS)
def _quantize_input(x, w):
    return INPUT_FORMATS[TYPES[w.dtype].format.vec_dot](w)


def dot4(w0, w1, w2, w3, x, xq, xd, xs):
    """(w0 . x, w1 . x, w2 . x, w3 . x) for one token."""


@overload(dot4, jit_options=JIT_OPTIONS)
def _dot4(w0, w1, w2, w3, x, xq, xd, xs):
    if is_float(w0):
        return lambda w0, w1, w2, w3, x, xq, xd, xs: fdot4(w0, w1, w2, w3, x)  # four streams (fast.cpu's STREAMS)
    if in_runs(w0):  # reach: these rows and the next ones of their bundles
        return lambda w0, w1, w2, w3, x, xq, xd, xs: run_dot4(w0, w1, w2, w3, xq, xd, xs, np.int64(2 * w0.shape[0]))
    return lambda w0, w1, w2, w3, x, xq, xd, xs: (dot(w0, x, xq, xd, xs), dot(w1, x, xq, xd, xs), dot(w2, x, xq, xd, xs),
                                              dot(w3, x, xq, xd, xs))


def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
    """dot4 of rows w0..w3, where a0..a3 are the rows read next: rows in runs hint them into L2 line for line as
    these are read (run_dot4_ahead; within these rows only, not into the rows after them); other rows leave the
    hints to the caller (hints_ahead)."""


@overload(dot4_ahead, jit_options=JIT_OPTIONS)
def _dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
    if in_runs(w0):
        return lambda w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs: run_dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, xq,
                                                                                  xd, xs, np.int64(w0.shape[0]))
    return lambda w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs: dot4(w0, w1, w2, w3, x, xq, xd, xs)


def hints_ahead(bundle) -> bool:
    """Whether dot4_ahead hints the rows ahead itself for this bundle's rows (rows in runs)."""


@overload(hints_ahead, jit_options=JIT_OPTIONS)
def _hints_ahead(bundle):
    return (lambda bundle: True) if in_runs(bundle) else (lambda bundle: False)


def dot(w, x, xq, xd, xs):
    """w . x for one token."""


@overload(dot, jit_options=JIT_OPTIONS)
def _dot(w, x, xq, xd, xs):
    if is_float(w):
        return lambda w, x, xq, xd, xs: fdot(w, x)[0]
    if in_runs(w):
        return lambda w, x, xq, xd, xs: run_dot(w, xq, xd, xs, np.int64(2 * w.shape[0]))
    # reach: the row and whatever follows it (a matrix's next row, the next rows of a neuron's bundle), in blocks
    return lambda w, x, xq, xd, xs: block_dot(w, xq, xd, xs, np.int64(w.shape[0] + AHEAD))


def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
    """(w . x[t0], ..., w . x[t3]): one row against four tokens of x [T, K], the row read once."""


@overload(dot4t, jit_options=JIT_OPTIONS)
def _dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
    if is_float(w):
        return lambda w, x, xq, xd, xs, t0, t1, t2, t3: fdot4t(w, x[t0], x[t1], x[t2], x[t3])
    if in_runs(w):
        return lambda w, x, xq, xd, xs, t0, t1, t2, t3: run_dot4t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0),
                                                                  np.int64(t1), np.int64(t2), np.int64(t3))
    return lambda w, x, xq, xd, xs, t0, t1, t2, t3: block_dot4t(w, xq, xd, xs, np.int64(t0), np.int64(t1),
                                                                np.int64(t2), np.int64(t3))


def dot2t(w, x, xq, xd, xs, t0, t1):
    """(w . x[t0], w . x[t1]): one row against two tokens of x [T, K], the row read once."""


@overload(dot2t, jit_options=JIT_OPTIONS)
def _dot2t(w, x, xq, xd, xs, t0, t1):
    if is_float(w):
        return lambda w, x, xq, xd, xs, t0, t1: fdot2t(w, x[t0], x[t1])
    if in_runs(w):
        return lambda w, x, xq, xd, xs, t0, t1: run_dot2t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0),
                                                          np.int64(t1))
    return lambda w, x, xq, xd, xs, t0, t1: block_dot2t(w, xq, xd, xs, np.int64(t0), np.int64(t1))


# A neuron's gate and up rows against the same tokens: in float formats one pass over both rows, which shares the
# loop and overlaps the two sums' final reductions (the shipped model's 16-sequence union FFN 14 % faster). Block
# formats: their one-row kernels twice. Two tokens have their own loop (dot2_4t with the two tokens twice: 8 % slower).

def dot2(w0, w1, x, xq, xd, xs):
    """(w0 . x, w1 . x) for one token."""


@overload(dot2, jit_options=JIT_OPTIONS)
def _dot2(w0, w1, x, xq, xd, xs):
    if is_float(w0):
        return lambda w0, w1, x, xq, xd, xs: fdot2(w0, w1, x)
    return lambda w0, w1, x, xq, xd, xs: (dot(w0, x, xq, xd, xs), dot(w1, x, xq, xd, xs))


def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
    """(w0 . x[t0], w0 . x[t1], w1 . x[t0], w1 . x[t1]): two rows against two tokens of x [T, K]."""


@overload(dot2_2t, jit_options=JIT_OPTIONS)
def _dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
    if is_float(w0):
        return lambda w0, w1, x, xq, xd, xs, t0, t1: fdot2_2t(w0, w1, x[t0], x[t1])

    def blocks(w0, w1, x, xq, xd, xs, t0, t1):
        s0, s1 = dot2t(w0, x, xq, xd, xs, t0, t1)
        r0, r1 = dot2t(w1, x, xq, xd, xs, t0, t1)
        return s0, s1, r0, r1
    return blocks


def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
    """(w0 . x[t0], ..., w0 . x[t3], w1 . x[t0], ..., w1 . x[t3]): two rows against four tokens of x [T, K]."""


@overload(dot2_4t, jit_options=JIT_OPTIONS)
def _dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
    if is_float(w0):
        return lambda w0, w1, x, xq, xd, xs, t0, t1, t2, t3: fdot2_4t(w0, w1, x[t0], x[t1], x[t2], x[t3])

    def blocks(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
        s0, s1, s2, s3 = dot4t(w0, x, xq, xd, xs, t0, t1, t2, t3)
        r0, r1, r2, r3 = dot4t(w1, x, xq, xd, xs, t0, t1, t2, t3)
        return s0, s1, s2, s3, r0, r1, r2, r3
    return blocks


def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 w, ..., y[t3] += a3 w: one row into four tokens' outputs, the row read once."""


@overload(axpy4t, jit_options=JIT_OPTIONS)
def _axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    if is_float(w):
        def floats(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
            for d in range(y.shape[1]):
                wd = load(w, d)
                y[t0, d] = fma(a0, wd, y[t0, d])
                y[t1, d] = fma(a1, wd, y[t1, d])
                y[t2, d] = fma(a2, wd, y[t2, d])
                y[t3, d] = fma(a3, wd, y[t3, d])
        return floats

    return lambda y, t0, t1, t2, t3, a0, a1, a2, a3, w: block_axpy4t(y, np.int64(t0), np.int64(t1), np.int64(t2),
                                                                    np.int64(t3), a0, a1, a2, a3, w)


def axpy2t(y, t0, t1, a0, a1, w):
    """y[t0] += a0 w, y[t1] += a1 w: one row into two tokens' outputs, the row read once."""


@overload(axpy2t, jit_options=JIT_OPTIONS)
def _axpy2t(y, t0, t1, a0, a1, w):
    if is_float(w):
        def floats(y, t0, t1, a0, a1, w):
            for d in range(y.shape[1]):
                wd = load(w, d)
                y[t0, d] = fma(a0, wd, y[t0, d])
                y[t1, d] = fma(a1, wd, y[t1, d])
        return floats
    return lambda y, t0, t1, a0, a1, w: block_axpy2t(y, np.int64(t0), np.int64(t1), a0, a1, w)


def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 w0 + a1 w1 + a2 w2 + a3 w3: axpy four times, in order (the same bits)."""


@overload(axpy4, jit_options=JIT_OPTIONS)
def _axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
    if is_float(w0):
        def floats(y, a0, a1, a2, a3, w0, w1, w2, w3):
            for d in range(y.shape[0]):
                y[d] = fma(a3, load(w3, d), fma(a2, load(w2, d), fma(a1, load(w1, d), fma(a0, load(w0, d), y[d]))))
        return floats

    return lambda y, a0, a1, a2, a3, w0, w1, w2, w3: block_axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3)


def axpy(y, a, w):
    """y += a w, each element rounded once (fma; a block format's a d first, blocks._fma_block)."""


@overload(axpy, jit_options=JIT_OPTIONS)
def _axpy(y, a, w):
    if is_float(w):
        def floats(y, a, w):
            for d in range(y.shape[0]):
                y[d] = fma(a, load(w, d), y[d])
        return floats
    return lambda y, a, w: block_axpy(y, a, w)


def store(row, x):
    """row = x stored in row's format: float32 as it is, f16 and bf16 rounded to nearest even, q8_0 blocks as
    ref.quant.quantize_q8_0 makes them (a KV cache's write).  row: [n / block]; x: [n] float32."""


@overload(store, jit_options=JIT_OPTIONS)
def _store(row, x):
    if row.dtype == types.float32:
        def f32(row, x):
            for k in range(x.shape[0]):
                row[k] = x[k]
        return f32
    if isinstance(row.dtype, types.Record) and "f16" in row.dtype.fields:
        def f16(row, x):
            for k in range(x.shape[0]):
                row[k].f16 = f16_bits(x[k])
        return f16
    if isinstance(row.dtype, types.Record) and "bf16" in row.dtype.fields:
        def bf16(row, x):
            for k in range(x.shape[0]):
                row[k].bf16 = bf16_bits(x[k])
        return bf16

    def q8_0(row, x):  # q8_0_block: the quants written into the block's own bytes
        v = np.ascontiguousarray(x)
        for b in range(row.shape[0]):
            d, _ = q8_0_block(row[b].qs, np.int64(0), np.int64(4), v, np.int64(b * BLOCK))
            row[b].d = f16_bits(d)
        return None
    return q8_0


def decoded(rows, first, n, scratch):
    """Rows first..first+n-1 of rows [N, m] in a format as float32 [n, E]: the rows themselves for float32, else
    decoded into scratch [>= n, E] (y = 0 + 1 w, axpy: what ref.quant.values gives)."""


@overload(decoded, jit_options=JIT_OPTIONS)
def _decoded(rows, first, n, scratch):
    if rows.dtype == types.float32:
        return lambda rows, first, n, scratch: rows[first:first + n]

    if float_kind(rows.dtype) in ("f16", "bf16"):
        L = target.FLOAT_LANES

        def halves(rows, first, n, scratch):  # whole vectors widened, else element by element
            E = scratch.shape[1]
            for j in range(n):
                if E % L == 0:
                    widen(scratch[j], rows[first + j])
                else:
                    for e in range(E):
                        scratch[j, e] = load(rows[first + j], e)
            return scratch[:n]
        return halves

    def other(rows, first, n, scratch):
        for j in range(n):
            scratch[j] = 0.0
            axpy(scratch[j], np.float32(1.0), rows[first + j])
        return scratch[:n]
    return other


def prefetch_span(bundle):
    """Bytes of each row of a lane's next bundle that fast.cpu.sparse_ffn hints ahead: a block format's whole row
    (short rows, 1 to 2 KiB, that the hardware prefetcher does not keep ahead of: q4_0 over a 10 % set 7 -> 10.7
    GB/s); a float format's first line only (its rows are long enough for the hardware prefetcher)."""


@overload(prefetch_span, jit_options=JIT_OPTIONS)
def _prefetch_span(bundle):
    if is_float(bundle):
        return lambda bundle: 64
    return lambda bundle: bundle.shape[-1] * bundle.itemsize
