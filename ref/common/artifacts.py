"""The offline artifact files (docs/design.md, Files): activations, predictors, placements; atomic writes, hashes and
numerically indexed layer keys. All safetensors, never pickle.

| file | tensors | metadata (JSON strings) |
| activations | `layers.{l}.counts` int64 [F] (tokens on which the neuron fired), `tokens` int64 [1] | corpus, corpus_sha256, model_sha256 |
| predictors | `layers.{l}.fc1.weight` [R_l, D], `layers.{l}.fc2.weight` [F, R_l] | threshold, per-layer held-out metrics |
| placement | `layers.{l}.gpu_neurons` int32 sorted | the request (budget, hardware, format, activations hash, ...), `dense_on_gpu`, the solver's report |

Dimensions: D d_model, F FFN neurons, R predictor hidden size, L layers.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ref.common.errors import UserError
from ref.common.safetensors import checkpoint_files, open_safetensors, read_header, upcast, write_safetensors


def atomic_save(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write a safetensors file to a temp name in the same folder, then rename: never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, path)
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


def load_placement(path: str | Path, n_layers: int | None = None, d_ffn: int | None = None) -> tuple[list, dict]:
    """(gpu neurons per layer, metadata) with every layer's ids checked sorted, unique and in [0, F)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: placement file not found")
    tensors = open_safetensors(path)
    try:
        meta = {k: json.loads(v) for k, v in read_header(path)[2].items()}
    except json.JSONDecodeError:
        raise UserError(f"{path}: corrupt metadata") from None
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
