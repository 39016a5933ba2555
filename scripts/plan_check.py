"""The planner's CPU-only decode predictions (placement.cost.cpu_only) against scripts/bench.py on this machine:
shapes x formats, dense and sparse, each case a bench run whose own read probe gives the bandwidth the prediction
uses. Prints predicted, measured and the error per case, and how many are within 15 %.

With --calibrate it measures the CPU kernels' constants (placement.cost.Kernels) instead, on a shape the check does
not predict (LLaMA-13B's cut to 4 layers), and prints them.

    python scripts/plan_check.py
    python scripts/plan_check.py --calibrate
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

from placement.cost import CPU_KERNELS, Kernels, Parts, cpu_only
from placement.synthetic import firing
from ref.common.config import shape_config
from ref.common.formats import FORMATS
from ref.predictor import predictor_size

ROOT = Path(__file__).resolve().parent.parent

CASES = [("tinyllama-1.1b", None), ("opt-1.3b", None), ("llama-7b", 8)]  # (shape, layers)
CALIBRATION = ("llama-13b", 4)


def bench(shape: str, layers: int | None, fmt: str, sparsity: float, threads: int, tokens: int, runs: int) -> dict:
    """One scripts/bench.py run in its own process (its memory goes with it): its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--shape", shape, "--type", fmt, "--sparsity",
               str(sparsity), "--tokens", str(tokens), "--runs", str(runs), "-t", str(threads), "--probe-gib", "0.5",
               "--json", str(out), *(["--layers", str(layers)] if layers else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise click.ClickException(f"{' '.join(cmd[1:])}: {r.stderr.strip().splitlines()[-1:]}")
        return json.loads(out.read_text())


def parts(shape: str, layers: int | None, fmt: str) -> Parts:
    cfg = shape_config(shape, layers)
    return Parts.of(cfg, FORMATS[fmt], predictor_hidden=predictor_size(cfg))


def predict(p: Parts, fmt: str, sparsity: float, bandwidth: float, kernels: Kernels = CPU_KERNELS) -> tuple:
    """(dense, sparse) predictions at `bandwidth` bytes/s."""
    active = np.full(p.cfg.n_layers, firing(p.cfg.d_ffn, sparsity).sum())
    return (cpu_only(p, FORMATS[fmt], bandwidth, None, kernels),
            cpu_only(p, FORMATS[fmt], bandwidth, active, kernels))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--formats", default="f16,q8_0,q4_0", show_default=True)
@click.option("--sparsity", type=float, default=0.9, show_default=True)
@click.option("-t", "--threads", type=int, default=2, show_default=True)
@click.option("--tokens", type=int, default=8, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--calibrate", is_flag=True, help="Measure placement.cost.CPU_KERNELS' constants instead.")
def main(formats, sparsity, threads, tokens, runs, calibrate):
    """Predicted vs measured CPU-only decode (or, with --calibrate, the constants the prediction uses)."""
    formats = formats.split(",")
    if calibrate:
        from fast.bench import overhead_per_token
        # A step's fixed time, a + b L: the benchmark's step over near-empty matrices at 2 and 32 layers.
        small, large = (overhead_per_token(shape_config("tinyllama-1.1b", n), threads) for n in (2, 32))
        per_layer = (large - small) / 30
        fixed_kernels = Kernels(token_seconds=small - 2 * per_layer, layer_seconds=per_layer)
        shape, layers = CALIBRATION
        dense, sparse = {}, {}
        for fmt in formats:
            b = bench(shape, layers, fmt, sparsity, threads, tokens, runs)
            p = parts(shape, layers, fmt)
            L, B = p.cfg.n_layers, b["read_bandwidth_gbs"] * 1e9
            fixed = fixed_kernels.fixed(L)
            dense_bytes = p.dense_token
            dense[fmt] = dense_bytes / (B * (1 / b["dense"]["tok_s"] - fixed))
            rows_bytes = L * (p.attention + p.predictor) + p.output  # a sparse token's whole rows
            ffn = L * firing(p.cfg.d_ffn, sparsity).sum() * p.neuron
            sparse[fmt] = ffn / (B * (1 / b["sparse"]["tok_s"] - fixed - rows_bytes / (B * dense[fmt])))
            click.echo(f"{fmt}: probe {B / 1e9:.1f} GB/s, dense {b['dense']['tok_s']:.2f} t/s, sparse "
                       f"{b['sparse']['tok_s']:.2f} t/s; bytes ours / bench's: dense "
                       f"{dense_bytes / b['dense']['bytes_per_token']:.3f}, sparse "
                       f"{(rows_bytes + ffn) / b['sparse']['bytes_per_token']:.3f}")
        click.echo(f"Kernels(dense={ {f: round(float(v), 2) for f, v in dense.items()} }, "
                   f"sparse={ {f: round(float(v), 2) for f, v in sparse.items()} }, "
                   f"token_seconds={fixed_kernels.token_seconds:.2e}, layer_seconds={per_layer:.2e})")
        return
    click.echo("| shape | type | probe GB/s | dense predicted / measured t/s | error | sparse predicted / measured t/s "
               "| error |")
    click.echo("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    errors = []
    for (shape, layers), fmt in ((c, f) for c in CASES for f in formats):
        b = bench(shape, layers, fmt, sparsity, threads, tokens, runs)
        B = b["read_bandwidth_gbs"] * 1e9
        d, s = predict(parts(shape, layers, fmt), fmt, sparsity, B)
        e = [d.tok_s / b["dense"]["tok_s"] - 1, s.tok_s / b["sparse"]["tok_s"] - 1]
        errors += e
        name = f"{shape}" + (f" x{layers}" if layers else "")
        click.echo(f"| {name} | {fmt} | {B / 1e9:.1f} | {d.tok_s:.2f} / {b['dense']['tok_s']:.2f} | {e[0]:+.1%} | "
                   f"{s.tok_s:.2f} / {b['sparse']['tok_s']:.2f} | {e[1]:+.1%} |")
    within = sum(abs(e) <= 0.15 for e in errors)
    click.echo(f"{within} of {len(errors)} predictions within 15 % of the measured decode; median |error| "
               f"{float(np.median(np.abs(errors))):.1%}")


if __name__ == "__main__":
    main()
