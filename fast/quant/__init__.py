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

The package by layout: `layouts` (what each item type is: plain rows, interleaved groups, runs, and the transforms
between them), `floats` (float formats' rows), `blocks` (q8_0 and q4_0 rows block by block), `groups` (interleaved
groups, eight rows a vpdpbusd), `runs` (a row's blocks in runs), `ir` and `target` (the LLVM helpers and the
instruction set they generate for), `reference` (the plain reference of every row operation per format and layout).
Each layout's module ends with its row operations as a class of plain functions (`Floats`, `Blocks`, `Runs`), one
per operation below: an operation compiles, for the layout of its weight argument, the function of that name
(IMPLEMENTATIONS). A new layout is one class more; a new operation a stub here and a function in each class.

Dimensions: T tokens, K row length, B = K / 32 blocks per row.
"""

import inspect

from numba.extending import overload

from fast.quant.blocks import (AHEAD, OFFSET, Blocks, block_axpy, block_axpy2t, block_axpy4, block_axpy4t, block_dot,
                               block_dot2t, block_dot4t, q8_0_block, q8_0_input)
from fast.quant.floats import (Floats, bf16_bits, bf16_to_f32, dot4x4, f16_bits, f16_round, f16_to_f32, fdot, fdot2,
                               fdot2_2t, fdot2_4t, fdot2t, fdot4, fdot4t, float_input, fma, load, put, widen)
from fast.quant.groups import block_dot8, block_dot8_4t, block_dot8x2_4t, block_dot8x4
from fast.quant.layouts import (BLOCK, BLOCK_FORMATS, INTERLEAVED, INTERLEAVED_FORMATS, ROWS, RUN, RUN_FORMATS, RUNS,
                                LAYOUTS, TYPES, Layout, for_matmul, for_sparse, in_runs, interleave, interleaved,
                                is_float, layout_of, n_rows, plain, to_runs)
from fast.quant.runs import (Runs, run_axpy, run_axpy2t, run_axpy4, run_axpy4t, run_dot, run_dot2t, run_dot4,
                             run_dot4_ahead, run_dot4t)
from fast.quant.target import JIT_OPTIONS

# The row operations below, and what the kernels and tests take from the modules (the intrinsics among them: a test
# that generates code for another instruction set forgets the code of everything named here).
__all__ = ["AHEAD", "BLOCK", "BLOCK_FORMATS", "Blocks", "Floats", "IMPLEMENTATIONS", "INPUT_FORMATS", "INTERLEAVED",
           "INTERLEAVED_FORMATS", "LAYOUTS", "OFFSET", "ROWS", "RUN", "RUN_FORMATS", "RUNS", "Runs", "TYPES", "axpy",
           "axpy2t", "axpy4", "axpy4t", "bf16_bits", "bf16_to_f32", "block_axpy", "block_axpy2t", "block_axpy4",
           "block_axpy4t", "block_dot", "block_dot2t", "block_dot4t", "block_dot8", "block_dot8_4t",
           "block_dot8x2_4t", "block_dot8x4", "decoded", "dot", "dot2", "dot2_2t", "dot2_4t", "dot2t", "dot4",
           "dot4_ahead", "dot4t", "dot4x4", "f16_bits", "f16_round", "f16_to_f32", "fdot", "fdot2", "fdot2_2t",
           "fdot2_4t", "fdot2t", "fdot4", "fdot4t", "float_input", "fma", "for_matmul", "for_sparse", "hints_ahead",
           "in_runs", "interleave", "interleaved", "is_float", "Layout", "layout_of", "load", "n_rows", "plain",
           "prefetch_span", "put", "q8_0_block", "q8_0_input", "quantize_input", "run_axpy", "run_axpy2t",
           "run_axpy4", "run_axpy4t", "run_dot", "run_dot2t", "run_dot4", "run_dot4_ahead", "run_dot4t", "store",
           "to_runs", "widen"]


# ---------------------------------------------------------------------------------------------------- the row operations

def dot(w, x, xq, xd, xs):
    """w . x for one token."""


def dot2(w0, w1, x, xq, xd, xs):
    """(w0 . x, w1 . x) for one token: in float formats one pass over both rows (a neuron's gate and up rows: the
    shipped model's 16-sequence union FFN 14 % faster), block formats their one-row products twice."""


def dot4(w0, w1, w2, w3, x, xq, xd, xs):
    """(w0 . x, w1 . x, w2 . x, w3 . x) for one token."""


def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
    """dot4 of rows w0..w3, where a0..a3 are the rows read next: rows in runs hint them into L2 line for line as
    these are read (run_dot4_ahead; within these rows only, not into the rows after them); other rows leave the
    hints to the caller (hints_ahead)."""


def hints_ahead(bundle) -> bool:
    """Whether dot4_ahead hints the rows ahead itself for this bundle's rows (rows in runs)."""


def dot2t(w, x, xq, xd, xs, t0, t1):
    """(w . x[t0], w . x[t1]): one row against two tokens of x [T, K], the row read once."""


def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
    """(w . x[t0], ..., w . x[t3]): one row against four tokens of x [T, K], the row read once."""


def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
    """(w0 . x[t0], w0 . x[t1], w1 . x[t0], w1 . x[t1]): two rows against two tokens of x [T, K] (two tokens have
    their own loop: dot2_4t with the two tokens twice was 8 % slower)."""


def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
    """(w0 . x[t0], ..., w0 . x[t3], w1 . x[t0], ..., w1 . x[t3]): two rows against four tokens of x [T, K]."""


def axpy(y, a, w):
    """y += a w, each element rounded once (fma; a block format's a d first, blocks._fma_block)."""


def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 w0 + a1 w1 + a2 w2 + a3 w3: axpy four times, in order (the same bits)."""


def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 w, ..., y[t3] += a3 w: one row into four tokens' outputs, the row read once."""


def axpy2t(y, t0, t1, a0, a1, w):
    """y[t0] += a0 w, y[t1] += a1 w: one row into two tokens' outputs, the row read once."""


def store(row, x):
    """row = x stored in row's format: float32 as it is, f16 and bf16 rounded to nearest even, q8_0 blocks as
    ref.quant.quantize_q8_0 makes them (a KV cache's write).  row: [n / block]; x: [n] float32."""


def decoded(rows, first, n, scratch):
    """Rows first..first+n-1 of rows [N, m] in a format as float32 [n, E]: the rows themselves for float32, else
    decoded into scratch [>= n, E] (y = 0 + 1 w: what ref.quant.values gives)."""


def prefetch_span(bundle):
    """Bytes of each row of a lane's next bundle that fast.cpu.sparse_ffn hints ahead: a block format's whole row
    (short rows, 1 to 2 KiB, that the hardware prefetcher does not keep ahead of: q4_0 over a 10 % set 7 -> 10.7
    GB/s); a float format's first line only (its rows are long enough for the hardware prefetcher)."""


ROW_OPERATIONS = (dot, dot2, dot4, dot4_ahead, hints_ahead, dot2t, dot4t, dot2_2t, dot2_4t, axpy, axpy4, axpy4t,
                  axpy2t, store, decoded, prefetch_span)
# Each layout's row operations, by (layout name, whether its format is quantized): interleaved groups have none
# (fast.cpu.matmul calls their products, block_dot8 and siblings, itself).
IMPLEMENTATIONS = {("rows", False): Floats, ("rows", True): Blocks, ("runs", True): Runs}
WEIGHT = ("w", "w0", "row", "rows", "bundle")  # the argument whose layout picks an operation's implementation


def implementation(name: str, weight):
    """The class IMPLEMENTATIONS holds for the layout of the numba array type `weight`, its function `name`."""
    lay = TYPES.get(getattr(weight, "dtype", None))
    return None if lay is None else getattr(IMPLEMENTATIONS.get((lay.name, lay.format.quantized)), name, None)


def _register(op):
    """op's numba overload: the implementation for its weight argument's layout (a `chosen` one picks by types)."""
    at = next(i for i, p in enumerate(inspect.signature(op).parameters) if p in WEIGHT)

    def typer(*args):
        impl = implementation(op.__name__, args[at])
        return impl(*args) if getattr(impl, "chooses", False) else impl
    overload(op, jit_options=JIT_OPTIONS, strict=False)(typer)


for _op in ROW_OPERATIONS:
    _register(_op)


# ------------------------------------------------------------------------------------------------------ the input

def quantize_input(x, w):
    """(xq [T, K] int8, xd [T, B] float32, xs [T, B, 8] int32): x [T, K] as products with w read it (empty for
    float formats); xs holds each block's correction -OFFSET sum(xq) in lane 0 (block_dot's vpdpbusd form). For rows
    in RUNS, each run of the token laid out as theirs (word k of its blocks in turn) and xs [T, B / RUN, RUN] the
    corrections of its blocks."""


# Each input format (ref.common.formats.Format.vec_dot: what a product rounds its token to) as quantize_input makes
# it for a weight's rows: a format whose products read another input format (K-quants: Q8_K) adds its entry here.
INPUT_FORMATS = {None: float_input, "q8_0": q8_0_input}


@overload(quantize_input, jit_options=JIT_OPTIONS)
def _quantize_input(x, w):
    return INPUT_FORMATS[TYPES[w.dtype].format.vec_dot](w)
