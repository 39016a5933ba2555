"""Training-free activation sparsity in ref: the thinning's semantics, the calibration's thresholds on held-out text,
WINA's weights, greedy allocation, and the thresholds file's checks."""

import numpy as np
import pytest

from ref import activation_sparsity as A
from ref.common.artifacts import model_fingerprint
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.model import Model, ffn_activation
from ref.profile import corpus_windows
from ref.quant import Quantized, Transposed, quantize_model
from ref.sparse import load_model
from tests.helpers import ROOT, SHIPPED, SHIPPED_SILU, assert_close

IDS = [1, 45, 300, 12, 99, 7, 1000, 5, 8, 77, 31, 2000]


@pytest.fixture(scope="module")
def calibrated(shipped_tokenizer):
    """The shipped model's thresholds from 4,096 training tokens, every method."""
    model = Model.load(SHIPPED)
    tables, tokens, _ = A.calibrate(model, corpus_windows(shipped_tokenizer, ROOT / "data/corpus/train.txt", 256, 4096),
                                    A.METHODS)
    assert tokens == 4096
    return A.Thresholds(tables, {}, np.zeros(0), A.widths(model.config),
                        {"tokens": tokens, "model": model_fingerprint(model.weights)})


def test_sparsity_zero_is_the_dense_model_exactly():
    dense = Model.load(SHIPPED).logits(IDS)
    assert np.array_equal(load_model(SHIPPED, sparsity=0.0, sparsity_file=SHIPPED / A.DEFAULT_FILE).logits(IDS), dense)
    thinned = A.thin_inputs(Model.load(SHIPPED), "teal", np.zeros((6, 4), np.float32))  # t = 0 keeps every non-zero
    assert np.array_equal(thinned.logits(IDS), dense)


@pytest.mark.parametrize("method", A.METHODS)
@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_calibrated_thresholds_reach_the_target_on_held_out_text(calibrated, shipped_tokenizer, method, sparsity):
    """The model-wide share of dropped scores on validation text (the dense model's inputs, as calibrated) is within 2
    points of the target; each site's within 5 of its level (layer 0's attention output moves most, 3 to 4.5 points
    at 50 % from 4,096 to 16,384 calibration tokens: its scores cluster), where the level lies above the share of
    zeros (a ReLU FFN's hidden sits at its zeros)."""
    model = Model.load(SHIPPED)
    levels = calibrated.levels(model.config, method, sparsity)
    cut = calibrated.cut(method, levels)
    dropped, seen = np.zeros((6, 4)), np.zeros((6, 4))

    def count(m, l, s, scores):
        if m == method:
            dropped[l, s] += np.count_nonzero(scores <= cut[l, s])
            seen[l, s] += scores.size
    A.observe_sites(model, (method,), count)
    for ids, _ in corpus_windows(shipped_tokenizer, ROOT / "data/corpus/val.txt", 256, 2048):
        cache = model.new_cache(len(ids))
        model.forward(Batch.single(ids, cache), cache)
    share = dropped / np.maximum(seen, 1)
    checked = (cut > 0) & (levels > 0)
    assert checked[:, :2].all()  # attention's sites always
    assert np.abs(share - levels)[checked].max() <= 0.05
    realised = np.where(checked, share, levels)
    assert abs(A.model_sparsity(model, method, realised) - A.model_sparsity(model, method, levels)) <= 0.02


def test_wina_weights_are_the_stacked_columns_norms():
    model = Model.load(SHIPPED)
    w = lambda n: model.weights[f"layers.2.{n}"].astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(A.column_norms(model, 2, "attn_in"),
                               np.linalg.norm(np.concatenate([w("wq"), w("wk"), w("wv")]), axis=0), rtol=1e-6)
    np.testing.assert_allclose(A.column_norms(model, 2, "ffn_in"),
                               np.linalg.norm(np.concatenate([w("wg"), w("wu")]), axis=0), rtol=1e-6)
    np.testing.assert_allclose(A.column_norms(model, 2, "ffn_hidden"), np.linalg.norm(w("wd"), axis=0), rtol=1e-6)


def test_thinning_is_the_mask_of_the_scores():
    """Each product reads its input with the entries whose score is not above t zeroed (WINA: |x| ||W[:, i]||)."""
    model = Model.load(SHIPPED)
    cut = np.full((6, 4), 0.3, np.float32)
    A.thin_inputs(model, "wina", cut)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    norms = A.column_norms(model, 1, "attn_out")
    want = np.where(np.abs(x) * norms > 0.3, x, 0) @ model.weights["layers.1.wo"].astype(np.float32).T
    assert_close(model.linear(x, "layers.1.wo"), want, rtol=1e-6)
    assert model.thinning.seen[1, 1] == x.size and model.thinning.kept[1, 1] == np.count_nonzero(np.abs(x) * norms > 0.3)


def test_cats_skips_the_neurons_whose_gate_activation_is_small():
    model = Model.load(SHIPPED)
    cut = np.zeros((6, 4), np.float32)
    cut[3, 3] = 0.05
    A.thin_inputs(model, "cats", cut)
    h = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    g, u = Model.load(SHIPPED).ffn_gate_up(3, h)
    f = ffn_activation("relu", g, np.ones_like(g))
    a = np.where(np.abs(f) > 0.05, ffn_activation("relu", g, u), 0)
    assert_close(model.ffn_block(3, h), a @ model.weights["layers.3.wd"].astype(np.float32).T, rtol=1e-6)


def test_quantized_matrices_are_stored_transposed_when_thinned():
    """A q4_0 matrix whose input is thinned is quantized again along its output (blocks along D for wq), as the
    engine lays it; quantize_model's down matrix is transposed already."""
    model = quantize_model(Model.load(SHIPPED), "q4_0")
    assert isinstance(model.weights["layers.0.wq"], Quantized)
    A.apply_activation_sparsity(model, "teal", np.zeros((6, 4), np.float32))
    wq = model.weights["layers.0.wq"]
    assert isinstance(wq, Transposed) and isinstance(wq.T, Quantized) and wq.T.shape == (256, 256)
    assert isinstance(model.weights["layers.0.wd"], Transposed)


def test_model_sparsity_weights_sites_by_the_parameters_they_skip():
    model = Model.load(SHIPPED)
    assert A.model_sparsity(model, "teal", np.full((6, 4), 0.4)) == pytest.approx(0.4)
    cats = np.zeros((6, 4))
    cats[:, 3] = 0.6  # a skipped neuron: its up row and down column, 2/3 of the FFN's parameters
    ffn_share = 3 * 1024 * 256 / (512 * 256 + 256 * 256 + 3 * 1024 * 256)
    assert A.model_sparsity(model, "cats", cats) == pytest.approx(0.6 * 2 / 3 * ffn_share)


def test_greedy_allocation_reaches_each_target(calibrated, shipped_tokenizer):
    model = Model.load(SHIPPED)
    _, _, inputs = A.calibrate(model, corpus_windows(shipped_tokenizer, ROOT / "data/corpus/train.txt", 64, 64),
                               ("teal",), keep_windows=1)
    targets = np.array([0.0, 0.2, 0.4])
    g = A.greedy_allocation(model, calibrated, "teal", inputs, targets, step=0.05)
    assert g.shape == (3, 6, 4) and np.all(g[0] == 0) and np.all((g >= 0) & (g <= A.LEVELS[-1]))
    for k, t in enumerate(targets):
        block = np.array([A.model_sparsity(model, "teal", np.repeat(g[k, l][None], 6, 0)) for l in range(6)])
        assert np.all(block >= t - 1e-9) and np.all(block <= t + 0.05)


def test_the_thresholds_file_round_trips_and_refuses_another_model(calibrated, tmp_path):
    path = tmp_path / "sparsity.safetensors"
    calibrated.save(path)
    back = A.Thresholds.load(path)
    for m in A.METHODS:
        assert np.array_equal(back.tables[m], calibrated.tables[m])
    from ref.common.config import shape_config
    from ref.common.weights import Weights
    with pytest.raises(UserError, match="another model"):
        A.sparsity_to_run(Weights(shape_config("tinyllama-1.1b"), {}), tmp_path, 0.4, "teal", path)
    only_teal = A.Thresholds({"teal": calibrated.tables["teal"]}, {}, np.zeros(0), calibrated.widths,
                             calibrated.metadata)
    only_teal.save(tmp_path / "teal.safetensors")
    weights = Model.load(SHIPPED).weights
    with pytest.raises(UserError, match="calibrated for teal"):
        A.sparsity_to_run(weights, tmp_path, 0.4, "wina", tmp_path / "teal.safetensors")
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        A.sparsity_to_run(weights, tmp_path, 1.0, "teal", path)
    (tmp_path / "uncalibrated").mkdir()
    with pytest.raises(UserError, match="calibrate the model first"):
        A.sparsity_to_run(weights, tmp_path / "uncalibrated", 0.4, "teal")
    bad = A.Thresholds({"teal": calibrated.tables["teal"][:, :, ::-1].copy()}, {}, np.zeros(0), calibrated.widths, {})
    bad.save(tmp_path / "bad.safetensors")
    with pytest.raises(UserError, match="not increasing"):
        A.Thresholds.load(tmp_path / "bad.safetensors")


def test_a_calibration_names_its_model_in_every_format(calibrated, tmp_path):
    """The twin's thresholds (the same layers and widths) are refused on the shipped model by the fingerprint of its
    vectors; the shipped model's fit it in q4_0 too (its norms stored exactly); a file that names no model is
    refused."""
    relu, silu = Model.load(SHIPPED).weights, Model.load(SHIPPED_SILU).weights
    assert model_fingerprint(relu) != model_fingerprint(silu)
    assert model_fingerprint(quantize_model(Model.load(SHIPPED), "q4_0").weights) == model_fingerprint(relu)
    twin = A.Thresholds.load(SHIPPED_SILU / A.DEFAULT_FILE)
    with pytest.raises(UserError, match="thresholds calibrated for another model"):
        twin.check(relu, "teal", SHIPPED_SILU / A.DEFAULT_FILE)
    twin.check(silu, "teal", SHIPPED_SILU / A.DEFAULT_FILE)
    A.Thresholds.load(SHIPPED / A.DEFAULT_FILE).check(relu, "teal", SHIPPED / A.DEFAULT_FILE)
    unnamed = A.Thresholds(calibrated.tables, {}, np.zeros(0), calibrated.widths, {"tokens": 1})
    with pytest.raises(UserError, match="an unnamed model"):
        unnamed.check(relu, "teal", "x.safetensors")
