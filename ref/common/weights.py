"""A checkpoint's weights by our names: the files of an HF folder, the exact key set and every shape checked against
the config, each tensor memory-mapped in its stored dtype."""

from pathlib import Path

import numpy as np

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.artifacts import Predictors, check_predictor_shapes
from ref.common.names import CARRIED_PREDICTORS, IGNORED_SUFFIXES, PREFIXES, expected_shapes, hf_name
from ref.common.safetensors import BF16, checkpoint_files, open_safetensors, release, upcast


class Weights:
    """The checked tensors of one checkpoint, by our names, memory-mapped in their stored dtype."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray], predictors=None, source: Path | None = None,
                 sparsity=None):
        self.config = cfg
        self.tensors = tensors
        self.predictors = predictors  # a PowerInfer file's own (ref.common.artifacts.Predictors), else None
        self.sparsity = sparsity  # a GGUF file's activation-sparsity calibration (ref.common.artifacts.Thresholds)
        self.source = source  # the folder or file they were read from, for messages

    def __getitem__(self, name: str):
        return self.tensors[name]

    def release(self) -> None:
        """Drop the checkpoint pages read so far from this process's memory (a loader that copied them calls this);
        tensors not read from files (no `source`) have none."""
        if self.source is not None:
            release(self.tensors.values())

    @staticmethod
    def load(model_dir: str | Path, cfg: ModelConfig) -> "Weights":
        """Load and check the exact key set and every shape against the config."""
        model_dir = Path(model_dir)
        found: dict[str, np.ndarray] = {}
        where: dict[str, Path] = {}
        files = checkpoint_files(model_dir)
        for f in files:
            for name, t in open_safetensors(f).items():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name in found:
                    raise UserError(f"{f}: tensor {name} also stored in {where[name]}")
                found[name], where[name] = t, f
        cfg.check_bytes(sum(f.stat().st_size for f in files), model_dir / "config.json")  # before any per-layer list
        found, where = renamed(cfg, found, where)
        predictors = carried_predictors(cfg, found, where, model_dir)
        shapes = expected_shapes(cfg)
        wanted = {hf_name(cfg, n): n for n in shapes}
        if cfg.tie_word_embeddings and "lm_head" not in shapes and hf_name(cfg, "lm_head") in found:
            found.pop(hf_name(cfg, "lm_head"))  # a tied head saved as well (older exports): the embedding serves
        missing = sorted(set(wanted) - set(found))
        extra = sorted(set(found) - set(wanted))
        if missing:
            raise UserError(f"{model_dir}: missing {len(missing)} tensor(s), first {missing[0]}")
        if extra:
            raise UserError(f"{model_dir}: {len(extra)} unexpected tensor(s), first {extra[0]} (not part of a "
                            f"{cfg.architecture} as config.json describes it)")
        tensors = {}
        for hf, ours in wanted.items():
            check_float(where[hf], hf, found[hf])
            if tuple(found[hf].shape) != shapes[ours]:
                raise UserError(f"{where[hf]}: tensor {hf} has shape {tuple(found[hf].shape)}, config.json implies {shapes[ours]}")
            tensors[ours] = found[hf]
        return Weights(cfg, tensors, predictors, source=model_dir)


def check_float(file: Path, name: str, t) -> None:
    if not (isinstance(t, BF16) or np.issubdtype(t.dtype, np.floating)):
        raise UserError(f"{file}: tensor {name} has dtype {t.dtype}, weights must be floating point")


def renamed(cfg: ModelConfig, found: dict, where: dict) -> tuple[dict, dict]:
    """The tensors under the names of the family's table, where the checkpoint uses another prefix (PREFIXES)."""
    def rename(name):
        for theirs, ours in PREFIXES.get(cfg.family, {}).items():
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name
    return {rename(n): t for n, t in found.items()}, {rename(n): f for n, f in where.items()}


def carried_predictors(cfg: ModelConfig, found: dict, where: dict, model_dir: Path) -> Predictors | None:
    """The per-layer predictors a checkpoint carries (TurboSparse's mlp.predictor.fc1 / fc2), taken out of `found`:
    all layers' or none."""
    fc = {}
    for name in [n for n in found if CARRIED_PREDICTORS.fullmatch(n)]:
        l, which = CARRIED_PREDICTORS.fullmatch(name).groups()
        fc[int(l), which] = (name, found.pop(name))
    if not fc:
        return None
    for l in range(cfg.n_layers):
        for which in ("fc1", "fc2"):
            if (l, which) not in fc:
                raise UserError(f"{model_dir}: the checkpoint carries predictors but not layer {l}'s {which}")
    if len(fc) != 2 * cfg.n_layers:
        raise UserError(f"{model_dir}: predictors for layers beyond the model's {cfg.n_layers}")
    fc1, fc2 = [], []
    for l in range(cfg.n_layers):
        (n1, a), (n2, b) = fc[l, "fc1"], fc[l, "fc2"]
        check_float(where[n1], n1, a)
        check_float(where[n2], n2, b)
        check_predictor_shapes(where[n1], cfg, l, a, b)
        fc1.append(upcast(a))
        fc2.append(upcast(b))
    return Predictors(fc1, fc2, 0.0, {"source": str(model_dir)})
