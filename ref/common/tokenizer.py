"""Thin wrapper over `tokenizers.Tokenizer`: BOS from the model's config where its tokenizer adds one, the EOS ids
every config file of the folder names (`stop_ids`), never from the template."""

import json
from pathlib import Path
from typing import NamedTuple

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.gguf_io import EOS_IDS_KEY, gguf_metadata, is_gguf


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: tuple[int, ...]):
        self.tok, self.bos_id, self.eos_ids = tok, bos_id, eos_ids

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`, led by BOS when the model has one and `bos` asks (a chat template writes its own).
        (encode_batch lets other Python threads run while it works, as encode does not: a server's event loop goes
        on answering during a long prompt.)"""
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ([self.bos_id] if self.bos_id is not None and bos else []) + ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`tokenizer.json` of a model folder, BOS and EOS ids from its `config.json` when there is one; or a GGUF
    file's tokenizer (`gguf_tokenizer`)."""
    path = Path(path)
    if is_gguf(path):
        return gguf_tokenizer(path)
    model_dir = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file}: missing (the model folder needs tokenizer.json)")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{file}: not a valid tokenizer file ({str(e).splitlines()[0][:120]})") from None
    tok_cfg = read_json(model_dir / "tokenizer_config.json")
    if not (model_dir / "config.json").is_file():
        return Tokenizer(tok, None, stop_ids(model_dir, tok, tok_cfg, ()))
    cfg = ModelConfig.from_hf(model_dir)
    adds = tok_cfg.get("add_bos_token", ADDS_BOS[cfg.family] and cfg.architecture not in NO_BOS)
    bos = cfg.bos_token_id if adds is True else None
    return Tokenizer(tok, bos, stop_ids(model_dir, tok, tok_cfg, cfg.eos_token_ids))


# Family -> whether a prompt starts with BOS where tokenizer_config.json does not say (add_bos_token): as each
# family's transformers tokenizer does, LLaMA's adding it, OPT's configured to (its BOS is </s>), Falcon's not
# (its config names a BOS that its tokenizer never adds).
ADDS_BOS = {"llama": True, "opt": True, "falcon": False}
NO_BOS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # LLaMA-family architectures whose tokenizers add none


def read_json(file: Path) -> dict:
    """A JSON object from an optional file of a model folder; {} where it is absent or unreadable (these files only
    refine what config.json says)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def stop_ids(model_dir: Path, tok: HFTokenizer, tok_cfg: dict, eos: tuple[int, ...]) -> tuple[int, ...]:
    """Every end-of-sequence id the folder names, config.json's first: generation_config.json's eos_token_id (an id
    or a list) and tokenizer_config.json's (`tok_cfg`) eos_token (TurboSparse's `<|im_end|>`, where config.json says
    `</s>`)."""
    ids = list(eos)
    more = read_json(model_dir / "generation_config.json").get("eos_token_id")
    ids += [i for i in (more if isinstance(more, list) else [more]) if isinstance(i, int)]
    token = tok_cfg.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and tok.token_to_id(token) is not None:
        ids.append(tok.token_to_id(token))
    return tuple(dict.fromkeys(ids))


class Pre(NamedTuple):
    """How a byte-level BPE tokenizer splits text before merging: the Split regex of its tokenizer.json (None: GPT-2's
    ByteLevel regex), NFC first (Qwen's), whole words in the vocabulary taken as they are (`ignore_merges`,
    Llama-3's), and whether llama.cpp adds BOS where the file does not say."""
    split: str | None = None
    nfc: bool = False
    ignore_merges: bool = False
    adds_bos: bool = False


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3, QWEN2 = Pre(LLAMA3_SPLIT, False, True, True), Pre(LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), True)
# llama.cpp's `tokenizer.ggml.pre` names (src/llama-vocab.cpp). Its converter names a tokenizer by hashing its output
# on a test text (convert_hf_to_gguf.py, get_vocab_base_pre): the same Split regex and normalizer, the same name.
PRE_TOKENIZERS = {"default": Pre(), "gpt-2": Pre(), "llama-bpe": LLAMA3, "llama3": LLAMA3, "llama-v3": LLAMA3,
                  "qwen2": QWEN2, "deepseek-r1-qwen": QWEN2}


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The `tokenizer.ggml.pre` name of a byte-level BPE tokenizer.json: the PRE_TOKENIZERS entry with its Split
    regex and normalizer, 'default' for any other."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    split = next((p.get("pattern", {}).get("Regex") for p in steps if isinstance(p, dict) and p.get("type") == "Split"
                  and isinstance(p.get("pattern"), dict)), None)
    norm = tokenizer_json.get("normalizer") or {}
    nfc = [n.get("type") for n in norm.get("normalizers", [norm])] == ["NFC"]
    return next((name for name, how in PRE_TOKENIZERS.items() if (how.split, how.nfc) == (split, nfc)), "default")


def gguf_tokenizer(path: Path) -> Tokenizer:
    """A GGUF file's tokenizer: its tokenizer.huggingface.json when it has one, else one built from llama.cpp's
    tokenizer.ggml.* metadata ('gpt2': byte-level BPE from tokens and merges, split first as its
    tokenizer.ggml.pre names (PRE_TOKENIZERS); 'llama': SentencePiece BPE from tokens and scores, merges ranked by
    the merged piece's score, as transformers' GGUF converter does). BOS where tokenizer.ggml.add_bos_token says,
    else as llama.cpp decides; every end-of-generation id the file names (EOS, Llama-3's end of turn)."""
    meta = gguf_metadata(path)
    kind, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    how = PRE_TOKENIZERS.get(pre, Pre())
    adds = meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or how.adds_bos)
    bos = meta.get("tokenizer.ggml.bos_token_id") if adds else None
    eos_ids = tuple(dict.fromkeys([meta.get(key) for key in EOG_KEYS if meta.get(key) is not None]
                                  + meta.get(EOS_IDS_KEY, [])))
    hf_json = meta.get("tokenizer.huggingface.json")
    if hf_json is not None:
        try:
            return Tokenizer(HFTokenizer.from_str(hf_json), bos, eos_ids)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise UserError(f"{path}: tokenizer.huggingface.json is not a tokenizer ({str(e).splitlines()[0][:120]})"
                            ) from None
    if tokens is None:
        raise UserError(f"{path}: no tokenizer (neither tokenizer.huggingface.json nor tokenizer.ggml.tokens)")
    for key in ("tokenizer.ggml.bos_token_id", *EOG_KEYS, "tokenizer.ggml.unknown_token_id"):
        if not 0 <= meta.get(key, 0) < len(tokens):
            raise UserError(f"{path}: metadata key '{key}' is {meta.get(key)}, not a token id (of {len(tokens)})")
    if not all(0 <= i < len(tokens) for i in eos_ids):
        raise UserError(f"{path}: metadata key '{EOS_IDS_KEY}' holds an id past the {len(tokens)} tokens")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if len(meta.get(key) or tokens) != len(tokens):
            raise UserError(f"{path}: metadata key '{key}' has {len(meta.get(key))} entries for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        if pre not in PRE_TOKENIZERS:
            raise UserError(f"{path}: tokenizer.ggml.pre '{pre}' is not supported (supported: "
                            f"{', '.join(PRE_TOKENIZERS)}); its text would split differently")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        if any(len(m) != 2 or m[0] not in vocab or m[1] not in vocab for m in merges):
            raise UserError(f"{path}: metadata key 'tokenizer.ggml.merges' has an entry that is not two tokens")
        tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=how.ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if how.split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(how.split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        steps = [normalizers.NFC()] * how.nfc + [normalizers.Lowercase()] * meta.get(LOWERCASE_KEY, False)
        if steps:
            tok.normalizer = steps[0] if len(steps) == 1 else normalizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = []
        for piece, i in vocab.items():  # every split of a piece into two pieces is a merge, ranked by its score
            merges += [(piece[:k], piece[k:], scores[i]) for k in range(1, len(piece))
                       if piece[:k] in vocab and piece[k:] in vocab]
        merges.sort(key=lambda m: -m[2])
        unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
        tok = HFTokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token=tokens[unk], fuse_unk=True,
                                     byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        raise UserError(f"{path}: tokenizer.ggml.model '{kind}' is not supported (supported: gpt2, llama)")
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([tokens[i] for i, t in enumerate(types) if t == 3])  # CONTROL
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == 4])  # USER_DEFINED
    return Tokenizer(tok, bos, eos_ids)


LOWERCASE_KEY = "tokenizer.ggml.normalizer.lowercase"  # llama.cpp's converter's note of a lowercasing normalizer
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def tokenizer_kv(tokenizer_json: str, bos: int | None, eos_ids: tuple[int, ...], vocab_size: int) -> list:
    """llama.cpp's tokenizer metadata for a byte-level BPE tokenizer.json ('gpt2', its pre-tokenizer named as
    llama.cpp names it), plus the file itself as tokenizer.huggingface.json (llama.cpp's metadata has no place for
    every normalizer, e.g. lowercasing) and every EOS id (llama.cpp's keys hold one)."""
    tj = json.loads(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise UserError(f"tokenizer.json: a {model.get('type')} model; GGUF export writes byte-level BPE tokenizers only")
    vocab = dict(model["vocab"])
    special = set()
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    for s, i in vocab.items():
        tokens[i] = s
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    types = [3 if i in special else 1 for i in range(n)]  # CONTROL, NORMAL
    kv = [("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", pre_tokenizer_name(tj)), ("add_token_list", tokens),
          ("add_token_types", types), ("add_token_merges", merges), ("add_add_bos_token", bos is not None),
          ("add_string", "tokenizer.huggingface.json", tokenizer_json)]
    if bos is not None:
        kv.append(("add_bos_token_id", bos))
    if eos_ids:
        kv += [("add_eos_token_id", eos_ids[0]), ("add_array", EOS_IDS_KEY, list(eos_ids))]
    return kv
