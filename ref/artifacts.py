"""Offline artifact files (DESIGN section 3): atomic writes, hashes, numerically indexed layer keys."""

import hashlib
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ref.errors import UserError


def atomic_save(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write a safetensors file to a temp name in the same folder, then rename: never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths) -> str:
    """One hash over several files (a sharded checkpoint), in the order given."""
    h = hashlib.sha256()
    for p in paths:
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
