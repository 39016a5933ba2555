import numpy as np
import pytest

import ref
from ref.common.artifacts import Predictors
from ref.common.errors import UserError
from ref.model import ffn_activation, fired
from ref.sparse import Selector, apply_oracle, apply_predictors, hybrid_ffn, predicted_set, predictor_logits, sparse_ffn
from tests.helpers import SHIPPED, SMALL_CONFIG, assert_close, write_model


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m"))


def ffn_inputs(F, D=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(D).astype(np.float32), rng.standard_normal((F, D)).astype(np.float16),
            rng.standard_normal((F, D)).astype(np.float16), rng.standard_normal((D, F)).astype(np.float16))


def dense(x, wg, wu, wd, kind, t=0.0):
    g, u = wg.astype(np.float32) @ x, wu.astype(np.float32) @ x
    return wd.astype(np.float32) @ ffn_activation(kind, g, u, t)


@pytest.mark.parametrize("kind", ["relu", "fatrelu", "drelu"])
def test_sparse_ffn_over_fired_set_equals_dense(kind):
    x, wg, wu, wd = ffn_inputs(77)
    g, u = wg.astype(np.float32) @ x, wu.astype(np.float32) @ x
    active = np.flatnonzero(fired(kind, g, u, 0.2)).astype(np.int32)
    assert_close(sparse_ffn(x, wg, wu, wd, active, kind, 0.2), dense(x, wg, wu, wd, kind, 0.2), rtol=1e-6)


@pytest.mark.parametrize("split", ["none", "all", "random", "half"])
def test_hybrid_split_sums_to_sparse(split):
    x, wg, wu, wd = ffn_inputs(100, seed=1)
    rng = np.random.default_rng(2)
    active = np.sort(rng.choice(100, 40, replace=False)).astype(np.int32)
    gpu = {"none": np.empty(0, np.int32), "all": np.arange(100, dtype=np.int32),
           "random": np.sort(rng.choice(100, 37, replace=False)).astype(np.int32),
           "half": np.arange(50, dtype=np.int32)}[split]
    y_gpu, y_cpu = hybrid_ffn(x, wg, wu, wd, active, gpu, "relu")
    assert_close(y_gpu + y_cpu, sparse_ffn(x, wg, wu, wd, active, "relu"), rtol=1e-6)
    if split == "none":
        assert not y_gpu.any()


def test_empty_active_set_gives_zero():
    x, wg, wu, wd = ffn_inputs(10)
    assert not sparse_ffn(x, wg, wu, wd, np.empty(0, np.int32), "relu").any()


def test_predictor_forward_and_threshold():
    rng = np.random.default_rng(3)
    h, fc1, fc2 = rng.standard_normal((2, 8)), rng.standard_normal((4, 8)), rng.standard_normal((6, 4))
    want = np.stack([fc2 @ np.maximum(fc1 @ h[t], 0) for t in range(2)])
    assert_close(predictor_logits(h, fc1, fc2), want, rtol=1e-12)
    z = np.array([0.5, -0.1, 0.0, -2.0])
    assert predicted_set(z).tolist() == [0, 2] and predicted_set(z, -0.5).tolist() == [0, 1, 2]


def test_oracle_sparse_logits_equal_dense(shipped_model):
    ids = ref.load_tokenizer(SHIPPED).encode("the little dog found a ball in the park.")
    oracle = apply_oracle(ref.load_model(SHIPPED))
    assert_close(oracle.logits(ids), shipped_model.logits(ids), rtol=1e-5)


def all_firing_predictors(cfg, R=2):
    """fc1 = [I; -I]-like so relu(fc1 h) >= 0 with a positive sum, fc2 all ones: every logit >= 0."""
    fc1 = np.zeros((R, cfg.d_model), np.float32)
    fc1[0, 0], fc1[1, 0] = 1.0, -1.0
    return Predictors([fc1] * cfg.n_layers, [np.ones((cfg.d_ffn, R), np.float32)] * cfg.n_layers, 0.0, {"threshold": "0.0"})


def test_predictors_choosing_everything_equal_dense(small_dir, tmp_path):
    m = ref.load_model(small_dir)
    all_firing_predictors(m.config).save(tmp_path / "p.safetensors")
    sparse = ref.load_model(small_dir, predictors=tmp_path / "p.safetensors")
    ids = np.array([1, 5, 7, 9, 11])
    assert_close(sparse.logits(ids), m.logits(ids), rtol=1e-5)


def test_predictors_choosing_nothing_skip_ffn(small_dir):
    m = ref.load_model(small_dir)
    p = all_firing_predictors(m.config)
    p.fc2 = [-w for w in p.fc2]  # every logit <= 0; threshold above 0 picks none
    sparse = apply_predictors(ref.load_model(small_dir), p, threshold=1e-3)
    m.ffn_block = lambda l, h: np.zeros_like(h)
    ids = np.array([1, 5, 7])
    assert_close(sparse.logits(ids), m.logits(ids), rtol=1e-6)


def test_sparse_needs_sparse_kind(tmp_path):
    d = write_model(tmp_path, {"hidden_act": "silu"})
    with pytest.raises(UserError, match="no activation sparsity"):
        apply_oracle(ref.load_model(d))


@pytest.mark.parametrize("what, message", [
    ("layers", "predictors for 3 layers, the model has 2"),
    ("shape", "layer 1 predictor has fc1"),
    ("key", "unexpected tensor key 'layers.x.fc1.weight'"),
])
def test_mismatched_predictors(small_dir, tmp_path, what, message):
    from ref.common.artifacts import atomic_save
    cfg = ref.ModelConfig.from_hf(small_dir)
    t = {}
    for l in range(3 if what == "layers" else 2):
        t[f"layers.{l}.fc1.weight"] = np.zeros((4, cfg.d_model), np.float32)
        t[f"layers.{l}.fc2.weight"] = np.zeros((cfg.d_ffn - (what == "shape" and l == 1), 4), np.float32)
    if what == "key":
        t["layers.x.fc1.weight"] = t.pop("layers.1.fc1.weight")
    atomic_save(tmp_path / "p.safetensors", t, {"threshold": "0"})
    with pytest.raises(UserError, match=f"p.safetensors: {message}"):
        ref.load_model(small_dir, predictors=tmp_path / "p.safetensors")


def test_truncated_predictors(small_dir, tmp_path):
    m = ref.load_model(small_dir)
    all_firing_predictors(m.config).save(tmp_path / "p.safetensors")
    data = (tmp_path / "p.safetensors").read_bytes()
    (tmp_path / "p.safetensors").write_bytes(data[:-10])
    with pytest.raises(UserError, match="p.safetensors: truncated"):
        ref.load_model(small_dir, predictors=tmp_path / "p.safetensors")
    with pytest.raises(UserError, match="nope.safetensors: predictors file not found"):
        ref.load_model(small_dir, predictors=tmp_path / "nope.safetensors")


def test_oracle_block_equals_dense_block(small_dir):
    """The sparse block normalizes with ffn_norm exactly as the dense one (oracle == dense per layer)."""
    m = ref.load_model(small_dir)
    o = apply_oracle(ref.load_model(small_dir))
    h = np.random.default_rng(4).standard_normal((3, SMALL_CONFIG["hidden_size"])).astype(np.float32)
    assert_close(o.ffn_block(1, h), m.dense_ffn_block(1, h), rtol=1e-5)


def test_predictors_round_trip_12_layers(tmp_path):
    """Save and load give back every layer's weights in numeric layer order (10 and 11 after 9) and the metadata."""
    rng = np.random.default_rng(8)
    cfg = ref.ModelConfig.from_dict({**SMALL_CONFIG, "num_hidden_layers": 12})
    fc1 = [rng.standard_normal((4 + l, cfg.d_model)).astype(np.float32) for l in range(12)]
    fc2 = [rng.standard_normal((cfg.d_ffn, 4 + l)).astype(np.float32) for l in range(12)]
    Predictors(fc1, fc2, -0.5, {"threshold": "-0.5", "target_recall": "0.97"}).save(tmp_path / "p.safetensors")
    got = Predictors.load(tmp_path / "p.safetensors", cfg)
    assert got.threshold == -0.5 and got.metadata["target_recall"] == "0.97"
    assert [a.shape[0] for a in got.fc1] == list(range(4, 16))
    for l in range(12):
        np.testing.assert_array_equal(got.fc1[l], fc1[l])
        np.testing.assert_array_equal(got.fc2[l], fc2[l])


def test_selector_picks_everything_without_predictors_and_the_threshold_set_with_them():
    rng = np.random.default_rng(9)
    dense = Selector(6)
    assert not dense.predicts and dense.pick(0, None).tolist() == list(range(6))
    pred = Predictors([rng.standard_normal((2, 4))], [rng.standard_normal((6, 2))], 0.0, {})
    sel = Selector(6, pred, threshold=-0.1)
    z = np.array([0.3, -0.2, -0.1, 5.0, -3.0, 0.0])
    assert sel.predicts and sel.pick(0, z).tolist() == [0, 2, 3, 5]
