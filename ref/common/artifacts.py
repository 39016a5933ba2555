"""The offline artifact files (docs/design.md, Files): activations, predictors, placements; atomic writes, hashes and
numerically indexed layer keys. All safetensors, never pickle.

| file | tensors | metadata (JSON strings) |
| activations | `layers.{l}.counts` int64 [F] (tokens on which the neuron fired), `tokens` int64 [1] | corpus, corpus_sha256, model_sha256 |
| predictors | `layers.{l}.fc1.weight` [R_l, D], `layers.{l}.fc2.weight` [F, R_l] | threshold, per-layer held-out metrics |
| placement | `layers.{l}.gpu_neurons` int32 sorted | the request (budget, hardware, format, activations hash, ...), `dense_on_gpu`, the solver's report |
| sparsity | `{method}.table` [L, 4, N], `{method}.greedy` [G, L, 4], `greedy_targets` [G], `widths` [4] | methods, corpus, corpus_sha256, tokens |

Dimensions: D d_model, F FFN neurons, R predictor hidden size, L layers, N sparsity levels, G greedy targets.
"""

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np

from ref.common.errors import UserError
from ref.common.safetensors import checkpoint_files, open_safetensors, read_header, upcast, write_safetensors


EMBEDDED = "embedded"  # the predictors a checkpoint carries (a PowerInfer GGUF's, TurboSparse's), where it has them


def default_predictors(path: str | Path, predictors=None, dense: bool = False):
    """The predictors a CLI runs (every CLI that loads a model alike): those given; with none given and not --dense, a
    folder's predictors.safetensors, else the checkpoint's own (EMBEDDED: dense where it has none); None for dense."""
    if predictors is not None or dense:
        return predictors
    beside = Path(path) / "predictors.safetensors"
    if beside.is_file():
        return beside
    return EMBEDDED


def check_replaceable(path: str | Path, flag: str = "-o/--output") -> None:
    """A path a command may write a file to: absent, a regular file or a link (the rename replaces the link, not
    what it names); never a folder, a device, a FIFO or a socket, which a rename would replace with a file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, a FIFO or a socket)"
        raise UserError(f"{flag} {path}: {kind}; name a file to write")


def replace_file(tmp: str | Path, path: str | Path) -> None:
    """Rename the complete file `tmp` over `path`, checked again now (check_replaceable)."""
    check_replaceable(path)
    os.replace(tmp, path)


def atomic_save(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write a safetensors file to a temp name in the same folder, then rename: never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_safetensors(tmp, tensors, metadata)
        replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_sha256(model_dir: Path) -> str:
    """One hash over a checkpoint's weight files (a sharded one in shard order)."""
    h = hashlib.sha256()
    for p in checkpoint_files(Path(model_dir)):
        h.update(bytes.fromhex(sha256_file(p)))
    return h.hexdigest()


def layer_keys(path: Path, tensors, suffixes: tuple[str, ...], others: tuple[str, ...] = ()) -> int:
    """Number of layers in `layers.{l}.{suffix}` keys, checked numeric, 0..n-1, each with every suffix.

    Keys in `others` may stand beside them; anything else is an error naming the file.
    """
    layers: dict[int, set] = {}
    for key in tensors:
        if key in others:
            continue
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in suffixes:
            raise UserError(f"{path}: unexpected tensor key '{key}' (want layers.<number>.{'|'.join(suffixes)})")
        l = int(parts[1])
        if parts[2] in layers.setdefault(l, set()) or str(l) != parts[1]:
            raise UserError(f"{path}: duplicated layer key '{key}'")
        layers[l].add(parts[2])
    if sorted(layers) != list(range(len(layers))):
        raise UserError(f"{path}: layer keys are not 0..{len(layers) - 1} (found {sorted(layers)[:8]}...)")
    for l, have in layers.items():
        if have != set(suffixes):
            raise UserError(f"{path}: layer {l} lacks {', '.join(sorted(set(suffixes) - have))}")
    return len(layers)


def save_activations(path: Path, counts: np.ndarray, tokens: int, corpus: Path, model_dir: Path) -> None:
    tensors = {f"layers.{l}.counts": counts[l].astype(np.int64) for l in range(len(counts))}
    tensors["tokens"] = np.array([tokens], dtype=np.int64)
    meta = {"corpus": json.dumps(Path(corpus).name), "corpus_sha256": json.dumps(sha256_file(corpus)),
            "model_sha256": json.dumps(model_sha256(model_dir))}
    atomic_save(path, tensors, meta)


def load_activations(path: str | Path, n_layers: int | None = None, d_ffn: int | None = None) -> tuple[np.ndarray, int, dict]:
    """(counts [L, F] int64, tokens, metadata), checked against the expected layer count and F when given."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: activations file not found")
    tensors = open_safetensors(path)
    meta = read_header(path)[2]
    if "tokens" not in tensors:
        raise UserError(f"{path}: no 'tokens' tensor (not an activations file?)")
    n = layer_keys(path, tensors, ("counts",), others=("tokens",))
    if n_layers is not None and n != n_layers:
        raise UserError(f"{path}: activations for {n} layers, the model has {n_layers}")
    shapes = {tuple(tensors[f"layers.{l}.counts"].shape) for l in range(n)}
    F = d_ffn if d_ffn is not None else next(iter(shapes), (0,))[0]
    if shapes != {(F,)}:
        raise UserError(f"{path}: counts of shape {sorted(shapes)[0]}, expected ({F},) per layer")
    counts = np.stack([np.asarray(tensors[f"layers.{l}.counts"], dtype=np.int64) for l in range(n)])
    tokens = int(np.asarray(tensors["tokens"]).reshape(-1)[0])
    if counts.min(initial=0) < 0 or counts.max(initial=0) > tokens:
        raise UserError(f"{path}: counts outside [0, tokens={tokens}]")
    return counts, tokens, meta


def check_predictor_shapes(path, cfg, l: int, fc1, fc2) -> None:
    """Layer l's predictor must be fc1 [R, D], fc2 [F, R] for the model (in a safetensors or a GGUF file)."""
    if len(fc1.shape) != 2 or fc1.shape[1] != cfg.d_model or tuple(fc2.shape) != (cfg.d_ffn, fc1.shape[0]):
        raise UserError(f"{path}: layer {l} predictor has fc1 {tuple(fc1.shape)}, fc2 {tuple(fc2.shape)}; "
                        f"the model needs fc1 [R, {cfg.d_model}], fc2 [{cfg.d_ffn}, R]")


class Predictors:
    """Per-layer predictor weights (fc1 [R_l, D], fc2 [F, R_l]; float32 as trained and saved, or stored in another
    format by ref.quant.quantize_predictors) and the threshold, checked against a model."""

    def __init__(self, fc1: list, fc2: list, threshold: float, metadata: dict):
        self.fc1, self.fc2, self.threshold, self.metadata = fc1, fc2, threshold, metadata

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(a.shape)) + int(np.prod(b.shape)) for a, b in zip(self.fc1, self.fc2))

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
            check_predictor_shapes(path, cfg, l, a, b)
            fc1.append(upcast(a))
            fc2.append(upcast(b))
        try:
            threshold = float(json.loads(meta.get("threshold", "0")))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise UserError(f"{path}: metadata 'threshold' is not a number") from None
        return Predictors(fc1, fc2, threshold, meta)

    def save(self, path: Path) -> None:
        tensors = {}
        for l, (a, b) in enumerate(zip(self.fc1, self.fc2)):
            tensors[f"layers.{l}.fc1.weight"] = a
            tensors[f"layers.{l}.fc2.weight"] = b
        atomic_save(path, tensors, self.metadata)


def predictor_params(path: Path | None, n_layers: int) -> list[int]:
    """Parameters of each layer's predictor from a predictors file's header (no weights read); [] without a file."""
    if path is None or not Path(path).is_file():
        return []
    tensors = open_safetensors(Path(path))
    n = layer_keys(path, tensors, ("fc1.weight", "fc2.weight"))
    if n != n_layers:
        raise UserError(f"{path}: predictors for {n} layers, the model has {n_layers}")
    return [int(np.prod(tensors[f"layers.{l}.fc1.weight"].shape) + np.prod(tensors[f"layers.{l}.fc2.weight"].shape))
            for l in range(n)]


def dense_names(n_layers: int, output: bool = True) -> list[str]:
    """The dense parts a placement may put on the GPU (`dense_on_gpu`), in PowerInfer's order: each layer's attention
    (with its KV cache), each layer's predictor, and with `output` the FFN norms and the output layer (final norm,
    lm_head). `placement.budget.dense_parts` prices them; `fast.hybrid` uploads them."""
    return ([f"{part}.{l}" for part in ("attention", "predictor") for l in range(n_layers)]
            + (["ffn_norms", "output"] if output else []))


def save_placement(path: Path, gpu_neurons: list, meta: dict) -> None:
    """`layers.{l}.gpu_neurons` int32 sorted, and `meta` (the request and the solver's report) as JSON metadata."""
    tensors = {f"layers.{l}.gpu_neurons": np.asarray(n, np.int32) for l, n in enumerate(gpu_neurons)}
    atomic_save(path, tensors, {k: json.dumps(v) for k, v in meta.items()})


def open_artifact(path: Path, what: str) -> tuple[dict, dict]:
    """(tensors, metadata with its JSON values decoded) of an artifact file whose metadata is JSON (`what` names the
    kind of file in the error where it is missing)."""
    if not path.is_file():
        raise UserError(f"{path}: {what} file not found")
    tensors = open_safetensors(path)
    try:
        return tensors, {k: json.loads(v) for k, v in read_header(path)[2].items()}
    except json.JSONDecodeError:
        raise UserError(f"{path}: corrupt metadata") from None


def load_placement(path: str | Path, n_layers: int | None = None, d_ffn: int | None = None) -> tuple[list, dict]:
    """(gpu neurons per layer, metadata) with every layer's ids checked sorted, unique and in [0, F)."""
    path = Path(path)
    tensors, meta = open_artifact(path, "placement")
    n = layer_keys(path, tensors, ("gpu_neurons",))
    if n_layers is not None and n != n_layers:
        raise UserError(f"{path}: placement for {n} layers, the model has {n_layers}")
    out = []
    for l in range(n):
        ids = np.asarray(tensors[f"layers.{l}.gpu_neurons"])
        if ids.dtype != np.int32 or ids.ndim != 1 or (len(ids) and (np.any(np.diff(ids) <= 0) or ids[0] < 0)):
            raise UserError(f"{path}: layer {l} gpu_neurons must be sorted unique int32 ids")
        if d_ffn is not None and len(ids) and ids[-1] >= d_ffn:
            raise UserError(f"{path}: layer {l} has neuron id {ids[-1]}, the model has F = {d_ffn}")
        out.append(ids.copy())
    return out, meta


# Activation sparsity's calibration (ref.activation_sparsity): a layer's four sites, the methods, the levels of a table
SITES = ("attn_in", "attn_out", "ffn_in", "ffn_hidden")
METHODS = ("teal", "wina", "cats")
LEVELS = np.arange(100) / 100  # [N] the sparsities the table holds a threshold for; others are interpolated
DEFAULT_SPARSITY_FILE = "sparsity.safetensors"


def check_sparsity(sparsity: float, flag: str = "--sparsity") -> float:
    """A model-wide sparsity must be in [0, 1)."""
    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"{flag} must be in [0, 1), got {sparsity}")
    return sparsity


def model_fingerprint(weights) -> str:
    """A checkpoint's identity, the same in every weight format: sha256 of its shape (layers, widths, heads,
    vocabulary) and its vectors (norms, biases) as float32, which every format stores exactly (GGUF files keep
    them F32). A calibration records it; another model's vectors differ."""
    c = weights.config
    h = hashlib.sha256(repr((c.n_layers, c.d_model, c.d_ffn, c.n_heads, c.n_kv_heads, c.vocab_size)).encode())
    for name in sorted(n for n, t in weights.tensors.items() if len(t.shape) == 1):
        h.update(name.encode())
        h.update(np.ascontiguousarray(upcast(weights.tensors[name]), np.float32).tobytes())
    return h.hexdigest()[:32]


def site_widths(cfg) -> np.ndarray:
    """Each site's input width [4]: D, H E, D, F."""
    return np.array([cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.d_model, cfg.d_ffn], np.int64)


class Thresholds:
    """A calibration: per method, the threshold of each sparsity level at each (layer, site) (table [L, 4, N]) and,
    where greedy allocation ran, each block's site sparsities for targets on its grid (greedy [G, L, 4]).

    sparsity.safetensors: `{method}.table` float32 [L, 4, N], `{method}.greedy` float32 [G, L, 4] (optional),
    `greedy_targets` float32 [G], `widths` int64 [4]; metadata: methods, corpus, corpus_sha256, tokens, and `model`:
    the model_fingerprint of the model calibrated."""

    def __init__(self, tables: dict, greedy: dict, targets: np.ndarray, site_widths: np.ndarray, metadata: dict):
        self.tables, self.greedy, self.targets = tables, greedy, targets
        self.widths, self.metadata = site_widths, metadata

    def levels(self, cfg, method: str, sparsity: float, allocation: str = "uniform") -> np.ndarray:
        """Per-(layer, site) sparsities [L, 4] for a model-wide target: `uniform` every site at it (CATS: ffn_in
        dense, so its neurons at the target times the FFN's parameters over those a skipped neuron leaves unread:
        1.5 gated, 2 not), `greedy` each block's allocation for the target, interpolated between the grid's."""
        L = self.tables[method].shape[0]
        if allocation == "greedy":
            if method not in self.greedy:
                raise UserError(f"the thresholds file has no greedy allocation for {method} (calibrate with --greedy)")
            g = self.greedy[method]  # [G, L, 4]
            i = int(np.clip(np.searchsorted(self.targets, sparsity), 1, len(self.targets) - 1))
            a, b = self.targets[i - 1], self.targets[i]
            s = np.clip((sparsity - a) / (b - a), 0, 1)
            return (1 - s) * g[i - 1] + s * g[i]
        out = np.full((L, len(SITES)), sparsity)
        if method == "cats":
            out[:, 2], out[:, 3] = 0, min(sparsity * (1.5 if cfg.gated else 2.0), LEVELS[-1])
        return out

    def cut(self, method: str, levels: np.ndarray) -> np.ndarray:
        """The thresholds [L, 4] of per-site sparsities levels [L, 4]: each table's values interpolated; level 0 is
        threshold 0 (keep everything)."""
        table = self.tables[method]  # [L, 4, N]
        L = table.shape[0]
        out = np.zeros((L, len(SITES)), np.float32)
        for l in range(L):
            for s in range(len(SITES)):
                out[l, s] = np.interp(levels[l, s], LEVELS, table[l, s]) if levels[l, s] > 0 else 0.0
        return out

    def check(self, weights, method: str | None, path, own: bool = False) -> None:
        """This calibration must be of the model of `weights` (ref.common.weights.Weights): its layers and widths,
        and unless it is the checkpoint's `own` (a GGUF file's), its model_fingerprint; and hold `method` if given."""
        cfg = weights.config
        L = next(iter(self.tables.values())).shape[0]
        if L != cfg.n_layers or not np.array_equal(self.widths, site_widths(cfg)):
            raise UserError(f"{path}: thresholds for {L} layers of site widths {self.widths.tolist()}, the model has "
                            f"{cfg.n_layers} of {site_widths(cfg).tolist()} (a file of another model?)")
        if not own and self.metadata.get("model") != model_fingerprint(weights):
            raise UserError(f"{path}: thresholds calibrated for " + (
                f"another model (fingerprint {self.metadata['model']}, this model's {model_fingerprint(weights)})"
                if "model" in self.metadata else "an unnamed model (a file without its model's fingerprint)")
                + f"; calibrate this one: python scripts/calibrate_sparsity.py {weights.source or 'MODEL'}")
        if method is not None and method not in self.tables:
            raise UserError(f"--sparsity-method {method}: {path} was calibrated for {', '.join(self.tables)} "
                            f"(scripts/calibrate_sparsity.py --methods {method})")

    def tensors(self) -> dict[str, np.ndarray]:
        """The calibration as the file's tensors (a GGUF file embeds them under `sparsity.`)."""
        out = {f"{m}.table": t.astype(np.float32) for m, t in self.tables.items()}
        out |= {f"{m}.greedy": g.astype(np.float32) for m, g in self.greedy.items()}
        if self.greedy:
            out["greedy_targets"] = np.asarray(self.targets, np.float32)
        out["widths"] = self.widths.astype(np.int64)
        return out

    def save(self, path: Path) -> None:
        atomic_save(path, self.tensors(), {k: json.dumps(v) for k, v in self.metadata.items()})

    @staticmethod
    def load(path: str | Path) -> "Thresholds":
        path = Path(path)
        return Thresholds.of(path, *open_artifact(path, "thresholds"))

    @staticmethod
    def of(path, tensors: dict, meta: dict) -> "Thresholds":
        """A calibration from its tensors (`tensors()`), every shape and value checked; `path` names the file."""
        tables, greedy = {}, {}
        for key, t in tensors.items():
            method, _, part = key.partition(".")
            if key == "widths" or key == "greedy_targets":
                continue
            if method not in METHODS or part not in ("table", "greedy"):
                raise UserError(f"{path}: unexpected tensor key '{key}' (want <teal|wina|cats>.<table|greedy>)")
            (tables if part == "table" else greedy)[method] = np.asarray(t, np.float32)
        if "widths" not in tensors or tuple(tensors["widths"].shape) != (len(SITES),) or not tables:
            raise UserError(f"{path}: not a thresholds file (no 'widths' [4] or no table)")
        site = np.asarray(tensors["widths"])
        if not np.all(site == np.round(site)) or np.any(site < 1):
            raise UserError(f"{path}: 'widths' must hold four positive integers")
        shapes = {t.shape for t in tables.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[1:] != (len(SITES), len(LEVELS)):
            raise UserError(f"{path}: tables of shapes {sorted(shapes)}, want [L, {len(SITES)}, {len(LEVELS)}]")
        L = next(iter(shapes))[0]
        targets = np.asarray(tensors.get("greedy_targets", np.zeros(0)), np.float64)
        for m, g in greedy.items():
            if g.shape != (len(targets), L, len(SITES)) or len(targets) < 2 or np.any(np.diff(targets) <= 0):
                raise UserError(f"{path}: {m}.greedy of shape {g.shape} does not match greedy_targets {targets.shape}")
            if not np.all((g >= 0) & (g < 1)):
                raise UserError(f"{path}: {m}.greedy holds sparsities outside [0, 1)")
        for m, t in tables.items():
            if not np.all(np.isfinite(t)) or np.any(t < 0) or np.any(np.diff(t, axis=-1) < 0):
                raise UserError(f"{path}: {m}.table holds thresholds that are negative, not finite or not increasing")
        return Thresholds(tables, greedy, targets, site.astype(np.int64), meta)
