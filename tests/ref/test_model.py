import numpy as np
import pytest
from safetensors.numpy import load_file

import ref
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.model import attention, ffn_activation, fired, rmsnorm, rope
from tests.helpers import SHIPPED, SHIPPED_SILU, assert_close, write_model

GOLDEN = load_file(SHIPPED / "golden.safetensors")
N_GOLDEN = len([k for k in GOLDEN if k.endswith(".ids")])


@pytest.mark.parametrize("j", range(N_GOLDEN))
@pytest.mark.parametrize("path", [SHIPPED, SHIPPED_SILU], ids=["relu", "silu"])
def test_golden_logits(path, j):
    """Logits of both shipped models match the training script's own PyTorch implementation, 1e-4 relative per
    position."""
    golden = load_file(path / "golden.safetensors")
    ids, want = golden[f"prompts.{j}.ids"], golden[f"prompts.{j}.logits"]
    got = ref.load_model(path).logits(ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    for t in range(len(ids)):
        assert_close(got[t], want[t], rtol=1e-4, name=f"prompt {j} position {t}")


def test_kv_cache_incremental_equals_whole(shipped_model):
    ids = GOLDEN["prompts.2.ids"]
    whole = shipped_model.logits(ids)
    cache = shipped_model.new_cache(len(ids))
    parts = [shipped_model.forward(Batch.single(ids[:5], cache), cache)]
    parts += [shipped_model.forward(Batch.single(ids[t:t + 1], cache), cache) for t in range(5, len(ids))]
    assert cache.lengths.tolist() == [len(ids)]
    assert_close(np.concatenate(parts), whole, rtol=1e-5)


def test_float64_agrees(tmp_path):
    m32 = ref.load_model(write_model(tmp_path))
    m64 = ref.load_model(tmp_path, dtype=np.float64)
    ids = np.arange(1, 20)
    assert_close(m32.logits(ids), m64.logits(ids), rtol=1e-5)


def test_tied_embeddings(tmp_path):
    """Tied: the output layer is the embedding matrix, the same logits as an untied copy of it."""
    from tests.helpers import SMALL_CONFIG, random_tensors
    t = random_tensors(SMALL_CONFIG)
    tied = ref.load_model(write_model(tmp_path / "tied", {"tie_word_embeddings": True},
                                      tensors={k: v for k, v in t.items() if k != "lm_head.weight"}))
    assert "lm_head" not in tied.weights.tensors
    untied = ref.load_model(write_model(tmp_path / "untied", tensors={**t, "lm_head.weight": t["model.embed_tokens.weight"]}))
    ids = np.array([1, 2, 3])
    assert_close(tied.logits(ids), untied.logits(ids), rtol=1e-6)


@pytest.mark.parametrize("F", [100, 1, 77])
def test_ffn_not_multiple_of_64(tmp_path, F):
    m = ref.load_model(write_model(tmp_path, {"intermediate_size": F}))
    assert m.logits(np.array([1, 7, 9])).shape == (3, 50)


def test_context_overflow(tmp_path):
    m = ref.load_model(write_model(tmp_path))
    with pytest.raises(UserError, match="longer than the context"):
        m.logits(np.ones(65, np.int64))
    with pytest.raises(UserError, match="out of range"):
        m.logits(np.array([1, 50]))


def test_causality(tmp_path):
    """Changing a later token never changes earlier logits."""
    m = ref.load_model(write_model(tmp_path))
    a, b = m.logits(np.array([1, 5, 6, 7])), m.logits(np.array([1, 5, 6, 9]))
    assert_close(a[:3], b[:3], rtol=1e-6)
    assert not np.allclose(a[3], b[3])


def test_rmsnorm_unit_rms():
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32) * 7
    y = rmsnorm(x, np.ones(16, np.float32), 0.0)
    assert_close(np.sqrt((y * y).mean(-1)), np.ones(5), rtol=1e-6)


def test_rope_is_complex_rotation():
    """Rotate-half RoPE equals multiplying (x_i, x_{i+E/2}) as a complex number by exp(i pos theta^(-2i/E))."""
    rng = np.random.default_rng(1)
    T, h, E, theta = 6, 3, 8, 500.0
    x = rng.standard_normal((T, h, E))
    pos = np.arange(10, 10 + T)
    z = x[..., : E // 2] + 1j * x[..., E // 2:]
    z = z * np.exp(1j * pos[:, None, None] * theta ** (-np.arange(0, E, 2) / E))
    assert_close(rope(x, pos, theta), np.concatenate([z.real, z.imag], -1), rtol=1e-12)
    assert_close(rope(x, np.zeros(T, int), theta), x, rtol=0)


def test_gqa_equals_repeated_kv_heads():
    rng = np.random.default_rng(2)
    T, H, K, E = 4, 6, 2, 5
    q, k, v = rng.standard_normal((T, H, E)), rng.standard_normal((K, 7, E)), rng.standard_normal((K, 7, E))
    gqa = attention(q, k, v, np.arange(3, 7))
    mha = attention(q, np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0), np.arange(3, 7))
    assert_close(gqa, mha, rtol=1e-12)
    # Last query sees all 7 keys: plain softmax attention for head 0.
    s = q[-1, 0] @ k[0].T / np.sqrt(E)
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert_close(gqa[-1, 0], p @ v[0], rtol=1e-12)


@pytest.mark.parametrize("kind", ["relu", "fatrelu", "drelu"])
def test_fired_set_is_support_of_activation(kind):
    rng = np.random.default_rng(3)
    g, u = rng.standard_normal(1000), rng.standard_normal(1000)
    a = ffn_activation(kind, g, u, 0.3)
    mask = fired(kind, g, u, 0.3)
    assert np.all(a[~mask] == 0) and np.all(a[mask] != 0)


def test_activation_values():
    g, u = np.array([-1.0, 0.2, 2.0]), np.array([3.0, -1.0, 0.5])
    np.testing.assert_allclose(ffn_activation("relu", g, u), [0, -0.2, 1.0])
    np.testing.assert_allclose(ffn_activation("fatrelu", g, u, 0.5), [0, 0, 1.0])
    np.testing.assert_allclose(ffn_activation("drelu", g, u), [0, 0, 1.0])
    np.testing.assert_allclose(ffn_activation("silu", g, u), g / (1 + np.exp(-g)) * u)
    with pytest.raises(UserError, match="no activation sparsity"):
        fired("silu", g, u)
