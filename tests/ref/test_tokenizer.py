import pytest

import ref
from ref.common.errors import UserError
from tests.helpers import SHIPPED


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
