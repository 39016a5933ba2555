"""Thin wrapper over `tokenizers.Tokenizer`: BOS and EOS from the model's config, never from the template."""

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ref.common.config import ModelConfig
from ref.common.errors import UserError


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
    """`tokenizer.json` of a model folder; BOS and EOS ids from its `config.json` when there is one."""
    path = Path(path)
    model_dir = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file}: missing (the model folder needs tokenizer.json)")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{file}: not a valid tokenizer file ({str(e).splitlines()[0][:120]})") from None
    if not (model_dir / "config.json").is_file():
        return Tokenizer(tok, None, ())
    cfg = ModelConfig.from_hf(model_dir)
    return Tokenizer(tok, cfg.bos_token_id, cfg.eos_token_ids)
