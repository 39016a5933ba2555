"""Weight formats: the one table that byte counts, budgets and layouts read.

Names and type ids are llama.cpp's (GGML). Quantized formats pack `block` elements of a row into `block_bytes`
bytes (Q8_0: an fp16 scale and 32 int8; Q4_0: an fp16 scale and 32 4-bit values), so a row of n elements takes
n / block blocks; float formats are blocks of one element. `dtype` is a block as a numpy type: a row of blocks is an
array of it, a view of the file's bytes, and numba's kernels specialise on it (ref/quant.py says what the values are).
"""

from dataclasses import dataclass

import numpy as np

from ref.common.errors import UserError


@dataclass(frozen=True)
class Format:
    name: str  # llama.cpp's type name
    ggml_type: int  # GGML type id, as GGUF files store it
    block: int  # elements per block (along a row)
    block_bytes: int  # bytes per block
    vector: str  # format of the vectors that go with such weights (norms, KV cache)
    dtype: np.dtype  # one block; numpy has no 16-bit floats numba can use, so f16 and bf16 are named uint16 records
    aliases: tuple[str, ...] = ()  # torch_dtype and safetensors names
    vec_dot: str | None = None  # llama.cpp's vec_dot_type: the format a product with such weights rounds its input
    # to (ref.quant.input_values; fast.quant.quantize_input), None for a float format's, which reads it as it is

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of n elements."""
        if n % self.block:
            raise UserError(f"format {self.name}: rows of {n} elements are not whole blocks of {self.block}")
        return n // self.block * self.block_bytes

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a [..., n] tensor stored row by row."""
        rows = 1
        for s in shape[:-1]:
            rows *= s
        return rows * self.row_bytes(shape[-1])


FORMATS = {f.name: f for f in (
    Format("f32", 0, 1, 4, "f32", np.dtype(np.float32), ("float32", "F32")),
    Format("f16", 1, 1, 2, "f16", np.dtype([("f16", "<u2")]), ("float16", "F16")),
    Format("bf16", 30, 1, 2, "bf16", np.dtype([("bf16", "<u2")]), ("bfloat16", "BF16")),
    # llama.cpp keeps the KV cache of quantized models in f16
    Format("q8_0", 8, 32, 34, "f16", np.dtype([("d", "<u2"), ("qs", "i1", (32,))]), vec_dot="q8_0"),
    Format("q4_0", 2, 32, 18, "f16", np.dtype([("d", "<u2"), ("qs", "u1", (16,))]), vec_dot="q8_0"),
)}


def format_of(name: str, flag: str = "--type") -> Format:
    """The format called `name` (llama.cpp's name in any case, q4_0 or llama-quantize's Q4_0, or a torch_dtype /
    safetensors alias)."""
    for f in FORMATS.values():
        if name.lower() == f.name or name in f.aliases:
            return f
    raise UserError(f"{flag}: unknown format '{name}' (known: {', '.join(FORMATS)})")
