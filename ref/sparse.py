"""Predictor-gated sparse FFN (the PowerInfer paper, sections 4-5), as transforms applied to a dense `Model`.

Predictor of layer l, on h = the residual stream entering the FFN block (before its norm; Falcon's layer input):
logits = fc2 relu(fc1 h), P = {i : logits_i >= θ}. Sparse FFN: y = sum_{i in P} a_i Wd[:, i] (+ bd), a_i computed
only for i in P. Over the oracle set (the neurons that fire) it equals the dense FFN up to summation order. With
biases (OPT), a neuron outside P contributes nothing, even where relu(bu_i) > 0 alone would have: PowerInfer drops it
the same way, and bd is added once. Hybrid split: with G a layer's GPU neurons,
y = y_gpu + y_cpu, summing over P ∩ G and P \\ G.

Dimensions: T tokens, D d_model, F FFN neurons, R predictor hidden size, L layers.
"""

from pathlib import Path

import numpy as np

from ref.activation_sparsity import apply_activation_sparsity, sparsity_to_run
from ref.common.artifacts import EMBEDDED, Predictors
from ref.common.formats import Format, format_of
from ref.common.safetensors import upcast
from ref.model import FFN_NORM, Model, ffn_activation, fired, require_sparse
from ref.quant import input_values, predictors_beside, quantize_predictors, stored_format


def predictor_logits(h: np.ndarray, fc1, fc2) -> np.ndarray:
    """fc2 . relu(fc1 . h), PowerInfer's predictor.  h: [T, D], fc1: [R, D], fc2: [F, R] -> [T, F].

    fc1 and fc2 as stored (any format); each product reads its input as the format does (ref.quant.input_values)."""
    r = np.maximum(input_values(h, fc1) @ upcast(fc1, h.dtype).T, 0)  # [T, R]
    return input_values(r, fc2) @ upcast(fc2, h.dtype).T


def predicted_set(logits: np.ndarray, threshold: float = 0.0) -> np.ndarray:
    """Sorted int32 neuron ids with logit >= threshold.  logits: [F]."""
    return np.flatnonzero(logits >= threshold).astype(np.int32)


def sparse_ffn(x: np.ndarray, wg, wu, wd, active: np.ndarray, kind: str, t: float = 0.0, dtype=np.float32,
               bu=None) -> np.ndarray:
    """y = sum_{i in active} a_i Wd[:, i], computing a_i only for active neurons.  x: [D] -> [D].

    wg, wu: [F, D] and wd: [D, F] as stored (any format); only the active rows/columns are read. Gate and up read x
    as their format does (ref.quant.input_values), the down matrix the activations as they are. A non-gated FFN
    (wg None) has a_i = act(Wu_i x + bu_i), the gated one's with u = 1 (ref.model).
    """
    u = upcast(wu[active], dtype) @ input_values(x, wu)  # [|P|]
    if bu is not None:
        u = u + upcast(bu, dtype)[active]
    g, u = (u, np.ones_like(u)) if wg is None else (upcast(wg[active], dtype) @ input_values(x, wg), u)
    a = ffn_activation(kind, g, u, t)  # [|P|]
    return upcast(wd[:, active], dtype) @ a  # [D]


def hybrid_ffn(x: np.ndarray, wg, wu, wd, active: np.ndarray, gpu: np.ndarray, kind: str, t: float = 0.0,
               dtype=np.float32, bu=None) -> tuple[np.ndarray, np.ndarray]:
    """PowerInfer's split: (y_gpu over P ∩ G, y_cpu over P \\ G); their sum is the sparse FFN.  x: [D]."""
    on_gpu = np.isin(active, gpu)
    return (sparse_ffn(x, wg, wu, wd, active[on_gpu], kind, t, dtype, bu),
            sparse_ffn(x, wg, wu, wd, active[~on_gpu], kind, t, dtype, bu))


class Selector:
    """The active-set seam of every engine: per-layer predictor weights (none: every neuron is computed) and `pick`,
    which turns a layer's predictor logits [F] into the sorted ids of the neurons to compute. An engine runs the
    predictor wherever it keeps the weights, then asks `pick`."""

    def __init__(self, d_ffn: int, predictors: Predictors | None = None, threshold: float = 0.0):
        self.fc1 = None if predictors is None else predictors.fc1  # per layer [R, D]
        self.fc2 = None if predictors is None else predictors.fc2  # per layer [F, R]
        self.threshold = threshold
        self.all = np.arange(d_ffn, dtype=np.int32)

    @property
    def predicts(self) -> bool:
        return self.fc1 is not None

    def pick(self, l: int, logits: np.ndarray | None) -> np.ndarray:
        """P = {i : logits_i >= θ} of layer l; every neuron when there is no predictor (logits None)."""
        return self.all if logits is None else predicted_set(logits, self.threshold)

    def pick_rows(self, l: int, logits: np.ndarray | None, T: int) -> np.ndarray:
        """The sets of T tokens as a mask [T, F] uint8 (token t computes neuron i): `pick` per token; a subclass may
        do it at once. logits: [T, F] or None."""
        picked = np.zeros((T, len(self.all)), np.uint8)
        for t in range(T):
            picked[t, self.pick(l, None if logits is None else logits[t])] = 1
        return picked


class SparseFFN:
    """The FFN block with the active set chosen per token by `choose(l, h, x, wg, wu) -> sorted neuron ids` (h the
    block input, x its FFN norm; wg None for a non-gated FFN)."""

    def __init__(self, model: Model, choose):
        self.model, self.choose = model, choose

    def __call__(self, l: int, h: np.ndarray) -> np.ndarray:
        m, c, p = self.model, self.model.config, f"layers.{l}."
        x = m.norm_in(h, FFN_NORM[c.block], l)  # [T, D]
        # upcast once per block, as the dense block does
        wg, wu, wd = m.w(p + "wg") if c.gated else None, m.w(p + "wu"), m.w(p + "wd")
        bu, bd = (m.w(p + "wu.bias"), m.w(p + "wd.bias")) if c.bias else (None, 0)
        xr = input_values(x, m.weights[p + "wu"])  # [T, D] x as the stored gate and up matrices read it
        y = np.empty_like(x)  # [T, D]
        for t in range(x.shape[0]):
            active = self.choose(l, h[t], x[t], wg, wu)
            y[t] = sparse_ffn(xr[t], wg, wu, wd, active, c.ffn_kind, c.act_threshold, m.dtype, bu) + bd
        return y


def oracle_set(model: Model, l: int, x: np.ndarray, wg, wu) -> np.ndarray:
    """The neurons of layer l that really fire for FFN input x [D], wg and wu upcast (wg None: non-gated); computes
    the full gate/up: for tests and eval."""
    c = model.config
    u = wu @ x + (model.w(f"layers.{l}.wu.bias") if c.bias else 0)  # [F]
    g, u = (u, np.ones_like(u)) if wg is None else (wg @ x, u)
    return np.flatnonzero(fired(c.ffn_kind, g, u, c.act_threshold)).astype(np.int32)


def apply_oracle(model: Model) -> Model:
    """Sparse FFN over the oracle set: equals dense up to summation order."""
    require_sparse(model.config.ffn_kind)
    model.ffn_block = SparseFFN(model, lambda l, h, x, wg, wu: oracle_set(model, l, x, wg, wu))
    return model


def resolve_predictors(cfg, predictors: str | Path | Predictors, threshold: float | None) -> tuple[Predictors, float]:
    """Loaded predictors checked against the model, and the threshold to use (the stored one unless overridden)."""
    require_sparse(cfg.ffn_kind)
    pred = predictors if isinstance(predictors, Predictors) else Predictors.load(predictors, cfg)
    return pred, pred.threshold if threshold is None else threshold


def apply_predictors(model: Model, predictors: str | Path | Predictors, threshold: float | None = None) -> Model:
    """Predictor-gated sparse FFN: P = {i : fc2 relu(fc1 h) >= θ} with h the residual before the FFN norm."""
    sel = model.selector = Selector(model.config.d_ffn, *resolve_predictors(model.config, predictors, threshold))

    def choose(l, h, x, wg, wu):
        return sel.pick(l, predictor_logits(h[None, :], sel.fc1[l], sel.fc2[l])[0])

    model.ffn_block = SparseFFN(model, choose)
    return model


def predictors_to_run(cfg, source, own: Predictors | None, fmt: Format, threshold: float | None = None,
                      predictor_type: str | None = None) -> tuple[Predictors, float] | None:
    """The predictors an engine with `fmt` weights runs, and their threshold (the stored one unless given): `source`
    (a file, loaded Predictors, or EMBEDDED: `own`, the checkpoint's; None where it has none) stored in
    `predictor_type` if given, else a checkpoint's own as stored and others in the formats that go with the weights
    (ref.quant.predictors_beside: q8_0 beside f16 and bf16, half their bytes at the same recall). ref and fast apply
    the same, so that the same command means the same model in both."""
    if source == EMBEDDED and own is None:
        return None
    pred, threshold = resolve_predictors(cfg, own if source == EMBEDDED else source, threshold)
    if predictor_type is not None:
        return quantize_predictors(pred, format_of(predictor_type, "--predictor-type")), threshold
    return (pred if source == EMBEDDED else predictors_beside(pred, fmt)), threshold


def load_model(path: str | Path, predictors=None, dtype=np.float32, predictor_threshold: float | None = None,
               predictor_type: str | None = None, sparsity: float | None = None, sparsity_method: str = "teal",
               sparsity_file: Path | None = None) -> Model:
    """`Model.load(path)`, made predictor-gated sparse by `apply_predictors` where `predictors` (a file, loaded
    Predictors, or EMBEDDED) gives any, as `predictors_to_run` stores them; then with activation sparsity where
    `sparsity` asks (ref.activation_sparsity; the FFN's only without predictors)."""
    model = Model.load(path, dtype)
    run = None if predictors is None else predictors_to_run(
        model.config, predictors, model.weights.predictors, stored_format(model.weights), predictor_threshold,
        predictor_type)
    if run is not None:
        apply_predictors(model, *run)
    cut = sparsity_to_run(model.weights, path, sparsity, sparsity_method, sparsity_file, ffn=run is None)
    return model if cut is None else apply_activation_sparsity(model, sparsity_method, cut, ffn=run is None)
