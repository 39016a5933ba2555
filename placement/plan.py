"""`python -m placement.plan MODEL_OR_SHAPE --hardware NAME`: what a machine will give before it is bought or the
model downloaded. For the CPU alone (dense and sparse), llama.cpp's whole layers on the GPU and PowerInfer's neurons
placed by the ILP: the bytes a decode token reads on each device, the predicted decode and prompt tok/s
(placement.cost), and what the GPU and the host hold (weights, predictors, keys and values for -c). A prediction
from a cost model, not a measurement: scripts/plan_check.py compares it with scripts/bench.py on this machine."""

import dataclasses
import json
import sys
from pathlib import Path

import click
import numpy as np

from placement.budget import GiB, HARDWARE, load_hardware
from placement.cost import (CPU_KERNELS, GPU_EFFICIENCY, Parts, cpu_only, flops_per_byte, layers_on_gpu, neurons_placed,
                            prompt_seconds)
from placement.synthetic import firing
from ref.common.artifacts import load_activations
from ref.common.cli import FORMAT_CHOICE, old_sparsity_option, user_errors
from ref.common.config import SHAPES, ModelConfig, shape_config
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.predictor import predictor_size


def model_config(model: str, layers: int | None) -> tuple[ModelConfig, Path | None]:
    """A model folder's config (and the folder), or a shape by name (SHAPES), cut to `layers` where asked."""
    path = Path(model)
    if path.is_dir():
        cfg = ModelConfig.from_hf(path)
        if layers is not None:
            raise UserError("--layers: only for a shape by name, not a model folder")
        return cfg, path
    if model in SHAPES:
        return shape_config(model, layers), None
    raise UserError(f"MODEL_OR_SHAPE: '{model}' is neither a model folder nor a shape ({', '.join(SHAPES)})")


def firing_of(cfg: ModelConfig, folder: Path | None, sparsity: float | None) -> tuple[np.ndarray, str]:
    """Each neuron's firing probability [L, F]: the folder's profile (activations.safetensors) unless
    --predicted-sparsity asks for a power law with that mean."""
    if sparsity is None and folder is not None and (folder / "activations.safetensors").is_file():
        counts, tokens, _ = load_activations(folder / "activations.safetensors", cfg.n_layers, cfg.d_ffn)
        return counts / max(tokens, 1), f"profiled firing ({folder / 'activations.safetensors'})"
    s = 0.9 if sparsity is None else sparsity
    if not 0 <= s < 1:
        raise UserError(f"--predicted-sparsity must be in [0, 1), got {s:g}")
    p = firing(cfg.d_ffn, s)
    rng = np.random.default_rng(0)
    return np.stack([p[rng.permutation(cfg.d_ffn)] for _ in range(cfg.n_layers)]), f"power-law firing, sparsity {s:g}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--hardware", default="rtx4090", show_default=True,
              help=f"A profile ({', '.join(HARDWARE)}) or a JSON file of the same fields.")
@click.option("--vram", type=float, default=None, help="GiB of GPU memory each GPU gives the model [default: all].")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs of the profile's kind.")
@click.option("--type", "type_", type=FORMAT_CHOICE, default="q4_0", show_default=True, help="Weight format.")
@click.option("--predicted-sparsity", "sparsity", type=float, default=None,
              help="Mean share of FFN neurons idle per token [default: the folder's profile, else 0.9].")
@old_sparsity_option
@click.option("-c", "--ctx-size", type=int, default=4096, show_default=True, help="Positions the KV cache holds.")
@click.option("--depth", type=click.IntRange(min=0), default=0, show_default=True,
              help="Positions cached when a token decodes (their keys and values are read).")
@click.option("--cpu-bandwidth", type=float, default=None, help="GB/s the CPU reads [default: the profile's].")
@click.option("--ram", type=float, default=None, help="GiB of host memory: plans that need more are marked.")
@click.option("--layers", type=int, default=None, help="Cut a shape to this many layers.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout instead of the table.")
@user_errors
def main(model, hardware, vram, gpus, type_, sparsity, ctx_size, depth, cpu_bandwidth, ram, layers, as_json):
    """Predicted decode tok/s of MODEL (a folder or a shape name) on a machine: CPU only, llama.cpp's layers on the
    GPU, PowerInfer's neuron placement."""
    cfg, folder = model_config(model, layers)
    hw = load_hardware(hardware)
    fmt = FORMATS[type_]
    if vram is not None and not 0 <= vram * GiB <= hw.vram_bytes:
        raise UserError(f"--vram {vram:g} GiB: the {hw.name} has {hw.vram_bytes / GiB:g} GiB")
    if ram is not None and not ram > 0:
        raise UserError(f"--ram must be a positive number of GiB, got {ram:g}")
    if ctx_size < 1 or depth > ctx_size:
        raise UserError(f"-c/--ctx-size must be >= 1 and >= --depth, got {ctx_size} (depth {depth})")
    bandwidth = (cpu_bandwidth or hw.cpu_bandwidth / 1e9) * 1e9
    budget = int((vram if vram is not None else hw.vram_bytes / GiB) * GiB)
    probs, source = firing_of(cfg, folder, sparsity)
    R = predictor_size(cfg)
    p = Parts.of(cfg, fmt, depth, predictor_hidden=R)
    cpu = dict(ctx=ctx_size, flops=hw.cpu_flops)
    rows = [cpu_only(p, fmt, bandwidth, None, **cpu), cpu_only(p, fmt, bandwidth, probs.sum(axis=1), **cpu)]
    if hw.vram_bytes:
        # llama.cpp splits the layers over the GPUs
        rows.append(layers_on_gpu(p, fmt, hw, bandwidth, ctx_size, gpus * budget, flops=hw.cpu_flops))
        rows.append(neurons_placed(p, fmt, hw, bandwidth, ctx_size, [budget] * gpus, probs,
                                   [R * (cfg.d_model + cfg.d_ffn)] * cfg.n_layers, flops=hw.cpu_flops))
    rows = [dataclasses.replace(r, prompt_seconds=prompt_seconds(r, p, fmt, hw)) for r in rows]
    kv = cfg.n_layers * ctx_size * p.kv_position
    fits = {r.plan: ram is None or r.host_resident <= ram * GiB for r in rows}
    if as_json:
        click.echo(json.dumps({"model": model, "hardware": hw.name, "gpus": gpus, "type": fmt.name, "firing": source,
                               "weights_bytes": p.weights, "predictors_bytes": cfg.n_layers * p.predictor,
                               "kv_bytes": kv, "ctx_size": ctx_size, "plans": [
                                   {"plan": r.plan, "cpu_bytes": r.cpu_bytes, "gpu_bytes": r.gpu_bytes,
                                    "tok_s": r.tok_s, "prompt_tok_s": r.prompt_tok_s,
                                    "gpu_resident_bytes": r.gpu_resident, "host_resident_bytes": r.host_resident,
                                    "fits_ram": fits[r.plan], "note": r.note}
                                   for r in rows]}))
        return
    click.echo(f"{model}: {cfg.n_params / 1e9:.2f} B parameters, {fmt.name} {p.dense_token / GiB:.2f} GiB a token reads "
               f"dense at depth {depth}; {source}; predictors of {R} hidden")
    card = (f"{gpus} x {hw.vram_bytes / GiB:g} GiB at {hw.gpu_bandwidth / 1e9:g} GB/s ({GPU_EFFICIENCY:.0%} of it "
            f"streamed), {hw.gpu_flops / 1e12:g} TFLOP/s, PCIe {hw.pcie_bandwidth / 1e9:g} GB/s; " if hw.vram_bytes
            else "no GPU; ")
    arithmetic = hw.cpu_flops * CPU_KERNELS.compute[fmt.name] / flops_per_byte(fmt)  # bytes/s of rows
    click.echo(f"{hw.name}: {card}CPU {bandwidth / 1e9:g} GB/s (this project's kernels: {CPU_KERNELS.dense[fmt.name]:.0%}"
               f" dense, {CPU_KERNELS.sparse[fmt.name]:.0%} sparse), {hw.cpu_flops / 1e12:g} TFLOP/s (its decode "
               f"arithmetic: {arithmetic / 1e9:.0f} GB/s of {fmt.name} rows)")
    click.echo(f"memory: weights {p.weights / GiB:.2f} GiB, predictors {cfg.n_layers * p.predictor / GiB:.2f} GiB, "
               f"keys and values of -c {ctx_size} {kv / GiB:.2f} GiB (f16)")
    click.echo("| plan | CPU reads / token | GPU reads / token | GPU holds | host holds | decode tok/s | prompt tok/s |")
    click.echo("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        host = f"{r.host_resident / GiB:.2f} GiB" + ("" if fits[r.plan] else " (over --ram)")
        click.echo(f"| {r.plan} | {r.cpu_bytes / 1e9:.3f} GB | {sum(r.gpu_bytes) / 1e9:.3f} GB | "
                   f"{sum(r.gpu_resident) / GiB:.2f} GiB | {host} | {r.tok_s:.2f} | {r.prompt_tok_s:.0f} |")
    for r in rows:
        if r.note:
            click.echo(f"{r.plan}: {r.note}")
    click.echo("Predicted, not measured: decode from the bytes each device reads, prompts from their multiply-adds "
               "(placement.cost).")


if __name__ == "__main__":
    sys.exit(main())
