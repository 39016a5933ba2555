from pathlib import Path

import pytest

import ref
from ref.common.errors import UserError
from tests.helpers import SHIPPED, write_gguf


def test_bos_and_round_trip(shipped_tokenizer):
    text = "once upon a time, there was a little cat named tom."
    ids = shipped_tokenizer.encode(text)
    assert ids[0] == 1 and 1 not in ids[1:]
    assert shipped_tokenizer.decode(ids) == text
    assert shipped_tokenizer.vocab_size == 4096


def test_missing_tokenizer(tmp_path):
    with pytest.raises(UserError, match="tokenizer.json: missing"):
        ref.load_tokenizer(tmp_path)


def test_corrupt_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text((SHIPPED / "tokenizer.json").read_text()[:500])
    with pytest.raises(UserError, match="tokenizer.json: not a valid tokenizer file"):
        ref.load_tokenizer(tmp_path)


def test_shipped_tokenizer_lowercases(shipped_tokenizer):
    """The model saw lowercase text only; its tokenizer.json lowercases the input (a normalizer every loader applies)."""
    assert shipped_tokenizer.encode("Once Upon A TIME") == shipped_tokenizer.encode("once upon a time")


VOCABS = Path(__file__).parent.parent / "vocab"


@pytest.mark.parametrize("name, bos", [("llama-bpe", 128000), ("qwen2", None)])
def test_llama_cpp_vocabularies_tokenize_as_transformers(name, bos):
    """llama.cpp's vocabulary files of Llama-3 ('gpt2' model, pre 'llama-bpe') and Qwen2 (pre 'qwen2') from their
    metadata alone: each of llama.cpp's test texts gives the ids transformers gave (the .out file); BOS as llama.cpp
    adds it (Llama-3's, none for Qwen)."""
    tok = ref.load_tokenizer(VOCABS / f"ggml-vocab-{name}.gguf")
    texts = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    want = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == 47 and tok.bos_id == bos
    for text, ids in zip(texts, want):
        got = tok.encode(text)
        assert got == ([bos] if bos is not None else []) + [int(i) for i in ids.split()], repr(text)
        assert tok.decode(got) == text, repr(text)


def tiny_bpe(path, **kv):
    tokens = ["a", "b", "ab", "<s>", "</s>", "<|eot|>"]
    return write_gguf(path, tokenizer_model="gpt2", token_list=tokens, token_types=[1, 1, 1, 3, 3, 3],
                      token_merges=["a b"], bos_token_id=3, eos_token_id=4, **kv)


def test_unknown_pre_tokenizer_is_one_line(tmp_path):
    with pytest.raises(UserError, match="tokenizer.ggml.pre 'mystery' is not supported"):
        ref.load_tokenizer(tiny_bpe(tmp_path / "t.gguf", tokenizer_pre="mystery"))


@pytest.mark.parametrize("kv, bos", [({}, None), ({"tokenizer_pre": "llama-bpe"}, 3),
                                     ({"tokenizer_pre": "llama-bpe", "add_bos_token": False}, None),
                                     ({"add_bos_token": True}, 3)])
def test_bos_as_llama_cpp_adds_it(tmp_path, kv, bos):
    assert ref.load_tokenizer(tiny_bpe(tmp_path / "t.gguf", **kv)).bos_id == bos


def test_every_end_of_generation_id_stops(tmp_path):
    """Llama-3's files name <|eot_id|> (tokenizer.ggml.eot_token_id) beside EOS: a chat turn ends at either."""
    tok = ref.load_tokenizer(tiny_bpe(tmp_path / "t.gguf", eot_token_id=5))
    assert tok.eos_ids == (4, 5) and tok.encode("ab<|eot|>") == [2, 5]


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2"])
def test_llama_cpp_converted_file_tokenizes_as_its_folder(name):
    """llama.cpp's converter keeps the shipped tokenizer's lowercasing as tokenizer.ggml.normalizer.lowercase. (BOS
    aside: it adds the BOS that this tokenizer.json's template adds, where a Qwen folder's tokenizer adds none.)"""
    from tests.helpers import FAMILIES
    text = "Once upon a TIME, Lily saw a big dog. She said: \"Hello!\" 3333"
    got, want = ref.load_tokenizer(FAMILIES / name / "llama.cpp.gguf"), ref.load_tokenizer(FAMILIES / name)
    assert got.encode(text)[got.bos_id is not None:] == want.encode(text)[want.bos_id is not None:]


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_a_tokenizer_json_is_named_as_llama_cpp_names_it(name):
    """The writer's side of PRE_TOKENIZERS: the tokenizer.json of Llama-3's or Qwen2's tokenizer gets the
    tokenizer.ggml.pre that llama.cpp's converter gives it; another split is 'default'."""
    import json
    from ref.common.tokenizer import pre_tokenizer_name
    tj = json.loads(ref.load_tokenizer(VOCABS / f"ggml-vocab-{name}.gguf").tok.to_str())
    assert pre_tokenizer_name(tj) == name
    assert pre_tokenizer_name(json.loads((SHIPPED / "tokenizer.json").read_text())) == "default"
