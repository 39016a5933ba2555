"""From a model config, an activations file, a budget and a hardware profile to a placement: what a placement is
solved for (`request`) and the solve (`place`)."""

from dataclasses import asdict
from pathlib import Path

from ref.common.artifacts import load_activations, sha256_file
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format

from placement.budget import GiB, Budget, Hardware, plan_budget
from placement.solver import Placement, solve


def request(cfg: ModelConfig, activations: Path, budget_gib: float, hw: Hardware, fmt: Format, ctx: int, group: int,
            min_cpu: str | int) -> dict:
    """What a placement is solved for; the placement file records it."""
    if budget_gib < 0:
        raise UserError(f"--vram-budget must be >= 0, got {budget_gib:g} GiB")
    budget = int(round(budget_gib * GiB))
    if hw.vram_bytes and budget > hw.vram_bytes:
        raise UserError(f"--vram-budget {budget_gib:g} GiB exceeds the {hw.name}'s {hw.vram_bytes / GiB:g} GiB")
    if not Path(activations).is_file():
        raise UserError(f"{activations}: activations file not found")
    return {"budget_bytes": budget, "hardware": hw.name, "hardware_profile": asdict(hw), "format": fmt.name,
            "ctx_size": ctx, "group": group, "min_cpu_neurons_request": str(min_cpu),
            "activations_sha256": sha256_file(activations)}


def place(cfg: ModelConfig, activations: Path, req: dict, hw: Hardware, predictor_params: list[int],
          time_limit: float = 10.0) -> tuple[Placement, Budget, dict]:
    """Budget the dense parts, then solve the neuron ILP; returns the placement, the budget and the file metadata."""
    counts, _, _ = load_activations(activations, cfg.n_layers, cfg.d_ffn)
    plan = plan_budget(cfg, FORMATS[req["format"]], req["ctx_size"], req["budget_bytes"], predictor_params)
    if req["min_cpu_neurons_request"] == "auto":
        min_cpu = [hw.min_cpu_neurons(plan.neuron_bytes, cfg.d_model)] * cfg.n_layers
    else:
        min_cpu = [int(req["min_cpu_neurons_request"])] * cfg.n_layers
    p = solve(counts, plan.neuron_bytes, plan.ffn_budget_bytes, min_cpu, req["group"], time_limit)
    meta = {**req, "dense_on_gpu": [n for n, _ in plan.on_gpu], "ffn_budget_bytes": plan.ffn_budget_bytes,
            "neuron_bytes": plan.neuron_bytes, **p.report()}
    return p, plan, meta
