"""The checkpoint readers (safetensors folders and GGUF files) against damaged and crafted files: random truncation, bit
flips and header fields of the wrong type or size. Each case either loads (a flip inside tensor data is still a
checkpoint) or is refused with one UserError line naming the file; none raises anything else, and none grows the
process by a gigabyte. Seeded: the same cases every run, a few hundred, in seconds."""

import json
import resource
import struct

import numpy as np
import pytest

from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.common.gguf_io import EOS_IDS_KEY, model_kv, write_gguf
from ref.common.safetensors import upcast
from ref.common.weights import Weights
from tests.helpers import write_model

pytest.importorskip("gguf")
CASES = 150  # per reader and kind of damage


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def outcome(path, what: str) -> str:
    """'loaded' or 'refused'; fails the test on any other exception or a message that is not one line naming path."""
    try:
        w = load_checkpoint(path)
        for t in w.tensors.values():  # every tensor readable as values
            upcast(t.T if hasattr(t, "T") and not isinstance(t, np.ndarray) else t)
        return "loaded"
    except UserError as e:
        message = str(e)
        assert "\n" not in message and str(path.name) in message and len(message) < 600, (what, message)
        return "refused"
    except Exception as e:  # noqa: BLE001: the point of the test
        pytest.fail(f"{what}: {type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("fuzz") / "hf", {"intermediate_size": 128})  # whole q8_0 blocks


@pytest.fixture(scope="module")
def gguf_file(folder):
    from fast.convert import plan
    cfg = ModelConfig.from_hf(folder)
    out = folder.parent / "m.gguf"
    write_gguf(out, "gguf", "llama", model_kv(cfg, FORMATS["q8_0"], "fuzz"),
               plan(Weights.load(folder, cfg), FORMATS["q8_0"], None))
    return out


def damaged(data: bytes, rng, kind: str, header: int) -> bytes:
    """data truncated at a random length, or with 1 to 8 random bytes flipped (mostly in the first `header`
    bytes, where a flip changes what the reader believes)."""
    if kind == "truncate":
        return data[:rng.integers(0, len(data))]
    b = bytearray(data)
    for _ in range(rng.integers(1, 9)):
        i = rng.integers(0, header) if rng.random() < 0.8 else rng.integers(0, len(b))
        b[i] ^= 1 << rng.integers(0, 8)
    return bytes(b)


@pytest.mark.parametrize("kind", ["truncate", "flip"])
def test_damaged_safetensors(folder, tmp_path, kind):
    data = (folder / "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    rng, start, seen = np.random.default_rng(1 if kind == "truncate" else 2), peak_rss(), set()
    for i in range(CASES):
        (tmp_path / "model.safetensors").write_bytes(damaged(data, rng, kind, header))
        seen.add(outcome(tmp_path, f"{kind} case {i}"))
    assert "refused" in seen and peak_rss() - start < 1 << 30


@pytest.mark.parametrize("kind", ["truncate", "flip"])
def test_damaged_gguf(gguf_file, tmp_path, kind):
    import gguf
    data = gguf_file.read_bytes()
    header = gguf.GGUFReader(gguf_file).data_offset
    rng, start, seen = np.random.default_rng(3 if kind == "truncate" else 4), peak_rss(), set()
    for i in range(CASES):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(damaged(data, rng, kind, header))
        seen.add(outcome(path, f"{kind} case {i}"))
        path.unlink()
    assert "refused" in seen and peak_rss() - start < 1 << 30


def entry_cases():
    """Header entries and config fields of the wrong type, size or range (each was a traceback or worse)."""
    bad_entries = ["a string", {"dtype": "F16", "shape": [2, 2]}, {"dtype": "F16", "shape": [2, 2], "data_offsets": ["0", "8"]},
                   {"dtype": "F16", "shape": [-2, 2], "data_offsets": [0, 8]}, {"dtype": 5, "shape": [2], "data_offsets": [0, 4]},
                   {"dtype": "F16", "shape": [2**62, 2**62], "data_offsets": [0, 8]},
                   {"dtype": "F16", "shape": [2], "data_offsets": [8, 4]}, {"dtype": "F16", "shape": [2], "data_offsets": [0, 2**60]}]
    bad_config = [("num_hidden_layers", 10**9), ("num_hidden_layers", "2"), ("vocab_size", 2**40), ("rms_norm_eps", float("nan")),
                  ("rms_norm_eps", float("inf")), ("rope_theta", "fast"), ("max_position_embeddings", 10**12),
                  ("hidden_size", 0), ("num_attention_heads", 1.5), ("intermediate_size", -4), ("bos_token_id", 10**6),
                  ("eos_token_id", "x"), ("eos_token_id", [2, None, 3.5])]
    return [("entry", e) for e in bad_entries] + [("config", c) for c in bad_config]


@pytest.mark.parametrize("what, bad", entry_cases())
def test_crafted_folder_is_one_line(folder, tmp_path, what, bad):
    data = (folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    config = json.loads((folder / "config.json").read_text())
    if what == "entry":
        header["model.norm.weight"] = bad
    else:
        config[bad[0]] = bad[1]
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = peak_rss()
    assert outcome(tmp_path, f"{what} {bad}") == "refused"
    assert peak_rss() - start < 1 << 30


def test_overlapping_tensors_are_refused(folder, tmp_path):
    """Two entries over the same bytes (a crafted file aliasing one tensor as another) are refused, in safetensors
    and in GGUF."""
    data = (folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    a, b = header["model.layers.0.input_layernorm.weight"], header["model.layers.1.input_layernorm.weight"]
    b["data_offsets"] = a["data_offsets"]
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    with pytest.raises(UserError, match="overlap"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("key, value", [("block_count", 10**9), ("context_length", 2**40), ("vocab_size", 2**31),
                                        ("embedding_length", 2**30), ("feed_forward_length", 0)])
def test_crafted_gguf_counts_are_refused_before_anything_is_built(gguf_file, tmp_path, key, value):
    """Counts in the metadata that the file's bytes cannot hold: one line, no per-layer structure built first (a
    17 MB file claiming 1e9 layers grew to 22 GB before)."""
    import gguf
    reader = gguf.GGUFReader(gguf_file)
    field = reader.fields[f"llama.{key}"]
    raw = bytearray(gguf_file.read_bytes())
    at = field.data[0]
    part = field.parts[at]
    offset = int(part.ctypes.data - reader.data.ctypes.data)
    struct.pack_into("<I" if part.dtype == np.uint32 else "<Q", raw, offset, min(value, 2**32 - 1))
    path = tmp_path / "crafted.gguf"
    path.write_bytes(bytes(raw))
    start = peak_rss()
    assert outcome(path, f"{key} {value}") == "refused"
    assert peak_rss() - start < 1 << 30


def test_a_file_of_a_million_empty_strings_stays_small(tmp_path):
    """Metadata arrays cost a Python object an element (gguf's reader: about 1.5 KB of numpy views each, 3 GB for
    2 million empty strings in a 16 MB file)."""
    import gguf

    from ref.common.gguf_io import gguf_metadata
    path = tmp_path / "strings.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list([""] * 1_000_000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    start = peak_rss()
    assert len(gguf_metadata(path).get("tokenizer.ggml.tokens")) == 1_000_000
    assert peak_rss() - start < 200 << 20
    with pytest.raises(UserError, match="an array of 2000000 strings"):  # more than the bytes left can hold
        raw = bytearray(path.read_bytes())
        at = raw.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8  # type, item type, count
        struct.pack_into("<Q", raw, at, 2_000_000)
        path.write_bytes(bytes(raw))
        gguf_metadata(path)


def write_fields(path, fields: dict, tensors) -> None:
    """A GGUF file of these metadata values (types from the Python values) and f32 tensors (name, GGML shape,
    data)."""
    import gguf
    T = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, fields["general.architecture"] if isinstance(fields.get("general.architecture"), str)
                        else "llama")
    scalar = {str: T.STRING, bool: T.BOOL, float: T.FLOAT32}
    for k, v in fields.items():
        if k == "general.architecture":
            continue
        if isinstance(v, list):
            sub = scalar.get(type(v[0]), T.INT32) if v else T.INT32
            w.add_key_value(k, v, T.ARRAY, sub_type=sub)
        elif type(v) in scalar:
            w.add_key_value(k, v, scalar[type(v)])
        else:
            w.add_key_value(k, v, T.UINT32 if 0 <= v < 2**32 else T.INT64)
    for name, shape, data in tensors:
        w.add_tensor(name, np.asarray(data).reshape(shape[::-1]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def f32_gguf(folder):
    """The fuzz model as an f32 GGUF with a small SentencePiece tokenizer ('llama': tokens, scores, types)."""
    from fast.convert import plan
    from ref.common.gguf_io import Parser
    cfg = ModelConfig.from_hf(folder)
    out = folder.parent / "f32.gguf"
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(cfg.vocab_size - 3)]
    kv = model_kv(cfg, FORMATS["f32"], "fuzz") + [
        ("add_tokenizer_model", "llama"), ("add_token_list", tokens), ("add_token_scores", [0.0] * len(tokens)),
        ("add_token_types", [2, 3, 3] + [1] * (len(tokens) - 3)), ("add_bos_token_id", 1), ("add_eos_token_id", 2),
        ("add_unk_token_id", 0), ("add_string", "tokenizer.chat_template", "{{ messages[0]['content'] }}"),
        ("add_tokenizer_pre", "default"), ("add_add_bos_token", True), ("add_eot_token_id", 2), ("add_eom_token_id", 2),
        ("add_expert_count", 0),
        ("add_bool", "tokenizer.ggml.normalizer.lowercase", False), ("add_array", EOS_IDS_KEY, [2])]
    write_gguf(out, "gguf", "llama", kv, plan(Weights.load(folder, cfg), FORMATS["f32"], None))
    _, fields, tensors = Parser(out).read()
    return fields, [(t.name, t.shape, np.array(t.data)) for t in tensors]


def wrong_values(v):
    """Values of other types than v's (and, for ids and counts, out of range)."""
    if isinstance(v, list):
        return [7, "x", [1, 2] if v and isinstance(v[0], str) else ["a", "b"]]
    if isinstance(v, str):
        return [5, 1.5, ["a"]]
    if isinstance(v, float):
        return ["x", float("nan"), [1.0]]
    return ["x", 1.5, [1], 2**40, 0]


def field_cases():
    from ref.common.gguf_io import KEY_TYPES
    return sorted(k.lstrip(".") for k in KEY_TYPES)


@pytest.mark.parametrize("key", field_cases())
def test_gguf_fields_of_the_wrong_type(f32_gguf, tmp_path, key):
    """Each metadata key read, given values of other types (or out of range): loading the checkpoint and its
    tokenizer either works or says one line naming the file."""
    from ref.common.tokenizer import load_tokenizer
    fields, tensors = f32_gguf
    key = next((k for k in fields if k == key or k.endswith("." + key) and k.startswith("llama.")), None)
    if key is None:
        pytest.skip("the fixture has no such key")
    for i, bad in enumerate(wrong_values(fields[key])):
        path = tmp_path / f"case{i}.gguf"
        write_fields(path, {**fields, key: bad}, tensors)
        outcome(path, f"{key} = {bad!r}")
        try:
            load_tokenizer(path)
        except UserError as e:
            assert "\n" not in str(e) and path.name in str(e), str(e)
