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


def hf_name(cfg: ModelConfig, name: str) -> str:
    names = HF_NAMES[cfg.family]
    if name.startswith("layers."):
        _, l, rest = name.split(".", 2)
        return names["layers.{l}." + rest].format(l=l)
    return names[name]
