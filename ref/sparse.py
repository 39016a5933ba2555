"""Predictor-gated sparse FFN (PowerInfer section 4-5), as transforms applied to a dense `Model`.

Dimensions: T tokens, D d_model, F FFN neurons, R predictor hidden size, L layers.
"""

import json
from pathlib import Path

import numpy as np

from ref.artifacts import layer_keys
from ref.errors import UserError
from ref.model import Model, ffn_activation, fired, require_sparse, rmsnorm
from ref.weights import open_safetensors, read_header, upcast


def predictor_logits(h: np.ndarray, fc1: np.ndarray, fc2: np.ndarray) -> np.ndarray:
    """fc2 . relu(fc1 . h), PowerInfer's predictor.  h: [T, D], fc1: [R, D], fc2: [F, R] -> [T, F]."""
    return np.maximum(h @ fc1.T, 0) @ fc2.T


def predicted_set(logits: np.ndarray, threshold: float = 0.0) -> np.ndarray:
    """Sorted int32 neuron ids with logit >= threshold.  logits: [F]."""
    return np.flatnonzero(logits >= threshold).astype(np.int32)


def sparse_ffn(x: np.ndarray, wg, wu, wd, active: np.ndarray, kind: str, t: float = 0.0, dtype=np.float32) -> np.ndarray:
    """y = sum_{i in active} a_i Wd[:, i], computing a_i only for active neurons.  x: [D] -> [D].

    wg, wu: [F, D] and wd: [D, F] as stored (any dtype); only the active rows/columns are read.
    """
    g = upcast(wg[active], dtype) @ x  # [|P|]
    u = upcast(wu[active], dtype) @ x  # [|P|]
    a = ffn_activation(kind, g, u, t)  # [|P|]
    return upcast(wd[:, active], dtype) @ a  # [D]


def hybrid_ffn(x: np.ndarray, wg, wu, wd, active: np.ndarray, gpu: np.ndarray, kind: str, t: float = 0.0,
               dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """PowerInfer's split: (y_gpu over P ∩ G, y_cpu over P \\ G); their sum is the sparse FFN.  x: [D]."""
    on_gpu = np.isin(active, gpu)
    return (sparse_ffn(x, wg, wu, wd, active[on_gpu], kind, t, dtype),
            sparse_ffn(x, wg, wu, wd, active[~on_gpu], kind, t, dtype))


class Predictors:
    """Per-layer predictor weights and the threshold; validated against a model's shape."""

    def __init__(self, fc1: list, fc2: list, threshold: float, metadata: dict):
        self.fc1, self.fc2, self.threshold, self.metadata = fc1, fc2, threshold, metadata

    @property
    def hidden_sizes(self) -> list[int]:
        return [w.shape[0] for w in self.fc1]

    @property
    def n_params(self) -> int:
        return sum(a.size + b.size for a, b in zip(self.fc1, self.fc2))

    @staticmethod
    def load(path: str | Path, cfg) -> "Predictors":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: predictors file not found")
        tensors = open_safetensors(path)
        meta = read_header(path)[2]
        n = layer_keys(path, tensors, ("fc1.weight", "fc2.weight"))
        if n != cfg.n_layers:
            raise UserError(f"{path}: predictors for {n} layers, the model has {cfg.n_layers}")
        fc1, fc2 = [], []
        for l in range(cfg.n_layers):
            a, b = tensors[f"layers.{l}.fc1.weight"], tensors[f"layers.{l}.fc2.weight"]
            if len(a.shape) != 2 or a.shape[1] != cfg.d_model or tuple(b.shape) != (cfg.d_ffn, a.shape[0]):
                raise UserError(f"{path}: layer {l} predictor has fc1 {tuple(a.shape)}, fc2 {tuple(b.shape)}; "
                                f"the model needs fc1 [R, {cfg.d_model}], fc2 [{cfg.d_ffn}, R]")
            fc1.append(upcast(a))
            fc2.append(upcast(b))
        try:
            threshold = float(json.loads(meta.get("threshold", "0")))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise UserError(f"{path}: metadata 'threshold' is not a number") from None
        return Predictors(fc1, fc2, threshold, meta)


class SparseFFN:
    """The FFN block with the active set chosen per token by `choose(l, h, x, wg, wu) -> sorted neuron ids`."""

    def __init__(self, model: Model, choose):
        self.model, self.choose = model, choose

    def __call__(self, l: int, h: np.ndarray) -> np.ndarray:
        m, c, p = self.model, self.model.config, f"layers.{l}."
        x = rmsnorm(h, m.w(p + "ffn_norm"), c.rms_norm_eps)  # [T, D]
        wg, wu, wd = m.w(p + "wg"), m.w(p + "wu"), m.w(p + "wd")  # upcast once per block, as the dense block does
        y = np.empty_like(x)  # [T, D]
        for t in range(x.shape[0]):
            active = self.choose(l, h[t], x[t], wg, wu)
            y[t] = sparse_ffn(x[t], wg, wu, wd, active, c.ffn_kind, c.act_threshold, m.dtype)
        return y


def oracle_set(cfg, x: np.ndarray, wg: np.ndarray, wu: np.ndarray) -> np.ndarray:
    """The neurons that really fire for normed input x [D] (computes the full gate/up: for tests and eval)."""
    return np.flatnonzero(fired(cfg.ffn_kind, wg @ x, wu @ x, cfg.act_threshold)).astype(np.int32)


def apply_oracle(model: Model) -> Model:
    """Sparse FFN over the oracle set: equals dense up to summation order (DESIGN section 2)."""
    require_sparse(model.config.ffn_kind)
    model.ffn_block = SparseFFN(model, lambda l, h, x, wg, wu: oracle_set(model.config, x, wg, wu))
    return model


def resolve_predictors(cfg, predictors: str | Path | Predictors, threshold: float | None) -> tuple[Predictors, float]:
    """Loaded predictors checked against the model, and the threshold to use (the stored one unless overridden)."""
    require_sparse(cfg.ffn_kind)
    pred = predictors if isinstance(predictors, Predictors) else Predictors.load(predictors, cfg)
    return pred, pred.threshold if threshold is None else threshold


def apply_predictors(model: Model, predictors: str | Path | Predictors, threshold: float | None = None) -> Model:
    """Predictor-gated sparse FFN: P = {i : fc2 relu(fc1 h) >= θ} with h the residual before the FFN norm."""
    pred, theta = resolve_predictors(model.config, predictors, threshold)
    model.predictors, model.predictor_threshold = pred, theta

    def choose(l, h, x, wg, wu):
        return predicted_set(predictor_logits(h[None, :], pred.fc1[l], pred.fc2[l])[0], theta)

    model.ffn_block = SparseFFN(model, choose)
    return model

