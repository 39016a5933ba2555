import json

import numpy as np
import pytest

import ref
from ref.common.errors import UserError
from ref.common import safetensors
from ref.common.safetensors import BF16, open_safetensors, read_header, upcast, write_safetensors
from tests.helpers import SMALL_CONFIG, assert_close, random_tensors, write_model


def test_shipped_weights_stay_memory_mapped(shipped_model):
    wg = shipped_model.weights["layers.0.wg"]
    assert isinstance(wg, np.memmap) and wg.dtype == np.float16
    assert upcast(wg).dtype == np.float32


def test_missing_tensor(tmp_path):
    t = random_tensors(SMALL_CONFIG)
    del t["model.layers.1.mlp.up_proj.weight"]
    write_model(tmp_path, tensors=t)
    with pytest.raises(UserError, match="missing 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        ref.load_model(tmp_path)


def test_extra_tensor(tmp_path):
    t = random_tensors(SMALL_CONFIG)
    t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"]
    write_model(tmp_path, tensors=t)
    with pytest.raises(UserError, match="unexpected tensor.*model.layers.2.mlp.up_proj.weight"):
        ref.load_model(tmp_path)


def test_ignored_rotary_buffer(tmp_path):
    """Old checkpoints carry RoPE's inv_freq buffer: skipped (RoPE comes from the config), the same model."""
    t = random_tensors(SMALL_CONFIG)
    write_model(tmp_path / "plain", tensors=t)
    write_model(tmp_path / "buffer", tensors={**t, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
    with_buffer = ref.load_model(tmp_path / "buffer")
    assert not any("inv_freq" in name for name in with_buffer.weights.tensors)
    ids = [1, 5, 9]
    np.testing.assert_array_equal(with_buffer.logits(ids), ref.load_model(tmp_path / "plain").logits(ids))


def test_wrong_shape(tmp_path):
    t = random_tensors(SMALL_CONFIG)
    t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"][:-1]
    write_model(tmp_path, tensors=t)
    with pytest.raises(UserError, match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape \(99, 32\), config.json implies \(100, 32\)"):
        ref.load_model(tmp_path)


@pytest.mark.parametrize("keep", [4, 100, -100])
def test_truncated_file(tmp_path, keep):
    write_model(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    with pytest.raises(UserError, match="model.safetensors: truncated"):
        ref.load_model(tmp_path)


def test_corrupt_header(tmp_path):
    write_model(tmp_path)
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt safetensors header"):
        ref.load_model(tmp_path)


def test_no_weights_file(tmp_path):
    write_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        ref.load_model(tmp_path)


def test_sharded_equals_single(tmp_path):
    single = ref.load_model(write_model(tmp_path / "one"))
    sharded = ref.load_model(write_model(tmp_path / "three", shards=3))
    assert len(list((tmp_path / "three").glob("model-*-of-00003.safetensors"))) == 3
    ids = np.array([1, 5, 9, 3, 7])
    np.testing.assert_array_equal(single.logits(ids), sharded.logits(ids))


def test_missing_shard(tmp_path):
    write_model(tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors: shard listed"):
        ref.load_model(tmp_path)


def test_bf16_bits_upcast_exactly(tmp_path):
    x = np.array([[1.0, -2.5, 3.140625, 0.0]], np.float32)  # representable in bf16
    write_safetensors(tmp_path / "t.safetensors", {"x": x}, dtype="BF16")
    t = open_safetensors(tmp_path / "t.safetensors")["x"]
    assert isinstance(t, BF16) and t.shape == (1, 4)
    np.testing.assert_array_equal(upcast(t), x)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_stored_dtypes_agree(tmp_path, dtype):
    """The same weights rounded to fp16 load identically from fp16, fp32 and bf16 files (bf16 up to its rounding)."""
    t = {k: v.astype(np.float16).astype(np.float32) for k, v in random_tensors(SMALL_CONFIG).items()}
    base = ref.load_model(write_model(tmp_path / "f16", tensors=t))
    other = ref.load_model(write_model(tmp_path / dtype, tensors=t, dtype=dtype))
    ids = np.array([1, 4, 8, 15, 16, 23, 42])
    assert_close(other.logits(ids), base.logits(ids), rtol=1e-6 if dtype == "F32" else 3e-2)


def test_index_must_be_valid(tmp_path):
    write_model(tmp_path, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(UserError, match="index.json: not a valid safetensors index"):
        ref.load_model(tmp_path)


def test_writer_round_trip_in_chunks(tmp_path, monkeypatch):
    """The one writer: every dtype back bit for bit, written a few rows at a time, metadata kept; the safetensors
    package reads what it writes."""
    from safetensors.numpy import load_file
    monkeypatch.setattr(safetensors, "CHUNK_BYTES", 64)
    rng = np.random.default_rng(0)
    t = {"f32": rng.standard_normal((37, 5)).astype(np.float32), "i64": np.arange(7, dtype=np.int64),
         "i32": np.array([3, 1], np.int32), "f16": rng.standard_normal((3, 4, 5)).astype(np.float16),
         "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 3), np.float32)}
    write_safetensors(tmp_path / "t.safetensors", t, {"note": "x"})
    back = load_file(tmp_path / "t.safetensors")
    for k, v in t.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    assert read_header(tmp_path / "t.safetensors")[2] == {"note": "x"}
    write_safetensors(tmp_path / "h.safetensors", {"w": t["f32"], "n": t["i64"]}, dtype="F16")
    back = open_safetensors(tmp_path / "h.safetensors")
    assert back["w"].dtype == np.float16 and back["n"].dtype == np.int64
    np.testing.assert_array_equal(back["w"], t["f32"].astype(np.float16))
