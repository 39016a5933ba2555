"""Model configuration from a Hugging Face `config.json`: one frozen dataclass for every family, each family's field
names read in one parser (`PARSERS`).

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, L layers, P positions.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ref.common.errors import UserError

MAX_INT = 2**31 - 1  # any count or size: the kernels index with int32
MAX_CONTEXT = 1 << 24  # positions: the RoPE tables and learned positions are built for all of them

# HF architecture -> model family: one block definition and one weight-name table each (ref.model, ref.common.names).
# ProSparse's folders name their remote code's classes (configuration_sparsellama.py, modeling_sparsellama.py).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "BambooForCausalLM": "llama",
                 "SparseLlamaForCausalLM": "llama", "Qwen2ForCausalLM": "llama", "Qwen3ForCausalLM": "llama",
                 "OPTForCausalLM": "opt", "FalconForCausalLM": "falcon",
                 "RWForCausalLM": "falcon"}
# Configs without `architectures`: model_type -> architecture.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "bamboo": "BambooForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "sparsellama": "SparseLlamaForCausalLM",
               "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM", "RefinedWeb": "RWForCausalLM",
               "RefinedWebModel": "RWForCausalLM"}

# HF activation name -> FFN kind (docs/design.md, Semantics). All naming lives here.
FFN_KINDS = {
    "relu": "relu",        # ReLU: ReluLLaMA, ProSparse without threshold, OPT, ReluFalcon, the shipped model
    "fatrelu": "fatrelu",  # ProSparse: relu with values <= threshold set to 0 (`hidden_act_param`)
    "drelu": "drelu",      # Bamboo / TurboSparse: relu(gate) * relu(up)
    "silu": "silu",        # SwiGLU: dense only
    "swish": "silu",
    "gelu": "gelu",        # Falcon's default (exact erf GELU): dense only
}
# LLaMA-family architectures whose attention differs: q, k and v with biases (Qwen2); each head's q and k RMS-normed
# before RoPE (Qwen3).
QKV_BIAS = ("Qwen2ForCausalLM",)
QK_NORM = ("Qwen3ForCausalLM",)
# Checkpoints whose config says `hidden_act: relu` but whose FFN is dReLU (their modeling code applies relu to up too).
DRELU_ARCHITECTURES = ("BambooForCausalLM",)
# The block around attention and FFN (ref.model): pre-norm residual (LLaMA, OPT, Falcon-RW), post-norm residual
# (OPT-350m), or Falcon's parallel attention and FFN from the same input, with two norms or one shared.
BLOCKS = ("pre_norm", "post_norm", "parallel", "parallel_shared")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str              # one of ARCHITECTURES' values
    vocab_size: int          # V
    d_model: int             # D
    n_layers: int            # L
    n_heads: int             # H
    n_kv_heads: int          # K
    head_dim: int            # E
    d_ffn: int               # F
    ffn_kind: str            # one of FFN_KINDS' values
    act_threshold: float     # fatrelu threshold t (0 for the others)
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    gated: bool = True       # FFN y = Wd a(Wg x, Wu x) (LLaMA); else y = Wd act(Wu x + bu) + bd (OPT, Falcon)
    norm: str = "rms"        # "rms" (RMSNorm, weight only) or "layer" (LayerNorm with weight and bias)
    bias: bool = False       # biases on the attention and FFN matrices
    positions: str = "rope"  # "rope", or "learned" (OPT: a table of P + 2 rows read at position + 2)
    block: str = "pre_norm"  # one of BLOCKS
    fused_qkv: bool = False  # one q/k/v matrix, rows per kv head group: its H/K query heads, its key, its value
    embed_dim: int = 0       # OPT's word_embed_proj_dim where it differs from D (project_in / project_out), else 0
    final_norm: bool = True  # a norm before the output head (OPT-350m has none)
    rope_scaling: tuple = ()  # () plain RoPE; ("linear", factor); ("llama3", factor, low, high, original context);
    #                          ("factors", d_0 .. d_{E/2-1}) from a GGUF's rope_freqs
    qkv_bias: bool = False   # biases on q, k and v only (Qwen2)
    qk_norm: bool = False    # RMSNorm of each head's q and k before RoPE, weights [E] shared by the heads (Qwen3)

    @property
    def ffn_matrices(self) -> int:
        """Rows per neuron: gate, up and down, or up and down for a non-gated FFN."""
        return 3 if self.gated else 2

    @property
    def n_params(self) -> int:
        D, F, E = self.d_model, self.d_ffn, self.head_dim
        attn = D * self.n_heads * E * 2 + D * self.n_kv_heads * E * 2
        per_layer = attn + self.ffn_matrices * D * F + 2 * D
        head = 0 if self.tie_word_embeddings else self.vocab_size * D
        return self.vocab_size * D + self.n_layers * per_layer + D + head

    @staticmethod
    def from_hf(path: str | Path) -> "ModelConfig":
        """Read `config.json` from a model folder (or the file itself) and validate it."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise UserError(f"{path}: no such model folder")
        if not file.is_file():
            raise UserError(f"{file}: missing (a model folder needs config.json)")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{file}: expected a JSON object")
        return ModelConfig.from_dict(raw, source=str(file))

    @staticmethod
    def from_dict(raw: dict, source: str = "config") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None if archs else MODEL_TYPES.get(raw.get("model_type")))
        if arch is None:
            raise UserError(f"{source}: unsupported architectures {archs or raw.get('model_type')!r} "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        family = ARCHITECTURES[arch]
        read = Fields(raw, source)
        fields = PARSERS[family](read, arch)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # BOS is put in prompts, so it must be a token; an EOS beyond the vocabulary is never sampled: harmless
        for key, ids, top in (("bos_token_id", [raw.get("bos_token_id")], fields["vocab_size"]),
                              ("eos_token_id", eos_ids, MAX_INT + 1)):
            if not all(i is None or isinstance(i, int) and not isinstance(i, bool) and 0 <= i < top for i in ids):
                raise UserError(f"{source}: field '{key}' must be a token id (or a list of them) below {top}, got "
                                f"{json.dumps(raw.get(key))[:60]}")
        cfg = ModelConfig(architecture=arch, family=family, bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
                          torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"), **fields)
        if cfg.n_heads % cfg.n_kv_heads:
            raise UserError(f"{source}: the {cfg.n_heads} attention heads are not a multiple of the {cfg.n_kv_heads} "
                            "key-value heads")
        if cfg.head_dim % 2:  # rotate-half RoPE needs it, and so do the engines' attention kernels
            raise UserError(f"{source}: the head dimension must be even, got {cfg.head_dim}")
        if cfg.max_seq_len > MAX_CONTEXT:
            raise UserError(f"{source}: a context of {cfg.max_seq_len} positions is more than the {MAX_CONTEXT} this "
                            "engine takes")
        return cfg

    def check_bytes(self, nbytes: int, source) -> None:
        """Refuse a config whose weights cannot be in `nbytes` of checkpoint, before anything is built per layer: even
        in q4_0 (the smallest format read: 18 bytes a block of 32) its n_params take n_params * 18 / 32 bytes."""
        least = self.n_params * 18 // 32
        if least > nbytes:
            raise UserError(f"{source}: the config describes {self.n_params:,} parameters ({self.n_layers:,} layers, "
                            f"vocabulary {self.vocab_size:,}), at least {least:,} bytes even in q4_0; the checkpoint "
                            f"holds {nbytes:,}")


class Fields:
    """A raw config's fields, each checked as it is read; every message names the file and the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def get(self, key, default):
        value = self.raw.get(key)
        return default if value is None else value

    def int(self, key, default=None):
        value = self.get(key, default)
        if value is None:
            raise UserError(f"{self.source}: missing field '{key}'")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_INT:
            raise UserError(f"{self.source}: field '{key}' must be a positive integer of at most {MAX_INT}, "
                            f"got {value!r}"[:300])
        return value

    def float(self, key, default, zero_ok=False):
        value = self.get(key, default)
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0
                or (value == 0 and not zero_ok)):
            sign = "non-negative" if zero_ok else "positive"
            raise UserError(f"{self.source}: field '{key}' must be a finite {sign} number, got {value!r}"[:300])
        return float(value)

    def bool(self, key, default):
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.source}: field '{key}' must be true or false, got {value!r}")
        return value

    def activation(self, key, default):
        act = str(self.get(key, default)).lower()
        if act not in FFN_KINDS:
            raise UserError(f"{self.source}: unsupported {key} '{act}' (supported: {', '.join(FFN_KINDS)})")
        return FFN_KINDS[act]

    def rope(self) -> dict:
        """rope_theta and rope_scaling (or transformers 5's rope_parameters, which holds both), as transformers'
        rope_init_functions read them: 'linear' and 'llama3' change the frequencies; 'dynamic' (NTK) changes
        nothing up to its original context, which is as far as this engine goes (context); other types are
        refused."""
        params = self.raw.get("rope_parameters") or {}
        scaling = self.raw.get("rope_scaling") or params
        if not isinstance(scaling, dict):
            raise UserError(f"{self.source}: rope_scaling must be an object, got {json.dumps(scaling)[:60]}")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        out = Fields({"rope_theta": params.get("rope_theta", self.raw.get("rope_theta"))}, self.source)
        theta = out.float("rope_theta", 10000.0)
        read = Fields(scaling, self.source + " rope_scaling")
        if kind in ("default", "dynamic"):
            return dict(rope_theta=theta)
        if kind == "linear":
            return dict(rope_theta=theta, rope_scaling=("linear", read.float("factor", None)))
        if kind == "llama3":
            return dict(rope_theta=theta, rope_scaling=(
                "llama3", read.float("factor", None), read.float("low_freq_factor", None),
                read.float("high_freq_factor", None), read.int("original_max_position_embeddings")))
        raise UserError(f"{self.source}: rope_scaling type '{kind}' is not supported (supported: linear, llama3, "
                        "dynamic)")

    def context(self, key: str = "max_position_embeddings", default=None) -> int:
        """The positions a sequence may hold: max_position_embeddings, or the sliding window where it is smaller
        (Mistral, Qwen with use_sliding_window): attention here sees every earlier position, which is the window's
        attention only while the sequence fits in it."""
        positions, window = self.int(key, default), self.raw.get("sliding_window")
        if window is not None and self.raw.get("use_sliding_window", True) is not False:
            positions = min(positions, self.int("sliding_window"))
        scaling = self.raw.get("rope_scaling") or self.raw.get("rope_parameters") or {}
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "dynamic" \
                and "original_max_position_embeddings" in scaling:
            # dynamic NTK changes the frequencies past its original context: stop there
            positions = min(positions, Fields(scaling, self.source).int("original_max_position_embeddings"))
        return positions


def parse_llama(f: Fields, arch: str) -> dict:
    """LLaMA (1 to 3.x), Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Bamboo (ReluLLaMA, ProSparse,
    TurboSparse): RMSNorm, RoPE, GQA, gated FFN."""
    for key in ("attention_bias", "mlp_bias"):  # Llama's and Qwen3's optional biases on every matrix
        if f.bool(key, False):
            raise UserError(f"{f.source}: {key} true is not supported")
    kind = f.activation("hidden_act", "silu")
    kind = "drelu" if arch in DRELU_ARCHITECTURES and kind == "relu" else kind
    d_model, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    return dict(
        vocab_size=f.int("vocab_size"), d_model=d_model, n_layers=f.int("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=f.int("num_key_value_heads", n_heads), head_dim=f.int("head_dim", d_model // n_heads),
        d_ffn=f.int("intermediate_size"), ffn_kind=kind,
        act_threshold=f.float("hidden_act_param", 0.0, zero_ok=True) if kind == "fatrelu" else 0.0,
        norm_eps=f.float("rms_norm_eps", 1e-6), **f.rope(), max_seq_len=f.context(),
        tie_word_embeddings=f.bool("tie_word_embeddings", False), qkv_bias=arch in QKV_BIAS,
        qk_norm=arch in QK_NORM)


def parse_opt(f: Fields, arch: str) -> dict:
    """OPT (modeling_opt.py): LayerNorm (eps 1e-5) with bias, learned positions, MHA with biases, FFN fc2 relu(fc1),
    tied head; pre-norm, or post-norm with a narrower embedding (word_embed_proj_dim) and no final norm (350m)."""
    kind = f.activation("activation_function", "relu")
    if not f.bool("layer_norm_elementwise_affine", True):
        raise UserError(f"{f.source}: layer_norm_elementwise_affine false (LayerNorm without weights) is not supported")
    d_model, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    if d_model % n_heads:
        raise UserError(f"{f.source}: hidden_size {d_model} is not a multiple of num_attention_heads {n_heads}")
    pre = f.bool("do_layer_norm_before", True)
    embed_dim = f.int("word_embed_proj_dim", d_model)
    return dict(
        vocab_size=f.int("vocab_size"), d_model=d_model, n_layers=f.int("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=n_heads, head_dim=d_model // n_heads, d_ffn=f.int("ffn_dim"), ffn_kind=kind, act_threshold=0.0,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=f.int("max_position_embeddings"),
        tie_word_embeddings=f.bool("tie_word_embeddings", True), gated=False, norm="layer",
        bias=f.bool("enable_bias", True), positions="learned", block="pre_norm" if pre else "post_norm",
        embed_dim=0 if embed_dim == d_model else embed_dim,
        final_norm=pre and not f.bool("_remove_final_layer_norm", False))


# Falcon's RW-era configs (RWForCausalLM, custom code) by transformers' names, as its convert_custom_code_checkpoint
# does.
RW_NAMES = {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_head_kv": "num_kv_heads",
            "n_embed": "hidden_size"}


def parse_falcon(f: Fields, arch: str) -> dict:
    """Falcon (modeling_falcon.py): LayerNorm with bias, RoPE, one fused q/k/v matrix, parallel attention and FFN
    (two norms in the new decoder architecture, else one shared) or sequential, FFN dense_4h_to_h act(dense_h_to_4h)."""
    raw = dict(f.raw)
    if any(k in raw for k in RW_NAMES):
        raw = {RW_NAMES.get(k, k): v for k, v in raw.items()}
        raw.setdefault("new_decoder_architecture", "num_kv_heads" in raw)
    f = Fields(raw, f.source)
    if f.bool("alibi", False):
        raise UserError(f"{f.source}: alibi (Falcon-RW's positions) is not supported; rotary Falcon models are")
    d_model, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    new_arch, multi_query = f.bool("new_decoder_architecture", False), f.bool("multi_query", True)
    # The fused matrix's kv head groups (modeling_falcon's _split_heads): num_kv_heads of them in the new decoder
    # architecture, one for multi-query, else one per head (q, k, v interleaved head by head).
    n_kv = f.int("num_kv_heads", n_heads) if new_arch else 1 if multi_query else n_heads
    parallel = f.bool("parallel_attn", True)
    norms = f.int("num_ln_in_parallel_attn", 2 if new_arch else 1)
    if new_arch and not parallel:
        raise UserError(f"{f.source}: new_decoder_architecture with parallel_attn false is not a Falcon layout")
    block = "pre_norm" if not parallel else "parallel" if new_arch and norms == 2 else "parallel_shared"
    return dict(
        vocab_size=f.int("vocab_size"), d_model=d_model, n_layers=f.int("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=d_model // n_heads, d_ffn=f.int("ffn_hidden_size", 4 * d_model),
        ffn_kind=f.activation("activation", "gelu"), act_threshold=0.0, norm_eps=f.float("layer_norm_epsilon", 1e-5),
        **f.rope(), max_seq_len=f.int("max_position_embeddings", 2048),
        tie_word_embeddings=f.bool("tie_word_embeddings", True), gated=False, norm="layer",
        bias=f.bool("bias", False), block=block, fused_qkv=True)


PARSERS = {"llama": parse_llama, "opt": parse_opt, "falcon": parse_falcon}
def llama_shape(D: int, F: int, L: int, H: int, K: int, V: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
            "num_attention_heads": H, "num_key_value_heads": K, "vocab_size": V, "rms_norm_eps": 1e-5}


# Real architectures' shapes for benchmarks, as config.json fields (ReLU versions: ReluLLaMA, OPT, ReluFalcon).
SHAPES = {
    "tinyllama-1.1b": llama_shape(2048, 5632, 22, 32, 4, 32000),
    "llama-7b": llama_shape(4096, 11008, 32, 32, 32, 32000),
    "llama-13b": llama_shape(5120, 13824, 40, 40, 40, 32000),
    "llama-70b": llama_shape(8192, 28672, 80, 64, 8, 32000),
    "opt-1.3b": {"architectures": ["OPTForCausalLM"], "hidden_size": 2048, "ffn_dim": 8192, "num_hidden_layers": 24,
                 "num_attention_heads": 32, "vocab_size": 50272},
    "opt-6.7b": {"architectures": ["OPTForCausalLM"], "hidden_size": 4096, "ffn_dim": 16384, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "vocab_size": 50272},
    "falcon-7b": {"architectures": ["FalconForCausalLM"], "hidden_size": 4544, "num_hidden_layers": 32,
                  "num_attention_heads": 71, "multi_query": True, "parallel_attn": True, "vocab_size": 65024},
    "falcon-40b": {"architectures": ["FalconForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 60,
                   "num_attention_heads": 128, "num_kv_heads": 8, "new_decoder_architecture": True,
                   "vocab_size": 65024},
    "llama-3-8b": {**llama_shape(4096, 14336, 32, 32, 8, 128256), "rope_theta": 500000.0},
    "llama-3.2-1b": {**llama_shape(2048, 8192, 16, 32, 8, 128256), "rope_theta": 500000.0, "tie_word_embeddings": True},
    "mistral-7b": {**llama_shape(4096, 14336, 32, 32, 8, 32000), "architectures": ["MistralForCausalLM"]},
    "qwen2.5-7b": {**llama_shape(3584, 18944, 28, 28, 4, 152064), "architectures": ["Qwen2ForCausalLM"],
                   "rope_theta": 1e6},
    "qwen3-8b": {**llama_shape(4096, 12288, 36, 32, 8, 151936), "architectures": ["Qwen3ForCausalLM"], "head_dim": 128,
                 "rope_theta": 1e6},
    "tiny": llama_shape(256, 1024, 6, 8, 4, 4096),  # the shipped model's shape, for quick runs
    "micro": llama_shape(16, 24, 2, 2, 1, 32),  # smoke runs under the CUDA simulator
    "micro-32": llama_shape(32, 64, 2, 2, 1, 32),  # the same in every weight format (rows of whole q4_0 blocks)
}
# Family -> the config field that names its FFN activation.
ACTIVATION_FIELDS = {"llama": "hidden_act", "opt": "activation_function", "falcon": "activation"}


def shape_config(name: str, layers: int | None = None, hidden_act: str = "relu", context: int = 2048) -> ModelConfig:
    """The config of a named shape with activation `hidden_act` (optionally cut to `layers` layers) and `context`
    positions."""
    if name not in SHAPES:
        raise UserError(f"unknown shape '{name}' (known: {', '.join(SHAPES)})")
    raw = {**SHAPES[name], "max_position_embeddings": context, "torch_dtype": "float32"}
    raw[ACTIVATION_FIELDS[ARCHITECTURES[raw["architectures"][0]]]] = hidden_act
    if layers:
        raw["num_hidden_layers"] = layers
    return ModelConfig.from_dict(raw, source=f"--shape {name}")


def rope_frequencies(E: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """f_i = theta^(-2i/E) in float64, scaled as transformers' rope_init_functions do: 'linear' f / factor;
    'llama3' f / factor for wavelengths 2 pi / f above original / low, f below original / high, and between them
    (1 - s) f / factor + s f with s = (original / wavelength - low) / (high - low); 'factors' f_i / d_i (llama.cpp's
    rope_freqs, Llama-3's scaling as its converter stores it).  -> [E/2]."""
    f = theta ** (-np.arange(0, E, 2, dtype=np.float64) / E)  # [E/2]
    if not scaling:
        return f
    if scaling[0] == "linear":
        return f / scaling[1]
    if scaling[0] == "factors":
        return f / np.array(scaling[1:])
    _, factor, low, high, original = scaling  # llama3
    wavelength = 2 * np.pi / f
    s = (original / wavelength - low) / (high - low)
    mid = (1 - s) * f / factor + s * f
    return np.where(wavelength > original / low, f / factor, np.where(wavelength < original / high, f, mid))
