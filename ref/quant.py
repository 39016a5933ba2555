"""What a weight in each format means: llama.cpp's block layouts and reference rounding (ggml-quants.c), in NumPy.
A weight stored in a format means its dequantized values; `quantize_model` is the transform that stores a model's
matrices in a format, after which every engine computes with those values. A product W x with q8_0 or q4_0 weights
reads x rounded to Q8_0 blocks (`input_values`), as llama.cpp's integer dot products do; the FFN's down matrix
stored transposed (PowerInfer's ffn_down_t, applied as a sum of scaled rows) reads the activations as they are.

Blocks run along a row (the input dimension of a [out, in] weight), 32 elements each:
  q8_0, 34 bytes: fp16 d, 32 int8 q;  d = amax / 127, q = round(x / d) (half away from zero), value q d.
  q4_0, 18 bytes: fp16 d, 16 bytes;   m = the element of largest |x| (sign kept, the first on ties), d = m / -8,
                  q = min(15, trunc(x / d + 8.5)), low nibbles elements 0-15, high nibbles 16-31, value (q - 8) d.
f16 rounds to nearest even; bf16 keeps the upper 16 bits of the float32, rounded to nearest even.
The FFN's down matrix is stored transposed (rows = neurons, blocks along D), as PowerInfer's `ffn_down_t`.

Dimensions: N rows, n elements per row, B = n / 32 blocks per row.
"""

import numpy as np

from ref.common.artifacts import Predictors
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format, format_of
from ref.common.safetensors import BF16, to_bf16_bits, upcast

BLOCK = 32


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round goes to even)."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def inverse(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, 0 where d is 0 (an all-zero block)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Blocks [N * B, 34] uint8 of x [N * B, 32] float32."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)  # [N B, 1]
    q = round_half_away(x * inverse(d)).astype(np.int8)  # [N B, 32]
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Blocks [N * B, 18] uint8 of x [N * B, 32] float32."""
    m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)  # [N B, 1]
    d = m / np.float32(-8)
    q = np.minimum(np.trunc(x * inverse(d) + np.float32(8.5)), 15).astype(np.uint8)  # [N B, 32], in 0..15
    nibbles = q[:, :16] | (q[:, 16:] << np.uint8(4))  # [N B, 16]
    return np.concatenate([d.astype(np.float16).view(np.uint8), nibbles], axis=1)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Values [N * B, 32] float32 of blocks [N * B, 34]."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [N B, 1]
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Values [N * B, 32] float32 of blocks [N * B, 18]."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [N B, 1]
    q = np.concatenate([blocks[:, 2:] & np.uint8(15), blocks[:, 2:] >> np.uint8(4)], axis=1)  # [N B, 32]
    return (q.astype(np.float32) - np.float32(8)) * d


CODECS = {"q8_0": (quantize_q8_0, dequantize_q8_0), "q4_0": (quantize_q4_0, dequantize_q4_0)}


class Quantized:
    """A tensor [..., n] stored in a block format as `blocks` [..., B * block_bytes] uint8; it means its dequantized
    float32 values. Indexing picks rows; `astype` dequantizes."""

    def __init__(self, fmt: Format, blocks: np.ndarray, shape: tuple[int, ...]):
        self.format, self.blocks, self.shape = fmt, blocks, tuple(shape)

    def __getitem__(self, rows):
        blocks = self.blocks[rows]
        return Quantized(self.format, blocks, (*blocks.shape[:-1], self.shape[-1]))

    def astype(self, dtype) -> np.ndarray:
        values = CODECS[self.format.name][1](self.blocks.reshape(-1, self.format.block_bytes))
        return values.reshape(self.shape).astype(dtype, copy=False)


class Transposed:
    """A matrix [D, F] kept as its transpose [F, D] (the FFN's down matrix, blocks along D): `t[:, cols]` reads rows
    of the stored transpose."""

    def __init__(self, t):
        self.t, self.shape = t, tuple(t.shape[::-1])

    @property
    def T(self):
        """The stored transpose [F, D]."""
        return self.t

    def __getitem__(self, index):
        rows, cols = index
        if rows != slice(None):
            raise IndexError("a Transposed matrix is indexed by columns only: t[:, cols]")
        return Transposed(self.t[cols])

    def astype(self, dtype) -> np.ndarray:
        return upcast(self.t, dtype).T


def quantize(x: np.ndarray, fmt: str | Format, name: str = "tensor", flag: str = "--type"):
    """x [..., n] stored in `fmt`: a float32 or float16 array, BF16 bits, or Quantized blocks."""
    fmt = fmt if isinstance(fmt, Format) else format_of(fmt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if fmt.name == "f32":
        return x
    if fmt.name == "f16":
        return x.astype(np.float16)
    if fmt.name == "bf16":
        return BF16(to_bf16_bits(x))
    if x.shape[-1] % fmt.block:
        raise UserError(f"{flag} {fmt.name}: {name} has rows of {x.shape[-1]} elements, not whole blocks of {fmt.block}")
    blocks = CODECS[fmt.name][0](x.reshape(-1, fmt.block))  # [N B, block_bytes]
    return Quantized(fmt, blocks.reshape(*x.shape[:-1], -1), x.shape)


def input_values(x: np.ndarray, t) -> np.ndarray:
    """What a product with the stored weight t reads of its input x [..., n]: x rounded to the blocks of its format's
    input format along its rows (Format.vec_dot, llama.cpp's vec_dot_type: Q8_0 for q8_0 and q4_0), in x's dtype; x
    itself for a float format and for a stored transpose (applied as a sum of scaled rows)."""
    vec_dot = None if isinstance(t, Transposed) else tensor_format(t).vec_dot
    return x if vec_dot is None else quantize(x, vec_dot).astype(x.dtype)


BLOCK_FORMATS = {f.dtype: f for f in FORMATS.values()}  # what rows of blocks (`blocks`) are stored in


def tensor_format(t) -> Format:
    """The format a stored tensor (float32 or float16 array, BF16, Quantized) is in."""
    if isinstance(t, Quantized):
        return t.format
    if isinstance(t, BF16):
        return FORMATS["bf16"]
    return FORMATS["f16" if t.dtype == np.float16 else "f32"]


def stored_format(w) -> Format:
    """The format a checkpoint's (ref.common.weights.Weights) matrices are stored in: its embedding's."""
    return tensor_format(w["embed"])


def blocks(t) -> np.ndarray:
    """A stored tensor [..., n] (float32 or float16 array, BF16, Quantized) as rows of its format's blocks
    [..., n / block] (`Format.dtype`), as llama.cpp lays them out; no copy of contiguous rows."""
    if isinstance(t, Quantized):
        return t.blocks.view(t.format.dtype)
    if isinstance(t, BF16):
        return np.ascontiguousarray(t.bits).view(FORMATS["bf16"].dtype)
    t = np.asarray(t)
    if t.dtype == np.float16:
        return np.ascontiguousarray(t).view(np.uint16).view(FORMATS["f16"].dtype)
    return np.ascontiguousarray(t, dtype=np.float32)


def values(b: np.ndarray) -> np.ndarray:
    """Rows of blocks [..., B] (any `Format.dtype`) as float32 values [..., n]: what they mean."""
    fmt = BLOCK_FORMATS[b.dtype]
    b = np.ascontiguousarray(b)
    if fmt.name == "f32":
        return b
    if fmt.name == "f16":
        return b.view(np.uint16).view(np.float16).astype(np.float32)
    if fmt.name == "bf16":
        return BF16(b.view(np.uint16)).astype(np.float32)
    return Quantized(fmt, b.view(np.uint8), (*b.shape[:-1], b.shape[-1] * fmt.block)).astype(np.float32)


# The predictors' format that goes with a weight format: q8_0 for f16 and bf16 weights, else the weights' own (as
# PowerInfer's Q4 files hold Q4_0 predictors: its quantize tool takes every matrix); f16 where the model's rows (fc1's)
# are not whole blocks of it. Predictor recall on the shipped model, 6,000 held-out tokens: 0.977 in f32, f16
# and q8_0, 0.952 in q4_0, yet its perplexity beside q4_0 weights is 18.2784 with q4_0 predictors against 18.2765
# with q8_0 (+0.01%; val.txt, fast.perplexity); q8_0 predictors read about half an f16 predictor's bytes (TinyLlama's
# shape, f16 weights, 90% sparse decode: 26.7 -> 29.7 tok/s, 2.15x -> 2.44x llama.cpp's dense f16), q4_0 ones half a
# q8_0's (q4_0 weights: 1.73x -> 1.83x to 1.92x llama.cpp's dense q4_0, runs of the same hour).
PREDICTOR_FORMATS = {"f16": "q8_0", "bf16": "q8_0"}


def predictor_format(fmt: Format, d_model: int | None = None) -> Format:
    """The format of the predictors beside `fmt` weights, for a model of `d_model` (any, if None): fc1's rows are
    d_model long, fc2's are padded to whole blocks (pad_hidden)."""
    f = FORMATS[PREDICTOR_FORMATS.get(fmt.name, fmt.name)]
    return f if d_model is None or d_model % f.block == 0 else FORMATS["f16"]


def pad_hidden(fc1: np.ndarray, fc2: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A predictor fc1 [R, D], fc2 [F, R] with R padded to whole blocks by zero hidden units: relu(0 . h) = 0 adds 0 to
    every logit, so the predictor is the same function and every layer's fc2 takes the block format (-> float32)."""
    fc1, fc2 = upcast(fc1), upcast(fc2)
    pad = -fc1.shape[0] % block
    if pad == 0:
        return fc1, fc2
    return (np.concatenate([fc1, np.zeros((pad, fc1.shape[1]), np.float32)]),
            np.concatenate([fc2, np.zeros((fc2.shape[0], pad), np.float32)], axis=1))


def quantize_predictors(pred: Predictors, fmt: str | Format, flag: str = "--predictor-type") -> Predictors:
    """The predictors with fc1 and fc2 stored in `fmt`, each layer's hidden size padded to whole blocks of it
    (pad_hidden), so that every layer has the same formats; a format whose blocks do not divide the model's rows
    (fc1's) is refused. The recall each format keeps: scripts/eval_sparse.py --predictor-type."""
    fmt = fmt if isinstance(fmt, Format) else format_of(fmt, flag)
    fc1, fc2 = [], []
    for l, (a, b) in enumerate(zip(pred.fc1, pred.fc2)):
        a, b = pad_hidden(a, b, fmt.block)
        fc1.append(quantize(a, fmt, f"layer {l}'s fc1", flag))
        fc2.append(quantize(b, fmt, f"layer {l}'s fc2", flag))
    return Predictors(fc1, fc2, pred.threshold, {**pred.metadata, "format": fmt.name})


def predictors_beside(pred: Predictors, fmt: Format) -> Predictors:
    """The predictors in the format that goes with `fmt` weights (predictor_format), every layer alike."""
    return quantize_predictors(pred, predictor_format(fmt, pred.fc1[0].shape[1] if pred.fc1 else None))


def quantize_model(model, fmt: str | Format):
    """Store every matrix of `model` (embedding, attention, FFN, output) in `fmt`, the down matrix as its transpose;
    norms and OPT's learned positions (a table added, as the engine keeps it) stay as they are. A transform: the
    model code is unchanged and computes with the stored values."""
    fmt = fmt if isinstance(fmt, Format) else format_of(fmt)
    tensors = model.weights.tensors
    for name, t in tensors.items():
        if len(t.shape) != 2 or name == "pos_embed":
            continue
        if name.endswith(".wd"):
            tensors[name] = Transposed(quantize(upcast(t).T, fmt, name))
        else:
            tensors[name] = quantize(upcast(t), fmt, name)
    model.format = fmt
    return model


