"""Model configuration from a Hugging Face `config.json`.

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, L layers.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ref.common.errors import UserError

# HF architecture -> model family: one block definition and one weight-name table each (ref.model, ref.common.names).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "BambooForCausalLM": "llama"}
# Configs without `architectures`: model_type -> architecture.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}

# HF `hidden_act` (or architecture) -> FFN kind (docs/design.md, Semantics). All naming lives here.
FFN_KINDS = {
    "relu": "relu",        # ReGLU: ReluLLaMA, ProSparse without threshold, the shipped model
    "fatrelu": "fatrelu",  # ProSparse: relu with values <= threshold set to 0 (`hidden_act_param`)
    "drelu": "drelu",      # Bamboo / TurboSparse: relu(gate) * relu(up)
    "silu": "silu",        # SwiGLU: dense only
    "swish": "silu",
}
# Checkpoints whose config says `hidden_act: relu` but whose FFN is dReLU (their modeling code applies relu to up too).
DRELU_ARCHITECTURES = ("BambooForCausalLM",)


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
    rms_norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @property
    def ffn_matrices(self) -> int:
        """Rows per neuron: gate, up and down (all our kinds are gated)."""
        return 3

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
        def need(key, kind=int):
            if key not in raw:
                raise UserError(f"{source}: missing field '{key}'")
            value = raw[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise UserError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
            if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise UserError(f"{source}: field '{key}' must be a positive number, got {value!r}")
            return value

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None if archs else MODEL_TYPES.get(raw.get("model_type")))
        if arch is None:
            raise UserError(f"{source}: unsupported architectures {archs!r} (supported: {', '.join(ARCHITECTURES)})")
        act = str(raw.get("hidden_act", "silu")).lower()
        if act not in FFN_KINDS:
            raise UserError(f"{source}: unsupported hidden_act '{act}' (supported: {', '.join(FFN_KINDS)})")
        kind = "drelu" if arch in DRELU_ARCHITECTURES and FFN_KINDS[act] == "relu" else FFN_KINDS[act]
        threshold = float(raw.get("hidden_act_param", 0.0)) if kind == "fatrelu" else 0.0

        d_model, n_heads = need("hidden_size"), need("num_attention_heads")
        n_kv = raw.get("num_key_value_heads") or n_heads
        head_dim = raw.get("head_dim") or d_model // n_heads
        if n_heads % n_kv:
            raise UserError(f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        if raw.get("rope_scaling"):
            raise UserError(f"{source}: rope_scaling {raw['rope_scaling']!r} is not supported")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            family=ARCHITECTURES[arch],
            vocab_size=need("vocab_size"),
            d_model=d_model,
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ffn=need("intermediate_size"),
            ffn_kind=kind,
            act_threshold=threshold,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_seq_len=need("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype", "float32")),
        )


# Real architectures' shapes for benchmarks: name -> (D, F, layers, heads, kv heads, vocab).
SHAPES = {
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000),
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama-70b": (8192, 28672, 80, 64, 8, 32000),
    "tiny": (256, 1024, 6, 8, 4, 4096),  # the shipped model's shape, for quick runs
    "micro": (16, 24, 2, 2, 1, 32),  # smoke runs under the CUDA simulator
}


def shape_config(name: str, layers: int | None = None, hidden_act: str = "relu") -> ModelConfig:
    """A ReLU LLaMA config of a named shape (optionally cut to `layers` layers)."""
    D, F, L, H, K, V = SHAPES[name]
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_act": hidden_act, "hidden_size": D, "intermediate_size": F,
        "num_hidden_layers": layers or L, "num_attention_heads": H, "num_key_value_heads": K, "vocab_size": V,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32"})
