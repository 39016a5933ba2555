"""Held-out measurements: perplexity, and predictor recall/precision against the fired set.

Dimensions: T window tokens, V vocab, F FFN neurons, L layers.
"""

import numpy as np

from ref.common.progress import Progress
from ref.model import Model
from ref.profile import run_corpus
from ref.sparse import SparseFFN, oracle_set


def perplexity(model: Model, windows, label: str = "eval") -> tuple[float, int]:
    """exp(mean next-token NLL) over the windows, each from a fresh cache; and the tokens scored."""
    nll, n = 0.0, 0
    progress = Progress(label, 1.0)
    for ids, frac in windows:
        logits = model.logits(ids).astype(np.float64)[:-1]  # [T-1, V]
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        n += len(ids) - 1
        progress.update(len(ids), done=frac)
    progress.close()
    return float(np.exp(nll / max(n, 1))), n


def measure_predictors(model: Model, windows, label: str = "measure") -> list[dict]:
    """Per layer, on these tokens: recall and precision of the predicted set, predicted and fired fractions.

    `model` carries predictors (`apply_predictors`). Runs the predictor-gated model (so every layer sees the inputs it
    would really see) and compares each predicted set with the neurons that would fire for the same input.
    """
    c, saved = model.config, model.ffn_block
    tp, npred, nfired, tokens = (np.zeros(c.n_layers) for _ in range(4))

    def choose(l, h, x, wg, wu):
        p = saved.choose(l, h, x, wg, wu)
        f = oracle_set(model, l, x, wg, wu)
        tp[l] += np.intersect1d(p, f).size
        npred[l] += p.size
        nfired[l] += f.size
        tokens[l] += 1
        return p

    model.ffn_block = SparseFFN(model, choose)
    try:
        run_corpus(model, windows, label)
    finally:
        model.ffn_block = saved
    return [{"layer": l, "recall": tp[l] / max(nfired[l], 1), "precision": tp[l] / max(npred[l], 1),
             "predicted_fraction": npred[l] / max(tokens[l], 1) / c.d_ffn,
             "fired_fraction": nfired[l] / max(tokens[l], 1) / c.d_ffn} for l in range(c.n_layers)]
