"""Weight names and shapes, one table per model family: our names -> Hugging Face's. The only place that knows HF's
tensor names.

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab.
"""

from ref.common.config import ModelConfig

# Family -> (our name -> HF name); `{l}` is the layer index.
HF_NAMES = {
    "llama": {
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
    },
}
# Family -> (our name -> GGUF name), llama.cpp's names (gguf-py's TENSOR_NAMES). PowerInfer's files store the down
# matrix transposed as blk.{l}.ffn_down_t.weight and add the predictors blk.{l}.fc1 / fc2 (ref.common.gguf_io).
GGUF_NAMES = {
    "llama": {
        "embed": "token_embd.weight",
        "norm": "output_norm.weight",
        "lm_head": "output.weight",
        "layers.{l}.attn_norm": "blk.{l}.attn_norm.weight",
        "layers.{l}.wq": "blk.{l}.attn_q.weight",
        "layers.{l}.wk": "blk.{l}.attn_k.weight",
        "layers.{l}.wv": "blk.{l}.attn_v.weight",
        "layers.{l}.wo": "blk.{l}.attn_output.weight",
        "layers.{l}.ffn_norm": "blk.{l}.ffn_norm.weight",
        "layers.{l}.wg": "blk.{l}.ffn_gate.weight",
        "layers.{l}.wu": "blk.{l}.ffn_up.weight",
        "layers.{l}.wd": "blk.{l}.ffn_down.weight",
    },
}
# GGUF `general.architecture` -> HF architecture (ref.common.config.ARCHITECTURES says its family).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "bamboo": "BambooForCausalLM"}
# Buffers some exports carry that hold nothing the model needs (RoPE frequencies are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


SHAPES = {"llama": llama_shapes}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return SHAPES[cfg.family](cfg)


def lookup(table: dict[str, str], name: str) -> str:
    """Our name -> a name table's, `{l}` filled in."""
    if name.startswith("layers."):
        _, l, rest = name.split(".", 2)
        return table["layers.{l}." + rest].format(l=l)
    return table[name]


def hf_name(cfg: ModelConfig, name: str) -> str:
    return lookup(HF_NAMES[cfg.family], name)


def gguf_name(cfg: ModelConfig, name: str) -> str:
    return lookup(GGUF_NAMES[cfg.family], name)
