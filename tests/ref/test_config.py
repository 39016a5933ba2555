import json

import pytest

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from tests.helpers import SHIPPED, SMALL_CONFIG


def test_shipped_config():
    c = ModelConfig.from_hf(SHIPPED)
    assert (c.d_model, c.d_ffn, c.n_heads, c.n_kv_heads, c.head_dim) == (256, 1024, 8, 4, 32)
    assert c.ffn_kind == "relu" and c.family == "llama" and not c.tie_word_embeddings
    assert 6 <= c.n_layers <= 8 and c.max_seq_len == 512 and c.vocab_size == 4096


@pytest.mark.parametrize("act, arch, kind, threshold", [
    ("relu", "LlamaForCausalLM", "relu", 0.0),
    ("fatrelu", "LlamaForCausalLM", "fatrelu", 0.01),
    ("relu", "BambooForCausalLM", "drelu", 0.0),
    ("fatrelu", "SparseLlamaForCausalLM", "fatrelu", 0.01),
    ("drelu", "MistralForCausalLM", "drelu", 0.0),
    ("silu", "LlamaForCausalLM", "silu", 0.0),
])
def test_ffn_kind_mapping(act, arch, kind, threshold):
    c = ModelConfig.from_dict({**SMALL_CONFIG, "hidden_act": act, "architectures": [arch], "hidden_act_param": 0.01})
    assert (c.ffn_kind, c.act_threshold) == (kind, threshold)


def test_defaults_mha_and_head_dim():
    raw = {k: v for k, v in SMALL_CONFIG.items() if k != "num_key_value_heads"}
    c = ModelConfig.from_dict(raw)
    assert c.n_kv_heads == c.n_heads == 4 and c.head_dim == 8


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu_new"}, "unsupported hidden_act 'gelu_new' (supported: relu"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures"),
    ({"hidden_size": 0}, "'hidden_size' must be a positive integer"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling: field 'factor' must be a finite positive number"),
])
def test_bad_config_values(change, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict({**SMALL_CONFIG, **change}, source="x/config.json")


def test_missing_field_named():
    raw = {k: v for k, v in SMALL_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(UserError, match="missing field 'intermediate_size'"):
        ModelConfig.from_dict(raw)


def test_missing_and_invalid_config_file(tmp_path):
    with pytest.raises(UserError, match="no such model folder"):
        ModelConfig.from_hf(tmp_path / "nope")
    with pytest.raises(UserError, match="config.json: missing"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json: not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(UserError, match="expected a JSON object"):
        ModelConfig.from_hf(tmp_path)
