"""The plain reference of fast.quant's row operations, per weight format and layout, as llama.cpp's ggml-quants.c keeps
a `_ref` beside each SIMD variant: loops over the layouts' definitions, in float64, that share no code with the
intrinsics (tests/fast/test_row_ops.py checks each of those against these, on every instruction set the machine can
run).

Layouts (`layout` below), each of a Format from ref.common.formats:
- "rows": a row of the format's items (`Format.dtype`: float32, f16 or bf16 bits, or q8_0 / q4_0 blocks), [B].
- "groups" (fast.quant.INTERLEAVED, q8_0 and q4_0): a row of one group of ROWS matrix rows, [B]: each item holds the
  ROWS rows' fp16 scales, then word i (4 quant bytes) of each row in turn, for each word i.
- "runs" (fast.quant.RUNS, q8_0 and q4_0): a row in runs of RUN blocks, [B / RUN]: each item holds its RUN blocks'
  fp16 scales, then word i of each block in turn, for each word i.
A block's quant bytes are q8_0's int8 values, or q4_0's nibbles (byte j holds elements j and j + 16, value q - 8);
interleaved q8_0 bytes are stored plus 128. A product with q8_0 or q4_0 weights reads the token rounded to Q8_0 blocks
(ref.quant.input_values), the others read it as it is.

Dimensions: B items of a row, K elements of a row, L lanes of an interleaved item (ROWS rows, or RUN blocks).
"""

import numpy as np

from ref.common.formats import Format
from ref.quant import blocks, quantize, values

ROWS = RUN = 8  # rows of a group, blocks of a run (fast.quant's)


def block_values(d_bits: int, raw: np.ndarray, fmt: Format) -> np.ndarray:
    """The 32 values of one q8_0 or q4_0 block: fp16 scale bits d_bits and its quant bytes raw [32 or 16]."""
    d = float(np.uint16(d_bits).view(np.float16))
    if fmt.name == "q8_0":
        q = raw.view(np.int8).astype(np.float64)
    else:
        q = np.concatenate([raw & 15, raw >> 4]).astype(np.float64) - 8
    return d * q  # [32]


def lane_values(d: np.ndarray, qs: np.ndarray, fmt: Format) -> np.ndarray:
    """The values of an interleaved item's L lanes: scales d [L], quants qs, word i of lane l at bytes 4 (i L + l) on.
    -> [L, 32]."""
    L, words = len(d), (fmt.block_bytes - 2) // 4
    out = np.empty((L, fmt.block))
    for lane in range(L):
        raw = np.empty(4 * words, np.uint8)
        for i in range(words):
            at = 4 * (i * L + lane)
            raw[4 * i:4 * i + 4] = qs[at:at + 4]
        out[lane] = block_values(d[lane], raw ^ np.uint8(0x80 if fmt.name == "q8_0" else 0), fmt)
    return out


def row_values(w: np.ndarray, fmt: Format, layout: str = "rows") -> np.ndarray:
    """The values of a row in `layout`: [K], or [ROWS, K] for a group of rows."""
    if fmt.name == "f32":
        return w.astype(np.float64)
    if fmt.name == "f16":
        return w["f16"].view(np.float16).astype(np.float64)
    if fmt.name == "bf16":
        return (w["bf16"].astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    if layout == "rows":
        return np.concatenate([block_values(b["d"], b["qs"].view(np.uint8), fmt) for b in w])
    lanes = [lane_values(item["d"], item["qs" if layout == "groups" else "qw"], fmt) for item in w]  # [B][L, 32]
    if layout == "groups":
        return np.concatenate(lanes, axis=1)  # [ROWS, K]: lane l is row l
    return np.concatenate([v.reshape(-1) for v in lanes])  # [K]: lane j is block j of the run


def token_values(x: np.ndarray, fmt: Format) -> np.ndarray:
    """What a product with fmt weights reads of tokens x [..., K]: x, or x rounded to Q8_0 blocks."""
    if not fmt.quantized:
        return x.astype(np.float64)
    return values(blocks(quantize(x.astype(np.float32), "q8_0"))).astype(np.float64).reshape(x.shape)


def dot(w: np.ndarray, x: np.ndarray, fmt: Format, layout: str = "rows"):
    """w . x for one token x [K] (a group's ROWS rows: [ROWS])."""
    return row_values(w, fmt, layout) @ token_values(x, fmt)


def axpy(y: np.ndarray, a: float, w: np.ndarray, fmt: Format, layout: str = "rows") -> np.ndarray:
    """y + a w.  y: [K]."""
    return y.astype(np.float64) + a * row_values(w, fmt, layout)
