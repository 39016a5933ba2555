"""Thin wrapper over `tokenizers.Tokenizer`: BOS from the model's config, never from the template."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ref.errors import UserError


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: tuple[int, ...]):
        self.tok, self.bos_id, self.eos_ids = tok, bos_id, eos_ids

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, led by BOS when the model has one."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`tokenizer.json` of a model folder; BOS and EOS ids from its `config.json`."""
    path = Path(path)
    model_dir = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file}: missing (the model folder needs tokenizer.json)")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{file}: not a valid tokenizer file ({str(e).splitlines()[0][:120]})") from None
    bos, eos = None, ()
    config = model_dir / "config.json"
    if config.is_file():
        try:
            raw = json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{config}: not valid JSON") from None
        bos = raw.get("bos_token_id")
        e = raw.get("eos_token_id")
        eos = tuple(e) if isinstance(e, list) else (() if e is None else (e,))
    return Tokenizer(tok, bos, eos)
