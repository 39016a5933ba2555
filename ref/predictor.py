"""Predictor training in NumPy (PowerInfer section 5.2): per layer, fc2 . relu(fc1 . h) trained with Adam on a
class-weighted BCE, its hidden size picked from a ladder as the smallest that reaches the target recall on
held-out tokens, all predictors together within a fraction of the model's parameters.

Dimensions: N samples, B batch, D d_model, F FFN neurons, R predictor hidden size, L layers.
"""

import json
from dataclasses import dataclass, field

import numpy as np

from ref.common.artifacts import Predictors
from ref.common.config import ModelConfig
from ref.common.progress import Progress
from ref.sparse import predictor_logits

LADDER = (16, 32, 64, 128, 256, 512, 1024)
THRESHOLDS = (0.0, -0.25, -0.5, -1.0, -1.5, -2.0, -3.0)


@dataclass
class TrainSettings:
    target_recall: float = 0.97
    budget_fraction: float = 0.10  # all predictors <= this share of the model's parameters (the paper's bound)
    epochs: int = 12
    batch: int = 256
    lr: float = 2e-3
    pos_weight: float = 4.0  # positives are rare and a miss costs more than a false alarm
    held_out: float = 0.1
    max_set_ratio: float = 2.0  # predicted set at most this times the fired set (threshold tuning)
    seed: int = 0
    ladder: tuple[int, ...] = LADDER


@dataclass
class Candidate:
    """One trained predictor of a layer and its held-out metrics at threshold 0."""

    R: int
    fc1: np.ndarray  # [R, D]
    fc2: np.ndarray  # [F, R]
    recall: float
    precision: float
    predicted: float  # mean predicted-set fraction of F
    fired: float  # mean fired fraction of F


@dataclass
class LayerReport:
    layer: int
    R: int
    recall: float
    precision: float
    predicted: float
    fired: float
    tried: list = field(default_factory=list)


def metrics(logits: np.ndarray, mask: np.ndarray, threshold: float = 0.0) -> tuple[float, float, float, float]:
    """(recall, precision, predicted fraction, fired fraction) of P = {logits >= θ} against the fired mask [N, F]."""
    pred = logits >= threshold
    tp = np.logical_and(pred, mask).sum()
    return (tp / max(mask.sum(), 1), tp / max(pred.sum(), 1), pred.mean(), mask.mean())


def train_predictor(h: np.ndarray, mask: np.ndarray, R: int, s: TrainSettings, rng: np.random.Generator):
    """Adam on mean weighted BCE: -[w y log σ(z) + (1-y) log(1-σ(z))], z = fc2 relu(fc1 h).  h: [N, D], mask: [N, F]."""
    N, D = h.shape
    F = mask.shape[1]
    # relu(fc1 h) is positively homogeneous, so training on h / scale and exporting fc1 / scale changes nothing.
    scale = float(np.sqrt(np.mean(h * h))) or 1.0
    hs = (h / scale).astype(np.float32)
    params = [(rng.standard_normal((R, D)) / np.sqrt(D)).astype(np.float32),
              (rng.standard_normal((F, R)) / np.sqrt(R)).astype(np.float32)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    b1, b2, eps, step = 0.9, 0.999, 1e-8, 0
    steps_per_epoch = max(1, N // s.batch)
    total = s.epochs * steps_per_epoch
    for epoch in range(s.epochs):
        order = rng.permutation(N)
        for k in range(steps_per_epoch):
            idx = order[k * s.batch:(k + 1) * s.batch]
            x, y = hs[idx], mask[idx].astype(np.float32)  # [B, D], [B, F]
            fc1, fc2 = params
            a = x @ fc1.T  # [B, R]
            r = np.maximum(a, 0)
            z = r @ fc2.T  # [B, F]
            sig = 1 / (1 + np.exp(-np.clip(z, -30, 30)))
            dz = (sig * (1 + (s.pos_weight - 1) * y) - s.pos_weight * y) / y.size  # [B, F]
            g2 = dz.T @ r  # [F, R]
            g1 = ((dz @ fc2) * (a > 0)).T @ x  # [R, D]
            step += 1
            lr = s.lr * 0.5 * (1 + np.cos(np.pi * step / total))  # cosine decay
            for p, g, mm, vv in zip(params, (g1, g2), m, v):
                mm *= b1
                mm += (1 - b1) * g
                vv *= b2
                vv += (1 - b2) * g * g
                p -= lr * (mm / (1 - b1 ** step)) / (np.sqrt(vv / (1 - b2 ** step)) + eps)
    return params[0] / scale, params[1]


def fit_layer(train: tuple, held: tuple, s: TrainSettings, max_R: int, rng: np.random.Generator,
              progress: Progress | None = None) -> list[Candidate]:
    """Train up the ladder until a size reaches the target recall on the held-out (h, mask) (or the size cap)."""
    out = []
    for R in (r for r in s.ladder if r <= max_R):
        fc1, fc2 = train_predictor(*train, R, s, rng)
        rec, prec, pred, fire = metrics(predictor_logits(held[0], fc1, fc2), held[1])
        out.append(Candidate(R, fc1, fc2, rec, prec, pred, fire))
        if progress is not None:
            progress.update(1)
        if rec >= s.target_recall:
            break
    return out


def choose_sizes(cands: list[list[Candidate]], s: TrainSettings, budget: int) -> list[int]:
    """Per layer the smallest size reaching the target; while over budget, shrink where recall drops least."""
    def cost(l, i):
        return cands[l][i].fc1.size + cands[l][i].fc2.size

    pick = []
    for c in cands:
        ok = [i for i, x in enumerate(c) if x.recall >= s.target_recall]
        pick.append(ok[0] if ok else int(np.argmax([x.recall for x in c])))
    while sum(cost(l, i) for l, i in enumerate(pick)) > budget:
        options = [(cands[l][i].recall - cands[l][i - 1].recall, l) for l, i in enumerate(pick) if i > 0]
        if not options:
            break
        _, l = min(options)
        pick[l] -= 1
    return pick


def tune_threshold(chosen: list[Candidate], held: list[tuple[np.ndarray, np.ndarray]], s: TrainSettings) -> float:
    """The θ <= 0 that reaches the target mean recall with the smallest predicted sets, keeping the predicted set
    at most `max_set_ratio` times the fired set; θ = 0 unless another threshold buys recall that cheaply."""
    rows = []
    for theta in THRESHOLDS:
        ms = [metrics(predictor_logits(h, c.fc1, c.fc2), m, theta) for c, (h, m) in zip(chosen, held)]
        recall = float(np.mean([x[0] for x in ms]))
        ratio = float(np.mean([x[2] for x in ms]) / max(np.mean([x[3] for x in ms]), 1e-12))
        rows.append((theta, recall, ratio))
    fits = [r for r in rows if r[2] <= s.max_set_ratio]
    if not fits:
        return 0.0
    reaching = [r for r in fits if r[1] >= s.target_recall]
    return (reaching[0] if reaching else max(fits, key=lambda r: r[1]))[0]


def train_all(samples, model_params: int, s: TrainSettings) -> tuple[Predictors, list[LayerReport]]:
    """Train every layer's predictor from `samples` (`n_layers`, `layer(l) -> (h [N, D], mask [N, F])`)."""
    budget = int(s.budget_fraction * model_params)
    cands, held = [], []
    progress = Progress("predictors", samples.n_layers * len(s.ladder), unit="fits")
    for l in range(samples.n_layers):
        h, mask = samples.layer(l)
        rng = np.random.default_rng([s.seed, l])
        perm = rng.permutation(len(h))
        n_val = max(1, int(len(h) * s.held_out))
        val, tr = perm[:n_val], perm[n_val:]
        held.append((h[val], mask[val]))
        max_R = budget // (h.shape[1] + mask.shape[1])  # one layer alone never takes more than the whole budget
        cands.append(fit_layer((h[tr], mask[tr]), held[-1], s, max_R, rng, progress))
    progress.close()
    pick = choose_sizes(cands, s, budget)
    chosen = [c[i] for c, i in zip(cands, pick)]
    theta = tune_threshold(chosen, held, s)
    reports = []
    for l, (c, (h, m)) in enumerate(zip(chosen, held)):
        rec, prec, pred, fire = metrics(predictor_logits(h, c.fc1, c.fc2), m, theta)
        reports.append(LayerReport(l, c.R, float(rec), float(prec), float(pred), float(fire),
                                   [(x.R, round(float(x.recall), 4)) for x in cands[l]]))
    meta = {"threshold": json.dumps(theta), "target_recall": json.dumps(s.target_recall),
            "layers": json.dumps([{"layer": r.layer, "hidden": r.R, "recall": r.recall, "precision": r.precision,
                                   "predicted_fraction": r.predicted, "fired_fraction": r.fired} for r in reports])}
    pred = Predictors([c.fc1.astype(np.float32) for c in chosen], [c.fc2.astype(np.float32) for c in chosen], theta, meta)
    return pred, reports


def predictor_size(cfg: ModelConfig, budget_fraction: float = 0.10) -> int:
    """A predictor's hidden size for a model without one (benchmarks, the planner): the largest ladder size R with all layers' predictors within the paper's 10% of parameters (at least 16)."""
    per_layer = budget_fraction * cfg.n_params / cfg.n_layers
    return max([16] + [r for r in (32, 64, 128, 256, 512, 1024) if r * (cfg.d_model + cfg.d_ffn) <= per_layer])
