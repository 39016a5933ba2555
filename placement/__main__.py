"""`python -m placement MODEL_DIR --activations FILE --vram-budget GiB --hardware NAME -o FILE`: solve neuron placement."""

import json
import sys
from pathlib import Path

import click

from ref.common.artifacts import load_activations, predictor_params, save_placement
from ref.common.cli import output_file, user_errors
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import format_of

from placement.budget import load_hardware
from placement.place import place, request


def min_cpu_option(value: str) -> str | int:
    if value == "auto":
        return value
    if not value.isdigit():
        raise UserError(f"--min-cpu-neurons must be 'auto' or an integer >= 0, got '{value}'")
    return int(value)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--activations", type=click.Path(path_type=Path), required=True, help="activations.safetensors from scripts/profile.py.")
@click.option("--vram-budget", type=float, required=True, help="GiB of GPU memory this model may use.")
@click.option("--hardware", required=True, help="Profile name (rtx4090, rtx2080ti, h200, cpu-only) or a JSON file.")
@click.option("--group", type=int, default=64, show_default=True, help="Neurons per ILP group.")
@click.option("--min-cpu-neurons", default="auto", show_default=True, help="C_l: 'auto' from the hardware, or N (0: off).")
@click.option("--time-limit", type=float, default=10.0, show_default=True, help="Solver seconds.")
@click.option("--dtype", default=None, help="Weight format on the GPU: f32, f16, bf16, q8_0, q4_0 (or a torch dtype) "
              "[default: config's torch_dtype].")
@click.option("-c", "--ctx-size", type=int, default=0, help="KV cache tokens [default: the model's context].")
@click.option("--predictors", type=click.Path(path_type=Path), default=None, help="Predictors file (their bytes are budgeted).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="placement.safetensors to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of the table.")
@user_errors
def main(model_dir, activations, vram_budget, hardware, group, min_cpu_neurons, time_limit, dtype, ctx_size,
         predictors, output, force, as_json):
    """Place each layer's most frequently firing FFN neurons on the GPU within a VRAM budget."""
    output_file(output, force)
    cfg = ModelConfig.from_hf(model_dir)
    hw = load_hardware(hardware)
    fmt = format_of(dtype or cfg.torch_dtype, "--dtype")
    if time_limit <= 0:
        raise UserError(f"--time-limit must be > 0, got {time_limit}")
    if predictors is None and (model_dir / "predictors.safetensors").is_file():
        predictors = model_dir / "predictors.safetensors"
    req = request(cfg, activations, vram_budget, hw, fmt, ctx_size or cfg.max_seq_len, group,
                  min_cpu_option(min_cpu_neurons))
    p, plan, meta = place(cfg, activations, req, hw, predictor_params(predictors, cfg.n_layers), time_limit)
    save_placement(output, p.gpu_neurons, meta)
    if as_json:
        click.echo(json.dumps({
            "status": p.status, "objective": p.objective, "bound": p.bound, "gap": p.gap,
            "solve_seconds": p.solve_seconds, "budget_bytes": plan.budget_bytes,
            "dense_on_gpu": meta["dense_on_gpu"], "ffn_budget_bytes": plan.ffn_budget_bytes,
            "neuron_bytes": plan.neuron_bytes, "gpu_neurons": [len(n) for n in p.gpu_neurons],
            "min_cpu_neurons": p.min_cpu_neurons}))
        return
    counts = load_activations(activations, cfg.n_layers, cfg.d_ffn)[0]
    click.echo(f"budget {plan.budget_bytes / 2**30:.3f} GiB on {hw.name}: headroom {plan.headroom_bytes / 2**20:.1f} MiB, "
               f"dense on GPU {sum(b for _, b in plan.on_gpu) / 2**20:.1f} MiB ({len(plan.on_gpu)} parts), "
               f"dense parts left on the CPU: {', '.join(n for n, _ in plan.on_cpu) or 'none'}")
    click.echo(f"FFN budget {plan.ffn_budget_bytes / 2**20:.1f} MiB = {plan.ffn_budget_bytes // plan.neuron_bytes:,} neurons "
               f"of {plan.neuron_bytes:,} bytes; C_l = {p.min_cpu_neurons[0] if p.min_cpu_neurons else 0}")
    click.echo("layer | GPU neurons | share of F | share of firings")
    for l, n in enumerate(p.gpu_neurons):
        cover = counts[l][n].sum() / max(counts[l].sum(), 1)
        click.echo(f"{l:5d} | {len(n):11,d} | {len(n) / cfg.d_ffn:10.1%} | {cover:16.1%}")
    total = sum(len(n) for n in p.gpu_neurons)
    covered = sum(counts[l][n].sum() for l, n in enumerate(p.gpu_neurons)) / max(counts.sum(), 1)
    click.echo(f"total | {total:11,d} | {total / (cfg.d_ffn * cfg.n_layers):10.1%} | {covered:16.1%}")
    click.echo(f"{p.status}: objective {p.objective:,.0f}, bound {p.bound:,.0f}, gap {p.gap:.2e}, "
               f"{p.solve_seconds:.2f} s; wrote {output}")


if __name__ == "__main__":
    sys.exit(main())
