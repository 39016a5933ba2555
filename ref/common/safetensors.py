"""safetensors files: a memory-mapping reader that checks the file is whole and names it in every error, and one
streaming writer (fp16, bf16, fp32 and integer tensors, larger than memory if need be).

Tensors stay in their stored dtype on disk pages and are upcast where used (`upcast`); numpy has no bf16, so bf16
tensors are kept as their raw bits (`BF16`).
"""

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from ref.common.errors import UserError

DTYPES = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(t): name for name, t in DTYPES.items() if name != "BF16"}  # numpy dtype -> safetensors name
CHUNK_BYTES = 1 << 24  # the writer converts and writes this much of a tensor at a time
MAX_HEADER = 100 << 20  # bytes of JSON header, safetensors' own limit


def read_header(path: Path) -> tuple[dict, int, dict]:
    """The safetensors tensor entries, the offset where tensor data starts, and the metadata; checks the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise UserError(f"{path}: a safetensors header of {n} bytes (the format allows {MAX_HEADER})")
        if n > size - 8:
            raise UserError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise UserError(f"{path}: __metadata__ must map names to strings")
    end, last = 0, None
    for a, b, name in sorted(entry_span(path, name, t) for name, t in header.items()):
        if a < end:
            raise UserError(f"{path}: tensors {last} and {name} overlap (bytes {a} to {end} of the data)")
        end, last = b, name
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + n + end})")
    return header, 8 + n, metadata


def entry_span(path: Path, name: str, t) -> tuple[int, int, str]:
    """A header entry's data range, the entry checked to be {dtype, shape, data_offsets} of the right types."""
    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0
    if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
            and all(count(d) for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2 and all(count(o) for o in t["data_offsets"])
            and t["data_offsets"][0] <= t["data_offsets"][1]):
        raise UserError(f"{path}: tensor {name[:100]!r} must be {{dtype: a name, shape: [counts], data_offsets: "
                        f"[begin, end]}}, got {json.dumps(t)[:100]}")
    return t["data_offsets"][0], t["data_offsets"][1], name


def open_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a file in its stored dtype (bf16 as raw uint16, see `upcast`)."""
    header, start, _ = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, t in header.items():
        if t["dtype"] not in DTYPES:
            raise UserError(f"{path}: tensor {name} has unsupported dtype {t['dtype']} (supported: {', '.join(DTYPES)})")
        a, b = t["data_offsets"]
        dtype = np.dtype(DTYPES[t["dtype"]])
        if (b - a) != math.prod(t["shape"]) * dtype.itemsize:
            raise UserError(f"{path}: tensor {name} has {b - a} bytes, its shape {t['shape']} needs another size")
        arr = data[start + a:start + b].view(dtype).reshape(t["shape"])
        out[name] = BF16(arr) if t["dtype"] == "BF16" else arr
    return out


class BF16:
    """A bf16 tensor kept as its raw uint16 bits; numpy has no bf16 type."""

    def __init__(self, bits: np.ndarray):
        self.bits, self.shape, self.dtype = bits, bits.shape, "bfloat16"

    def __getitem__(self, index):
        return BF16(self.bits[index])

    @property
    def T(self) -> "BF16":
        return BF16(self.bits.T)

    def astype(self, dtype) -> np.ndarray:
        return (self.bits.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)


def upcast(t, dtype=np.float32) -> np.ndarray:
    """A stored tensor (a memory-mapped array of any supported dtype, or a stored-format object such as `BF16` whose
    `astype` decodes it) as a compute array; no copy when already `dtype`."""
    return t.astype(dtype, copy=False) if isinstance(t, np.ndarray) else t.astype(dtype)


def release(tensors) -> None:
    """Unmap the pages read so far of the files these memory-mapped tensors live in (they are clean: touched again,
    they are read again), so that a process copying a checkpoint into a layout of its own holds one copy, not two."""
    maps = {}
    for t in tensors:
        a = t
        while not isinstance(a, np.ndarray):  # the array inside a stored form (BF16 bits, quantized blocks, a transpose)
            a = next(getattr(a, f) for f in ("bits", "blocks", "t") if hasattr(a, f))
        while a is not None and not isinstance(a, np.memmap):
            a = a.base
        while isinstance(a, np.memmap) and a._mmap is None:  # a view: its base holds the mapping
            a = a.base
        if a is not None:
            maps[id(a._mmap)] = a._mmap
    for m in maps.values():
        m.madvise(mmap.MADV_DONTNEED)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None, dtype: str | None = None) -> None:
    """Write `tensors` (name -> array, or any object with `shape`, `dtype` and row slicing) to `path`, a chunk of rows
    at a time; `dtype` ("F16", "BF16", "F32") stores every floating tensor in that type, others keep their own."""
    def stored(t) -> str:
        floating = np.issubdtype(np.dtype(t.dtype), np.floating)
        return dtype if dtype is not None and floating else NAMES[np.dtype(t.dtype)]

    header, offset = {}, 0
    for name, t in tensors.items():
        n = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(DTYPES[stored(t)]).itemsize
        header[name] = {"dtype": stored(t), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, t in tensors.items():
            kind = stored(t)
            rows = t.shape[0] if len(t.shape) else 1
            step = max(1, CHUNK_BYTES // max(1, int(np.prod(t.shape[1:], dtype=np.int64)) * 4))
            for i in range(0, rows, step):
                chunk = np.asarray(t[i:i + step] if len(t.shape) else t)
                f.write((to_bf16_bits(chunk) if kind == "BF16" else chunk.astype(DTYPES[kind], copy=False)).tobytes())


def checkpoint_files(model_dir: Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise UserError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise UserError(f"{f}: shard listed in {index.name} is missing")
        return files
    if single.is_file():
        return [single]
    raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
