"""Every row operation of fast.quant against its plain reference (fast.quant.reference), in one table: each operation,
weight format and layout; the integer products (q8_0, q4_0) also on every instruction set this machine can run. And
the layouts themselves (interleave, to_runs, plain) against the reference's reading of their definitions."""

import numpy as np
import pytest
from numba import njit

from fast.quant import reference as R
from ref.common.formats import FORMATS
from ref.quant import blocks, quantize
from tests.fast.isa import generating, with_isa

T = 5
A = np.array([0.5, -1.25, 2.0, 0.75], np.float32)  # the axpys' coefficients
I64 = np.int64
NOTHING = (np.float32(0.0),)  # an axpy's results: it writes y


def operation(q, op):
    """Row operation `op` of fast.quant module q as a kernel over a matrix w [8 rows or 2 groups, B], tokens x [T, K]
    and outputs y [T, K] -> its results in order (32 at most); compiled anew per call (a new instruction set
    generates new code)."""
    def run(w, x, y):
        xq, xd, xs = q.quantize_input(x, w)
        out = np.zeros(64, np.float32)
        r = body(w, x, y, xq, xd, xs)
        for i in range(len(r)):
            out[i] = r[i]
        return out

    bodies = {
        "dot": lambda w, x, y, xq, xd, xs: (q.dot(w[1], x[0], xq[0], xd[0], xs[0]),),
        "dot2": lambda w, x, y, xq, xd, xs: q.dot2(w[1], w[2], x[0], xq[0], xd[0], xs[0]),
        "dot4": lambda w, x, y, xq, xd, xs: q.dot4(w[3], w[0], w[2], w[1], x[0], xq[0], xd[0], xs[0]),
        "dot4_ahead": lambda w, x, y, xq, xd, xs: q.dot4_ahead(w[3], w[0], w[2], w[1], w[4], w[5], w[6], w[7], x[0],
                                                               xq[0], xd[0], xs[0]),
        "dot2t": lambda w, x, y, xq, xd, xs: q.dot2t(w[0], x, xq, xd, xs, 3, 0),
        "dot4t": lambda w, x, y, xq, xd, xs: q.dot4t(w[2], x, xq, xd, xs, 4, 0, 2, 1),
        "dot2_2t": lambda w, x, y, xq, xd, xs: q.dot2_2t(w[1], w[2], x, xq, xd, xs, 3, 0),
        "dot2_4t": lambda w, x, y, xq, xd, xs: q.dot2_4t(w[1], w[2], x, xq, xd, xs, 4, 0, 2, 1),
        "dot4x4": lambda w, x, y, xq, xd, xs: q.dot4x4(w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], w[1], w[2], w[3],
                                                       w[0]),
        # the axpys write y (the kernel's result: nothing)
        "axpy": lambda w, x, y, xq, xd, xs: (q.axpy(y[0], A[0], w[1]), NOTHING)[1],
        "axpy4": lambda w, x, y, xq, xd, xs: (q.axpy4(y[0], A[0], A[1], A[2], A[3], w[3], w[0], w[2], w[1]), NOTHING)[1],
        "axpy2t": lambda w, x, y, xq, xd, xs: (q.axpy2t(y, 3, 0, A[0], A[1], w[1]), NOTHING)[1],
        "axpy4t": lambda w, x, y, xq, xd, xs: (q.axpy4t(y, 4, 0, 2, 1, A[0], A[1], A[2], A[3], w[2]), NOTHING)[1],
        "block_dot8": lambda w, x, y, xq, xd, xs: q.block_dot8(w[1], xq[0], xd[0], xs[0], I64(w.shape[1])),
        "block_dot8x4": lambda w, x, y, xq, xd, xs: q.block_dot8x4(w[1], w[0], w[1], w[0], xq[0], xd[0], xs[0],
                                                                   I64(w.shape[1])),
        "block_dot8_4t": lambda w, x, y, xq, xd, xs: q.block_dot8_4t(w[1], xq, xd, xs, I64(w.shape[1]), I64(4), I64(0),
                                                                     I64(2), I64(1)),
        "block_dot8x2_4t": lambda w, x, y, xq, xd, xs: q.block_dot8x2_4t(w[1], w[0], xq, xd, xs, I64(w.shape[1]),
                                                                         I64(4), I64(0), I64(2), I64(1)),
    }
    body = njit(bodies[op])
    return njit(run)


def dots(rows, tokens):
    """Reference products of rows [n, K] (values) and tokens [m, K] (as read), row by row."""
    return (rows @ tokens.T).ravel()


# name -> the reference: f(v, t, y) of the rows' values v [8, K] (two groups': [16, K]), the tokens as read t [T, K]
# and the outputs y [T, K] before -> the expected results (the outputs after, for an axpy)
WANT = {
    "dot": lambda v, t, y: dots(v[[1]], t[[0]]),
    "dot2": lambda v, t, y: dots(v[[1, 2]], t[[0]]),
    "dot4": lambda v, t, y: dots(v[[3, 0, 2, 1]], t[[0]]),
    "dot4_ahead": lambda v, t, y: dots(v[[3, 0, 2, 1]], t[[0]]),
    "dot2t": lambda v, t, y: dots(v[[0]], t[[3, 0]]),
    "dot4t": lambda v, t, y: dots(v[[2]], t[[4, 0, 2, 1]]),
    "dot2_2t": lambda v, t, y: dots(v[[1, 2]], t[[3, 0]]),
    "dot2_4t": lambda v, t, y: dots(v[[1, 2]], t[[4, 0, 2, 1]]),
    "dot4x4": lambda v, t, y: dots(v[[0, 1, 2, 3]], t[[0, 1, 2, 3]]),
    "axpy": lambda v, t, y: np.vstack([y[0] + A[0] * v[1], y[1:]]),
    "axpy4": lambda v, t, y: np.vstack([y[0] + A @ v[[3, 0, 2, 1]], y[1:]]),
    "axpy2t": lambda v, t, y: y + np.outer(np.eye(T)[3] * A[0] + np.eye(T)[0] * A[1], v[1]),
    "axpy4t": lambda v, t, y: y + np.outer(A @ np.eye(T)[[4, 0, 2, 1]], v[2]),
    "block_dot8": lambda v, t, y: dots(v[8:16], t[[0]]),
    "block_dot8x4": lambda v, t, y: dots(np.vstack([v[8:16], v[:8], v[8:16], v[:8]]), t[[0]]),
    "block_dot8_4t": lambda v, t, y: dots(v[8:16], t[[4, 0, 2, 1]]).reshape(8, 4).T.ravel(),
    "block_dot8x2_4t": (lambda v, t, y: np.concatenate([dots(v[g:g + 8], t[[4, 0, 2, 1]]).reshape(8, 4).T.ravel()
                                                            for g in (8, 0)])),
}
ROW_OPS = ["dot", "dot2", "dot4", "dot4_ahead", "dot2t", "dot4t", "dot2_2t", "dot2_4t", "axpy", "axpy4", "axpy2t",
           "axpy4t"]
GROUP_OPS = ["block_dot8", "block_dot8x4", "block_dot8_4t", "block_dot8x2_4t"]
ISA_OPS = {"dot", "dot4", "dot4_ahead", "dot2t", "dot4t", *GROUP_OPS}  # their integer products differ by instruction set
CASES = ([(op, fmt, "rows", "native") for fmt in ("f32", "f16", "bf16") for op in ROW_OPS + ["dot4x4"]]
         + [(op, fmt, layout, "native") for fmt in ("q8_0", "q4_0") for layout in ("rows", "runs") for op in ROW_OPS]
         + [(op, fmt, "groups", "native") for fmt in ("q8_0", "q4_0") for op in GROUP_OPS]
         + [(op, fmt, layout, isa) for isa in ("vnni512", "vnni", "avx2", "generic") for fmt in ("q8_0", "q4_0")
            for layout in ("rows", "runs", "groups") for op in sorted(ISA_OPS)
            if (op in GROUP_OPS) == (layout == "groups")])


def laid_out(fmt, layout, rng):
    """Random weights in `layout` and their values as the reference reads the layout [rows, K], tokens x [T, K]."""
    from fast import quant
    f = FORMATS[fmt]
    K = 32 * 24 if f.quantized else 45  # 3 runs of blocks; a float row's vector tail
    b = blocks(quantize(rng.standard_normal((16 if layout == "groups" else 8, K)).astype(np.float32), f))
    w = quant.interleave(b) if layout == "groups" else quant.to_runs(b) if layout == "runs" else b
    v = np.vstack([R.row_values(row, f, layout) for row in w])  # a group's row: its 8 rows' values
    return w, v, (rng.standard_normal((T, K)) * 3).astype(np.float32)


@pytest.mark.parametrize("op, fmt, layout, isa", CASES, ids=["-".join(c) for c in CASES])
def test_row_operation(monkeypatch, request, op, fmt, layout, isa):
    from fast import quant
    q = quant if isa == "native" else with_isa(monkeypatch, request, isa)
    rng = np.random.default_rng()
    w, v, x = laid_out(fmt, layout, rng)
    y0 = rng.standard_normal((T, x.shape[1])).astype(np.float32)
    y = y0.copy()
    reference = WANT[op]
    got = operation(q, op)(w, x, y)
    t = R.token_values(x, FORMATS[fmt])
    want = reference(v, t, y0.astype(np.float64))
    got = y if op.startswith("axpy") else got[:want.size]
    # float32 sums of K terms: the tolerance scales with the terms' magnitudes, not with a result that cancels
    scale = np.abs(reference(np.abs(v), np.abs(t), np.abs(y0).astype(np.float64))).max()
    np.testing.assert_allclose(got.ravel(), np.ravel(want), rtol=1e-5, atol=1e-6 * scale, err_msg=f"{op} {fmt} {layout}")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_layouts_are_what_the_reference_reads(fmt):
    """interleave and to_runs lay the blocks out as the reference reads the layouts' definitions; plain undoes
    them byte for byte."""
    from fast import quant
    f = FORMATS[fmt]
    b = blocks(quantize(np.random.default_rng(3).standard_normal((16, 32 * 16)).astype(np.float32), f))
    plain_values = np.vstack([R.row_values(row, f) for row in b])  # [16, K]
    groups, runs = quant.interleave(b), quant.to_runs(b)
    np.testing.assert_array_equal(np.vstack([R.row_values(g, f, "groups") for g in groups]), plain_values)
    np.testing.assert_array_equal(np.vstack([R.row_values(r, f, "runs") for r in runs]), plain_values)
    assert quant.plain(groups).tobytes() == b.tobytes() and quant.plain(runs).tobytes() == b.tobytes()
    assert quant.for_sparse(b.reshape(8, 2, 16)).dtype == runs.dtype and quant.for_sparse(b[:, :12]).dtype == b.dtype
    # matrices stacked ([q | k | v]) as the stacked matrix is: each part interleaved into its groups, or stacked
    # first where a group spans two parts, or as they are where the rows make no whole groups
    assert quant.for_matmul(b[:8], b[8:]).tobytes() == groups.tobytes()
    assert quant.for_matmul(b[:4], b[4:]).tobytes() == groups.tobytes()
    assert quant.for_matmul(b[:4], b[4:12]).tobytes() == b[:12].tobytes()


def test_every_item_type_names_its_format_and_layout():
    """fast.quant.LAYOUTS says which format and layout each kernel item type is, the same for numpy's dtypes and
    numba's types; the layout transforms' outputs are what they say; anything else is refused by name."""
    from numba.np.numpy_support import from_dtype

    from fast import quant
    assert len(quant.LAYOUTS) == len(FORMATS) + 2 * len(quant.INTERLEAVED)
    for dt, lay in quant.LAYOUTS.items():
        assert quant.TYPES[from_dtype(dt)] is lay and lay.elements == lay.format.block * (quant.RUN if lay.name == "runs" else 1)
    for f in FORMATS.values():
        b = blocks(quantize(np.ones((16, 32 * 8), np.float32), f))
        matrix, bundle = quant.for_matmul(b), quant.for_sparse(b.reshape(8, 2, -1))
        want = ("groups", "runs") if f.quantized else ("rows", "rows")
        assert (quant.layout_of(matrix).name, quant.layout_of(bundle).name) == want
        assert quant.layout_of(matrix).format is quant.layout_of(bundle).format is f and quant.n_rows(matrix) == 16
    with pytest.raises(ValueError, match="float64"):
        quant.layout_of(np.zeros(2))


def test_every_layout_implements_the_row_operations_as_declared():
    """fast.quant.IMPLEMENTATIONS holds a class for every layout of plain rows and runs, each defining every row
    operation (runs: all but a KV cache's store and decoded) with its stub's parameters, and nothing else."""
    import inspect

    from fast import quant
    stubs = {op.__name__: list(inspect.signature(op).parameters) for op in quant.ROW_OPERATIONS}
    kinds = {(lay.name, lay.format.quantized) for lay in quant.LAYOUTS.values()} - {("groups", True)}
    assert set(quant.IMPLEMENTATIONS) == kinds
    for (layout, _), cls in quant.IMPLEMENTATIONS.items():
        funcs = {name: f for name, f in vars(cls).items() if callable(f)}
        assert set(funcs) == set(stubs) - ({"store", "decoded"} if layout == "runs" else set()), cls.__name__
        for name, f in funcs.items():
            assert list(inspect.signature(f).parameters) == stubs[name], f"{cls.__name__}.{name}"


def test_every_format_reads_its_input_as_ref_says():
    """quantize_input makes each weight format's input format (Format.vec_dot: fast.quant.INPUT_FORMATS), in every
    layout: the Q8_0 blocks of ref.quant.input_values (quants and scales), nothing for a float format."""
    from fast import quant

    @njit
    def quantized(x, w):
        return quant.quantize_input(x, w)

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for f in FORMATS.values():
        assert f.vec_dot in quant.INPUT_FORMATS
        b = blocks(quantize(rng.standard_normal((16, 256)).astype(np.float32), f))
        for w in (b, quant.for_matmul(b), quant.for_sparse(b.reshape(8, 2, -1))[:, 0]):
            xq, xd, _ = quantized(x, w)
            if f.vec_dot is None:
                assert xq.shape == (3, 0)
                continue
            want = blocks(quantize(x, f.vec_dot))  # [T, B] Q8_0 blocks
            np.testing.assert_array_equal(xd, want["d"].view(np.float16).astype(np.float32))
            if quant.layout_of(w).name != "runs":  # runs interleave the quants word by word (to_runs)
                np.testing.assert_array_equal(xq, want["qs"].reshape(3, -1))


def test_the_reference_reads_blocks_as_ref_quant_does():
    """The reference's decoding of plain rows is ref.quant.values (the gguf package's, byte for byte), for every
    format."""
    from ref.quant import values
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    for f in FORMATS.values():
        b = blocks(quantize(x, f))
        np.testing.assert_array_equal(np.vstack([R.row_values(row, f) for row in b]), values(b).astype(np.float64))


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("K", [48, 37, 5])
def test_float_tiles_in_every_width(monkeypatch, request, lanes, fmt, K):
    """fast.quant.dot4x4 in 16-lane vectors (AVX-512) and 8-lane ones (other CPUs), steps and a tail, a tail alone,
    against ref's values: lane 4 i + j = w_i . x_j."""
    import numpy as np
    from numba import njit

    from ref.quant import blocks, quantize, values
    quant = generating(monkeypatch, request, FLOAT_LANES=lanes)

    @njit
    def tile(w, x):
        return quant.dot4x4(w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], w[1], w[2], w[3], w[0])

    rng = np.random.default_rng(11)
    w = blocks(quantize(rng.standard_normal((4, K)).astype(np.float32), fmt))
    x = rng.standard_normal((4, K)).astype(np.float32)
    want = values(w).astype(np.float64) @ x.astype(np.float64).T  # [4 rows, 4 tokens]
    np.testing.assert_allclose(np.array(tile(w, x)), want.ravel(), rtol=1e-5, atol=1e-5 * np.abs(want).max())


# Which (rows, tokens) of laid_out's w [8, K] and x [T, K] each float product variant of `operation` takes, in its
# results' order (row-major: row i's tokens, then row i + 1's)
PAIRS = {"dot2": ([1, 2], [0]), "dot4": ([3, 0, 2, 1], [0]), "dot4_ahead": ([3, 0, 2, 1], [0]), "dot2t": ([0], [3, 0]),
         "dot4t": ([2], [4, 0, 2, 1]), "dot2_2t": ([1, 2], [3, 0]), "dot2_4t": ([1, 2], [4, 0, 2, 1]),
         "dot4x4": ([0, 1, 2, 3], [0, 1, 2, 3])}


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_float_products_are_one_arithmetic(monkeypatch, request, lanes, fmt):
    """Every float dot product variant gives each (row, token) the bits `dot` gives it, with a tail and without: a
    row's product with a token does not depend on the rows and tokens it shares a call with, so neither does a
    token's result on its neighbours in a step (block formats' integer sums are exact anyway)."""
    q = generating(monkeypatch, request, FLOAT_LANES=lanes)

    @njit
    def each_dot(w, x):
        xq, xd, xs = q.quantize_input(x, w)
        out = np.empty((w.shape[0], x.shape[0]), np.float32)
        for r in range(w.shape[0]):
            for t in range(x.shape[0]):
                out[r, t] = q.dot(w[r], x[t], xq[t], xd[t], xs[t])
        return out

    rng = np.random.default_rng()
    for K in (45, 160, 7):
        b = blocks(quantize(rng.standard_normal((8, K)).astype(np.float32), FORMATS[fmt]))
        x = (rng.standard_normal((T, K)) * 3).astype(np.float32)
        single = each_dot(b, x)  # [8, T]
        for op, (rows, toks) in PAIRS.items():
            got = operation(q, op)(b, x, np.zeros_like(x))[:len(rows) * len(toks)]
            np.testing.assert_array_equal(got, single[rows][:, toks].ravel(), err_msg=f"{op} K={K}")
