"""How the CPU kernels read a weight row in each format of ref.common.formats: the row operations `fast.cpu` is
written in, resolved per row type when a kernel compiles (numba overloads), so each kernel stays one source.

  dot4(w0, w1, w2, w3, x, xq, xd, xs) -> (w0 . x, ..., w3 . x)   four rows against one token
  dot(w, x, xq, xd, xs)                -> w . x
  axpy4(y, a0..a3, w0..w3)             y += a0 w0 + ... + a3 w3
  axpy(y, a, w)                        y += a w
  dot4t / dot2t(w, x, ..., t0, ...)    -> (w . x[t0], ...)          one row against four / two tokens
  axpy4t / axpy2t(y, t0, ..., a0, ..., w)  y[t0] += a0 w, ...       one row into four / two tokens' outputs
  quantize_input(x, w)                 -> (xq, xd, xs): the token rows as the dot products with w read them

Float formats (f32; f16 and bf16 bits decoded with `load`) read the float32 token x. Block formats (q8_0, q4_0) read
it rounded to Q8_0 blocks, as llama.cpp's vec_dot_q8_0_q8_0 and vec_dot_q4_0_q8_0 do and ref.quant.input_values
defines: xq int8 quants, xd float32 scales (fp16-rounded), xs each block's correction lanes (block_dot). Their dot
products are integer sums per block, scaled and accumulated in float32 lanes: LLVM IR written here (`@intrinsic`),
because numba widens int8 arithmetic to int64 and its loops then stay scalar (measured: 2 GB/s on one core). Axpy
never quantizes: y += a dequant(w).

Dimensions: T tokens, K row length, B = K / 32 blocks per row.
"""

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, overload
from numba.np.numpy_support import from_dtype

from fast.pages import on_huge_pages
from ref.common.formats import FORMATS
from ref.quant import format_of_blocks

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
BLOCK = 32
# Software prefetch distance in a block row: 2.2 -> 5.6 GB/s for a one-core Q4_0 matmul ([45056, 2048], 0/256/512/
# 1024/2048 bytes ahead: 2.2, 2.7, 3.9, 5.2, 5.6); the hardware prefetcher does not keep ahead of 18-byte blocks.
AHEAD = 1024
# Blocks per step of a dot product, each into its own 8 accumulators (LLVM folds a single accumulator's adds into
# one chain of FMAs), one prefetch per cache line of the step: 1.31 -> 1.27 ns a q4_0 block, one core, in cache.
GROUP = 4
BLOCK_FORMATS = {from_dtype(FORMATS[n].dtype): FORMATS[n] for n in ("q8_0", "q4_0")}
# A matrix of q8_0 or q4_0 rows as fast.cpu.matmul reads it fastest: rows in groups of ROWS, each group block by
# block, a block of the group being its rows' ROWS fp16 scales, then their quants 4 bytes of each row in turn (a q4_0
# byte holds elements j and j + 16; q8_0's quants stored plus 128, i.e. unsigned). One vpdpbusd then multiplies 4
# quants of each of the 8 rows by the same 4 of the token: lanes are rows, a block's scales apply lane by lane, the
# token's block is read once for 8 rows, and no horizontal sum is left but the last. llama.cpp repacks Q4_0 for AVX2
# likewise (its q4_0_8x8). Measured: a [45056, 2048] q4_0 matmul, one token, 2 threads, 2.2 -> 1.2 ms.
ROWS = 8
INTERLEAVED = {n: np.dtype([("d", "<u2", (ROWS,)), ("qs", "u1", (ROWS * (FORMATS[n].block_bytes - 2),))])
               for n in ("q8_0", "q4_0")}
INTERLEAVED_FORMATS = {from_dtype(dt): FORMATS[n] for n, dt in INTERLEAVED.items()}
# A q8_0 or q4_0 row as the sparse kernels read it, one neuron's rows at a time: its blocks in runs of RUN, a run
# laid out as a group block with blocks for rows (the RUN blocks' fp16 scales, then word i of each block in turn, for
# each word i; q8_0's quants stored plus 128), and the token's blocks likewise (quantize_input). One vpdpbusd then
# multiplies word i of 8 blocks of the row by word i of the token's 8: lanes are blocks, the scales apply lane by lane,
# a sum across lanes is left once per row. Row by row, blocks one by one took 6.3 cycles a block and groups 1.9
# ([1, 2048] x [1024, 2048] q4_0 in cache, 2 threads); a neuron's rows cannot be grouped with its neighbours', whom
# the predictor does not pick with it.
RUN = 8
RUNS = {n: np.dtype([("d", "<u2", (RUN,)), ("qw", "u1", (RUN * (FORMATS[n].block_bytes - 2),))])
        for n in ("q8_0", "q4_0")}
RUN_FORMATS = {from_dtype(dt): FORMATS[n] for n, dt in RUNS.items()}


def isa() -> str:
    """The integer dot product this machine has: 'vnni' (vpdpbusd), 'avx2' (vpmaddubsw) or 'generic' IR. Numba
    compiles for the host unless NUMBA_CPU_NAME names another CPU, and keys its cache by CPU and features."""
    if numba_config.CPU_NAME and numba_config.CPU_NAME != "host":
        return "generic"
    feats = llvm.get_host_cpu_features()
    if feats.get("avxvnni") or (feats.get("avx512vnni") and feats.get("avx512vl")):
        return "vnni"
    return "avx2" if feats.get("avx2") else "generic"


ISA = isa()


def wide() -> bool:
    """Whether vpdpbusd runs on 16 lanes here (AVX512-VNNI; AVX-VNNI stops at 8): interleaved groups and rows in runs
    then go two by two (_dot8_codegen). Decided as isa() is, for the host. One token against [32000, 2048], four
    streams, 2 threads, in cache (an Intel Xeon with AVX-512): q8_0 groups 1.67 -> 1.23 ms, runs 1.95 -> 1.30; q4_0
    groups 0.74 -> 0.67, runs 0.95 -> 0.69. TinyLlama sparse decode, q8_0: 50.8 and 49.2 -> 52.4 and 51.7 tok/s
    (alternating runs); q4_0 within the noise."""
    if ISA != "vnni":
        return False
    feats = llvm.get_host_cpu_features()
    return bool(feats.get("avx512vnni") and feats.get("avx512bw"))


WIDE = wide()


def float_lanes() -> int:
    """Lanes of the float tiles' vectors (_float_tile): 16 where the CPU has AVX-512's 32 zmm registers, 8 elsewhere
    (AVX2's 16 ymm registers would spill 16 accumulators of 16 lanes)."""
    if numba_config.CPU_NAME and numba_config.CPU_NAME != "host":
        return 8
    return 16 if llvm.get_host_cpu_features().get("avx512f") else 8


FLOAT_LANES = float_lanes()


# ---------------------------------------------------------------------------------------------------- float formats

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
def f16_round(typingctx, x):
    """float32 rounded to the nearest fp16 (ties to even) and back, as numpy's astype(float16) rounds."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), F32)
    return types.float32(types.float32), codegen


def load(row, k):
    """Element k of a row in a float format, as float32."""


@overload(load, inline="always")
def _load(row, k):
    """Measured on a [45056, 2048] matmul, 2 threads: f32 32 GB/s as written inline, f16 25 GB/s, bf16 21 GB/s."""
    if row.dtype == types.float32:
        return lambda row, k: row[k]
    if isinstance(row.dtype, types.Record) and "f16" in row.dtype.fields:
        return lambda row, k: f16_to_f32(row[k].f16)
    if isinstance(row.dtype, types.Record) and "bf16" in row.dtype.fields:
        return lambda row, k: bf16_to_f32(row[k].bf16)


def is_float(row) -> bool:
    return float_kind(row.dtype) is not None


def in_runs(row) -> bool:
    """Whether the numba array type `row` holds a row's blocks in runs (RUNS)."""
    return row.dtype in RUN_FORMATS


def float_kind(dtype) -> str | None:
    """'f32', 'f16' or 'bf16' for a numba dtype of a float format's row elements, else None."""
    if dtype == types.float32:
        return "f32"
    if isinstance(dtype, types.Record) and len(dtype.fields) == 1:  # ref.common.formats' f16 and bf16 records
        return next((k for k in ("f16", "bf16") if k in dtype.fields), None)
    return None


def _float_lanes(builder, kind, p, n):
    """n elements of a float-format row at p (i8*) as <n x float>: f16 by fpext (vcvtph2ps), bf16 by a shift."""
    if kind == "f32":
        return _read(builder, p, _vec(F32, n))
    bits = _read(builder, p, _vec(I16, n))
    if kind == "f16":
        return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), n)), _vec(F32, n))
    return builder.bitcast(builder.shl(builder.zext(bits, _vec(I32, n)), _splat(I32, n, 16)), _vec(F32, n))


def _transpose_sum(builder, vs):
    """<16 x float> whose lane m is the sum of the lanes of vs[m] (16 vectors of L = 16 or 8 lanes): pairs of vectors
    trade halves of each member's lanes and add, until a vector holds L members' sums (16 lanes: 15 shuffle pairs and
    adds where 16 separate horizontal sums take 64)."""
    L, members = vs[0].type.count, 1
    while members < L:
        width = L // members  # lanes of each member of a vector at this level
        half = width // 2
        lo = [j * width + k for j in range(members) for k in range(half)]
        hi = [i + half for i in lo]
        vs = [builder.fadd(builder.shuffle_vector(a, b, _lanes(*lo, *[L + i for i in lo])),
                           builder.shuffle_vector(a, b, _lanes(*hi, *[L + i for i in hi])), flags=("fast",))
              for a, b in zip(vs[0::2], vs[1::2])]
        members *= 2
    return vs[0] if len(vs) == 1 else _joined(builder, vs)


def _float_tile(rows, toks, ahead):
    """Typing and codegen of the 4 x 4 products w_i . x_j of four float-format rows and four float32 tokens
    (contiguous, of one length), lane 4 i + j of the result: each row and token vector loaded once per step for all
    its products, 16 accumulators of FLOAT_LANES lanes (16, zmm, where the CPU has AVX-512: numba's
    loop vectoriser stops at 8), summed together (_transpose_sum). Each step also hints the same offset of the
    `ahead` rows (the rows the caller reads next) into L2: with 8 tokens a 4 x 4 tile reads its rows twice, and
    without the hints the bus idled through the second pass (into L1 the hints evicted the tokens)."""
    kind = float_kind(rows[0].dtype)
    if (kind is None or any(r.dtype != rows[0].dtype for r in rows) or any(x.dtype != types.float32 for x in toks)
            or any(a.ndim != 1 or a.layout != "C" for a in rows + toks)):
        return None
    size, L = (4 if kind == "f32" else 2), FLOAT_LANES
    ret = types.UniTuple(types.float32, 16)

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args, args)]
        K = cgutils.unpack_tuple(builder, arrays[4].shape)[0]
        wp, xp, pp = ([builder.bitcast(a.data, I8.as_pointer()) for a in arrays[k:k + 4]] for k in (0, 4, 8))
        zero = ir.Constant(_vec(F32, 16), [0.0] * 16)

        def lanes(k, n):  # elements k .. k + n - 1 of each row and token
            return ([_float_lanes(builder, kind, builder.gep(p, [builder.mul(k, I64(size))]), n) for p in wp],
                    [_float_lanes(builder, "f32", builder.gep(p, [builder.mul(k, I64(4))]), n) for p in xp])

        def step(s, accs):  # L elements of every row and token
            wv, xv = lanes(builder.mul(s, I64(L)), L)
            for p in pp:  # the lines of the rows to come, at this step's offset
                _call(builder, "llvm.prefetch.p0", ir.VoidType(), builder.gep(p, [builder.mul(s, I64(L * size))]),
                      I32(0), I32(2), I32(1))
            for m in range(16):
                fma = _call(builder, f"llvm.fma.v{L}f32", _vec(F32, L), wv[m // 4], xv[m % 4],
                            builder.extract_value(accs, m))
                accs = builder.insert_value(accs, fma, m)
            return accs

        def element(k, acc):  # one of the last K % L elements: lane m += w_(m / 4)[k] x_(m % 4)[k]
            w1, x1 = lanes(k, 1)
            wv, xv = ir.Constant(_vec(F32, 16), None), ir.Constant(_vec(F32, 16), None)
            for m in range(16):
                wv = builder.insert_element(wv, builder.extract_element(w1[m // 4], I32(0)), I32(m))
                xv = builder.insert_element(xv, builder.extract_element(x1[m % 4], I32(0)), I32(m))
            return _call(builder, "llvm.fma.v16f32", _vec(F32, 16), wv, xv, acc)

        steps = builder.sdiv(K, I64(L))
        acc0 = ir.Constant(_vec(F32, L), [0.0] * L)
        accs = _block_loop(builder, steps, ir.Constant(ir.LiteralStructType([acc0.type] * 16), [acc0] * 16), step)
        sums = _transpose_sum(builder, [builder.extract_value(accs, m) for m in range(16)])
        first = builder.mul(steps, I64(L))
        tail = _block_loop(builder, builder.sub(K, first), zero, lambda i, a: element(builder.add(first, i), a))
        sums = builder.fadd(sums, tail, flags=("fast",))
        return context.make_tuple(builder, ret, [builder.extract_element(sums, I32(m)) for m in range(16)])
    return ret(*rows, *toks, *ahead), codegen


@intrinsic
def dot4x4(typingctx, w0, w1, w2, w3, x0, x1, x2, x3, p0, p1, p2, p3):
    """The 16 products w_i . x_j of four float-format rows and four float32 tokens, in the order i = 0 (j = 0..3),
    i = 1, ..., hinting rows p0..p3 into L2 on the way (_float_tile). Unpack the result by name: a tuple indexed in a
    loop leaves registers.

    Against numba's loop (8 lanes, 16 horizontal sums), 2 threads, in one process: [16, 256] x [4096, 256] f16 0.20
    -> 0.15 ms, f32 0.19 -> 0.18; [8, 2048] x [32000, 2048] f16 6.5 -> 5.3 ms, f32 11.4 -> 10.0 (bus 35 GB/s);
    [4, 2048] x [32000, 2048] f16 3.9 -> 2.6."""
    return _float_tile((w0, w1, w2, w3), (x0, x1, x2, x3), (p0, p1, p2, p3))


# ---------------------------------------------------------------------------------------------------- block formats (IR)

def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, v):
    return ir.Constant(_vec(t, n), [v] * n)


def _lanes(*idx):
    return ir.Constant(_vec(I32, len(idx)), list(idx))


def _data(context, builder, aty, arr):
    """i8* to an array's first element."""
    return builder.bitcast(context.make_array(aty)(context, builder, arr).data, I8.as_pointer())


def _read(builder, ptr, ty):
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _call(builder, name, ret, *args, fastmath=()):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args), fastmath=fastmath)


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
    if ISA == "vnni":
        return _nibbles(builder, p) if fmt.name == "q4_0" else builder.xor(_quants(builder, fmt, p), _splat(I8, 32, -128))
    q = _quants(builder, fmt, p)
    if ISA == "generic":
        return builder.sext(q, _vec(I16, 32))
    return q, _call(builder, "llvm.x86.avx2.psign.b", _vec(I8, 32), q, q)


def _int_dot_with(builder, w, x, corr):
    """<8 x i32> partial sums of q . x over a block's 32 int8 pairs from its operand w (_int_operand), x the token's
    Q8_0 quants (|x| <= 127).

    vnni: vpdpbusd on the unsigned quants u = q + OFFSET, accumulating onto `corr` (-OFFSET sum(x) in lane 0):
    no sign juggling, 18 % faster than llama.cpp's vpsignb form in a one-core loop. avx2: vpmaddubsw, whose 16-bit
    pair sums would saturate at u = 255, so |q| times x sign(q) as llama.cpp does. generic: 16-bit products."""
    if ISA == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _vec(I32, 8), corr, builder.bitcast(w, _vec(I32, 8)),
                     builder.bitcast(x, _vec(I32, 8)))
    if ISA == "generic":
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


def _block_loop(builder, n, init, body):
    """for b in range(n): carried = body(b, carried); returns the final carried value (init when n <= 0)."""
    entry = builder.block
    loop = builder.function.append_basic_block("blocks.loop")
    done = builder.function.append_basic_block("blocks.done")
    builder.cbranch(builder.icmp_signed(">", n, I64(0)), loop, done)
    builder.position_at_end(loop)
    b, carried = builder.phi(I64), builder.phi(init.type)
    b.add_incoming(I64(0), entry)
    carried.add_incoming(init, entry)
    after = body(b, carried)
    b1 = builder.add(b, I64(1))
    b.add_incoming(b1, builder.block)
    carried.add_incoming(after, builder.block)
    last = builder.block
    builder.cbranch(builder.icmp_signed("<", b1, n), loop, done)
    builder.position_at_end(done)
    out = builder.phi(init.type)
    out.add_incoming(init, entry)
    out.add_incoming(after, last)
    return out


def _prefetch(builder, base, offset, limit, locality=3):
    """Hint base[offset] into the caches (locality 3: L1, 2: L2) if offset < limit (bytes): never past what the
    caller will read."""
    with builder.if_then(builder.icmp_signed("<", offset, limit), likely=True):
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), builder.gep(base, [offset]), I32(0), I32(locality), I32(1))


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
            d = builder.fmul(_scale(builder, wp), builder.load(builder.gep(dp0, [b])))
            dv = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(F32, 8), None), d, I32(0)),
                                        ir.Constant(_vec(F32, 8), None), _lanes(*[0] * 8))
            return builder.fmul(builder.sitofp(dot, _vec(F32, 8)), dv, flags=("fast",))

        def group(g, acc):  # block i of each group into accumulators 8i..8i+7; one line prefetched per 64 bytes
            first = builder.mul(g, I64(GROUP))
            off = builder.add(builder.mul(first, I64(bs)), I64(AHEAD))
            for line in range(0, GROUP * bs, 64):
                _prefetch(builder, wp0, builder.add(off, I64(line)), limit)
            t = [term(builder.add(first, I64(i))) for i in range(GROUP)]
            t01 = builder.shuffle_vector(t[0], t[1], _lanes(*range(16)))
            t23 = builder.shuffle_vector(t[2], t[3], _lanes(*range(16)))
            return builder.fadd(acc, builder.shuffle_vector(t01, t23, _lanes(*range(32))))

        n_groups = builder.sdiv(n, I64(GROUP))
        acc = _block_loop(builder, n_groups, ir.Constant(_vec(F32, 32), [0.0] * 32), group)
        first = builder.mul(n_groups, I64(GROUP))
        tail = _block_loop(builder, builder.sub(n, first), ir.Constant(_vec(F32, 8), [0.0] * 8),
                           lambda i, a: builder.fadd(a, term(builder.add(first, i))))
        return builder.fadd(_call(builder, "llvm.vector.reduce.fadd.v32f32", F32, ir.Constant(F32, -0.0), acc),
                            _call(builder, "llvm.vector.reduce.fadd.v8f32", F32, ir.Constant(F32, -0.0), tail))
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
                d = builder.fmul(dw, builder.load(builder.gep(dp0, [tb])))
                term = builder.fmul(builder.sitofp(dot, _vec(F32, 8)), _broadcast(builder, d), flags=("fast",))
                out = builder.insert_value(out, builder.fadd(builder.extract_value(accs, i), term, flags=("fast",)), i)
            return out

        zero = ir.Constant(_vec(F32, 8), [0.0] * 8)
        accs = _block_loop(builder, n, ir.Constant(accs_t, [zero] * n_tokens), body)
        sums = [_call(builder, "llvm.vector.reduce.fadd.v8f32", F32, ir.Constant(F32, -0.0),
                      builder.extract_value(accs, i)) for i in range(n_tokens)]
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


def _blocks_of(dtype):
    """(format, in runs) of the row type whose blocks an axpy dequantizes: q8_0 / q4_0 blocks, or their RUNS; else
    (None, False)."""
    if dtype in RUN_FORMATS:
        return RUN_FORMATS[dtype], True
    return BLOCK_FORMATS.get(dtype), False


def _transpose_words(builder, words):
    """A run's words (4 or 8 <8 x i32>, lane j of vector i: word i of block j) as each block's words in order (8
    vectors <4 x i32> or <8 x i32>): a butterfly of lane interleaves, 1 shuffle a block for q4_0, 3 for q8_0. An
    axpy over runs still costs more than over blocks (one token into [256, 2048] rows four at a time, in cache, 1
    thread: q4_0 2.0 to 2.3 against 1.8 to 2.0 ns a row's block, q8_0 2.4 against 1.5)."""
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


def _values(builder, fmt, raw):
    """A block's 32 quants as float32 <32 x float> from its quant bytes `raw`: q8_0's 32 int8 <32 x i8>; q4_0's 16
    bytes <16 x i8>, each widened to a 32-bit lane before its nibbles are split (low: elements 0-15, high: 16-31) and
    8 taken off, so that the nibbles never pass through a byte shuffle (vpmovzxbd, vpand / vpsrld, vpsubd,
    vcvtdq2ps). One token into [256, 2048] q4_0 rows in cache, 1 thread, ns a row's block, before (nibbles split as
    bytes, then widened) and after: four rows at once as blocks 1.95 -> 1.76, as runs 2.95 -> 2.02; a row at a time
    as runs 2.93 -> 2.27."""
    if fmt.name == "q8_0":
        return builder.sitofp(raw, _vec(F32, 32))
    wide = builder.zext(raw, _vec(I32, 16))
    eight = _splat(I32, 16, 8)
    low = builder.sub(builder.and_(wide, _splat(I32, 16, 15)), eight)
    high = builder.sub(builder.lshr(wide, _splat(I32, 16, 4)), eight)
    return builder.shuffle_vector(builder.sitofp(low, _vec(F32, 16)), builder.sitofp(high, _vec(F32, 16)),
                                  _lanes(*range(32)))


def _item_blocks(builder, fmt, runs, p):
    """The blocks of a row's item at p (a block, or a run of RUN) as (thunk of its 32 quants as float32 <32 x float>,
    scale d float32) each: a run's words loaded once, block j's 16 (q4_0) or 32 (q8_0) bytes taken from lane j of
    each."""
    if not runs:
        n = 16 if fmt.name == "q4_0" else 32
        return [(lambda: _read(builder, builder.gep(p, [I64(2)]), _vec(I8, n)), _scale(builder, p))]
    words = [_read(builder, builder.gep(p, [I64(2 * RUN + 32 * i)]), _vec(I32, 8))
             for i in range((fmt.block_bytes - 2) // 4)]
    d8 = builder.fpext(_read(builder, p, _vec(ir.HalfType(), RUN)), _vec(F32, RUN))
    blocks_ = _transpose_words(builder, words)  # block j's words: <4 x i32> (q4_0) or <8 x i32> (q8_0)

    def raw(j):
        raw = builder.bitcast(blocks_[j], _vec(I8, 4 * len(words)))
        return raw if fmt.name == "q4_0" else builder.xor(raw, _splat(I8, 32, -128))
    return [((lambda j=j: raw(j)), builder.extract_element(d8, I32(j))) for j in range(RUN)]


def _axpy_t_codegen(fmt, runs, n_tokens):
    """y[t_k] += a_k dequant(w) for `n_tokens` tokens' rows of y [T, K], each block of w (blocks or runs)
    dequantized once."""
    size = RUNS[fmt.name].itemsize if runs else fmt.block_bytes
    per = RUN if runs else 1  # blocks per item

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
            for j, (raw, d) in enumerate(_item_blocks(builder, fmt, runs, builder.gep(wp0, [off]))):
                q = _values(builder, fmt, raw())
                b = builder.add(builder.mul(i, I64(per)), I64(j))
                for start, a in zip(starts, as_):
                    yp = builder.bitcast(builder.gep(yp0, [builder.add(start, builder.mul(b, I64(BLOCK)))]),
                                         _vec(F32, 32).as_pointer())
                    sv = _broadcast(builder, builder.fmul(a, d), 32)
                    builder.store(builder.fadd(builder.load(yp, align=4), builder.fmul(q, sv, flags=("fast",)),
                                               flags=("fast",)), yp, align=4)
            return carried

        _block_loop(builder, n, I64(0), body)
        return context.get_dummy_value()
    return codegen


@intrinsic
def block_axpy4t(typingctx, y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 dequant(w), ..., y[t3] += a3 dequant(w): y [T, K] float32, w [B] q8_0 or q4_0 blocks (or runs)."""
    fmt, runs = _blocks_of(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, t2, t3, a0, a1, a2, a3, w), _axpy_t_codegen(fmt, runs, 4))


@intrinsic
def block_axpy2t(typingctx, y, t0, t1, a0, a1, w):
    """block_axpy4t for two tokens."""
    fmt, runs = _blocks_of(w.dtype)
    return None if fmt is None else (types.void(y, t0, t1, a0, a1, w), _axpy_t_codegen(fmt, runs, 2))


def _axpy_codegen(fmt, runs, rows):
    """y += sum_r a_r dequant(w_r) for `rows` rows of blocks (or runs), each y vector loaded and stored once per
    block."""
    size = RUNS[fmt.name].itemsize if runs else fmt.block_bytes
    per = RUN if runs else 1  # blocks per item

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
                items.append(_item_blocks(builder, fmt, runs, builder.gep(wp, [off])))
            for j in range(per):
                b = builder.add(builder.mul(i, I64(per)), I64(j))
                yp = builder.bitcast(builder.gep(yp0, [builder.mul(b, I64(BLOCK))]), _vec(F32, 32).as_pointer())
                y = builder.load(yp, align=4)
                for a, blocks_ in zip(a_, items):
                    raw, d = blocks_[j]
                    q = _values(builder, fmt, raw())
                    y = builder.fadd(y, builder.fmul(q, _broadcast(builder, builder.fmul(a, d), 32), flags=("fast",)),
                                     flags=("fast",))
                builder.store(y, yp, align=4)
            return carried

        _block_loop(builder, n, I64(0), body)
        return context.get_dummy_value()
    return codegen


@intrinsic
def block_axpy(typingctx, y, a, w):
    """y += a dequant(w): y [K] float32, w [B] q8_0 or q4_0 blocks (or runs); prefetches within the row only."""
    fmt, runs = _blocks_of(w.dtype)
    return None if fmt is None else (types.void(y, a, w), _axpy_codegen(fmt, runs, 1))


@intrinsic
def block_axpy4(typingctx, y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 dequant(w0) + ... + a3 dequant(w3), rows of equal length."""
    fmt, runs = _blocks_of(w0.dtype)
    return None if fmt is None else (types.void(y, a0, a1, a2, a3, w0, w1, w2, w3), _axpy_codegen(fmt, runs, 4))


def _dpbusd(builder, acc, a, b):
    """acc + in each of n i32 lanes (acc <n x i32>, n = 8 or 16) the sum of its 4 bytes' products u8(a) s8(b)
    (vpdpbusd; plain IR without VNNI)."""
    n = acc.type.count
    a, b = builder.bitcast(a, _vec(I32, n)), builder.bitcast(b, _vec(I32, n))
    if ISA == "vnni":
        return _call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", _vec(I32, n), acc, a, b)
    prod = builder.mul(builder.zext(builder.bitcast(a, _vec(I8, 4 * n)), _vec(I32, 4 * n)),
                       builder.sext(builder.bitcast(b, _vec(I8, 4 * n)), _vec(I32, 4 * n)))
    quarters = [builder.shuffle_vector(prod, prod, _lanes(*range(k, 4 * n, 4))) for k in range(4)]
    return builder.add(acc, builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3])))


def _broadcast(builder, v, n=8):
    """<n x v.type> of the scalar v."""
    undef = ir.Constant(_vec(v.type, n), None)
    return builder.shuffle_vector(builder.insert_element(undef, v, I32(0)), undef, _lanes(*[0] * n))


def _joined(builder, vs):
    """One vector of the vectors vs (one or two of a type) side by side."""
    return vs[0] if len(vs) == 1 else builder.shuffle_vector(vs[0], vs[1], _lanes(*range(2 * vs[0].type.count)))


def _group_operands(builder, fmt, ps):
    """The quants of the group blocks at ps (one, or two side by side: 16 lanes) as vpdpbusd's unsigned operands,
    each with the index of the token word it multiplies: q4_0's word i of 8 rows gives the low nibbles (token word
    i) and the high ones (word 4 + i)."""
    words = (fmt.block_bytes - 2) // 4  # 4-byte words of one row's quants in a block
    n = ROWS * len(ps)
    low = _splat(I32, n, 0x0F0F0F0F)
    out = []
    for i in range(words):  # word i of the 8 rows (of each group)
        v = _joined(builder, [_read(builder, builder.gep(p, [I64(2 * ROWS + 32 * i)]), _vec(I32, 8)) for p in ps])
        if fmt.name == "q4_0":
            out += [(builder.and_(v, low), i), (builder.and_(builder.lshr(v, _splat(I32, n, 4)), low), 4 + i)]
        else:
            out.append((v, i))
    return out


def _token_block(builder, xp, dp, sp, b, shared, n=8):
    """Token block b's 8 words, its correction and its scale, each broadcast to n lanes (xp, dp, sp: the token's
    quants, scales and correction lanes). Words `shared` by several groups are loaded once, here; otherwise as
    thunks that load them where they are used (_group_term), so that the broadcast load folds into vpdpbusd's
    operand: loaded up front, four tokens' words were spilled to the stack ([8, 2048] x [2048, 2048] q4_0 in cache,
    2 threads: 104 -> 209 to 234 GMAC/s). `words(k)` gives word k."""
    xw = builder.bitcast(builder.gep(xp, [builder.mul(b, I64(BLOCK))]), I32.as_pointer())

    def word(k):
        return _broadcast(builder, builder.load(builder.gep(xw, [I64(k)]), align=1), n)
    if shared:
        loaded = [word(k) for k in range(8)]
        words = loaded.__getitem__
    else:
        words = word
    corr = _broadcast(builder, builder.load(builder.gep(sp, [builder.mul(b, I64(8))])), n)
    return words, corr, _broadcast(builder, builder.load(builder.gep(dp, [b])), n)


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


def _group_term(builder, operands, token, d8):
    """<n x float> d_r xd (q_r . x) of a group block's 8 rows (or two groups' 16) and a token block: vpdpbusd in
    four chains (its latency), the first started from the correction -OFFSET sum(x) (the same for every row)."""
    words, corr, xd = token
    n = corr.type.count
    chains = [corr] + [ir.Constant(_vec(I32, n), [0] * n)] * 3
    for k, (operand, word) in enumerate(operands):
        chains[k % 4] = _dpbusd(builder, chains[k % 4], operand, words(word))
    total = builder.add(builder.add(chains[0], chains[1]), builder.add(chains[2], chains[3]))
    return builder.fmul(builder.sitofp(total, _vec(F32, n)), builder.fmul(d8, xd), flags=("fast",))


def _dot8_codegen(fmt, streams, n_tokens, runs=False, ahead=False):
    """Codegen of `streams` groups of interleaved rows against `n_tokens` Q8_0 tokens: one token (x [K], xd [B],
    xs [B, 8]) or tokens t_k of x [T, K] (xd [T, B], xs [T, B, 8]); each group block unpacked once for all tokens,
    each token block loaded once for all groups. Sums group by group, token by token.
    With `runs`, `streams` rows in RUNS against tokens laid out for them (xs [T, B / RUN, RUN]): lanes are blocks,
    one sum per row and token.
    Where vpdpbusd has 16 lanes (WIDE), an even number of streams goes two by two, side by side in 16 lanes: half
    the instructions for the same products.
    With `ahead`, `streams` more rows follow the rows (the ones the caller reads next) and each step hints the same
    offset of each into L2: their misses spread over this pass instead of arriving at once."""
    gb = (RUNS if runs else INTERLEAVED)[fmt.name].itemsize  # bytes of a group block, or of a run
    width = 2 if WIDE and streams % 2 == 0 else 1  # streams per vector
    n_acc, lanes_t = streams // width * max(n_tokens, 1), _vec(F32, 8 * width)

    def codegen(context, builder, sig, args):
        nw = 2 * streams if ahead else streams  # rows, and the rows ahead
        ws, (x_, xd_, xs_, reach_), ts = args[:streams], args[nw:nw + 4], args[nw + 4:]
        n = cgutils.unpack_tuple(builder, context.make_array(sig.args[0])(context, builder, ws[0]).shape)[0]
        wp0s = [_data(context, builder, t, w_) for t, w_ in zip(sig.args, ws)]
        aps = [_data(context, builder, t, a_) for t, a_ in zip(sig.args[streams:nw], args[streams:nw])]
        xp0 = _data(context, builder, sig.args[nw], x_)
        dp0 = builder.bitcast(_data(context, builder, sig.args[nw + 1], xd_), F32.as_pointer())
        sp0 = builder.bitcast(_data(context, builder, sig.args[nw + 2], xs_), I32.as_pointer())
        limit = builder.mul(reach_, I64(gb))
        row = builder.mul(n, I64(gb))  # bytes of a row (and of a row ahead)
        if ts:  # token t's rows: quants at t K, scales at t B, correction lanes at 8 t B
            K = cgutils.unpack_tuple(builder, context.make_array(sig.args[nw])(context, builder, x_).shape)[1]
            B = builder.sdiv(K, I64(BLOCK))
            lanes = B if runs else builder.mul(B, I64(8))  # correction lanes per token
            tokens = [(builder.gep(xp0, [builder.mul(t, K)]), builder.gep(dp0, [builder.mul(t, B)]),
                       builder.gep(sp0, [builder.mul(t, lanes)])) for t in ts]
        else:
            tokens = [(xp0, dp0, sp0)]

        def token_blocks(b):
            if not runs:  # words shared by vectors are loaded once
                return [_token_block(builder, *tok, b, streams > width, 8 * width) for tok in tokens]
            out = []
            for tok in tokens:  # a run's lanes are its blocks: the same token vectors for both rows of a pair
                words, corr, xd = _token_run(builder, *tok, b, streams > 1)
                out.append((lambda k, words=words: _joined(builder, [words(k)] * width),
                            _joined(builder, [corr] * width), _joined(builder, [xd] * width)))
            return out

        def body(b, accs):
            off = builder.mul(b, I64(gb))
            blocks_ = token_blocks(b)
            out = accs
            for j in range(streams // width):
                ps = []
                for s in range(j * width, (j + 1) * width):
                    for line in range(0, gb, 64):
                        _prefetch(builder, wp0s[s], builder.add(off, I64(AHEAD + line)), limit)
                        if ahead:
                            _prefetch(builder, aps[s], builder.add(off, I64(line)), row, locality=2)
                    ps.append(builder.gep(wp0s[s], [off]))
                operands = _group_operands(builder, fmt, ps)
                d8 = _joined(builder, [builder.fpext(_read(builder, p, _vec(ir.HalfType(), ROWS)), _vec(F32, 8))
                                       for p in ps])
                for k, token in enumerate(blocks_):
                    i = j * len(tokens) + k
                    term = _group_term(builder, operands, token, d8)
                    out = builder.insert_value(out, builder.fadd(builder.extract_value(accs, i), term,
                                                                 flags=("fast",)), i)
            return out

        zero = ir.Constant(lanes_t, [0.0] * lanes_t.count)
        accs = _block_loop(builder, n, ir.Constant(ir.LiteralStructType([lanes_t] * n_acc), [zero] * n_acc), body)

        def half(s, k):  # stream s's 8 lanes of token k's accumulator
            j, m = divmod(s, width)
            v = builder.extract_value(accs, j * len(tokens) + k)
            return v if width == 1 else builder.shuffle_vector(v, v, _lanes(*range(8 * m, 8 * m + 8)))
        if runs:  # a row's sum across its lanes (blocks)
            sums = [_call(builder, "llvm.vector.reduce.fadd.v8f32", F32, ir.Constant(F32, -0.0), half(s, k))
                    for s in range(streams) for k in range(len(tokens))]
        else:  # lanes are rows
            sums = [builder.extract_element(half(s, k), I32(r))
                    for s in range(streams) for k in range(len(tokens)) for r in range(ROWS)]
        if len(sums) == 1:  # one row, one token: a float32
            return sums[0]
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def block_dot8(typingctx, w, x, xd, xs, reach):
    """(w_0 . x, ..., w_7 . x) for a group of 8 interleaved rows w [B] (INTERLEAVED) and a Q8_0 token (xq [K] int8,
    xd [B] scales, xs [B, 8] correction lanes); prefetches up to `reach` group blocks from the group's start.

    Per block, 4-byte words of the token broadcast to the 8 lanes: q4_0's 4 words of 8 rows' bytes give the low
    nibbles (elements 4i..4i+3) and the high ones (16 + 4i..), q8_0's 8 words the bytes; vpdpbusd in four chains (its
    latency), started from the correction -OFFSET sum(x) (the same for every row)."""
    fmt = INTERLEAVED_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, ROWS)(w, x, xd, xs, reach), _dot8_codegen(fmt, 1, 0)


@intrinsic
def block_dot8x4(typingctx, w0, w1, w2, w3, x, xd, xs, reach):
    """block_dot8 for four groups at once (four streams, fast.cpu's STREAMS): 32 sums, group by group."""
    fmt = INTERLEAVED_FORMATS.get(w0.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 4 * ROWS)(w0, w1, w2, w3, x, xd, xs, reach), _dot8_codegen(fmt, 4, 0)


@intrinsic
def block_dot8_4t(typingctx, w, x, xd, xs, reach, t0, t1, t2, t3):
    """block_dot8 of one group against four tokens t0..t3 of x (xq [T, K], xd [T, B], xs [T, B, 8]): each group
    block unpacked once for the four. 32 sums, token by token."""
    fmt = INTERLEAVED_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return (types.UniTuple(types.float32, 4 * ROWS)(w, x, xd, xs, reach, t0, t1, t2, t3),
            _dot8_codegen(fmt, 1, 4))


@intrinsic
def block_dot8x2_4t(typingctx, w0, w1, x, xd, xs, reach, t0, t1, t2, t3):
    """block_dot8_4t of two groups at once (side by side in 16 lanes where WIDE: half the vpdpbusd of one group at a
    time). 64 sums, group by group, token by token."""
    fmt = INTERLEAVED_FORMATS.get(w0.dtype)
    if fmt is None:
        return None
    return (types.UniTuple(types.float32, 8 * ROWS)(w0, w1, x, xd, xs, reach, t0, t1, t2, t3),
            _dot8_codegen(fmt, 2, 4))


@intrinsic
def run_dot(typingctx, w, x, xd, xs, reach):
    """w . x for a row w [B / RUN] in RUNS and a Q8_0 token laid out for it (xq [K] int8, xd [B] scales, xs
    [B / RUN, RUN] correction lanes); prefetches up to `reach` runs from the row's start."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.float32(w, x, xd, xs, reach), _dot8_codegen(fmt, 1, 0, runs=True)


@intrinsic
def run_dot4(typingctx, w0, w1, w2, w3, x, xd, xs, reach):
    """run_dot of four rows at once (four streams), the token's runs loaded once for the four."""
    fmt = RUN_FORMATS.get(w0.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 4)(w0, w1, w2, w3, x, xd, xs, reach), _dot8_codegen(fmt, 4, 0, runs=True)


@intrinsic
def run_dot4_ahead(typingctx, w0, w1, w2, w3, a0, a1, a2, a3, x, xd, xs, reach):
    """run_dot4, hinting rows a0..a3 (the four read next) into L2 as these are read, line for line."""
    fmt = RUN_FORMATS.get(w0.dtype)
    if fmt is None or any(a.dtype != w0.dtype for a in (a0, a1, a2, a3)):
        return None
    return (types.UniTuple(types.float32, 4)(w0, w1, w2, w3, a0, a1, a2, a3, x, xd, xs, reach),
            _dot8_codegen(fmt, 4, 0, runs=True, ahead=True))


@intrinsic
def run_dot4t(typingctx, w, x, xd, xs, reach, t0, t1, t2, t3):
    """run_dot of one row against four tokens t0..t3 of x (xq [T, K], xd [T, B], xs [T, B / RUN, RUN]): each run
    unpacked once for the four."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return (types.UniTuple(types.float32, 4)(w, x, xd, xs, reach, t0, t1, t2, t3),
            _dot8_codegen(fmt, 1, 4, runs=True))


@intrinsic
def run_dot2t(typingctx, w, x, xd, xs, reach, t0, t1):
    """run_dot4t for two tokens."""
    fmt = RUN_FORMATS.get(w.dtype)
    if fmt is None:
        return None
    return types.UniTuple(types.float32, 2)(w, x, xd, xs, reach, t0, t1), _dot8_codegen(fmt, 1, 2, runs=True)


EXACT = ("nsz",)  # a fast-math flag that changes no rounding: numba's fastmath pass leaves flagged instructions alone


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
        # instead of 31 scalar steps that each check for one: a token of 2048 values 1.51 -> 0.81 us, paid before
        # every quantized matmul's workers start
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


# ---------------------------------------------------------------------------------------------------- the row operations

def quantize_input(x, w):
    """(xq [T, K] int8, xd [T, B] float32, xs [T, B, 8] int32): x [T, K] as products with w read it (empty for
    float formats); xs holds each block's correction -OFFSET sum(xq) in lane 0 (block_dot's vpdpbusd form). For rows
    in RUNS, each run of the token laid out as theirs (word k of its blocks in turn) and xs [T, B / RUN, RUN] the
    corrections of its blocks."""


@overload(quantize_input)
def _quantize_input(x, w):
    if is_float(w):
        return lambda x, w: (np.empty((x.shape[0], 0), np.int8), np.empty((x.shape[0], 0), np.float32),
                             np.empty((x.shape[0], 0, 8), np.int32))
    offset = OFFSET[(BLOCK_FORMATS.get(w.dtype) or INTERLEAVED_FORMATS.get(w.dtype) or RUN_FORMATS[w.dtype]).name]
    span = RUN if in_runs(w) else 1  # blocks whose words interleave

    def q8_0(x, w):  # ref.quant.quantize_q8_0, per block of 32 (q8_0_block)
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


def dot4(w0, w1, w2, w3, x, xq, xd, xs):
    """(w0 . x, w1 . x, w2 . x, w3 . x) for one token."""


@overload(dot4)
def _dot4(w0, w1, w2, w3, x, xq, xd, xs):
    if is_float(w0):
        def floats(w0, w1, w2, w3, x, xq, xd, xs):  # four streams in one loop (fast.cpu's STREAMS)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for k in range(x.shape[0]):
                xk = x[k]
                s0 += xk * load(w0, k)
                s1 += xk * load(w1, k)
                s2 += xk * load(w2, k)
                s3 += xk * load(w3, k)
            return s0, s1, s2, s3
        return floats
    if in_runs(w0):  # reach: these rows and the next ones of their bundles
        return lambda w0, w1, w2, w3, x, xq, xd, xs: run_dot4(w0, w1, w2, w3, xq, xd, xs, np.int64(2 * w0.shape[0]))
    return lambda w0, w1, w2, w3, x, xq, xd, xs: (dot(w0, x, xq, xd, xs), dot(w1, x, xq, xd, xs), dot(w2, x, xq, xd, xs),
                                              dot(w3, x, xq, xd, xs))


def dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
    """dot4 of rows w0..w3, where a0..a3 are the rows read next: rows in runs hint them into L2 line for line as
    these are read (run_dot4_ahead; within these rows only, not into the rows after them); other rows leave the
    hints to the caller (hints_ahead)."""


@overload(dot4_ahead)
def _dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs):
    if in_runs(w0):
        return lambda w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs: run_dot4_ahead(w0, w1, w2, w3, a0, a1, a2, a3, xq,
                                                                                  xd, xs, np.int64(w0.shape[0]))
    return lambda w0, w1, w2, w3, a0, a1, a2, a3, x, xq, xd, xs: dot4(w0, w1, w2, w3, x, xq, xd, xs)


def hints_ahead(bundle) -> bool:
    """Whether dot4_ahead hints the rows ahead itself for this bundle's rows (rows in runs)."""


@overload(hints_ahead)
def _hints_ahead(bundle):
    return (lambda bundle: True) if in_runs(bundle) else (lambda bundle: False)


def dot(w, x, xq, xd, xs):
    """w . x for one token."""


@overload(dot)
def _dot(w, x, xq, xd, xs):
    if is_float(w):
        def floats(w, x, xq, xd, xs):
            s = np.float32(0.0)
            for k in range(x.shape[0]):
                s += x[k] * load(w, k)
            return s
        return floats
    if in_runs(w):
        return lambda w, x, xq, xd, xs: run_dot(w, xq, xd, xs, np.int64(2 * w.shape[0]))
    # reach: the row and whatever follows it (a matrix's next row, the next rows of a neuron's bundle), in blocks
    return lambda w, x, xq, xd, xs: block_dot(w, xq, xd, xs, np.int64(w.shape[0] + AHEAD))


def dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
    """(w . x[t0], ..., w . x[t3]): one row against four tokens of x [T, K], the row read once."""


@overload(dot4t)
def _dot4t(w, x, xq, xd, xs, t0, t1, t2, t3):
    if is_float(w):
        def floats(w, x, xq, xd, xs, t0, t1, t2, t3):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for k in range(x.shape[1]):
                wk = load(w, k)
                s0 += wk * x[t0, k]
                s1 += wk * x[t1, k]
                s2 += wk * x[t2, k]
                s3 += wk * x[t3, k]
            return s0, s1, s2, s3
        return floats
    if in_runs(w):
        return lambda w, x, xq, xd, xs, t0, t1, t2, t3: run_dot4t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0),
                                                                  np.int64(t1), np.int64(t2), np.int64(t3))
    return lambda w, x, xq, xd, xs, t0, t1, t2, t3: block_dot4t(w, xq, xd, xs, np.int64(t0), np.int64(t1),
                                                                np.int64(t2), np.int64(t3))


def dot2t(w, x, xq, xd, xs, t0, t1):
    """(w . x[t0], w . x[t1]): one row against two tokens of x [T, K], the row read once."""


@overload(dot2t)
def _dot2t(w, x, xq, xd, xs, t0, t1):
    if is_float(w):
        def floats(w, x, xq, xd, xs, t0, t1):
            s0 = s1 = np.float32(0.0)
            for k in range(x.shape[1]):
                wk = load(w, k)
                s0 += wk * x[t0, k]
                s1 += wk * x[t1, k]
            return s0, s1
        return floats
    if in_runs(w):
        return lambda w, x, xq, xd, xs, t0, t1: run_dot2t(w, xq, xd, xs, np.int64(2 * w.shape[0]), np.int64(t0),
                                                          np.int64(t1))
    return lambda w, x, xq, xd, xs, t0, t1: block_dot2t(w, xq, xd, xs, np.int64(t0), np.int64(t1))


# A neuron's gate and up rows against the same tokens: in float formats one pass over both rows, which shares the
# loop and overlaps the two sums' final reductions; the shipped model's 16-sequence union FFN (D = 256, f16) 0.66 ->
# 0.57 ms a step, TinyLlama's at 8 tokens (f32) 2.62 -> 2.52 ms a layer. Block formats: their one-row kernels twice.
# Two tokens have their own loop: dot2_4t with the two tokens twice ran that FFN 8 % slower.

def dot2(w0, w1, x, xq, xd, xs):
    """(w0 . x, w1 . x) for one token."""


@overload(dot2)
def _dot2(w0, w1, x, xq, xd, xs):
    if is_float(w0):
        def floats(w0, w1, x, xq, xd, xs):
            s0 = s1 = np.float32(0.0)
            for k in range(x.shape[0]):
                xk = x[k]
                s0 += load(w0, k) * xk
                s1 += load(w1, k) * xk
            return s0, s1
        return floats
    return lambda w0, w1, x, xq, xd, xs: (dot(w0, x, xq, xd, xs), dot(w1, x, xq, xd, xs))


def dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
    """(w0 . x[t0], w0 . x[t1], w1 . x[t0], w1 . x[t1]): two rows against two tokens of x [T, K]."""


@overload(dot2_2t)
def _dot2_2t(w0, w1, x, xq, xd, xs, t0, t1):
    if is_float(w0):
        def floats(w0, w1, x, xq, xd, xs, t0, t1):
            s0 = s1 = r0 = r1 = np.float32(0.0)
            for k in range(x.shape[1]):
                v, u = load(w0, k), load(w1, k)
                x0, x1 = x[t0, k], x[t1, k]
                s0 += v * x0
                s1 += v * x1
                r0 += u * x0
                r1 += u * x1
            return s0, s1, r0, r1
        return floats

    def blocks(w0, w1, x, xq, xd, xs, t0, t1):
        s0, s1 = dot2t(w0, x, xq, xd, xs, t0, t1)
        r0, r1 = dot2t(w1, x, xq, xd, xs, t0, t1)
        return s0, s1, r0, r1
    return blocks


def dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
    """(w0 . x[t0], ..., w0 . x[t3], w1 . x[t0], ..., w1 . x[t3]): two rows against four tokens of x [T, K]."""


@overload(dot2_4t)
def _dot2_4t(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
    if is_float(w0):
        def floats(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
            s0 = s1 = s2 = s3 = r0 = r1 = r2 = r3 = np.float32(0.0)
            for k in range(x.shape[1]):
                v, u = load(w0, k), load(w1, k)
                x0, x1, x2, x3 = x[t0, k], x[t1, k], x[t2, k], x[t3, k]
                s0 += v * x0
                s1 += v * x1
                s2 += v * x2
                s3 += v * x3
                r0 += u * x0
                r1 += u * x1
                r2 += u * x2
                r3 += u * x3
            return s0, s1, s2, s3, r0, r1, r2, r3
        return floats

    def blocks(w0, w1, x, xq, xd, xs, t0, t1, t2, t3):
        s0, s1, s2, s3 = dot4t(w0, x, xq, xd, xs, t0, t1, t2, t3)
        r0, r1, r2, r3 = dot4t(w1, x, xq, xd, xs, t0, t1, t2, t3)
        return s0, s1, s2, s3, r0, r1, r2, r3
    return blocks


def axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    """y[t0] += a0 w, ..., y[t3] += a3 w: one row into four tokens' outputs, the row read once."""


@overload(axpy4t)
def _axpy4t(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
    if is_float(w):
        def floats(y, t0, t1, t2, t3, a0, a1, a2, a3, w):
            for d in range(y.shape[1]):
                wd = load(w, d)
                y[t0, d] += a0 * wd
                y[t1, d] += a1 * wd
                y[t2, d] += a2 * wd
                y[t3, d] += a3 * wd
        return floats

    return lambda y, t0, t1, t2, t3, a0, a1, a2, a3, w: block_axpy4t(y, np.int64(t0), np.int64(t1), np.int64(t2),
                                                                    np.int64(t3), a0, a1, a2, a3, w)


def axpy2t(y, t0, t1, a0, a1, w):
    """y[t0] += a0 w, y[t1] += a1 w: one row into two tokens' outputs, the row read once."""


@overload(axpy2t)
def _axpy2t(y, t0, t1, a0, a1, w):
    if is_float(w):
        def floats(y, t0, t1, a0, a1, w):
            for d in range(y.shape[1]):
                wd = load(w, d)
                y[t0, d] += a0 * wd
                y[t1, d] += a1 * wd
        return floats
    return lambda y, t0, t1, a0, a1, w: block_axpy2t(y, np.int64(t0), np.int64(t1), a0, a1, w)


def axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
    """y += a0 w0 + a1 w1 + a2 w2 + a3 w3."""


@overload(axpy4)
def _axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3):
    if is_float(w0):
        def floats(y, a0, a1, a2, a3, w0, w1, w2, w3):
            for d in range(y.shape[0]):
                y[d] += a0 * load(w0, d) + a1 * load(w1, d) + a2 * load(w2, d) + a3 * load(w3, d)
        return floats

    return lambda y, a0, a1, a2, a3, w0, w1, w2, w3: block_axpy4(y, a0, a1, a2, a3, w0, w1, w2, w3)


def axpy(y, a, w):
    """y += a w."""


@overload(axpy)
def _axpy(y, a, w):
    if is_float(w):
        def floats(y, a, w):
            for d in range(y.shape[0]):
                y[d] += a * load(w, d)
        return floats
    return lambda y, a, w: block_axpy(y, a, w)


def prefetch_span(bundle):
    """Bytes of each row of a lane's next bundle that fast.cpu.sparse_ffn hints ahead: a block format's whole row
    (short rows, 1 to 2 KiB, that the hardware prefetcher does not keep ahead of: q4_0 6.6-7.3 -> 10.7 GB/s, q8_0
    11.5-12.6 -> 13.3-15.7 GB/s over a 10 % set); a float format's first line only (more cost f32 28 -> 26 GB/s)."""


@overload(prefetch_span)
def _prefetch_span(bundle):
    if is_float(bundle):
        return lambda bundle: 64
    return lambda bundle: bundle.shape[-1] * bundle.itemsize


# -------------------------------------------------------------------------------------------------- interleaved matrices

def interleaved(w) -> bool:
    """Whether the numba array type w holds groups of interleaved rows (INTERLEAVED)."""
    return w.dtype in INTERLEAVED_FORMATS


def group_format(dtype: np.dtype):
    """The format of an interleaved group's rows (INTERLEAVED) if `dtype` is one's, else None."""
    return next((FORMATS[n] for n, dt in INTERLEAVED.items() if dt == dtype), None)


def n_rows(w) -> int:
    """Rows of a matrix (an interleaved one's groups times ROWS), in Python and in kernels."""
    return w.shape[0] * (ROWS if group_format(w.dtype) else 1)


@overload(n_rows)
def _n_rows(w):
    per = ROWS if interleaved(w) else 1
    return lambda w: w.shape[0] * per


def interleave(w: np.ndarray) -> np.ndarray:
    """A matrix [N, B] of q8_0 or q4_0 blocks as groups of ROWS rows [N / ROWS, B] (INTERLEAVED); N % ROWS == 0."""
    name = format_of_blocks(w.dtype).name
    (N, B), words = w.shape, (FORMATS[name].block_bytes - 2) // 4
    g = w.reshape(N // ROWS, ROWS, B)
    out = np.empty((N // ROWS, B), INTERLEAVED[name])
    out["d"] = g["d"].transpose(0, 2, 1)
    qs = g["qs"].view(np.uint8).reshape(N // ROWS, ROWS, B, words, 4)  # [G, r, B, word, byte]
    out["qs"] = (qs.transpose(0, 2, 3, 1, 4).reshape(N // ROWS, B, ROWS * 4 * words)
                 ^ np.uint8(0x80 if name == "q8_0" else 0))
    return out


def run_format(dtype: np.dtype):
    """The format of rows in runs (RUNS) if `dtype` is a run's, else None."""
    return next((FORMATS[n] for n, dt in RUNS.items() if dt == dtype), None)


def item_elements(dtype: np.dtype) -> int:
    """Elements of a row that one item of an array of `dtype` holds: a float, a block, a group block's row, a run."""
    fmt = base_format(dtype)
    return fmt.block * (RUN if run_format(dtype) else 1)


def base_format(dtype: np.dtype):
    """The weight format of a matrix of `dtype`: its blocks', or an interleaved group's rows' (ROWS blocks each), or
    a run's blocks' (RUN)."""
    return group_format(dtype) or run_format(dtype) or format_of_blocks(dtype)


def to_runs(w: np.ndarray) -> np.ndarray:
    """Rows [..., B] of q8_0 or q4_0 blocks in runs [..., B / RUN] (RUNS); B % RUN == 0."""
    name, lead, B = format_of_blocks(w.dtype).name, w.shape[:-1], w.shape[-1]
    words = (FORMATS[name].block_bytes - 2) // 4
    r = np.ascontiguousarray(w).reshape(-1, B // RUN, RUN)  # [N, run, block j]
    out = np.empty(r.shape[:2], RUNS[name])
    out["d"] = r["d"]
    qs = r["qs"].view(np.uint8).reshape(*r.shape, words, 4)  # [N, run, j, word, byte]
    out["qw"] = (qs.transpose(0, 1, 3, 2, 4).reshape(*r.shape[:2], RUN * 4 * words)
                 ^ np.uint8(0x80 if name == "q8_0" else 0))
    return out.reshape(*lead, B // RUN)


def for_sparse(bundle: np.ndarray) -> np.ndarray:
    """Neuron bundles [F, P, B] as fast.cpu.sparse_ffn reads them fastest: q8_0 and q4_0 rows in runs (RUNS) where B
    divides by RUN and the bundle has rows to take dot products with (P > 1; the dense layout's down rows alone read
    faster as blocks); other formats and shapes as they are. Runs also read the down rows (y += a down_i), at 1.2x
    (q4_0) to 1.8x (q8_0) the cost of blocks, that the neuron's rows stay one bundle. On huge pages (fast.pages)."""
    fast = (any(FORMATS[n].dtype == bundle.dtype for n in RUNS) and bundle.ndim == 3 and bundle.shape[1] > 1
            and bundle.shape[-1] % RUN == 0)
    return on_huge_pages(to_runs(bundle) if fast else bundle)


def plain(w: np.ndarray) -> np.ndarray:
    """Rows of blocks [..., B]: an interleaved matrix's rows back in their own order, rows in runs back in blocks,
    others as they are."""
    fmt = run_format(w.dtype)
    if fmt is not None:
        name, lead, n = fmt.name, w.shape[:-1], w.shape[-1]
        words = (fmt.block_bytes - 2) // 4
        r = np.ascontiguousarray(w).reshape(-1, n)  # [N, run]
        out = np.empty((r.shape[0], n, RUN), fmt.dtype)
        out["d"] = r["d"]
        qw = (r["qw"] ^ np.uint8(0x80 if name == "q8_0" else 0)).reshape(*r.shape, words, RUN, 4)  # [N, run, word, j, byte]
        out["qs"] = qw.transpose(0, 1, 3, 2, 4).reshape(*r.shape, RUN, 4 * words).view(out["qs"].dtype)
        return out.reshape(*lead, n * RUN)
    fmt = group_format(w.dtype)
    if fmt is None:
        return w
    name = fmt.name
    (G, B), words = w.shape, (FORMATS[name].block_bytes - 2) // 4
    out = np.empty((G, ROWS, B), FORMATS[name].dtype)
    out["d"] = w["d"].transpose(0, 2, 1)
    qs = (w["qs"] ^ np.uint8(0x80 if name == "q8_0" else 0)).reshape(G, B, words, ROWS, 4)  # [G, B, word, r, byte]
    out["qs"] = qs.transpose(0, 3, 1, 2, 4).reshape(G, ROWS, B, 4 * words).view(out["qs"].dtype)
    return out.reshape(G * ROWS, B)


def for_matmul(w: np.ndarray) -> np.ndarray:
    """A matrix [N, B] as fast.cpu.matmul reads it fastest: q8_0 and q4_0 rows interleaved in groups (INTERLEAVED)
    where N divides by ROWS; other formats and shapes as they are; on huge pages (fast.pages)."""
    fast = any(FORMATS[n].dtype == w.dtype for n in INTERLEAVED) and w.ndim == 2 and w.shape[0] % ROWS == 0
    return on_huge_pages(interleave(w) if fast else w)
