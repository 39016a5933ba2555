import numpy as np

from ref.predictor import TrainSettings, choose_sizes, fit_layer, metrics, train_all, train_predictor
from ref.sparse import predictor_logits


def planted(rank, n=3000, D=24, F=48, seed=0):
    """Masks from a hidden ReLU network of the given rank: a predictor of that size can learn them exactly."""
    rng = np.random.default_rng(seed)
    w1, w2 = rng.standard_normal((rank, D)), rng.standard_normal((F, rank))
    h = rng.standard_normal((n, D)).astype(np.float32) * 3
    mask = (np.maximum(h @ w1.T, 0) @ w2.T) > 0.5 * np.sqrt(rank)
    return h, mask


class Samples:
    def __init__(self, layers):
        self.layers, self.n_layers = layers, len(layers)

    def layer(self, l):
        return self.layers[l]


def test_trainer_reaches_target_recall_on_planted_structure():
    h, mask = planted(8)
    s = TrainSettings(epochs=25, batch=128, lr=5e-3)
    rng = np.random.default_rng(0)
    fc1, fc2 = train_predictor(h[:2700], mask[:2700], 32, s, rng)
    recall, precision, pred, fire = metrics(predictor_logits(h[2700:], fc1, fc2), mask[2700:])
    assert recall >= 0.97 and precision >= 0.6 and pred <= 2 * fire


def test_adaptive_sizing_prefers_small_for_predictable_layer():
    s = TrainSettings(epochs=20, batch=128, lr=5e-3, target_recall=0.97, ladder=(4, 8, 16, 32, 64))
    easy, hard = planted(1, seed=1), planted(48, seed=2)
    pred, reports = train_all(Samples([easy, hard]), 10**9, s)
    assert reports[0].R < reports[1].R
    assert [a.shape[0] for a in pred.fc1] == [reports[0].R, reports[1].R]


def test_budget_shrinks_where_recall_drops_least():
    class C:
        def __init__(self, R, recall):
            self.R, self.recall = R, recall
            self.fc1, self.fc2 = np.zeros((R, 1)), np.zeros((1, R))
    cands = [[C(1, 0.90), C(2, 0.98)], [C(1, 0.50), C(2, 0.99)]]
    s = TrainSettings(target_recall=0.97)
    assert choose_sizes(cands, s, budget=8) == [1, 1]
    assert choose_sizes(cands, s, budget=6) == [0, 1]  # layer 0 loses 0.08, layer 1 would lose 0.49
    assert choose_sizes(cands, s, budget=4) == [0, 0]


def test_deterministic_for_a_seed():
    s = TrainSettings(epochs=3, ladder=(8, 16))
    layers = Samples([planted(4, n=600)])
    a, _ = train_all(layers, 10**9, s)
    b, _ = train_all(layers, 10**9, s)
    np.testing.assert_array_equal(a.fc1[0], b.fc1[0])
    np.testing.assert_array_equal(a.fc2[0], b.fc2[0])


def test_fit_layer_stops_at_first_size_reaching_target():
    h, mask = planted(2, seed=5)
    s = TrainSettings(epochs=20, batch=128, lr=5e-3, ladder=(8, 16, 32, 64))
    cands = fit_layer((h[:2700], mask[:2700]), (h[2700:], mask[2700:]), s, max_R=1000, rng=np.random.default_rng(0))
    assert cands[-1].recall >= 0.97 and all(c.recall < 0.97 for c in cands[:-1])
