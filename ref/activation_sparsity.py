"""Training-free activation sparsity (TEAL, WINA, CATS) as a transform of a dense `Model`, and its calibration.

Each linear layer's input x is thinned before its product, x' = x * (score(x) > t), with one threshold t per
(layer, site) (TEAL's strict comparison: at t = 0, x' = x and its zeros count as dropped); a product W x' then reads
only the columns of W where x' is non-zero. A block's sites are the inputs
its matrices share:

  attn_in     the attention block's normed input, read by q, k and v       width D
  attn_out    the attention output, read by o                               width H E
  ffn_in      the FFN's normed input, read by gate and up (non-gated: up)   width D
  ffn_hidden  the FFN's activations a(g, u), read by down                   width F

Scores: TEAL |x_i|; WINA |x_i| ||W[:, i]||_2, W the site's matrices stacked (q, k and v as one, gate and up as one:
the engine reads them as one); CATS thins the FFN by neurons instead, keeping i where |act(g_i)| > t (the gate's
activation alone, so that a skipped neuron reads neither its up nor its down row) with ffn_in dense, and its
attention sites as TEAL's. A thinned matrix is stored transposed (rows = inputs, as PowerInfer's ffn_down_t), which
reads x as it is: a q8_0 or q4_0 matrix is quantized again along its output (ref.quant.Transposed).
A predictor-sparse FFN (the ReLU models) keeps its predictors: only the attention sites are thinned there.

Sparsity: a site's is the share of its entries dropped (CATS's FFN: of its neurons); the model's, the share of the
thinned matrices' parameters left unread, sum_{l, s} sparsity_{l, s} P_s / sum of every block's matrix parameters,
with P_s the parameters a dropped entry of site s skips (CATS: a neuron's up and down rows).
Calibration (TEAL's): the scores of each site over a corpus on the dense model, as histograms; the threshold of
sparsity s at a site is its scores' s-quantile (`uniform`: every site at the target), or per block TEAL's greedy
allocation: from 0, repeatedly raise the site whose step costs the block output's error least (`greedy`).

Dimensions: T tokens, D d_model, F FFN neurons, H heads, E head dim, L layers, N levels of the table, B bins.
"""

from pathlib import Path

import numpy as np

from ref.common.artifacts import DEFAULT_SPARSITY_FILE as DEFAULT_FILE
from ref.common.artifacts import LEVELS, METHODS, SITES, Thresholds, check_sparsity, site_widths as widths
from ref.common.batch import Batch, check_batch
from ref.common.errors import UserError
from ref.common.safetensors import upcast
from ref.model import Model, ffn_activation
from ref.quant import Quantized, Transposed, quantize, tensor_format

ATTENTION = SITES[:2]
MATRICES = {"attn_in": ("wq", "wk", "wv", "wqkv"), "attn_out": ("wo",), "ffn_in": ("wg", "wu"), "ffn_hidden": ("wd",)}
EDGES = np.geomspace(1e-7, 1e7, 4097)  # [B + 1] histogram bins of scores (steps of 0.8 %); below: bin 0 (zero)


def site_matrices(model: Model, l: int, site: str) -> list[str]:
    """The names of layer l's matrices that read `site`, in the model's stored order."""
    return [f"layers.{l}.{m}" for m in MATRICES[site] if f"layers.{l}.{m}" in model.weights.tensors]


def column_norms(model: Model, l: int, site: str) -> np.ndarray:
    """||W[:, i]||_2 of the site's matrices stacked, as stored (WINA's weights).  -> [width]."""
    cols = [upcast(model.weights[n], np.float64) for n in site_matrices(model, l, site)]  # each [out, width]
    return np.sqrt(sum((w * w).sum(0) for w in cols)).astype(np.float32)


def site_weights(model: Model, method: str) -> np.ndarray:
    """The matrix parameters one dropped entry of each site leaves unread: P_s [4] (the rows of the matrices that
    read it; CATS: a skipped neuron's up row and down column, its ffn_in never thinned)."""
    p = np.array([sum(model.weights[n].shape[0] for n in site_matrices(model, 0, s)) for s in SITES], np.float64)
    if method == "cats":
        p[2], p[3] = 0, (2 if model.config.gated else 1) * model.config.d_model
    return p


def model_sparsity(model: Model, method: str, levels: np.ndarray) -> float:
    """The model's sparsity of per-(layer, site) sparsities levels [L, 4]: the share of its blocks' matrix parameters
    left unread, sum_{l, s} levels_{l, s} P_s width_s / (L sum_s rows_s width_s)."""
    w = widths(model.config)
    block = (site_weights(model, "teal") * w).sum()  # every matrix of a block
    return float((np.asarray(levels) * site_weights(model, method) * w).sum() / (len(levels) * block))


class Thinning:
    """The transform's state: per (layer, site) the threshold and the score weights (1, or WINA's column norms), and
    the entries seen and kept so far (`realised`)."""

    def __init__(self, model: Model, method: str, cut: np.ndarray):
        c = model.config
        self.method, self.cut = method, cut  # cut [L, 4]
        self.norms = [[column_norms(model, l, s) if method == "wina" else None for s in SITES]
                      for l in range(c.n_layers)]
        self.seen = np.zeros((c.n_layers, len(SITES)), np.int64)
        self.kept = np.zeros((c.n_layers, len(SITES)), np.int64)

    def keep(self, l: int, s: int, score: np.ndarray, count: bool = True) -> np.ndarray:
        """score > t for layer l's site s, counted unless told not to.  score: [T, width] -> mask."""
        mask = score > self.cut[l, s]
        if count:
            self.seen[l, s] += mask.size
            self.kept[l, s] += np.count_nonzero(mask)
        return mask

    def thin(self, l: int, s: int, x: np.ndarray, count: bool = True) -> np.ndarray:
        """x' = x * (score(x) > t).  x: [T, width]."""
        score = np.abs(x) if self.norms[l][s] is None else np.abs(x) * self.norms[l][s]
        return np.where(self.keep(l, s, score, count), x, 0).astype(x.dtype)

    def realised(self) -> np.ndarray:
        """The share of entries dropped at each (layer, site) so far [L, 4] (nan where none was seen)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return 1 - self.kept / self.seen


def transposed(model: Model, names: list[str]) -> None:
    """Store these matrices transposed, as the input-sparse product reads them: the same values in a float format, a
    q8_0 or q4_0 one quantized again along its output (quantize_model's down matrix is so already)."""
    tensors = model.weights.tensors
    for name in names:
        t = tensors[name]
        if isinstance(t, Quantized):
            tensors[name] = Transposed(quantize(upcast(t).T, tensor_format(t), name))


def thinned_sites(model: Model, method: str, ffn: bool) -> dict[str, tuple[int, int]]:
    """The matrices whose inputs are thinned -> (layer, site): attention's, and the FFN's where `ffn` and the method
    thins inputs (CATS's FFN thins neurons)."""
    sites = SITES if ffn and method != "cats" else ATTENTION
    return {n: (l, SITES.index(s)) for l in range(model.config.n_layers) for s in sites
            for n in site_matrices(model, l, s)}


def thin_inputs(model: Model, method: str, cut: np.ndarray, ffn: bool = True) -> Model:
    """Each thinned matrix reads its input thinned by the thresholds cut [L, 4]; CATS's FFN by neurons where `ffn`.
    The weights as they are (apply_activation_sparsity stores them for it first). `model.thinning` counts."""
    site_of = thinned_sites(model, method, ffn)
    counted = {n for n, (l, s) in site_of.items() if n == site_matrices(model, l, SITES[s])[0]}
    thinning = model.thinning = Thinning(model, method, cut)
    dense_linear = model.linear

    def linear(x, name):
        if name not in site_of:
            return dense_linear(x, name)
        l, s = site_of[name]
        return dense_linear(thinning.thin(l, s, x, count=name in counted), name)  # q, k, v: one site, counted once

    model.linear = linear
    if method == "cats" and ffn:
        model.ffn_block = lambda l, h: cats_ffn_block(model, l, h, dense_linear)
    return model


def apply_activation_sparsity(model: Model, method: str, cut: np.ndarray, ffn: bool = True) -> Model:
    """Training-free activation sparsity: each linear layer's input thinned at its site by the thresholds cut [L, 4]
    (`method`'s scores), the FFN's too where `ffn` (a predictor-sparse FFN keeps its own), the thinned matrices
    stored transposed. Applied after quantize_model."""
    transposed(model, list(thinned_sites(model, method, ffn)))
    return thin_inputs(model, method, cut, ffn)


def cats_ffn_block(model: Model, l: int, h: np.ndarray, dense_linear) -> np.ndarray:
    """CATS's FFN: y = Wd (a(g, u) * (|a(g, 1)| > t)), a neuron whose gate's activation is not above t skipped."""
    c = model.config
    g, u = model.ffn_gate_up(l, h)  # [T, F]
    keep = model.thinning.keep(l, 3, np.abs(ffn_activation(c.ffn_kind, g, np.ones_like(g), c.act_threshold)))
    a = np.where(keep, ffn_activation(c.ffn_kind, g, u, c.act_threshold), 0).astype(g.dtype)
    return dense_linear(a, f"layers.{l}.wd")


def sparsity_to_run(weights, path, sparsity: float | None, method: str = "teal", given: Path | None = None,
                    allocation: str | None = None, ffn: bool = True) -> np.ndarray | None:
    """The thresholds [L, 4] of --sparsity S by `method` from the calibration of the model of `weights`
    (ref.common.weights.Weights, loaded from `path`): --sparsity-file (`given`), else a GGUF file's own
    (weights.sparsity), else DEFAULT_FILE in the model's folder, checked to be this model's (Thresholds.check); each
    block's allocation the calibration's greedy one where it has it for the method and the FFN is thinned too
    (`ffn`; beside predictors attention's inputs are at S), else uniform. None for no sparsity or S = 0 (the dense
    model, exactly)."""
    cfg, embedded = weights.config, weights.sparsity
    if sparsity is None:
        return None
    check_sparsity(sparsity)
    if method not in METHODS:
        raise UserError(f"--sparsity-method must be one of {', '.join(METHODS)}, got {method!r}")
    if sparsity == 0:
        return None
    if given is None and embedded is not None:
        th, source = embedded, path
    else:
        if given is None and not Path(path).is_dir():
            raise UserError(f"--sparsity: {path} carries no thresholds; name a file with --sparsity-file")
        source = Path(given) if given is not None else Path(path) / DEFAULT_FILE
        if not source.is_file():
            raise UserError(f"--sparsity {sparsity}: {source} not found; calibrate the model first: "
                            f"python scripts/calibrate_sparsity.py {path}")
        th = Thresholds.load(source)
    th.check(weights, method, source, own=th is embedded)
    allocation = allocation or ("greedy" if ffn and method in th.greedy else "uniform")
    return th.cut(method, th.levels(cfg, method, sparsity, allocation))


# ---- calibration ----

def histogram(scores: np.ndarray) -> np.ndarray:
    """Counts [B + 1] of scores (any shape) in EDGES' bins, bin 0 holding those below EDGES[0] (zeros)."""
    return np.bincount(np.searchsorted(EDGES, scores.reshape(-1), side="right"), minlength=len(EDGES) + 1)[
        : len(EDGES) + 1]


def quantiles(counts: np.ndarray) -> np.ndarray:
    """The threshold t of each level s in LEVELS such that a share s of the histogram's scores lies below t
    (geometric interpolation inside a bin; 0 for level 0 and for levels the zeros cover).  counts: [B + 1] -> [N]."""
    cdf = np.cumsum(counts) / max(counts.sum(), 1)  # [B + 1]: share below the upper edge of each bin
    out = np.zeros(len(LEVELS), np.float32)
    for k, s in enumerate(LEVELS):
        b = int(np.searchsorted(cdf, s, side="left"))  # first bin whose upper edge holds a share >= s
        if s == 0 or b == 0:
            continue
        b = min(b, len(EDGES))
        lo_share = cdf[b - 1]
        frac = (s - lo_share) / max(cdf[b] - lo_share, 1e-12) if b < len(cdf) else 1.0
        lo, hi = EDGES[b - 1], EDGES[min(b, len(EDGES) - 1)]
        out[k] = lo * (hi / lo) ** frac
    return np.maximum.accumulate(out)


GREEDY_TARGETS = np.round(np.arange(0, 0.91, 0.05), 2)  # [G] the block sparsities greedy allocation is kept for


def observe_sites(model: Model, methods: tuple[str, ...], observer) -> None:
    """Make the dense model report observer(method, l, s, scores [T, width]) for each site and method as it runs."""
    c = model.config
    norms = {(l, s): column_norms(model, l, s) for l in range(c.n_layers) for s in SITES} if "wina" in methods else {}
    first = {site_matrices(model, l, s)[0]: (l, si) for l in range(c.n_layers) for si, s in enumerate(SITES)}
    dense_linear = model.linear

    def linear(x, name):
        if name in first:
            l, s = first[name]
            for m in methods:
                if m != "cats" or s < 2:  # CATS's FFN scores neurons (ffn_block)
                    observer(m, l, s, np.abs(x) * norms[l, SITES[s]] if m == "wina" else np.abs(x))
        return dense_linear(x, name)

    def ffn_block(l, h):
        if "cats" in methods:
            g, _ = model.ffn_gate_up(l, h)
            observer("cats", l, 3, np.abs(ffn_activation(c.ffn_kind, g, np.ones_like(g), c.act_threshold)))
        return model.dense_ffn_block(l, h)

    model.linear, model.ffn_block = linear, ffn_block


def calibrate(model: Model, windows, methods: tuple[str, ...], keep_windows: int = 0, progress=None):
    """Per method the threshold table [L, 4, N] of the dense model's scores over the windows, the tokens seen, and
    the residual entering each block on the first `keep_windows` windows (per layer a list of [T, D]: what
    greedy_allocation replays)."""
    c = model.config
    counts = {m: np.zeros((c.n_layers, len(SITES), len(EDGES) + 1), np.int64) for m in methods}
    inputs: list[list[np.ndarray]] = [[] for _ in range(c.n_layers)]
    saved = dict(model.__dict__)

    def add(m, l, s, scores):
        counts[m][l, s] += histogram(scores)

    def block(l, h, batch, cache):
        if len(inputs[l]) < keep_windows:
            inputs[l].append(h.copy())
        return type(model).block(model, l, h, batch, cache)

    observe_sites(model, methods, add)
    model.block = block
    tokens = 0
    try:
        for ids, frac in windows:
            cache = model.new_cache(len(ids))
            model.forward(Batch.single(ids, cache), cache)
            tokens += len(ids)
            if progress:
                progress(len(ids), frac)
    finally:
        model.__dict__.clear()
        model.__dict__.update(saved)
    tables = {m: np.stack([[quantiles(counts[m][l, s]) for s in range(len(SITES))] for l in range(c.n_layers)])
              for m in methods}
    return tables, tokens, inputs


def run_block(model: Model, l: int, h: np.ndarray) -> np.ndarray:
    """Block l on its input h [T, D], one sequence from position 0 (a calibration window)."""
    cache = model.new_cache(len(h))
    batch = Batch.single(np.zeros(len(h), np.int64), cache)
    check_batch(batch, cache, model.config)  # gives the sequence its slot
    return model.block(l, h, batch, cache)


def greedy_allocation(model: Model, th: Thresholds, method: str, inputs: list[list[np.ndarray]],
                      targets: np.ndarray = GREEDY_TARGETS, step: float = 0.01) -> np.ndarray:
    """TEAL's greedy allocation, block by block: from every site at 0, raise the site whose raise costs the block
    output's error least (mean over tokens of ||block(h) - dense block(h)||) by `step` of the block's sparsity, until
    the block's sparsity passes each target; inputs[l]: windows of the residual entering block l.  -> [G, L, 4]."""
    c = model.config
    share = site_weights(model, method) * widths(c)
    share = share / (site_weights(model, "teal") * widths(c)).sum()  # [4] a site's part of the block's sparsity
    out = np.zeros((len(targets), c.n_layers, len(SITES)))
    saved = dict(model.__dict__)
    for l in range(c.n_layers):
        dense = [run_block(model, l, h) for h in inputs[l]]

        def error(levels):
            lv = np.zeros((c.n_layers, len(SITES)))
            lv[l] = levels
            thin_inputs(model, method, th.cut(method, lv))
            try:
                return np.mean([np.linalg.norm(run_block(model, l, h) - d, axis=-1).mean()
                                for h, d in zip(inputs[l], dense)])
            finally:
                model.__dict__.clear()
                model.__dict__.update(saved)

        levels, g = np.zeros(len(SITES)), 0
        while g < len(targets):
            if (levels * share).sum() >= targets[g] - 1e-9:
                out[g, l], g = levels, g + 1
                continue
            trials = []
            for s in np.flatnonzero((share > 0) & (levels < LEVELS[-1])):
                trial = levels.copy()
                trial[s] = min(LEVELS[-1], trial[s] + step / share[s])
                trials.append((error(trial), s, trial))
            if not trials:  # every site at the table's top: the targets above are out of reach
                out[g:, l] = levels
                break
            levels = min(trials, key=lambda t: (t[0], t[1]))[2]
    return out
