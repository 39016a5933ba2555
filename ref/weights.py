"""Memory-mapped safetensors reading and the HF LLaMA weight layout.

Tensors stay in their stored dtype (fp16, bf16, fp32) on disk pages and are upcast where used, so a
7B fp16 checkpoint runs in little more memory than its largest matrix.

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab.
"""

import json
import struct
from pathlib import Path

import numpy as np

from ref.config import ModelConfig
from ref.errors import UserError

# Our name -> HF name; `{l}` is the layer index. The only place that knows HF's names.
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layers.{l}.attn_norm": "model.layers.{l}.input_layernorm.weight",
    "layers.{l}.wq": "model.layers.{l}.self_attn.q_proj.weight",
    "layers.{l}.wk": "model.layers.{l}.self_attn.k_proj.weight",
    "layers.{l}.wv": "model.layers.{l}.self_attn.v_proj.weight",
    "layers.{l}.wo": "model.layers.{l}.self_attn.o_proj.weight",
    "layers.{l}.ffn_norm": "model.layers.{l}.post_attention_layernorm.weight",
    "layers.{l}.wg": "model.layers.{l}.mlp.gate_proj.weight",
    "layers.{l}.wu": "model.layers.{l}.mlp.up_proj.weight",
    "layers.{l}.wd": "model.layers.{l}.mlp.down_proj.weight",
}
# Buffers some exports carry that hold nothing the model needs (RoPE frequencies are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names and their shapes (HF stores Linear weights as [out, in])."""
    D, F, E, V = cfg.d_model, cfg.d_ffn, cfg.head_dim, cfg.vocab_size
    per_layer = {
        "attn_norm": (D,), "wq": (cfg.n_heads * E, D), "wk": (cfg.n_kv_heads * E, D), "wv": (cfg.n_kv_heads * E, D),
        "wo": (D, cfg.n_heads * E), "ffn_norm": (D,), "wg": (F, D), "wu": (F, D), "wd": (D, F),
    }
    shapes = {"embed": (V, D), "norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, D)
    for l in range(cfg.n_layers):
        shapes.update({f"layers.{l}.{k}": s for k, s in per_layer.items()})
    return shapes


def hf_name(name: str) -> str:
    if name.startswith("layers."):
        _, l, rest = name.split(".", 2)
        return HF_NAMES["layers.{l}." + rest].format(l=l)
    return HF_NAMES[name]


def read_header(path: Path) -> tuple[dict, int, dict]:
    """The safetensors tensor entries, the offset where tensor data starts, and the metadata; checks the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise UserError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + n + end})")
    return header, 8 + n, metadata


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
        if (b - a) != int(np.prod(t["shape"], dtype=np.int64)) * dtype.itemsize:
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

    def astype(self, dtype) -> np.ndarray:
        return (self.bits.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)


def upcast(t, dtype=np.float32) -> np.ndarray:
    """A stored tensor (memory-mapped, any supported dtype) as a compute array; no copy when already `dtype`."""
    return t.astype(dtype) if isinstance(t, BF16) else np.asarray(t).astype(dtype, copy=False)


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


class Weights:
    """The checked tensors of one checkpoint, by our names, memory-mapped in their stored dtype."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config = cfg
        self.tensors = tensors

    def __getitem__(self, name: str):
        return self.tensors[name]

    @staticmethod
    def load(model_dir: str | Path, cfg: ModelConfig) -> "Weights":
        """Load and check the exact key set and every shape against the config."""
        model_dir = Path(model_dir)
        found: dict[str, np.ndarray] = {}
        where: dict[str, Path] = {}
        for f in checkpoint_files(model_dir):
            for name, t in open_safetensors(f).items():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name in found:
                    raise UserError(f"{f}: tensor {name} also stored in {where[name]}")
                found[name], where[name] = t, f
        shapes = expected_shapes(cfg)
        wanted = {hf_name(n): n for n in shapes}
        missing = sorted(set(wanted) - set(found))
        extra = sorted(set(found) - set(wanted))
        if missing:
            raise UserError(f"{model_dir}: missing {len(missing)} tensor(s), first {missing[0]}")
        if extra:
            raise UserError(f"{model_dir}: {len(extra)} unexpected tensor(s), first {extra[0]}")
        tensors = {}
        for hf, ours in wanted.items():
            if not (isinstance(found[hf], BF16) or np.issubdtype(found[hf].dtype, np.floating)):
                raise UserError(f"{where[hf]}: tensor {hf} has dtype {found[hf].dtype}, weights must be floating point")
            if tuple(found[hf].shape) != shapes[ours]:
                raise UserError(f"{where[hf]}: tensor {hf} has shape {tuple(found[hf].shape)}, config.json implies {shapes[ours]}")
            tensors[ours] = found[hf]
        return Weights(cfg, tensors)
