"""LLVM IR helpers of fast.quant's intrinsics: vector types, loads, calls of LLVM intrinsics, block loops, hints, and
vpdpbusd (or its plain-IR form)."""

from llvmlite import ir
from numba.core import cgutils

import fast.quant.target as target


I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
# A fast-math flag that changes no rounding, on the float steps whose rounding is the contract: numba's fastmath pass
# flags only the instructions that carry none, and its 'fast' would let LLVM reassociate them.
EXACT = ("nsz",)

def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, v):
    return ir.Constant(_vec(t, n), [v] * n)


def _lanes(*idx):
    return ir.Constant(_vec(I32, len(idx)), list(idx))


def _member_sums(builder, vs):
    """<M x float> whose lane m is the sum of the L lanes of vs[m] (M = 1, 2, 4, 8 or 16 vectors of L = 16 or 8
    lanes), by one tree for every M: lane k and lane k + L/2 first, then k and k + L/4 of those, ... Pairs of vectors
    trade halves of each member's lanes and add while there are pairs (16 x 16 lanes: 15 shuffle pairs and adds
    where 16 separate horizontal sums take 64), then one vector's members halve in place. The adds are exact IEEE
    adds (EXACT: LLVM may not reorder them), so a product's sum is the same bits whichever rows and tokens
    share its call."""
    L, members = vs[0].type.count, 1
    while members < L and len(vs) > 1:
        width = L // members  # lanes of each member of a vector at this level
        half = width // 2
        lo = [j * width + k for j in range(members) for k in range(half)]
        hi = [i + half for i in lo]
        vs = [builder.fadd(builder.shuffle_vector(a, b, _lanes(*lo, *[L + i for i in lo])),
                           builder.shuffle_vector(a, b, _lanes(*hi, *[L + i for i in hi])), flags=EXACT)
              for a, b in zip(vs[0::2], vs[1::2])]
        members *= 2
    if len(vs) > 1:  # L members of one lane each, in two vectors (16 members of 8-lane vectors)
        return _joined(builder, vs)
    v, width = vs[0], L // members
    while width > 1:
        half = width // 2
        lo = [j * width + k for j in range(members) for k in range(half)]
        hi = [i + half for i in lo]
        v = builder.fadd(builder.shuffle_vector(v, v, _lanes(*lo)), builder.shuffle_vector(v, v, _lanes(*hi)),
                         flags=EXACT)
        width = half
    return v


def _lane_sum(builder, v):
    """The sum of the lanes of v (a power of two of them): _member_sums' tree for one member. llvm.vector.reduce.fadd
    is in order in a kernel without numba's fast-math pass and a tree in one with it, so two kernels that inline one
    product differed."""
    return builder.extract_element(_member_sums(builder, [v]), ir.Constant(ir.IntType(32), 0))


def _data(context, builder, aty, arr):
    """i8* to an array's first element."""
    return builder.bitcast(context.make_array(aty)(context, builder, arr).data, I8.as_pointer())


def _read(builder, ptr, ty):
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _call(builder, name, ret, *args, fastmath=()):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args), fastmath=fastmath)

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

def _dpbusd(builder, acc, a, b):
    """acc + in each of n i32 lanes (acc <n x i32>, n = 8 or 16) the sum of its 4 bytes' products u8(a) s8(b)
    (vpdpbusd; plain IR without VNNI)."""
    n = acc.type.count
    a, b = builder.bitcast(a, _vec(I32, n)), builder.bitcast(b, _vec(I32, n))
    if target.ISA == "vnni":
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
