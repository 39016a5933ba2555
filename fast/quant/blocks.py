"""q8_0 and q4_0 rows block by block: integer dot products of a row's blocks with the token's Q8_0 blocks (one
token, two, four), axpys of dequantized rows, the token's Q8_0 rounding (q8_0_block, q8_0_input), and the row
operations on such rows (`Blocks`)."""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fast.quant.ir import (EXACT, F32, I16, I32, I64, I8, _block_loop, _broadcast, _call, _data, _lane_sum, _lanes,
                           _prefetch, _read, _splat, _vec)
from fast.quant.floats import f16_bits, f16_round
from fast.quant.layouts import BLOCK, BLOCK_FORMATS, RUN, RUNS, TYPES, chosen, in_runs
import fast.quant.target as target


# Software prefetch distance in a block row: the hardware prefetcher does not keep ahead of 18-byte blocks (a one-core
# q4_0 matmul 2.2 GB/s without, 5.2 at 1 KiB ahead).
AHEAD = 1024
# Blocks per step of a dot product, each into its own 8 accumulators (LLVM folds a single accumulator's adds into
# one chain of FMAs), one prefetch per cache line of the step.
GROUP = 4


def _quants(builder, fmt, p):
    """The 32 signed quants <32 x i8> of the block at p: q8_0's int8; q4_0's nibbles (low: elements 0-15) minus 8."""
    if fmt.name == "q8_0":
        return _read(builder, builder.gep(p, [I64(2)]), _vec(I8, 32))
    return builder.sub(_nibbles(builder, p), _splat(I8, 32, 8))


def _nibbles(builder, p):
    """A q4_0 block's 32 quants as stored, 0..15 (elements 0-15 in the low nibbles, 16-31 in the high ones): the
    16 bytes loaded into both halves, the upper half's words shifted right by 4, then masked (no cross-lane shuffle:
    vbroadcasti128, vpsrlvw, vpand where the CPU has AVX-512BW)."""
    return _expand_nibbles(builder, _read(builder, builder.gep(p, [I64(2)]), _vec(I8, 16)))


def _expand_nibbles(builder, nib):
    """A q4_0 block's 16 quant bytes <16 x i8> as its 32 quants as stored (_nibbles)."""
    both = builder.bitcast(builder.shuffle_vector(nib, nib, _lanes(*range(16), *range(16))), _vec(I16, 16))
    shifted = builder.lshr(both, ir.Constant(_vec(I16, 16), [0] * 8 + [4] * 8))
    return builder.and_(builder.bitcast(shifted, _vec(I8, 32)), _splat(I8, 32, 15))


# The offset that makes a format's quants unsigned (q4_0's stored nibbles are q + 8; q8_0's q + 128 is q xor 0x80),
# for vpdpbusd's unsigned x signed form: q . x = u . x - OFFSET sum(x), quantize_input's correction lanes.
OFFSET = {"q4_0": 8, "q8_0": 128}


def _int_operand(builder, fmt, p):
    """What a block's int8 dot products need of the weight block at p, unpacked once for any number of tokens:
    vnni: the unsigned quants u = q + OFFSET; avx2: (q, |q|); generic: q widened to 16 bits."""
    if target.ISA == "vnni":
        return _nibbles(builder, p) if fmt.name == "q4_0" else builder.xor(_quants(builder, fmt, p), _splat(I8, 32, -128))
    q = _quants(builder, fmt, p)
    if target.ISA == "generic":
        return builder.sext(q, _vec(I16, 32))
    return q, _call(builder, "llvm.x86.avx2.psign.b", _vec(I8, 32), q, q)


def _int_dot_with(builder, w, x, corr):
    """<8 x i32> partial sums of q . x over a block's 32 int8 pairs from its operand w (_int_operand), x the token's
    Q8_0 quants (|x| <= 127).

    vnni: vpdpbusd on the unsigned quants u = q + OFFSET, accumulating onto `corr` (-OFFSET sum(x) in lane 0):
    no sign juggling, 18 % faster than llama.cpp's vpsignb form in a one-core loop. avx2: vpmaddubsw, whose 16-bit
    pair sums would saturate at u = 255, so |q| times x sign(q) as llama.cpp does. generic: 16-bit products."""
    if target.ISA == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _vec(I32, 8), corr, builder.bitcast(w, _vec(I32, 8)),
                     builder.bitcast(x, _vec(I32, 8)))
    if target.ISA == "generic":
        prod = builder.mul(w, builder.sext(x, _vec(I16, 32)))
        even = builder.sext(builder.shuffle_vector(prod, prod, _lanes(*range(0, 32, 2))), _vec(I32, 16))
        odd = builder.sext(builder.shuffle_vector(prod, prod, _lanes(*range(1, 32, 2))), _vec(I32, 16))
        s = builder.add(even, odd)
        return builder.add(builder.shuffle_vector(s, s, _lanes(*range(8))), builder.shuffle_vector(s, s, _lanes(*range(8, 16))))
    q, aq = w
    sx = _call(builder, "llvm.x86.avx2.psign.b", _vec(I8, 32), x, q)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), aq, sx)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), pairs, _splat(I16, 16, 1))


def _int_dot8(builder, fmt, p, x, corr):
    """<8 x i32> partial sums of q . x over the block at p (_int_dot_with its operand)."""
    return _int_dot_with(builder, _int_operand(builder, fmt, p), x, corr)


def _scale(builder, p):
    """A block's fp16 scale d as float32."""
    return builder.fpext(_read(builder, p, ir.HalfType()), F32)

@intrinsic
def block_dot(typingctx, w, x, xd, xs, reach):
    """sum_b d_b xd_b sum_i q_bi xq_bi over a row w [B] of q8_0 or q4_0 blocks and a Q8_0 token (xq [K] int8,
    xd [B] float32 scales, xs [B, 8] int32 correction lanes); prefetches up to `reach` blocks from the row's start
    (the next row's too, where the caller reads it next)."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    bs = fmt.block_bytes

    def codegen(context, builder, sig, args):
        w_, x_, xd_, xs_, reach_ = args
        n = cgutils.unpack_tuple(builder, context.make_array(sig.args[0])(context, builder, w_).shape)[0]
        wp0, xp0 = _data(context, builder, sig.args[0], w_), _data(context, builder, sig.args[1], x_)
        dp0 = builder.bitcast(_data(context, builder, sig.args[2], xd_), F32.as_pointer())
        sp0 = builder.bitcast(_data(context, builder, sig.args[3], xs_), _vec(I32, 8).as_pointer())
        limit = builder.mul(reach_, I64(bs))

        def term(b):  # d_b xd_b (q_b . xq_b) as 8 partial sums
            wp = builder.gep(wp0, [builder.mul(b, I64(bs))])
            xv = _read(builder, builder.gep(xp0, [builder.mul(b, I64(BLOCK))]), _vec(I8, 32))
            dot = _int_dot8(builder, fmt, wp, xv, builder.load(builder.gep(sp0, [b]), align=4))
            d = builder.fmul(_scale(builder, wp), builder.load(builder.gep(dp0, [b])), flags=EXACT)
            dv = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(F32, 8), None), d, I32(0)),
                                        ir.Constant(_vec(F32, 8), None), _lanes(*[0] * 8))
            return builder.fmul(builder.sitofp(dot, _vec(F32, 8)), dv, flags=EXACT)

        def group(g, acc):  # block i of each group into accumulators 8i..8i+7; one line prefetched per 64 bytes
            first = builder.mul(g, I64(GROUP))
            off = builder.add(builder.mul(first, I64(bs)), I64(AHEAD))
            for line in range(0, GROUP * bs, 64):
                _prefetch(builder, wp0, builder.add(off, I64(line)), limit)
            t = [term(builder.add(first, I64(i))) for i in range(GROUP)]
            t01 = builder.shuffle_vector(t[0], t[1], _lanes(*range(16)))
            t23 = builder.shuffle_vector(t[2], t[3], _lanes(*range(16)))
            return builder.fadd(acc, builder.shuffle_vector(t01, t23, _lanes(*range(32))), flags=EXACT)

        n_groups = builder.sdiv(n, I64(GROUP))
        acc = _block_loop(builder, n_groups, ir.Constant(_vec(F32, 32), [0.0] * 32), group)
        first = builder.mul(n_groups, I64(GROUP))
        tail = _block_loop(builder, builder.sub(n, first), ir.Constant(_vec(F32, 8), [0.0] * 8),
                           lambda i, a: builder.fadd(a, term(builder.add(first, i)), flags=EXACT))
        return builder.fadd(_lane_sum(builder, acc), _lane_sum(builder, tail), flags=EXACT)
    return types.float32(w, x, xd, xs, reach), codegen


def _dot_t_codegen(fmt, n_tokens):
    """Codegen of a row of blocks against `n_tokens` Q8_0 tokens of x, each block unpacked once for all of them."""
    bs = fmt.block_bytes
    accs_t = ir.LiteralStructType([_vec(F32, 8)] * n_tokens)

    def codegen(context, builder, sig, args):
        w_, x_, xd_, xs_ = args[:4]
        ts = args[4:]
        n = cgutils.unpack_tuple(builder, context.make_array(sig.args[0])(context, builder, w_).shape)[0]
        K = cgutils.unpack_tuple(builder, context.make_array(sig.args[1])(context, builder, x_).shape)[1]
        wp0, xp0 = _data(context, builder, sig.args[0], w_), _data(context, builder, sig.args[1], x_)
        dp0 = builder.bitcast(_data(context, builder, sig.args[2], xd_), F32.as_pointer())
        sp0 = builder.bitcast(_data(context, builder, sig.args[3], xs_), _vec(I32, 8).as_pointer())
        B = builder.sdiv(K, I64(BLOCK))
        rows = [builder.mul(t, B) for t in ts]  # each token's first block

        def body(b, accs):
            wp = builder.gep(wp0, [builder.mul(b, I64(bs))])
            operand, dw = _int_operand(builder, fmt, wp), _scale(builder, wp)
            out = accs
            for i, row in enumerate(rows):
                tb = builder.add(row, b)
                xv = _read(builder, builder.gep(xp0, [builder.mul(tb, I64(BLOCK))]), _vec(I8, 32))
                dot = _int_dot_with(builder, operand, xv, builder.load(builder.gep(sp0, [tb]), align=4))
                d = builder.fmul(dw, builder.load(builder.gep(dp0, [tb])), flags=EXACT)
                term = builder.fmul(builder.sitofp(dot, _vec(F32, 8)), _broadcast(builder, d), flags=EXACT)
                out = builder.insert_value(out, builder.fadd(builder.extract_value(accs, i), term, flags=EXACT), i)
            return out

        zero = ir.Constant(_vec(F32, 8), [0.0] * 8)
        accs = _block_loop(builder, n, ir.Constant(accs_t, [zero] * n_tokens), body)
        sums = [_lane_sum(builder, builder.extract_value(accs, i)) for i in range(n_tokens)]
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def block_dot4t(typingctx, w, x, xd, xs, t0, t1, t2, t3):
    """(w . x[t0], ..., w . x[t3]) over a row w [B] of q8_0 or q4_0 blocks and four Q8_0 tokens of x (xq [T, K] int8,
    xd [T, B] scales, xs [T, B, 8] correction lanes): each block unpacked once for the four tokens."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 4)(w, x, xd, xs, t0, t1, t2, t3), _dot_t_codegen(fmt, 4)


@intrinsic
def block_dot2t(typingctx, w, x, xd, xs, t0, t1):
    """block_dot4t for two tokens."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 2)(w, x, xd, xs, t0, t1), _dot_t_codegen(fmt, 2)


def _values(builder, fmt, raw):
    """A block's 32 quants as float32 <32 x float> from its quant bytes `raw`: q8_0's 32 int8 <32 x i8>; q4_0's 16
    bytes <16 x i8>, each widened to a 32-bit lane before its nibbles are split (low: elements 0-15, high: 16-31) and
    8 taken off, so that the nibbles never pass through a byte shuffle (vpmovzxbd, vpand / vpsrld, vpsubd,
    vcvtdq2ps): as runs, 2.02 ns a row's block where nibbles split as bytes, then widened, took 2.95."""
    if fmt.name == "q8_0":
        return builder.sitofp(raw, _vec(F32, 32))
    wide = builder.zext(raw, _vec(I32, 16))
    eight = _splat(I32, 16, 8)
    low = builder.sub(builder.and_(wide, _splat(I32, 16, 15)), eight)
    high = builder.sub(builder.lshr(wide, _splat(I32, 16, 4)), eight)
    return builder.shuffle_vector(builder.sitofp(low, _vec(F32, 16)), builder.sitofp(high, _vec(F32, 16)),
                                  _lanes(*range(32)))


def _block_item(builder, fmt, p):
    """The block at p as the one block of an item: [(thunk of its quant bytes, scale d float32)] (_values reads
    them). Rows in runs read theirs with fast.quant.runs' _run_blocks."""
    n = 16 if fmt.name == "q4_0" else 32
    return [(lambda: _read(builder, builder.gep(p, [I64(2)]), _vec(I8, n)), _scale(builder, p))]


def _fma_block(builder, q, a, d, y):
    """y + q (a d) for a block's 32 quants q, rounded once per lane (llvm.fma; a d rounded first, exactly): the one
    step of every axpy of a block format, so that a row adds the same bits into a token's output in every variant
    (one row or four, one token or several) and an output is the rows' steps in their order."""
    s = _broadcast(builder, builder.fmul(a, d, flags=EXACT), 32)
    return _call(builder, "llvm.fma.v32f32", _vec(F32, 32), q, s, y)


def _items(fmt, run_blocks):
    """(bytes of an item, blocks in it, its reader) of rows in blocks, or in runs read by `run_blocks`."""
    return (RUNS[fmt.name].itemsize, RUN, run_blocks) if run_blocks else (fmt.block_bytes, 1, _block_item)


def _axpy_t_codegen(fmt, n_tokens, run_blocks=None):
    """y[t_k] += a_k dequant(w) for `n_tokens` tokens' rows of y [T, K], each block of w dequantized once; w in
    blocks, or in runs read by `run_blocks` (fast.quant.runs)."""
    size, per, read = _items(fmt, run_blocks)

    def codegen(context, builder, sig, args):
        y_, ts, as_, w_ = args[0], args[1:1 + n_tokens], args[1 + n_tokens:1 + 2 * n_tokens], args[-1]
        n = cgutils.unpack_tuple(builder, context.make_array(sig.args[-1])(context, builder, w_).shape)[0]
        K = cgutils.unpack_tuple(builder, context.make_array(sig.args[0])(context, builder, y_).shape)[1]
        wp0 = _data(context, builder, sig.args[-1], w_)
        yp0 = builder.bitcast(context.make_array(sig.args[0])(context, builder, y_).data, F32.as_pointer())
        starts = [builder.mul(t, K) for t in ts]  # each token's row of y
        limit = builder.mul(n, I64(size))

        def body(i, carried):
            off = builder.mul(i, I64(size))
            for line in range(0, size, 64):
                _prefetch(builder, wp0, builder.add(off, I64(AHEAD + line)), limit)
            for j, (raw, d) in enumerate(read(builder, fmt, builder.gep(wp0, [off]))):
                q = _values(builder, fmt, raw())
                b = builder.add(builder.mul(i, I64(per)), I64(j))
                for start, a in zip(starts, as_):
                    yp = builder.bitcast(builder.gep(yp0, [builder.add(start, builder.mul(b, I64(BLOCK)))]),
                                         _vec(F32, 32).as_pointer())
                    builder.store(_fma_block(builder, q, a, d, builder.load(yp, align=4)), yp, align=4)
            return carried

        _block_loop(builder, n, I64(0), body)
        return context.get_dummy_value()
    return codegen


@intrinsic
def block_axpy4t(typingctx, y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 dequant(w), ..., y[t3] += a3 dequant(w): y [T, K] float32, w [B] q8_0 or q4_0 blocks."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, t2, t3, a0, a1, a2, a3, w), _axpy_t_codegen(fmt, 4))


@intrinsic
def block_axpy2t(typingctx, y, t0, t1, a0, a1, w):
    """block_axpy4t for two tokens."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, a0, a1, w), _axpy_t_codegen(fmt, 2))


def _axpy_codegen(fmt, rows, run_blocks=None):
    """y += sum_r a_r dequant(w_r) for `rows` rows of blocks (or runs read by `run_blocks`), each y vector loaded
    and stored once per block."""
    size, per, read = _items(fmt, run_blocks)

    def codegen(context, builder, sig, args):
        y_, a_, w_ = args[0], args[1:1 + rows], args[1 + rows:]
        n = cgutils.unpack_tuple(builder, context.make_array(sig.args[-1])(context, builder, w_[0]).shape)[0]
        wp0 = [_data(context, builder, t, v) for t, v in zip(sig.args[1 + rows:], w_)]
        yp0 = builder.bitcast(context.make_array(sig.args[0])(context, builder, y_).data, F32.as_pointer())
        limit = builder.mul(n, I64(size))

        def body(i, carried):
            off = builder.mul(i, I64(size))
            items = []
            for wp in wp0:
                for line in range(0, size, 64):
                    _prefetch(builder, wp, builder.add(off, I64(AHEAD + line)), limit)
                items.append(read(builder, fmt, builder.gep(wp, [off])))
            for j in range(per):
                b = builder.add(builder.mul(i, I64(per)), I64(j))
                yp = builder.bitcast(builder.gep(yp0, [builder.mul(b, I64(BLOCK))]), _vec(F32, 32).as_pointer())
                y = builder.load(yp, align=4)
                for a, blocks_ in zip(a_, items):
                    raw, d = blocks_[j]
                    y = _fma_block(builder, _values(builder, fmt, raw()), a, d, y)
                builder.store(y, yp, align=4)
            return carried

        _block_loop(builder, n, I64(0), body)
        return context.get_dummy_value()
    return codegen


@intrinsic
def block_axpy(typingctx, y, a, w):
    """y += a dequant(w): y [K] float32, w [B] q8_0 or q4_0 blocks; prefetches within the row only."""
    fmt = BLOCK_FORMATS.get(w.dtype)
    return None if fmt is None else (types.void(y, a, w), _axpy_codegen(fmt, 1))


@intrinsic
def block_axpy4(typingctx, y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 dequant(w0) + ... + a3 dequant(w3), rows of equal length."""
    fmt = BLOCK_FORMATS.get(w0.dtype)
    return None if fmt is None else (types.void(y, a0, a1, a2, a3, w0, w1, w2, w3), _axpy_codegen(fmt, 4))



@intrinsic
def q8_0_block(typingctx, q, start, stride, v, first):
    """(d, sum q_i) of the Q8_0 block of 32 float32 values v (a contiguous [32]; ref.quant.quantize_q8_0: d = amax /
    127, q_i = roundf(v_i / d) as sign * floor(|v_i / d| + 1/2)), its quants stored into the int8 array q as 8 words
    of 4 bytes, word k at byte start + k stride: a block's 32 bytes in order (stride 4), or its words in a token's
    runs (stride 4 RUN). In vectors: numba's loop of the same ran 2.5 ns an element."""
    def codegen(context, builder, sig, args):
        q_, start_, stride_, v_, first_ = args
        v32 = _vec(F32, 32)
        vp = builder.gep(context.make_array(sig.args[3])(context, builder, v_).data, [first_])
        vals = _read(builder, builder.bitcast(vp, I8.as_pointer()), v32)
        fabs = lambda a: _call(builder, "llvm.fabs.v32f32", v32, a)  # noqa: E731
        # nnan: a tree of vector maxima (the same maximum; a block holding a NaN has no meaningful quants either way)
        # instead of 31 scalar steps that each check for one: half the time, paid before every quantized matmul's
        # workers start
        amax = _call(builder, "llvm.vector.reduce.fmax.v32f32", F32, fabs(vals), fastmath=("nnan",))
        # exact IEEE steps inside fastmath kernels too: numba's fastmath pass marks only float instructions that carry
        # no flag, and 'fast' ones (arcp's 1 / d, a fused a x + 1/2) flip quants that sit within ulps of a half
        d = builder.fdiv(amax, ir.Constant(F32, 127.0), flags=EXACT)
        inv = builder.select(builder.fcmp_ordered("==", d, ir.Constant(F32, 0.0), flags=EXACT), ir.Constant(F32, 0.0),
                             builder.fdiv(ir.Constant(F32, 1.0), d, flags=EXACT))
        scaled = builder.fmul(vals, _broadcast(builder, inv, 32), flags=EXACT)
        half = _broadcast(builder, ir.Constant(F32, 0.5), 32)
        rounded = _call(builder, "llvm.floor.v32f32", v32, builder.fadd(fabs(scaled), half, flags=EXACT))
        qv = builder.fptosi(_call(builder, "llvm.copysign.v32f32", v32, rounded, scaled), _vec(I8, 32))
        total = _call(builder, "llvm.vector.reduce.add.v32i32", I32, builder.sext(qv, _vec(I32, 32)))
        words = builder.bitcast(qv, _vec(I32, 8))
        base = _data(context, builder, sig.args[0], q_)
        for k in range(8):
            at = builder.gep(base, [builder.add(start_, builder.mul(stride_, I64(k)))])
            builder.store(builder.extract_element(words, I32(k)), builder.bitcast(at, I32.as_pointer()), align=1)
        return context.make_tuple(builder, sig.return_type, [d, total])
    return types.Tuple([types.float32, types.int32])(q, start, stride, v, first), codegen


def q8_0_input(w):
    """fast.quant.quantize_input for rows that read their token as Q8_0 blocks (q8_0, q4_0:
    ref.quant.quantize_q8_0, per block of 32, q8_0_block), laid out as w's rows are (plain blocks, or runs)."""
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


class Blocks:
    """fast.quant's row operations on rows of q8_0 or q4_0 blocks, against the token's Q8_0 blocks (xq [T, K],
    xd [T, B], xs [T, B, 8]). A one-token product's reach: the row and whatever follows it (a matrix's next row, the
    next rows of a neuron's bundle)."""

    def dot(w, x, xq, xd, xs):
        return block_dot(w, xq, xd, xs, np.int64(w.shape[0] + AHEAD))

    def dot2(w0, w1, x, xq, xd, xs):
        reach = np.int64(w0.shape[0] + AHEAD)
        return block_dot(w0, xq, xd, xs, reach), block_dot(w1, xq, xd, xs, reach)

    def dot4(w0, w1, w2, w3, x, xq, xd, xs):
        reach = np.int64(w0.shape[0] + AHEAD)
        return (block_dot(w0, xq, xd, xs, reach), block_dot(w1, xq, xd, xs, reach), block_dot(w2, xq, xd, xs, reach),
                block_dot(w3, xq, xd, xs, reach))

    def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):  # the caller hints the rows ahead
        reach = np.int64(w0.shape[0] + AHEAD)
        return (block_dot(w0, xq, xd, xs, reach), block_dot(w1, xq, xd, xs, reach), block_dot(w2, xq, xd, xs, reach),
                block_dot(w3, xq, xd, xs, reach))

    def hints_ahead(bundle):
        return False

    def dot2t(w, x, xq, xd, xs, t0, t1):
        return block_dot2t(w, xq, xd, xs, np.int64(t0), np.int64(t1))

    def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
        return block_dot4t(w, xq, xd, xs, np.int64(t0), np.int64(t1), np.int64(t2), np.int64(t3))

    def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
        s0, s1 = block_dot2t(w0, xq, xd, xs, np.int64(t0), np.int64(t1))
        r0, r1 = block_dot2t(w1, xq, xd, xs, np.int64(t0), np.int64(t1))
        return s0, s1, r0, r1

    def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
        s0, s1, s2, s3 = block_dot4t(w0, xq, xd, xs, np.int64(t0), np.int64(t1), np.int64(t2), np.int64(t3))
        r0, r1, r2, r3 = block_dot4t(w1, xq, xd, xs, np.int64(t0), np.int64(t1), np.int64(t2), np.int64(t3))
        return s0, s1, s2, s3, r0, r1, r2, r3

    def axpy(y, a, w):
        block_axpy(y, a, w)

    def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
        block_axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3)

    def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
        block_axpy4t(y, np.int64(t0), np.int64(t1), np.int64(t2), np.int64(t3), a0, a1, a2, a3, w)

    def axpy2t(y, t0, t1, a0, a1, w):
        block_axpy2t(y, np.int64(t0), np.int64(t1), a0, a1, w)

    @chosen
    def store(row, x):
        return _store_q8_0 if TYPES[row.dtype].format.name == "q8_0" else None  # a KV cache's blocks: q8_0 only

    def decoded(rows, first, n, scratch):  # y = 0 + 1 w
        for j in range(n):
            scratch[j] = 0.0
            block_axpy(scratch[j], np.float32(1.0), rows[first + j])
        return scratch[:n]

    def prefetch_span(bundle):
        return bundle.shape[-1] * bundle.itemsize  # the whole row: the hardware prefetcher does not keep ahead


def _store_q8_0(row, x):
    """row = x as Q8_0 blocks (q8_0_block: the quants written into the block's own bytes)."""
    v = np.ascontiguousarray(x)
    for b in range(row.shape[0]):
        d, _ = q8_0_block(row[b].qs, np.int64(0), np.int64(4), v, np.int64(b * BLOCK))
        row[b].d = f16_bits(d)
