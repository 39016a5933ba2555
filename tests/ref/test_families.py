"""OPT and Falcon in the reference: golden logits from transformers for every variant, the layouts their real
checkpoints come in, and one clear line for what is refused."""

import re

import numpy as np
import pytest
from safetensors.numpy import load_file

import ref
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.sparse import apply_oracle
from tests.helpers import DENSE_VARIANTS, FAMILIES, VARIANTS, assert_close, turbosparse, variant_copy


def golden(variant):
    g = load_file(FAMILIES / variant / "golden.safetensors")
    return [(g[f"prompts.{j}.ids"], g[f"prompts.{j}.logits"]) for j in range(len(g) // 2)]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return request.param, ref.load_model(FAMILIES / request.param)


def check_golden(model, variant, rtol=1e-5):
    for j, (ids, want) in enumerate(golden(variant)):
        got = model.logits(ids)
        for t in range(len(ids)):
            assert_close(got[t], want[t], rtol=rtol, name=f"{variant} prompt {j} position {t}")


@pytest.mark.parametrize("name", VARIANTS + DENSE_VARIANTS)
def test_golden_logits(name):
    """ref matches transformers' float64 logits to 1e-5 relative per position, every family and variant."""
    check_golden(ref.load_model(FAMILIES / name), name)


@pytest.mark.parametrize("name", DENSE_VARIANTS)
def test_llama_cpp_converted_file_gives_the_golden_logits(name):
    """The folder as llama.cpp's own convert_hf_to_gguf.py wrote it (llama with Q/K rows permuted and Llama-3's
    scaling as rope_freqs, qwen2 with q/k/v biases, qwen3 with q/k norms, rows as they are) gives transformers'
    logits."""
    check_golden(ref.load_model(FAMILIES / name / "llama.cpp.gguf"), name)


@pytest.mark.parametrize("name, arch, scaling", [("llama3-rope", "LlamaForCausalLM", "factors"),
                                                 ("llama-linear-rope", "LlamaForCausalLM", "linear"),
                                                 ("qwen2", "Qwen2ForCausalLM", None), ("qwen3", "Qwen3ForCausalLM", None)])
def test_llama_cpp_converted_config(name, arch, scaling):
    from ref.common.gguf_io import read_gguf
    got, want = read_gguf(FAMILIES / name / "llama.cpp.gguf").config, ModelConfig.from_hf(FAMILIES / name)
    assert got.architecture == arch and (got.rope_scaling or (None,))[0] == scaling
    assert (got.qkv_bias, got.qk_norm, got.head_dim, got.tie_word_embeddings) == (
        want.qkv_bias, want.qk_norm, want.head_dim, want.tie_word_embeddings)


@pytest.mark.parametrize("name, scaling, qkv_bias, qk_norm, tied, positions", [
    ("llama3-rope", ("llama3", 8.0, 1.0, 4.0, 32), False, False, True, 64),
    ("llama-linear-rope", ("linear", 4.0), False, False, False, 64),
    ("mistral-window", (), False, False, False, 32),  # sliding_window 32 of 64 positions: the engine stops at 32
    ("qwen2", (), True, False, True, 64), ("qwen3", (), False, True, False, 64)])
def test_llama_family_configs(name, scaling, qkv_bias, qk_norm, tied, positions):
    c = ModelConfig.from_hf(FAMILIES / name)
    assert (c.family, c.rope_scaling, c.qkv_bias, c.qk_norm, c.tie_word_embeddings, c.max_seq_len) == (
        "llama", scaling, qkv_bias, qk_norm, tied, positions)
    assert c.head_dim == (16 if name == "qwen3" else 8) and c.ffn_kind == "silu"


def test_oracle_sparse_equals_dense(variant):
    """Over the neurons that fire (biases included) the sparse FFN is the dense one."""
    name, model = variant
    ids = golden(name)[0][0]
    dense = model.logits(ids)
    sparse = apply_oracle(ref.load_model(FAMILIES / name)).logits(ids)
    assert_close(sparse, dense, rtol=1e-5)


@pytest.mark.parametrize("variant, block, kv_heads", [
    ("opt-pre-ln", "pre_norm", 4), ("opt-post-ln", "post_norm", 4), ("falcon-gqa", "parallel", 2),
    ("falcon-multi-query", "parallel_shared", 1), ("falcon-interleaved", "pre_norm", 4)])
def test_variant_configs(variant, block, kv_heads):
    c = ModelConfig.from_hf(FAMILIES / variant)
    assert (c.block, c.n_kv_heads, c.gated, c.norm, c.ffn_kind) == (block, kv_heads, False, "layer", "relu")
    assert c.embed_dim == (16 if variant == "opt-post-ln" else 0) and c.final_norm == (variant != "opt-post-ln")


def test_opt_files_without_model_prefix_and_with_a_tied_head(tmp_path):
    """facebook/opt-* name their tensors decoder.*; older exports also save the tied head."""
    emb = load_file(FAMILIES / "opt-pre-ln" / "model.safetensors")["model.decoder.embed_tokens.weight"]
    folder = variant_copy(tmp_path, "opt-pre-ln", rename=lambda n: n.removeprefix("model."),
                          add={"lm_head.weight": emb})
    check_golden(ref.load_model(folder), "opt-pre-ln")


def test_falcon_rw_config_names(tmp_path):
    """RWForCausalLM configs (n_head, n_head_kv, n_layer) read as transformers converts them: n_head_kv means the
    new decoder architecture."""
    folder = variant_copy(tmp_path, "falcon-gqa", config={
        "architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "n_head": 4, "n_head_kv": 2, "n_layer": 2,
        "num_attention_heads": None, "num_kv_heads": None, "num_hidden_layers": None,
        "new_decoder_architecture": None, "num_ln_in_parallel_attn": None})
    check_golden(ref.load_model(folder), "falcon-gqa")


@pytest.mark.parametrize("variant, change, message", [
    ("falcon-gqa", {"alibi": True}, "alibi (Falcon-RW's positions) is not supported"),
    ("opt-pre-ln", {"activation_function": "gelu_new"}, "unsupported activation_function 'gelu_new'"),
    ("opt-pre-ln", {"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures ['GPT2LMHeadModel']"),
    ("falcon-gqa", {"num_kv_heads": 4}, "query_key_value.weight has shape (64, 32), config.json implies (96, 32)"),
    ("falcon-multi-query", {"multi_query": False}, "query_key_value.weight has shape (48, 32), config.json implies"),
    ("opt-post-ln", {"word_embed_proj_dim": None}, "unexpected tensor(s), first model.decoder.project_in.weight"),
    ("falcon-gqa", {"num_kv_heads": 3}, "4 attention heads are not a multiple of the 3 key-value heads"),
    ("llama3-rope", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not"),
    ("llama-linear-rope", {"rope_parameters": {"rope_type": "longrope"}}, "rope_scaling type 'longrope' is not"),
    ("qwen2", {"architectures": ["Qwen2MoeForCausalLM"]}, "unsupported architectures ['Qwen2MoeForCausalLM']"),
    ("llama3-rope", {"architectures": ["MixtralForCausalLM"]}, "unsupported architectures ['MixtralForCausalLM']"),
    ("qwen2", {"architectures": ["LlamaForCausalLM"]}, "unexpected tensor(s), first model.layers.0.self_attn.k_proj.bias"),
    ("qwen3", {"architectures": ["LlamaForCausalLM"]}, "unexpected tensor(s), first model.layers.0.self_attn.k_norm"),
    ("qwen3", {"attention_bias": True}, "attention_bias true is not supported"),
])
def test_refused_with_one_line(tmp_path, variant, change, message):
    folder = variant_copy(tmp_path, variant, config=change)
    with pytest.raises(UserError, match=re.escape(message)) as e:
        ref.load_model(folder)
    assert "\n" not in str(e.value)


def test_unknown_tensor_is_named(tmp_path):
    folder = variant_copy(tmp_path, "falcon-gqa", add={"transformer.h.0.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(UserError, match="unexpected tensor.*transformer.h.0.extra.weight"):
        ref.load_model(folder)


def test_carried_predictors_are_understood(tmp_path):
    from ref.common.checkpoint import load_checkpoint
    w = load_checkpoint(turbosparse(tmp_path))
    assert w.config.ffn_kind == "drelu" and w.predictors is not None and w.predictors.threshold == 0.0
    assert [a.shape for a in w.predictors.fc1] == [(6, 32)] * 2 and [b.shape for b in w.predictors.fc2] == [(100, 6)] * 2
    sparse = ref.apply_predictors(ref.load_model(tmp_path), w.predictors)
    assert sparse.logits([1, 5, 9]).shape == (3, 50)


def test_carried_predictors_must_cover_every_layer(tmp_path):
    with pytest.raises(UserError, match="carries predictors but not layer 1's fc1"):
        ref.load_model(turbosparse(tmp_path, drop_layer=1))


def test_every_stop_id_the_folder_names(tmp_path):
    """config.json's eos id, generation_config.json's list, and tokenizer_config.json's eos token."""
    import shutil

    from ref.common.tokenizer import load_tokenizer
    from tests.helpers import SHIPPED
    turbosparse(tmp_path)
    shutil.copy(SHIPPED / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "' + tok.tok.id_to_token(3) + '"}')
    assert load_tokenizer(tmp_path).eos_ids == (2, 7, 3)


@pytest.mark.parametrize("variant, config, bos", [
    ("opt-pre-ln", None, True), ("falcon-gqa", None, False), ("falcon-gqa", {"add_bos_token": True}, True),
    ("opt-pre-ln", {"add_bos_token": False}, False), ("llama3-rope", None, True), ("qwen2", None, False),
    ("qwen3", None, False)])
def test_bos_as_the_family_tokenizer_adds_it(tmp_path, variant, config, bos):
    """A prompt starts with BOS as transformers' tokenizer of the family does, unless tokenizer_config.json says."""
    import json
    import shutil

    from ref.common.tokenizer import load_tokenizer
    shutil.copytree(FAMILIES / variant, tmp_path / variant)
    if config is not None:
        (tmp_path / variant / "tokenizer_config.json").write_text(json.dumps(config))
    assert (load_tokenizer(tmp_path / variant).encode("once")[0] == 1) == bos


@pytest.mark.parametrize("extra, positions", [
    ({}, 4096), ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 4096),  # NTK changes nothing up to 4096
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}}, 1024),
    ({"sliding_window": 512}, 512), ({"sliding_window": 512, "use_sliding_window": False}, 4096)])
def test_the_context_a_config_allows(extra, positions):
    """A sequence holds max_position_embeddings positions, or fewer: the sliding window where one is used, dynamic
    NTK's original context (past which it would change the frequencies)."""
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 50, "max_position_embeddings": 4096}
    assert ModelConfig.from_dict({**raw, **extra}).max_seq_len == positions
