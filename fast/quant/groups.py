"""q8_0 and q4_0 rows in interleaved groups (INTERLEAVED, fast.cpu.matmul's layout): a group of 8 rows against the
token eight lanes at a time (lanes are rows), one vpdpbusd for 4 quants of each lane. Its engine (_dot8_codegen) also
reads rows in runs, whose lanes are blocks (fast.quant.runs)."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fast.quant.blocks import AHEAD
from fast.quant.ir import (EXACT, F32, I32, I64, _block_loop, _broadcast, _data, _dpbusd, _joined, _lane_sum,
                           _lanes, _prefetch, _read, _splat, _vec)
from fast.quant.layouts import BLOCK, INTERLEAVED, INTERLEAVED_FORMATS, ROWS, RUNS
import fast.quant.target as target


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
    operand: loaded up front, four tokens' words were spilled to the stack (half the GMAC/s). `words(k)` gives word
    k."""
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


def _group_term(builder, operands, token, d8):
    """<n x float> d_r xd (q_r . x) of a group block's 8 rows (or two groups' 16) and a token block: vpdpbusd in
    four chains (its latency), the first started from the correction -OFFSET sum(x) (the same for every row)."""
    words, corr, xd = token
    n = corr.type.count
    chains = [corr] + [ir.Constant(_vec(I32, n), [0] * n)] * 3
    for k, (operand, word) in enumerate(operands):
        chains[k % 4] = _dpbusd(builder, chains[k % 4], operand, words(word))
    total = builder.add(builder.add(chains[0], chains[1]), builder.add(chains[2], chains[3]))
    return builder.fmul(builder.sitofp(total, _vec(F32, n)), builder.fmul(d8, xd, flags=EXACT), flags=EXACT)


def _dot8_codegen(fmt, streams, n_tokens, run_token=None, ahead=False):
    """Codegen of `streams` groups of interleaved rows against `n_tokens` Q8_0 tokens: one token (x [K], xd [B],
    xs [B, 8]) or tokens t_k of x [T, K] (xd [T, B], xs [T, B, 8]); each group block unpacked once for all tokens,
    each token block loaded once for all groups. Sums group by group, token by token.
    With `run_token` (fast.quant.runs' reading of a token's run), `streams` rows in RUNS against tokens laid out for
    them (xs [T, B / RUN, RUN]): lanes are blocks, one sum per row and token.
    Where vpdpbusd has 16 lanes (target.WIDE), an even number of streams goes two by two, side by side in 16 lanes: half
    the instructions for the same products.
    With `ahead`, `streams` more rows follow the rows (the ones the caller reads next) and each step hints the same
    offset of each into L2: their misses spread over this pass instead of arriving at once."""
    runs = run_token is not None
    gb = (RUNS if runs else INTERLEAVED)[fmt.name].itemsize  # bytes of a group block, or of a run
    width = 2 if target.WIDE and streams % 2 == 0 else 1  # streams per vector
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
        tokens = _tokens(context, builder, sig.args[nw], x_, (xp0, dp0, sp0), ts, runs)

        def token_blocks(b):
            if not runs:  # words shared by vectors are loaded once
                return [_token_block(builder, *tok, b, streams > width, 8 * width) for tok in tokens]
            out = []
            for tok in tokens:  # a run's lanes are its blocks: the same token vectors for both rows of a pair
                words, corr, xd = run_token(builder, *tok, b, streams > 1)
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
                                                                 flags=EXACT), i)
            return out

        zero = ir.Constant(lanes_t, [0.0] * lanes_t.count)
        accs = _block_loop(builder, n, ir.Constant(ir.LiteralStructType([lanes_t] * n_acc), [zero] * n_acc), body)
        sums = _sums(builder, accs, streams, width, len(tokens), runs)
        return sums[0] if len(sums) == 1 else context.make_tuple(builder, sig.return_type, sums)  # one: a float32
    return codegen


def _tokens(context, builder, xty, x_, pointers, ts, runs):
    """(quants, scales, correction lanes) pointers of each token t of ts in x [T, K] (xty x_), from x's own
    `pointers`: quants at t K, scales at t B, correction lanes at 8 t B (runs: t B); [pointers] for one token."""
    if not ts:
        return [pointers]
    xp0, dp0, sp0 = pointers
    K = cgutils.unpack_tuple(builder, context.make_array(xty)(context, builder, x_).shape)[1]
    B = builder.sdiv(K, I64(BLOCK))
    lanes = B if runs else builder.mul(B, I64(8))  # correction lanes per token
    return [(builder.gep(xp0, [builder.mul(t, K)]), builder.gep(dp0, [builder.mul(t, B)]),
             builder.gep(sp0, [builder.mul(t, lanes)])) for t in ts]


def _sums(builder, accs, streams, width, n_tokens, runs):
    """The products from _dot8_codegen's accumulators (width streams a vector, n_tokens of them a stream), stream by
    stream, token by token: a row in runs sums its lanes (blocks); a group's lanes are its rows' sums."""
    def half(s, k):  # stream s's 8 lanes of token k's accumulator
        j, m = divmod(s, width)
        v = builder.extract_value(accs, j * n_tokens + k)
        return v if width == 1 else builder.shuffle_vector(v, v, _lanes(*range(8 * m, 8 * m + 8)))
    if runs:
        return [_lane_sum(builder, half(s, k)) for s in range(streams) for k in range(n_tokens)]
    return [builder.extract_element(half(s, k), I32(r)) for s in range(streams) for k in range(n_tokens)
            for r in range(ROWS)]


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
    """block_dot8_4t of two groups at once (side by side in 16 lanes where target.WIDE: half the vpdpbusd of one group at a
    time). 64 sums, group by group, token by token."""
    fmt = INTERLEAVED_FORMATS.get(w0.dtype)
    if fmt is None:
        return None
    return (types.UniTuple(types.float32, 8 * ROWS)(w0, w1, x, xd, xs, reach, t0, t1, t2, t3),
            _dot8_codegen(fmt, 2, 4))
