"""GGUF files in and out (read by `Parser`, written with llama.cpp's `gguf` package): llama.cpp's layout (magic GGUF) and PowerInfer's (magic
PWRI; per-layer predictors blk.N.fc1 / blk.N.fc2, the down matrix transposed as blk.N.ffn_down_t,
`powerinfer.sparse_threshold`).

Reading gives what an HF folder gives: a ModelConfig, the Weights by our names (memory-mapped in their stored
format, Q/K rows put back in HF order), the embedded predictors if any, and the tokenizer. Writing streams one
tensor at a time into a temporary file that is renamed when complete. For its llama architecture llama.cpp's
converter permutes the rows of attn_q and attn_k per head (that graph's RoPE rotates adjacent pairs, HF's
rotate-half pairs i and i + E/2); PowerInfer's LLaMA code expects the same, so we write them permuted and undo it
when reading. Its qwen2 and qwen3 graphs rotate as HF does: their rows stay as they are. Llama-3's frequency scaling
travels as the tensor rope_freqs (one divisor per frequency).

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, R predictor hidden size.
"""

import json
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ref.common.artifacts import Predictors, Thresholds, check_predictor_shapes, replace_file
from ref.common.config import ModelConfig, rope_frequencies
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format
from ref.common.names import GGUF_ARCHITECTURES, expected_shapes, gguf_name
from ref.common.safetensors import BF16
from ref.quant import Quantized, Transposed, blocks

MAGICS = {b"GGUF": "gguf", b"PWRI": "powerinfer"}
THRESHOLD_KEY = "powerinfer.sparse_threshold"
# The FFN kind is not in llama.cpp's metadata: its llama graph is SwiGLU, PowerInfer's sparse one ReLU. Files we write
# say which, under this key; others get their runtime's convention.
ACT_KEY = "powerinfer_py.hidden_act"
ACT_PARAM_KEY = "powerinfer_py.hidden_act_param"  # FATReLU's threshold
EOS_IDS_KEY = "powerinfer_py.eos_token_ids"  # every id that ends generation (llama.cpp's keys name one or two)
DEFAULT_ACT = {"gguf": "silu", "powerinfer": "relu"}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}  # general.file_type (llama_ftype)
PERMUTED = ("llama", "bamboo")  # the architectures whose attn_q / attn_k rows are in llama.cpp's RoPE order
ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF or PowerInfer file, by its first four bytes (never by its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) in MAGICS


def rope_rows(n_heads: int, E: int, to_gguf: bool) -> np.ndarray:
    """Row order that turns HF's q/k rows [n_heads E, D] into llama.cpp's (row 2i of a head = HF row i, row 2i + 1 =
    HF row i + E/2), or back. Whole rows move, so it applies to any stored format."""
    idx = np.arange(n_heads * E)
    if to_gguf:
        return idx.reshape(n_heads, 2, E // 2).swapaxes(1, 2).reshape(-1)
    return idx.reshape(n_heads, E // 2, 2).swapaxes(1, 2).reshape(-1)


# ---------------------------------------------------------------------------------------------------- reading

SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}  # GGUF's value types, but for 8 (string) and 9 (array)
STRING, ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass
class TensorInfo:
    """A tensor's entry in a GGUF file: name, GGML type, shape in GGML order (ne[0] first), where its bytes lie."""
    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data_offset: int  # from the start of the file
    n_bytes: int
    file: np.ndarray  # the whole file, memory-mapped

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as a flat array: float32 or float16 values for F32 and F16, else raw bytes."""
        raw = self.file[self.data_offset:self.data_offset + self.n_bytes]
        return raw.view({0: np.float32, 1: np.float16}.get(self.tensor_type, np.uint8))


class Parser:
    """GGUF's header (magic, version, counts), its key-value section and its tensor entries, read from a memory map
    with every length checked against the bytes left, so that a crafted count fails at once. Values come out as
    Python values (strings decoded, arrays as lists), as gguf's `contents()` gives them, with one Python object per
    element: gguf's own reader builds numpy views per element, gigabytes for a 16 MB file of empty strings."""

    def __init__(self, path: Path):
        self.path, self.file = path, np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        self.buf, self.pos = memoryview(self.file), 0

    def fail(self, what: str):
        raise UserError(f"{self.path}: not a readable GGUF file, truncated or corrupt ({what} at byte {self.pos})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"{n} bytes wanted, {len(self.buf) - self.pos} left")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def scalar(self, kind: int):
        fmt = SCALARS[kind]
        return np.frombuffer(self.take(np.dtype(fmt).itemsize), fmt)[0].item()

    def string(self) -> str:
        try:
            return bytes(self.take(self.scalar(10))).decode("utf-8")
        except UnicodeDecodeError:
            self.fail("a string that is not UTF-8")

    def value(self, kind: int):
        if kind in SCALARS:
            return self.scalar(kind)
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            self.fail(f"value type {kind}")
        inner, n = self.scalar(4), self.scalar(10)
        if inner in SCALARS:
            size = np.dtype(SCALARS[inner]).itemsize
            return np.frombuffer(self.take(n * size), SCALARS[inner]).tolist()
        if inner != STRING:
            self.fail(f"an array of value type {inner}")  # arrays of arrays: no model's metadata has them
        if n * 8 > len(self.buf) - self.pos:  # each string takes its 8-byte length at least
            self.fail(f"an array of {n} strings")
        return [self.string() for _ in range(n)]

    def read(self) -> tuple[str, dict, list[TensorInfo]]:
        """(kind, fields, tensors)."""
        from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
        kind = MAGICS.get(bytes(self.take(4)))
        if kind is None:
            raise UserError(f"{self.path}: not a GGUF file (no GGUF or PWRI magic)")
        version, n_tensors, n_kv = self.scalar(4), self.scalar(10), self.scalar(10)
        if version not in (2, 3):
            self.fail(f"GGUF version {version}")
        fields, self.types = {}, {}
        for _ in range(min(n_kv, len(self.buf))):  # a key-value takes a byte at least
            key = self.string()
            if key in fields:
                self.fail(f"metadata key '{key[:80]}' twice")
            vtype, start = self.scalar(4), self.pos
            fields[key] = self.value(vtype)
            self.types[key] = (vtype, int(np.frombuffer(self.buf[start:start + 4], "<u4")[0]) if vtype == ARRAY else None)
        if len(fields) < n_kv:
            self.fail(f"{n_kv} metadata keys")
        infos = []
        if n_tensors * 24 > len(self.buf) - self.pos:  # name length, dims, type and offset at least
            self.fail(f"{n_tensors} tensors")
        for _ in range(n_tensors):
            name, dims = self.string(), self.scalar(4)
            if dims > MAX_DIMS:
                self.fail(f"tensor {name[:80]} with {dims} dimensions")
            shape = tuple(self.scalar(10) for _ in range(dims))
            ggml_type, offset = self.scalar(4), self.scalar(10)
            if ggml_type not in GGML_QUANT_SIZES:
                self.fail(f"tensor {name[:80]} of GGML type {ggml_type}")
            block, size = GGML_QUANT_SIZES[ggml_type]
            n = math.prod(shape)
            if shape and shape[0] % block:
                self.fail(f"tensor {name[:80]}: rows of {shape[0]} elements, not whole blocks of {block}")
            infos.append((name, ggml_type, shape, offset, n // block * size))
        align = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            self.fail(f"general.alignment {align!r}")
        start = -(-self.pos // align) * align
        tensors = [TensorInfo(name, t, shape, start + offset, nbytes, self.file)
                   for name, t, shape, offset, nbytes in infos]
        return kind, fields, tensors


# The types of the keys read (".x" for ARCH.x of any architecture): a value of another type is refused by its key.
KEY_TYPES = {
    "general.architecture": str, ".embedding_length": int, ".attention.head_count": int,
    ".attention.head_count_kv": int, ".attention.key_length": int, ".rope.dimension_count": int,
    ".feed_forward_length": int, ".block_count": int, ".expert_count": int, ".context_length": int, ".vocab_size": int,
    ".attention.layer_norm_rms_epsilon": float, ".rope.freq_base": float, ".rope.scaling.type": str,
    ".rope.scaling.factor": float, "tokenizer.ggml.model": str, "tokenizer.ggml.tokens": [str],
    "tokenizer.ggml.merges": [str], "tokenizer.ggml.scores": [float], "tokenizer.ggml.token_type": [int],
    "tokenizer.ggml.bos_token_id": int, "tokenizer.ggml.eos_token_id": int, "tokenizer.ggml.unknown_token_id": int,
    "tokenizer.ggml.eot_token_id": int, "tokenizer.ggml.eom_token_id": int, "tokenizer.ggml.pre": str,
    "tokenizer.ggml.add_bos_token": bool, "tokenizer.ggml.normalizer.lowercase": bool,
    "tokenizer.huggingface.json": str, "tokenizer.chat_template": str, THRESHOLD_KEY: float, ACT_KEY: str,
    EOS_IDS_KEY: [int],
    ACT_PARAM_KEY: float}


def of_type(v, kind) -> bool:
    if isinstance(kind, list):
        return isinstance(v, list) and all(of_type(x, kind[0]) for x in v)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, kind) and (kind is bool or not isinstance(v, bool))


class Metadata:
    """The key-value section of a GGUF file, each value read checked against KEY_TYPES, with one-line errors naming
    the file and key."""

    def __init__(self, path: Path, fields: dict, types: dict):
        self.path, self.fields, self.types = path, fields, types  # types: key -> (GGUF value type, item type of an array)

    def get(self, key: str, default=None):
        if key not in self.fields:
            return default
        v = self.fields[key]
        kind = KEY_TYPES.get(key) or KEY_TYPES.get("." + key.split(".", 1)[-1])
        if kind is not None and not of_type(v, kind):
            what = f"a list of {kind[0].__name__}" if isinstance(kind, list) else kind.__name__
            raise UserError(f"{self.path}: metadata key '{key}' must be {what}, got {json.dumps(v)[:60]}"
                            if not isinstance(v, list) else f"{self.path}: metadata key '{key}' must be {what}")
        return v

    def need(self, key: str):
        if key not in self.fields:
            raise UserError(f"{self.path}: metadata key '{key}' is missing")
        return self.get(key)


def gguf_metadata(path: str | Path) -> Metadata:
    path = Path(path)
    parser = Parser(path)
    return Metadata(path, parser.read()[1], parser.types)


def config_from_gguf(meta: Metadata, kind: str, tied: bool) -> ModelConfig:
    """ModelConfig from a GGUF's metadata, through the same checks as config.json."""
    arch = meta.need("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{meta.path}: architecture '{arch}' is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    if meta.get(f"{arch}.expert_count", 0):  # Mixtral is written as llama with experts
        raise UserError(f"{meta.path}: a mixture-of-experts model ({arch}.expert_count "
                        f"{meta.get(f'{arch}.expert_count')}) is not supported")
    D, H = meta.need(f"{arch}.embedding_length"), meta.need(f"{arch}.attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    raw = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "hidden_size": D, "num_attention_heads": H,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", H),
        "head_dim": meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count")),
        "intermediate_size": meta.need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.need(f"{arch}.block_count"),
        "max_position_embeddings": meta.need(f"{arch}.context_length"),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": meta.get(f"{arch}.vocab_size", len(tokens) if tokens else None),
        "hidden_act": meta.get(ACT_KEY, DEFAULT_ACT[kind]), "hidden_act_param": meta.get(ACT_PARAM_KEY, 0.0),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
    }
    if raw["vocab_size"] is None:
        raise UserError(f"{meta.path}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' gives the vocabulary size")
    if meta.get(f"{arch}.rope.scaling.type", "none") != "none" or meta.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raw["rope_scaling"] = {"type": meta.get(f"{arch}.rope.scaling.type", "linear"),
                               "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
    return ModelConfig.from_dict(raw, source=str(meta.path))


def stored(path: Path, t):
    """A GGUF tensor as the stored form ref.quant reads (memory-mapped, no copy): float32 / float16 arrays, BF16
    bits, or Quantized blocks; shapes in numpy order [rows, n]."""
    from gguf import GGMLQuantizationType as Q
    shape = tuple(int(s) for s in reversed(t.shape))
    kind = Q(t.tensor_type)
    if kind in (Q.F32, Q.F16):
        return t.data.reshape(shape)
    if kind == Q.BF16:
        return BF16(t.data.view(np.uint16).reshape(shape))
    if kind.name.lower() in ("q8_0", "q4_0"):
        return Quantized(FORMATS[kind.name.lower()], t.data.reshape(*shape[:-1], -1), shape)
    raise UserError(f"{path}: tensor {t.name} is {kind.name}; this engine reads F32, F16, BF16, Q8_0 and Q4_0")


@dataclass
class GGUFCheckpoint:
    kind: str  # "gguf" (llama.cpp) or "powerinfer"
    config: ModelConfig
    tensors: dict  # our name -> stored tensor
    predictors: Predictors | None
    meta: Metadata
    sparsity: Thresholds | None = None  # activation sparsity's calibration, embedded under `sparsity.`


SPARSITY_PREFIX = "sparsity."  # an embedded activation-sparsity calibration: sparsity.teal.table, ... (Thresholds)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Config, weights by our names (exact tensor set and shapes checked), and embedded predictors of a GGUF file."""
    path = Path(path)
    parser = Parser(path)
    kind, fields, infos = parser.read()
    meta = Metadata(path, fields, parser.types)
    found = {t.name: t for t in infos}
    if len(found) < len(infos):
        raise UserError(f"{path}: two tensors share a name")
    check_ranges(path, infos, path.stat().st_size)
    cfg = config_from_gguf(meta, kind, tied="output.weight" not in found)
    cfg.check_bytes(path.stat().st_size, path)
    tensors, used = {}, set()
    if ROPE_FREQS in found:
        cfg = with_rope_factors(cfg, stored(path, found[ROPE_FREQS]), path)
        used.add(ROPE_FREQS)
    permuted = meta.get("general.architecture") in PERMUTED
    for ours, shape in expected_shapes(cfg).items():
        gname = gguf_name(cfg, ours)
        transposed = gname.replace("ffn_down.", "ffn_down_t.")
        if gname not in found and ours.endswith(".wd") and transposed in found:
            t = stored(path, found[transposed])
            want, gname, t = shape[::-1], transposed, Transposed(t)
            got = tuple(t.t.shape)
        else:
            if gname not in found:
                raise UserError(f"{path}: tensor {gname} is missing")
            t, want = stored(path, found[gname]), shape
            got = tuple(t.shape)
        if got != want:
            raise UserError(f"{path}: tensor {gname} has shape {got}, the metadata implies {want}")
        if permuted and ours.endswith((".wq", ".wk", ".wq.bias", ".wk.bias")):  # llama.cpp's row order -> HF's
            t = t[rope_rows(shape[0] // cfg.head_dim, cfg.head_dim, to_gguf=False)]
        tensors[ours] = t
        used.add(gname)
    predictors = read_predictors(path, cfg, found, meta, used)
    embedded = {n: t for n, t in found.items() if n.startswith(SPARSITY_PREFIX)}
    used.update(embedded)
    sparsity = Thresholds.of(path, {n[len(SPARSITY_PREFIX):]: stored(path, t) for n, t in embedded.items()},
                             {"source": str(path)}) if embedded else None
    extra = sorted(set(found) - used)
    if extra:
        raise UserError(f"{path}: {len(extra)} unexpected tensor(s), first {extra[0]}")
    return GGUFCheckpoint(kind, cfg, tensors, predictors, meta, sparsity)


def with_rope_factors(cfg: ModelConfig, factors, path: Path) -> ModelConfig:
    """The config with RoPE frequencies divided by rope_freqs' factors ([E/2], positive and finite), which is how
    llama.cpp's converter stores Llama-3's scaling."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape != (cfg.head_dim // 2,) or not (np.isfinite(f).all() and (f > 0).all()):
        raise UserError(f"{path}: tensor {ROPE_FREQS} must hold {cfg.head_dim // 2} positive factors (one per "
                        f"RoPE frequency), got {f.size}")
    if cfg.rope_scaling:
        raise UserError(f"{path}: tensor {ROPE_FREQS} and {cfg.rope_scaling[0]} RoPE scaling together are not supported")
    return replace(cfg, rope_scaling=("factors", *map(float, f)))


def check_ranges(path: Path, tensors, size: int) -> None:
    """Every tensor's bytes inside the file and no two tensors sharing a byte (a crafted file could alias them)."""
    end, last = 0, None
    for t in sorted(tensors, key=lambda t: int(t.data_offset)):
        a, b = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if a < end:
            raise UserError(f"{path}: tensors {last} and {t.name} overlap (bytes {a} to {end})")
        if b > size:
            raise UserError(f"{path}: truncated or corrupt GGUF file: tensor {t.name} runs past its end ({b} > {size} "
                            "bytes)")
        end, last = b, t.name


def read_predictors(path: Path, cfg: ModelConfig, found: dict, meta: Metadata, used: set) -> Predictors | None:
    """blk.N.fc1 [R_N, D] and blk.N.fc2 [F, R_N] for every layer, or None when the file has none."""
    names = [(f"blk.{l}.fc1.weight", f"blk.{l}.fc2.weight") for l in range(cfg.n_layers)]
    have = [a in found and b in found for a, b in names]
    if not any(a in found or b in found for a, b in names):
        return None
    if not all(have):
        missing = next(n for pair in names for n in pair if n not in found)
        raise UserError(f"{path}: predictors do not match the {cfg.n_layers} layers: {missing} is missing")
    fc1, fc2 = [], []
    for l, (a, b) in enumerate(names):
        x, y = stored(path, found[a]), stored(path, found[b])
        check_predictor_shapes(path, cfg, l, x, y)
        fc1.append(x)
        fc2.append(y)
        used.update((a, b))
    return Predictors(fc1, fc2, float(meta.get(THRESHOLD_KEY, 0.0)), {"source": str(path)})


# ---------------------------------------------------------------------------------------------------- writing

@dataclass
class Planned:
    """One tensor of the file to write: its GGUF name, numpy shape, format, and how to compute it when its turn comes."""
    name: str
    shape: tuple[int, ...]
    fmt: Format
    make: object  # () -> stored tensor (ndarray, BF16 or Quantized)


def tensor_bytes(t) -> np.ndarray:
    """A stored tensor's bytes as GGUF lays them out (row-major, llama.cpp's blocks)."""
    b = blocks(t)
    return np.ascontiguousarray(b).view(np.uint8).reshape(-1) if b.dtype != np.float32 else b


def write_gguf(out: Path, kind: str, arch: str, kv: list, planned: list[Planned], progress=None) -> int:
    """Write a GGUF (kind 'gguf') or PowerInfer (kind 'powerinfer': magic PWRI) file: metadata `kv` as (method,
    *args) calls on gguf.GGUFWriter, then each planned tensor computed and written in turn. Atomic: a temporary
    file beside `out`, renamed when complete (an interruption leaves nothing). Returns the file's size."""
    import gguf
    qtypes = {f.name: gguf.GGMLQuantizationType[f.name.upper()] for f in FORMATS.values()}
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(None, arch)
        for method, *args in kv:
            getattr(w, method)(*args)
        for p in planned:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.fmt.nbytes(p.shape), raw_dtype=qtypes[p.fmt.name])
        w.write_header_to_file(Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, p in enumerate(planned):
            data = tensor_bytes(p.make())
            if data.nbytes != p.fmt.nbytes(p.shape):
                raise ValueError(f"{p.name}: {data.nbytes} bytes computed, {p.fmt.nbytes(p.shape)} planned")
            w.write_tensor_data(data)
            if progress is not None:
                progress(i + 1, len(planned), p.fmt.nbytes(p.shape))
        w.close()
        if kind == "powerinfer":
            with open(tmp, "r+b") as f:
                f.write(b"PWRI")
        os.chmod(tmp, 0o666 & ~_umask())
        size = os.path.getsize(tmp)
        replace_file(tmp, out)
        return size
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gguf_rope_type(name: str):
    from gguf import RopeScalingType
    return RopeScalingType(name)


def rope_freqs(cfg: ModelConfig) -> list[Planned]:
    """rope_freqs [E/2] for a model whose RoPE frequencies are divided per frequency (Llama-3's scaling), as
    llama.cpp's converter writes it; none for the others."""
    if cfg.rope_scaling[:1] not in (("llama3",), ("factors",)):
        return []
    f = rope_frequencies(cfg.head_dim, cfg.rope_theta) / rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return [Planned(ROPE_FREQS, f.shape, FORMATS["f32"], lambda: f.astype(np.float32))]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def copied_kv(meta: Metadata, prefix: str) -> list:
    """The metadata keys under `prefix` of a file read, with their GGUF types, to write into another file."""
    from gguf import GGUFValueType
    return [("add_key_value", k, v, GGUFValueType(meta.types[k][0]),
             None if meta.types[k][1] is None else GGUFValueType(meta.types[k][1]))
            for k, v in meta.fields.items() if k.startswith(prefix)]


def model_kv(cfg: ModelConfig, fmt: Format, name: str) -> list:
    """llama.cpp's model metadata for a config (its architecture: names.gguf_architecture)."""
    kv = [("add_name", name), ("add_file_type", FILE_TYPES[fmt.name]), ("add_context_length", cfg.max_seq_len),
          ("add_embedding_length", cfg.d_model), ("add_block_count", cfg.n_layers),
          ("add_feed_forward_length", cfg.d_ffn), ("add_rope_dimension_count", cfg.head_dim),
          ("add_head_count", cfg.n_heads), ("add_head_count_kv", cfg.n_kv_heads),
          ("add_layer_norm_rms_eps", cfg.norm_eps), ("add_rope_freq_base", cfg.rope_theta),
          ("add_vocab_size", cfg.vocab_size), ("add_string", ACT_KEY, cfg.ffn_kind),
          ("add_float32", ACT_PARAM_KEY, cfg.act_threshold)]
    if cfg.head_dim != cfg.d_model // cfg.n_heads:
        kv += [("add_key_length", cfg.head_dim), ("add_value_length", cfg.head_dim)]
    if cfg.rope_scaling[:1] == ("linear",):
        kv += [("add_rope_scaling_type", gguf_rope_type("linear")), ("add_rope_scaling_factor", cfg.rope_scaling[1])]
    if fmt.quantized:
        kv.append(("add_quantization_version", 2))
    return kv
