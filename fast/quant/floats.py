"""Float formats' rows (f32; f16 and bf16 bits): decoded to float32 (`load`, `widen`) and written (`put`), their
products with float32 tokens in one arithmetic (_float_products; the 4 x 4 tiles of several tokens', dot4x4), the
attention's tiles, and the row operations on such rows (`Floats`)."""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from fast.quant.ir import (EXACT, F32, I16, I32, I64, I8, _block_loop, _broadcast, _call, _lanes, _member_sums, _read,
                           _splat, _vec)
from fast.quant.layouts import chosen, float_kind
import fast.quant.target as target


@intrinsic
def f16_to_f32(typingctx, bits):
    """IEEE half bits -> float32: an LLVM fpext, one vcvtph2ps for 8 or 16 lanes where the CPU has F16C."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)
    return types.float32(types.uint16), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):
    """bf16 bits -> float32: the upper half of the float32's bits."""
    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], I32), ir.Constant(I32, 16))
        return builder.bitcast(wide, F32)
    return types.float32(types.uint16), codegen


@intrinsic
def f16_bits(typingctx, x):
    """float32 -> IEEE half bits, rounded to nearest even (numpy's astype(float16)): an LLVM fptrunc."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), I16)
    return types.uint16(types.float32), codegen


@intrinsic
def bf16_bits(typingctx, x):
    """float32 -> bf16 bits, rounded to nearest even (ref.common.safetensors.to_bf16_bits)."""
    def codegen(context, builder, sig, args):
        bits = builder.bitcast(args[0], I32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(I32, 16)), ir.Constant(I32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(I32, 0x7FFF)), odd)
        return builder.trunc(builder.lshr(rounded, ir.Constant(I32, 16)), I16)
    return types.uint16(types.float32), codegen


@intrinsic
def f16_round(typingctx, x):
    """float32 rounded to the nearest fp16 (ties to even) and back, as numpy's astype(float16) rounds."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), F32)
    return types.float32(types.float32), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a b + c rounded once (llvm.fma.f32): the one step of every float axpy, so that a row adds the same bits into a
    token's output in every variant (one row or four, one token or several, a tile) and an output is the rows' steps
    in their order; numba's loops vectorise it."""
    if not all(isinstance(v, types.Float) for v in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        a_, b_, c_ = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
        return _call(builder, "llvm.fma.f32", F32, a_, b_, c_)
    return types.float32(a, b, c), codegen


def load(row, k):
    """Element k of a row in a float format, as float32."""


@overload(load, inline="always")
def _load(row, k):
    """Element k of a float-format row as float32: f32 as it is, f16 and bf16 from their bits."""
    if row.dtype == types.float32:
        return lambda row, k: row[k]
    if isinstance(row.dtype, types.Record) and "f16" in row.dtype.fields:
        return lambda row, k: f16_to_f32(row[k].f16)
    if isinstance(row.dtype, types.Record) and "bf16" in row.dtype.fields:
        return lambda row, k: bf16_to_f32(row[k].bf16)

def put(row, k, v):
    """row[k] = the float32 v in the row's float format (f16 and bf16 rounded to nearest even)."""


@overload(put, inline="always")
def _put(row, k, v):
    if row.dtype == types.float32:
        def f32(row, k, v):
            row[k] = v
        return f32
    if isinstance(row.dtype, types.Record) and "f16" in row.dtype.fields:
        def f16(row, k, v):
            row[k].f16 = f16_bits(v)
        return f16
    if isinstance(row.dtype, types.Record) and "bf16" in row.dtype.fields:
        def bf16(row, k, v):
            row[k].bf16 = bf16_bits(v)
        return bf16


def _float_lanes(builder, kind, p, n):
    """n elements of a float-format row at p (i8*) as <n x float>: f16 by fpext (vcvtph2ps), bf16 by a shift."""
    if kind == "f32":
        return _read(builder, p, _vec(F32, n))
    bits = _read(builder, p, _vec(I16, n))
    if kind == "f16":
        return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), n)), _vec(F32, n))
    return builder.bitcast(builder.shl(builder.zext(bits, _vec(I32, n)), _splat(I32, n, 16)), _vec(F32, n))


def _float_products(rows, toks, ahead=()):
    """Typing and codegen of the products w_i . x_j of R float-format rows and J float32 tokens (contiguous, of one
    length; R J = 1 to 16), member m = J i + j of the result: each row and token vector loaded once per step for all
    its products, one accumulator of target.FLOAT_LANES lanes per product (16, zmm, where the CPU has AVX-512:
    numba's loop vectoriser stops at 8) fused-multiply-added element k into lane k % L, the lanes summed by
    _member_sums, then the last K % L elements fused into the sum one by one, in order. Every float product of
    fast.quant is this arithmetic whatever R and J, so a row's product with a token is the same bits in a matrix
    product of one token or of many (what makes a token's result independent of its neighbours). Each step also
    hints the same offset of the `ahead` rows (the rows the caller reads next) into L2: with 8 tokens a 4 x 4 tile
    reads its rows twice, and without the hints the bus idled through the second pass (into L1 the hints evicted
    the tokens)."""
    kind = float_kind(rows[0].dtype)
    if (kind is None or any(r.dtype != rows[0].dtype for r in rows) or any(x.dtype != types.float32 for x in toks)
            or any(a.ndim != 1 or a.layout != "C" for a in rows + toks + ahead)):
        return None
    R, J, A = len(rows), len(toks), len(ahead)
    M, size, L = R * J, (4 if kind == "f32" else 2), target.FLOAT_LANES
    ret = types.UniTuple(types.float32, M)

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args, args)]
        K = cgutils.unpack_tuple(builder, arrays[R].shape)[0]
        wp, xp, pp = ([builder.bitcast(a.data, I8.as_pointer()) for a in arrays[k:k + n]]
                      for k, n in ((0, R), (R, J), (R + J, A)))
        zero = ir.Constant(_vec(F32, M), [0.0] * M)

        def lanes(k, n):  # elements k .. k + n - 1 of each row and token
            return ([_float_lanes(builder, kind, builder.gep(p, [builder.mul(k, I64(size))]), n) for p in wp],
                    [_float_lanes(builder, "f32", builder.gep(p, [builder.mul(k, I64(4))]), n) for p in xp])

        def step(s, accs):  # L elements of every row and token
            wv, xv = lanes(builder.mul(s, I64(L)), L)
            for p in pp:  # the lines of the rows to come, at this step's offset
                _call(builder, "llvm.prefetch.p0", ir.VoidType(), builder.gep(p, [builder.mul(s, I64(L * size))]),
                      I32(0), I32(2), I32(1))
            for m in range(M):
                fma = _call(builder, f"llvm.fma.v{L}f32", _vec(F32, L), wv[m // J], xv[m % J],
                            builder.extract_value(accs, m))
                accs = builder.insert_value(accs, fma, m)
            return accs

        def element(k, acc):  # one of the last K % L elements: lane m += w_(m / J)[k] x_(m % J)[k]
            w1, x1 = lanes(k, 1)
            wv, xv = ir.Constant(_vec(F32, M), None), ir.Constant(_vec(F32, M), None)
            for m in range(M):
                wv = builder.insert_element(wv, builder.extract_element(w1[m // J], I32(0)), I32(m))
                xv = builder.insert_element(xv, builder.extract_element(x1[m % J], I32(0)), I32(m))
            return _call(builder, f"llvm.fma.v{M}f32", _vec(F32, M), wv, xv, acc)

        steps = builder.sdiv(K, I64(L))
        acc0 = ir.Constant(_vec(F32, L), [0.0] * L)
        accs = _block_loop(builder, steps, ir.Constant(ir.LiteralStructType([acc0.type] * M), [acc0] * M), step)
        sums = _member_sums(builder, [builder.extract_value(accs, m) for m in range(M)])
        first = builder.mul(steps, I64(L))
        tail = _block_loop(builder, builder.sub(K, first), zero, lambda i, a: element(builder.add(first, i), a))
        sums = builder.fadd(sums, tail, flags=EXACT)
        return context.make_tuple(builder, ret, [builder.extract_element(sums, I32(m)) for m in range(M)])
    return ret(*rows, *toks, *ahead), codegen


@intrinsic
def dot4x4(typingctx, w0, w1, w2, w3, x0, x1, x2, x3, p0, p1, p2, p3):
    """The 16 products w_i . x_j of four float-format rows and four float32 tokens, in the order i = 0 (j = 0..3),
    i = 1, ..., hinting rows p0..p3 into L2 on the way (_float_products). Unpack the result by name: a tuple indexed
    in a loop leaves registers. Against numba's loop (8 lanes, 16 horizontal sums): [4, 2048] x [32000, 2048] f16
    3.9 -> 2.6 ms."""
    return _float_products((w0, w1, w2, w3), (x0, x1, x2, x3), (p0, p1, p2, p3))


@intrinsic
def fdot(typingctx, w, x):
    """(w . x,) for a float-format row and a float32 token (_float_products' arithmetic)."""
    return _float_products((w,), (x,))


@intrinsic
def fdot2(typingctx, w0, w1, x):
    """(w0 . x, w1 . x) (_float_products' arithmetic)."""
    return _float_products((w0, w1), (x,))


@intrinsic
def fdot4(typingctx, w0, w1, w2, w3, x):
    """(w0 . x, ..., w3 . x) (_float_products' arithmetic)."""
    return _float_products((w0, w1, w2, w3), (x,))


@intrinsic
def fdot2t(typingctx, w, x0, x1):
    """(w . x0, w . x1) (_float_products' arithmetic)."""
    return _float_products((w,), (x0, x1))


@intrinsic
def fdot4t(typingctx, w, x0, x1, x2, x3):
    """(w . x0, ..., w . x3) (_float_products' arithmetic)."""
    return _float_products((w,), (x0, x1, x2, x3))


@intrinsic
def fdot2_2t(typingctx, w0, w1, x0, x1):
    """(w0 . x0, w0 . x1, w1 . x0, w1 . x1) (_float_products' arithmetic)."""
    return _float_products((w0, w1), (x0, x1))


@intrinsic
def fdot2_4t(typingctx, w0, w1, x0, x1, x2, x3):
    """(w0 . x0, ..., w0 . x3, w1 . x0, ..., w1 . x3) (_float_products' arithmetic)."""
    return _float_products((w0, w1), (x0, x1, x2, x3))


@intrinsic
def axpy_tile(typingctx, acc, p, v, g0, n):
    """acc[g0 + i] += sum over j < n of p[g0 + i, j] v[j], i = 0..3: four rows of weighted sums of n rows, in
    registers (attention's values: four query heads' outputs, a block of positions). Each step loads 4 lanes-wide
    slices of a row of v and the four weights once for 16 FMAs (numba's loop loaded and stored the outputs for each
    row of v). E % target.FLOAT_LANES == 0.  acc: [G, E]; p: [G, >= n]; v: [>= n, E]; all float32, C-contiguous."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
               for a in (acc, p, v)):
        return None
    L = target.FLOAT_LANES
    vec = _vec(F32, L)

    def codegen(context, builder, sig, args):
        A, P, V = (context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[:3], args[:3]))
        g0, n = args[3], args[4]
        E = cgutils.unpack_tuple(builder, A.shape)[1]
        stride_p = cgutils.unpack_tuple(builder, P.shape)[1]
        ap, pp, vp = A.data, P.data, V.data  # float*

        def at(ptr, i):  # the L floats at ptr + i, as a vector pointer
            return builder.bitcast(builder.gep(ptr, [i]), vec.as_pointer())

        def chunks(e0, nv):  # acc[g0 .. g0 + 3, e0 : e0 + nv L] += ...
            rows = [builder.mul(builder.add(g0, I64(i)), E) for i in range(4)]
            init = [builder.load(at(ap, builder.add(r, builder.add(e0, I64(c * L)))), align=4)
                    for r in rows for c in range(nv)]
            state = ir.Constant(ir.LiteralStructType([vec] * (4 * nv)), None)
            for m, x in enumerate(init):
                state = builder.insert_value(state, x, m)

            def position(j, accs):
                row = builder.mul(j, E)
                vs = [builder.load(at(vp, builder.add(row, builder.add(e0, I64(c * L)))), align=4) for c in range(nv)]
                for i in range(4):
                    w = builder.load(builder.gep(pp, [builder.add(builder.mul(builder.add(g0, I64(i)), stride_p), j)]))
                    b = _broadcast(builder, w, L)
                    for c in range(nv):
                        m = i * nv + c
                        accs = builder.insert_value(accs, _call(builder, f"llvm.fma.v{L}f32", vec, b, vs[c],
                                                                builder.extract_value(accs, m)), m)
                return accs
            accs = _block_loop(builder, n, state, position)
            for i, r in enumerate(rows):
                for c in range(nv):
                    builder.store(builder.extract_value(accs, i * nv + c),
                                  at(ap, builder.add(r, builder.add(e0, I64(c * L)))), align=4)

        wide = builder.sdiv(E, I64(4 * L))  # groups of four vectors, then single vectors
        flag = ir.Constant(I64, 0)
        _block_loop(builder, wide, flag, lambda b, f: (chunks(builder.mul(b, I64(4 * L)), 4), f)[1])
        rest = builder.sdiv(builder.sub(E, builder.mul(wide, I64(4 * L))), I64(L))
        _block_loop(builder, rest, flag, lambda b, f: (chunks(builder.add(builder.mul(wide, I64(4 * L)),
                                                                            builder.mul(b, I64(L))), 1), f)[1])
        return context.get_dummy_value()
    return types.void(acc, p, v, g0, n), codegen


def _transpose(builder, vs):
    """The n vectors of n lanes vs as columns: lane p of result i is lane i of vs[p] (n a power of two; per bit of
    the index, pairs of vectors trade the lanes that differ in it: 3 rounds of 8 shuffles for 8 x 8)."""
    n, b = len(vs), 1
    while b < n:
        out = list(vs)
        for p in range(n):
            if p & b:
                continue
            a, c = vs[p], vs[p | b]  # lanes of c are n + l in a shuffle of (a, c)
            out[p] = builder.shuffle_vector(a, c, _lanes(*[l if not l & b else n + (l ^ b) for l in range(n)]))
            out[p | b] = builder.shuffle_vector(a, c, _lanes(*[l | b if not l & b else n + l for l in range(n)]))
        vs, b = out, 2 * b
    return vs


HEADS = 8  # query heads and positions of a scores_tile


@intrinsic
def scores_tile(typingctx, s, qt, k, j0, g0):
    """s[g0 + i, j0 + p] = qt[:, g0 + i] . k[j0 + p] for i, p < HEADS: eight query heads' products with eight rows,
    the heads in the lanes of one accumulator per row (each step: the heads' query elements loaded once, each row's
    element broadcast, 8 FMAs; no horizontal sums, which cost dot4x4 about as much as its FMAs where rows are as
    short as a head), then the 8 x 8 transposed in registers into eight rows of s.  s: [G, >= j0 + 8]; qt: [E, G],
    the queries transposed; k: [>= j0 + 8, E]; all float32, C-contiguous."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
               for a in (s, qt, k)):
        return None
    n = HEADS
    vec = _vec(F32, n)

    def codegen(context, builder, sig, args):
        S, Q, K = (context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[:3], args[:3]))
        j0, g0 = args[3], args[4]
        E, G = cgutils.unpack_tuple(builder, Q.shape)
        stride_s = cgutils.unpack_tuple(builder, S.shape)[1]
        sp, qp, kp = S.data, Q.data, K.data  # float*
        rows = [builder.mul(builder.add(j0, I64(p)), E) for p in range(n)]

        def step(e, accs):
            qv = builder.load(builder.bitcast(builder.gep(qp, [builder.add(builder.mul(e, G), g0)]),
                                              vec.as_pointer()), align=4)
            for p in range(n):
                b = _broadcast(builder, builder.load(builder.gep(kp, [builder.add(rows[p], e)])), n)
                accs = builder.insert_value(accs, _call(builder, f"llvm.fma.v{n}f32", vec, qv, b,
                                                        builder.extract_value(accs, p)), p)
            return accs
        zero = ir.Constant(vec, [0.0] * n)
        accs = _block_loop(builder, E, ir.Constant(ir.LiteralStructType([vec] * n), [zero] * n), step)
        heads = _transpose(builder, [builder.extract_value(accs, p) for p in range(n)])
        for i, h in enumerate(heads):
            at = builder.gep(sp, [builder.add(builder.mul(builder.add(g0, I64(i)), stride_s), j0)])
            builder.store(h, builder.bitcast(at, vec.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(s, qt, k, j0, g0), codegen


@intrinsic
def widen(typingctx, out, row):
    """out = the float32 values of an f16 or bf16 row, target.FLOAT_LANES at a time (vcvtph2ps, or a shift), for
    rows whose length is a multiple of them.  out: [n] float32; row: [n] f16 or bf16 (C-contiguous)."""
    kind = float_kind(row.dtype)
    if kind not in ("f16", "bf16") or out.dtype != types.float32 or out.layout != "C" or row.layout != "C":
        return None
    L = target.FLOAT_LANES

    def codegen(context, builder, sig, args):
        O, R = (context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args, args))
        n = cgutils.unpack_tuple(builder, O.shape)[0]
        op, rp = builder.bitcast(O.data, I8.as_pointer()), builder.bitcast(R.data, I8.as_pointer())

        def step(b, flag):
            k = builder.mul(b, I64(L))
            x = _float_lanes(builder, kind, builder.gep(rp, [builder.mul(k, I64(2))]), L)
            builder.store(x, builder.bitcast(builder.gep(op, [builder.mul(k, I64(4))]), _vec(F32, L).as_pointer()),
                          align=1)
            return flag
        _block_loop(builder, builder.sdiv(n, I64(L)), ir.Constant(I64, 0), step)
        return context.get_dummy_value()
    return types.void(out, row), codegen


# ----------------------------------------------------------------------------------------------- the row operations

def float_input(w):
    """fast.quant.quantize_input for a float format's rows (Format.vec_dot None): they read the float32 token as it
    is, so its quantized forms are empty."""
    return lambda x, w: (np.empty((x.shape[0], 0), np.int8), np.empty((x.shape[0], 0), np.float32),
                         np.empty((x.shape[0], 0, 8), np.int32))


class Floats:
    """fast.quant's row operations on rows of a float format (f32; f16 and bf16 bits), against float32 tokens as
    they are (xq, xd, xs empty): every product one arithmetic (_float_products), every axpy one fma per element, rows
    in their order."""

    def dot(w, x, xq, xd, xs):
        return fdot(w, x)[0]

    def dot2(w0, w1, x, xq, xd, xs):
        return fdot2(w0, w1, x)

    def dot4(w0, w1, w2, w3, x, xq, xd, xs):
        return fdot4(w0, w1, w2, w3, x)  # four streams (fast.cpu's STREAMS)

    def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
        return fdot4(w0, w1, w2, w3, x)  # a float row is long enough for the hardware prefetcher

    def hints_ahead(bundle):
        return False

    def dot2t(w, x, xq, xd, xs, t0, t1):
        return fdot2t(w, x[t0], x[t1])

    def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
        return fdot4t(w, x[t0], x[t1], x[t2], x[t3])

    def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
        return fdot2_2t(w0, w1, x[t0], x[t1])

    def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
        return fdot2_4t(w0, w1, x[t0], x[t1], x[t2], x[t3])

    def axpy(y, a, w):
        for d in range(y.shape[0]):
            y[d] = fma(a, load(w, d), y[d])

    def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
        for d in range(y.shape[0]):
            y[d] = fma(a3, load(w3, d), fma(a2, load(w2, d), fma(a1, load(w1, d), fma(a0, load(w0, d), y[d]))))

    def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
        for d in range(y.shape[1]):
            wd = load(w, d)
            y[t0, d] = fma(a0, wd, y[t0, d])
            y[t1, d] = fma(a1, wd, y[t1, d])
            y[t2, d] = fma(a2, wd, y[t2, d])
            y[t3, d] = fma(a3, wd, y[t3, d])

    def axpy2t(y, t0, t1, a0, a1, w):
        for d in range(y.shape[1]):
            wd = load(w, d)
            y[t0, d] = fma(a0, wd, y[t0, d])
            y[t1, d] = fma(a1, wd, y[t1, d])

    def store(row, x):
        for k in range(x.shape[0]):
            put(row, k, x[k])

    @chosen
    def decoded(rows, first, n, scratch):
        if rows.dtype == types.float32:  # the rows themselves
            return lambda rows, first, n, scratch: rows[first:first + n]
        return _widened

    def prefetch_span(bundle):
        return 64  # the first line: a float row is long enough for the hardware prefetcher


def _widened(rows, first, n, scratch):
    """Rows first..first+n-1 of f16 or bf16 rows, decoded into scratch: whole vectors widened, else element by
    element."""
    E = scratch.shape[1]
    for j in range(n):
        if E % target.FLOAT_LANES == 0:
            widen(scratch[j], rows[first + j])
        else:
            for e in range(E):
                scratch[j, e] = load(rows[first + j], e)
    return scratch[:n]
