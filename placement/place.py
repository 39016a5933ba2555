"""From a model config, an activations file, a budget and a hardware profile to a placement file, or reuse one."""

from dataclasses import asdict
from pathlib import Path

import numpy as np

from ref.artifacts import layer_keys, sha256_file
from ref.config import ModelConfig
from ref.errors import UserError
from ref.profile import load_activations
from ref.weights import open_safetensors

from placement.budget import GiB, Budget, Hardware, plan_budget
from placement.solver import Placement, load_placement, matches, save_placement, solve


def predictor_params(path: Path | None, n_layers: int) -> list[int]:
    """Parameters of each layer's predictor from a predictors file's header (no weights read)."""
    if path is None or not Path(path).is_file():
        return []
    tensors = open_safetensors(Path(path))
    n = layer_keys(path, tensors, ("fc1.weight", "fc2.weight"))
    if n != n_layers:
        raise UserError(f"{path}: predictors for {n} layers, the model has {n_layers}")
    return [int(np.prod(tensors[f"layers.{l}.fc1.weight"].shape) + np.prod(tensors[f"layers.{l}.fc2.weight"].shape))
            for l in range(n)]


def request(cfg: ModelConfig, activations: Path, budget_gib: float, hw: Hardware, dtype: str, ctx: int, group: int,
            min_cpu: str | int) -> dict:
    """What a placement is solved for; a stored placement is reused only for an identical request."""
    if budget_gib < 0:
        raise UserError(f"--vram-budget must be >= 0, got {budget_gib:g} GiB")
    budget = int(round(budget_gib * GiB))
    if hw.vram_bytes and budget > hw.vram_bytes:
        raise UserError(f"--vram-budget {budget_gib:g} GiB exceeds the {hw.name}'s {hw.vram_bytes / GiB:g} GiB")
    if not Path(activations).is_file():
        raise UserError(f"{activations}: activations file not found")
    return {"budget_bytes": budget, "hardware": hw.name, "hardware_profile": asdict(hw), "dtype": dtype,
            "ctx_size": ctx, "group": group, "min_cpu_neurons_request": str(min_cpu),
            "activations_sha256": sha256_file(activations)}


def place(cfg: ModelConfig, activations: Path, req: dict, hw: Hardware, predictors: Path | None = None,
          time_limit: float = 10.0) -> tuple[Placement, Budget, dict]:
    """Budget the dense parts, then solve the neuron ILP; returns the placement, the budget and the file metadata."""
    counts, _, _ = load_activations(activations, cfg.n_layers, cfg.d_ffn)
    plan = plan_budget(cfg, req["dtype"], req["ctx_size"], req["budget_bytes"], predictor_params(predictors, cfg.n_layers))
    if req["min_cpu_neurons_request"] == "auto":
        min_cpu = [hw.min_cpu_neurons(plan.neuron_bytes, cfg.d_model)] * cfg.n_layers
    else:
        min_cpu = [int(req["min_cpu_neurons_request"])] * cfg.n_layers
    p = solve(counts, plan.neuron_bytes, plan.ffn_budget_bytes, min_cpu, req["group"], time_limit)
    meta = {**req, "dense_on_gpu": [n for n, _ in plan.on_gpu], "ffn_budget_bytes": plan.ffn_budget_bytes,
            "neuron_bytes": plan.neuron_bytes}
    return p, plan, meta


def load_or_place(cfg: ModelConfig, path: Path, activations: Path, req: dict, hw: Hardware,
                  predictors: Path | None = None, time_limit: float = 10.0) -> tuple[list, dict, bool]:
    """Reuse `path` if it was solved for exactly `req`, else solve and write it. Returns (gpu neurons, meta, reused)."""
    if Path(path).is_file():
        neurons, meta = load_placement(path, cfg.n_layers, cfg.d_ffn)
        if matches(meta, req):
            return neurons, meta, True
    p, _, meta = place(cfg, activations, req, hw, predictors, time_limit)
    save_placement(path, p, meta)
    return p.gpu_neurons, load_placement(path)[1], False
