"""One table of scripts/bench_gpu.py's JSON results (scripts/device_check.sh prints it last): per weight format and
VRAM budget, the kernels' GB/s against a device copy, whole-layer offload and the hybrid engine's decode tok/s."""

import json
from pathlib import Path

import click

from ref.common.cli import user_errors
from ref.common.errors import UserError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("results", nargs=-1, type=click.Path(path_type=Path))
@user_errors
def main(results):
    """Print one markdown table of bench_gpu.py --json RESULTS."""
    runs = []
    for path in results:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a bench_gpu.py result ({type(e).__name__})")
    if not runs:
        raise UserError("no results given")
    click.echo("| shape | type | kernels GB/s (copy / sparse_ffn / sparse_rows) | budget | layers: GPU layers, t/s | "
               "hybrid: GPU neurons, t/s | hybrid / layers |")
    click.echo("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for run in runs:
        k = run["kernels_gbs"]
        gbs = f"{k['copy']:.0f} / {k['sparse_ffn']:.0f} / {k['sparse_rows']:.0f}"
        for r in run["decode"]:
            click.echo(f"| {run['shape']} | {run['type']} | {gbs} | {r['budget_share']:.0%} | {r['gpu_layers']}, "
                       f"{r['layers_tok_s']:.2f} | {r['gpu_neurons_share']:.0%}, {r['hybrid_tok_s']:.2f} | "
                       f"{r['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
