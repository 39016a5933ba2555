"""A checkpoint's weights by our names: the files of an HF folder, the exact key set and every shape checked against
the config, each tensor memory-mapped in its stored dtype."""

import json
from pathlib import Path

import numpy as np

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.names import IGNORED_SUFFIXES, expected_shapes, hf_name
from ref.common.safetensors import BF16, open_safetensors, release


def checkpoint_files(model_dir: Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise UserError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise UserError(f"{f}: shard listed in {index.name} is missing")
        return files
    if single.is_file():
        return [single]
    raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


class Weights:
    """The checked tensors of one checkpoint, by our names, memory-mapped in their stored dtype."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray], predictors=None, source: Path | None = None):
        self.config = cfg
        self.tensors = tensors
        self.predictors = predictors  # a PowerInfer file's own (ref.common.artifacts.Predictors), else None
        self.source = source  # the folder or file they were read from, for messages

    def __getitem__(self, name: str):
        return self.tensors[name]

    def release(self) -> None:
        """Drop the checkpoint pages read so far from this process's memory (a loader that copied them calls this)."""
        release(self.tensors.values())

    @staticmethod
    def load(model_dir: str | Path, cfg: ModelConfig) -> "Weights":
        """Load and check the exact key set and every shape against the config."""
        model_dir = Path(model_dir)
        found: dict[str, np.ndarray] = {}
        where: dict[str, Path] = {}
        for f in checkpoint_files(model_dir):
            for name, t in open_safetensors(f).items():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name in found:
                    raise UserError(f"{f}: tensor {name} also stored in {where[name]}")
                found[name], where[name] = t, f
        shapes = expected_shapes(cfg)
        wanted = {hf_name(cfg, n): n for n in shapes}
        missing = sorted(set(wanted) - set(found))
        extra = sorted(set(found) - set(wanted))
        if missing:
            raise UserError(f"{model_dir}: missing {len(missing)} tensor(s), first {missing[0]}")
        if extra:
            raise UserError(f"{model_dir}: {len(extra)} unexpected tensor(s), first {extra[0]}")
        tensors = {}
        for hf, ours in wanted.items():
            if not (isinstance(found[hf], BF16) or np.issubdtype(found[hf].dtype, np.floating)):
                raise UserError(f"{where[hf]}: tensor {hf} has dtype {found[hf].dtype}, weights must be floating point")
            if tuple(found[hf].shape) != shapes[ours]:
                raise UserError(f"{where[hf]}: tensor {hf} has shape {tuple(found[hf].shape)}, config.json implies {shapes[ours]}")
            tensors[ours] = found[hf]
        return Weights(cfg, tensors, source=model_dir)
