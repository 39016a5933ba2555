"""Weight names and shapes, one table per model family: our names -> Hugging Face's. The only place that knows HF's
tensor names. A bias is its matrix's or norm's name + ".bias" (HF: ".weight" -> ".bias").

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, P positions, R predictor
hidden size.
"""

import re

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
        "layers.{l}.q_norm": "model.layers.{l}.self_attn.q_norm.weight",
        "layers.{l}.k_norm": "model.layers.{l}.self_attn.k_norm.weight",
        "layers.{l}.ffn_norm": "model.layers.{l}.post_attention_layernorm.weight",
        "layers.{l}.wg": "model.layers.{l}.mlp.gate_proj.weight",
        "layers.{l}.wu": "model.layers.{l}.mlp.up_proj.weight",
        "layers.{l}.wd": "model.layers.{l}.mlp.down_proj.weight",
    },
    "opt": {
        "embed": "model.decoder.embed_tokens.weight",
        "pos_embed": "model.decoder.embed_positions.weight",
        "project_in": "model.decoder.project_in.weight",
        "project_out": "model.decoder.project_out.weight",
        "norm": "model.decoder.final_layer_norm.weight",
        "lm_head": "lm_head.weight",
        "layers.{l}.attn_norm": "model.decoder.layers.{l}.self_attn_layer_norm.weight",
        "layers.{l}.wq": "model.decoder.layers.{l}.self_attn.q_proj.weight",
        "layers.{l}.wk": "model.decoder.layers.{l}.self_attn.k_proj.weight",
        "layers.{l}.wv": "model.decoder.layers.{l}.self_attn.v_proj.weight",
        "layers.{l}.wo": "model.decoder.layers.{l}.self_attn.out_proj.weight",
        "layers.{l}.ffn_norm": "model.decoder.layers.{l}.final_layer_norm.weight",
        "layers.{l}.wu": "model.decoder.layers.{l}.fc1.weight",
        "layers.{l}.wd": "model.decoder.layers.{l}.fc2.weight",
    },
    "falcon": {
        "embed": "transformer.word_embeddings.weight",
        "norm": "transformer.ln_f.weight",
        "lm_head": "lm_head.weight",
        "layers.{l}.attn_norm": "transformer.h.{l}.input_layernorm.weight",
        "layers.{l}.wqkv": "transformer.h.{l}.self_attention.query_key_value.weight",
        "layers.{l}.wo": "transformer.h.{l}.self_attention.dense.weight",
        "layers.{l}.ffn_norm": "transformer.h.{l}.post_attention_layernorm.weight",
        "layers.{l}.wu": "transformer.h.{l}.mlp.dense_h_to_4h.weight",
        "layers.{l}.wd": "transformer.h.{l}.mlp.dense_4h_to_h.weight",
    },
}
# (family, block) -> the names that differ in that block: Falcon's new decoder architecture norms attention's and
# the FFN's input apart.
BLOCK_NAMES = {
    ("falcon", "parallel"): {"layers.{l}.attn_norm": "transformer.h.{l}.ln_attn.weight",
                             "layers.{l}.ffn_norm": "transformer.h.{l}.ln_mlp.weight"},
}
# Family -> (prefix some of its checkpoints use -> the table's): facebook/opt-* files name their tensors decoder.*,
# re-saves by transformers model.decoder.*.
PREFIXES = {"opt": {"decoder.": "model.decoder."}}
# Predictors a checkpoint carries (TurboSparse): HF name pattern -> which of ours (layer, fc1 or fc2).
CARRIED_PREDICTORS = re.compile(r"model\.layers\.(\d+)\.mlp\.predictor\.(fc1|fc2)\.weight")
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
        "layers.{l}.q_norm": "blk.{l}.attn_q_norm.weight",
        "layers.{l}.k_norm": "blk.{l}.attn_k_norm.weight",
        "layers.{l}.ffn_norm": "blk.{l}.ffn_norm.weight",
        "layers.{l}.wg": "blk.{l}.ffn_gate.weight",
        "layers.{l}.wu": "blk.{l}.ffn_up.weight",
        "layers.{l}.wd": "blk.{l}.ffn_down.weight",
    },
}
# GGUF `general.architecture` -> HF architecture (ref.common.config.ARCHITECTURES says its family). llama.cpp's
# converter writes Mistral and Llama-3 as llama, Qwen2 and Qwen3 as their own.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "bamboo": "BambooForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# Buffers some exports carry that hold nothing the model needs (RoPE frequencies are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names and their shapes (HF stores Linear weights as [out, in]), from the config alone."""
    D, F, E, V, H, K = cfg.d_model, cfg.d_ffn, cfg.head_dim, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads
    W = cfg.embed_dim or D  # the token embedding's width

    def norm(name):
        return {name: (D,), **({name + ".bias": (D,)} if cfg.norm == "layer" else {})}

    def linear(name, rows, cols):
        return {name: (rows, cols), **({name + ".bias": (rows,)} if cfg.bias else {})}

    attn = linear("wqkv", (H + 2 * K) * E, D) if cfg.fused_qkv else {
        **linear("wq", H * E, D), **linear("wk", K * E, D), **linear("wv", K * E, D)}
    if cfg.qkv_bias:
        attn.update({"wq.bias": (H * E,), "wk.bias": (K * E,), "wv.bias": (K * E,)})
    if cfg.qk_norm:
        attn.update({"q_norm": (E,), "k_norm": (E,)})
    ffn = {**({"wg": (F, D)} if cfg.gated else {}), **linear("wu", F, D), **linear("wd", D, F)}
    per_layer = {**norm("attn_norm"), **attn, **linear("wo", D, H * E),
                 **({} if cfg.block == "parallel_shared" else norm("ffn_norm")), **ffn}
    shapes = {"embed": (V, W), **(norm("norm") if cfg.final_norm else {})}
    if cfg.positions == "learned":
        shapes["pos_embed"] = (cfg.max_seq_len + 2, D)
    if cfg.embed_dim:
        shapes.update(project_in=(D, W), project_out=(W, D))
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, W)
    for l in range(cfg.n_layers):
        shapes.update({f"layers.{l}.{k}": s for k, s in per_layer.items()})
    return shapes


def lookup(table: dict[str, str], name: str) -> str:
    """Our name -> a name table's, `{l}` filled in; a bias by its matrix's or norm's name."""
    if name.endswith(".bias"):
        return lookup(table, name[: -len(".bias")]).removesuffix(".weight") + ".bias"
    if name.startswith("layers."):
        _, l, rest = name.split(".", 2)
        return table["layers.{l}." + rest].format(l=l)
    return table[name]


def hf_name(cfg: ModelConfig, name: str) -> str:
    return lookup({**HF_NAMES[cfg.family], **BLOCK_NAMES.get((cfg.family, cfg.block), {})}, name)


def gguf_architecture(cfg: ModelConfig) -> str:
    """The `general.architecture` a file of this model is written as: llama.cpp's converter's choice."""
    return {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}.get(cfg.architecture, "llama")


def gguf_name(cfg: ModelConfig, name: str) -> str:
    return lookup(GGUF_NAMES[cfg.family], name)
