"""The KV cache in f32, f16, bf16 and q8_0 (llama.cpp's -ctk, -ctv): ref stores each run's keys and values rounded
(or quantized) on write and attends over what they mean; the engine agrees with it through prompts, decode steps,
batches of sequences, slots that grow, the BLAS prompt path and a context shift."""

import subprocess
import sys

import numpy as np
import pytest

import ref
from fast import blas
from fast.load import check_memory, load_engine
from ref.common.batch import Batch, KVCache
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from tests.helpers import ROOT, SMALL_CONFIG, assert_close, write_model

PAIRS = [("f32", "f32"), ("f16", "f16"), ("bf16", "q8_0"), ("q8_0", "q8_0"), ("q8_0", "f16")]
RUN = [("q8_0", "f16")]  # the pair the engine runs (each pair compiles its own step; the kernel table has the rest)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A random model with 32-dim heads (q8_0's blocks) and room for 160 positions."""
    return write_model(tmp_path_factory.mktemp("kv"), {"hidden_size": 64, "num_attention_heads": 2,
                                                        "num_key_value_heads": 1, "max_position_embeddings": 160})


def with_kv(model, kv):
    model.kv_types = kv
    return model


@pytest.mark.parametrize("kv", RUN, ids="-".join)
def test_engine_matches_ref_in_every_kv_format(wide, kv, monkeypatch):
    """Two sequences: prompts (one long enough for fast.blas's prompt path), then decode steps together, their slots
    growing (room 4, then 8, ...): the logits as ref's, each sequence alone."""
    monkeypatch.setattr("ref.common.batch.MIN_ROOM", 4)
    monkeypatch.setattr(blas, "MIN_WORK", 0)
    model, engine = with_kv(ref.load_model(wide), kv), with_kv(load_engine(wide, threads=1), kv)
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 50, 40).tolist(), rng.integers(3, 50, 7).tolist()
    cache = engine.new_cache(slots=2)
    got = [engine.forward(Batch.of([(0, a[:36]), (1, b[:5])], cache), cache)]
    for i in range(2):
        got.append(engine.forward(Batch.of([(0, a[36 + i:37 + i]), (1, b[5 + i:6 + i])], cache), cache))
    got_a = np.concatenate([got[0][:36], got[1][:1], got[2][:1]])
    got_b = np.concatenate([got[0][36:], got[1][1:], got[2][1:]])
    assert_close(got_a, model.logits(a[:38]), rtol=1e-4)
    assert_close(got_b, model.logits(b), rtol=1e-4)
    assert cache.k[0][0].dtype == (np.float32 if kv[0] == "f32" else FORMATS[kv[0]].dtype)


@pytest.mark.parametrize("kv", RUN, ids="-".join)
def test_context_shift_in_a_kv_format(wide, kv):
    """A shift decodes the moved keys, rotates them and stores them again in the cache's format: ref and fast
    agree after it."""
    got = []
    for model in (ref.load_model(wide), load_engine(wide, threads=1)):
        with_kv(model, kv)
        cache = model.new_cache(12)
        model.forward(Batch.single(list(range(3, 15)), cache), cache)
        model.shift(cache, 0, 2, 5)
        got.append(model.forward(Batch.single([7, 8], cache), cache))
    assert_close(got[1], got[0], rtol=1e-4)


def test_bytes_follow_the_format():
    cfg = ModelConfig.from_dict({**SMALL_CONFIG, "hidden_size": 128})  # 4 heads of 32, 2 kv heads, 2 layers
    per = {kv: KVCache.empty(cfg, 8, np.float32, formats=kv).bytes_per_token() for kv in PAIRS}
    assert per[("f32", "f32")] == 2 * 2 * 2 * 32 * 4
    assert per[("f16", "f16")] == per[("f32", "f32")] // 2
    assert per[("q8_0", "q8_0")] == 2 * 2 * 2 * 34 and per[("q8_0", "f16")] == 2 * 2 * (34 + 64)
    cache = KVCache.empty(cfg, 8, np.float32, formats=("q8_0", "f16"))
    cache.reserve(0, 5)
    assert cache.nbytes == 8 * per[("q8_0", "f16")]  # the room: min(capacity, MIN_ROOM)


def test_bad_kv_formats_are_refused(small):
    cfg = ModelConfig.from_dict(SMALL_CONFIG)  # 8-dim heads
    with pytest.raises(UserError, match="-ctk q8_0: a head of 8 dims is not whole blocks of 32"):
        KVCache.empty(cfg, 8, np.float32, formats=("q8_0", "f16"))
    with pytest.raises(UserError, match="-ctv: the KV cache is stored in f32, f16, bf16, q8_0, not q4_0"):
        KVCache.empty(cfg, 8, np.float32, formats=("f16", "q4_0"))


def test_memory_check_counts_the_kv_format(tmp_path, monkeypatch):
    """The refusal's KV bytes follow -ctk/-ctv: a context that fits in q8_0 but not in f32."""
    import fast.load
    d = write_model(tmp_path / "m", {"hidden_size": 128, "max_position_embeddings": 1 << 16})
    cfg = ModelConfig.from_hf(d)
    f32 = 2 * 2 * (1 << 16) * 2 * 32 * 4  # layers, K and V, positions, kv heads, head dim, bytes
    monkeypatch.setattr(fast.load, "memory_available", lambda: f32 // 2)
    with pytest.raises(UserError, match="KV cache"):
        check_memory(d, cfg, FORMATS["f32"])
    check_memory(d, cfg, FORMATS["f32"], (FORMATS["q8_0"], FORMATS["q8_0"]))


def test_cli_flags():
    """-ctk/-ctv on ref and fast.run, said in the seed line (the engines' agreement per format is the tests above:
    a format here would compile the shipped model's step once more); a bad one is one line."""
    run = lambda mod, *a: subprocess.run([sys.executable, "-m", mod, "-p", "once upon a time", "-n", "8", "--temp",  # noqa: E731
                                          "0", *a], capture_output=True, text=True, cwd=ROOT, timeout=300)
    ref_out = run("ref", "-ctk", "q8_0", "-ctv", "bf16")
    assert ref_out.returncode == 0 and "KV cache q8_0/bf16" in ref_out.stderr, ref_out.stderr
    assert "KV cache f32/f32" in run("fast.run").stderr
    bad = run("fast.run", "-ctk", "q4_0")
    assert bad.returncode == 2 and "Invalid value for '-ctk'" in bad.stderr
