"""Decode benchmark (DESIGN section 5): a synthetic model of a real shape, dense vs predictor-sparse, against the
machine's read bandwidth measured in the same run. Prints a llama-bench-like table."""

import json
from pathlib import Path

import click
import numpy as np

from fast.bench import (SHAPES, SyntheticSelect, bytes_per_token, overhead_per_token, predictor_size, random_engine,
                        read_bandwidth, shape_config, synthetic_predictors, time_decode)
from fast.engine import DenseSelect
from ref.cli import user_errors


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default="tinyllama-1.1b", show_default=True)
@click.option("--sparsity", type=float, default=0.9, show_default=True, help="Predicted sparsity: 1 - |P| / F.")
@click.option("--layers", type=int, default=None, help="Use only this many layers (a 7B shape in float32 needs 27 GB).")
@click.option("-t", "--threads", type=int, default=None, help="[default: all cores]")
@click.option("--tokens", type=int, default=16, show_default=True, help="Decode steps per run.")
@click.option("--runs", type=int, default=5, show_default=True)
@click.option("--probe-gib", type=float, default=2.0, show_default=True, help="Size of the read-bandwidth probe.")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
@user_errors
def main(shape, sparsity, layers, threads, tokens, runs, probe_gib, json_file):
    """Dense and sparse decode tok/s, bytes per token and roofline fraction, side by side."""
    if not 0 <= sparsity < 1:
        raise click.UsageError("--sparsity must be in [0, 1)")
    bw = read_bandwidth(probe_gib)
    read_gbs = max(bw.values())
    cfg = shape_config(shape, layers)
    engine = random_engine(cfg, threads)
    R = predictor_size(cfg)
    pred = synthetic_predictors(cfg, R)
    pred_params = pred.n_params
    results = {}
    engine.select = DenseSelect(cfg.d_ffn)
    dense = time_decode(engine, tokens, runs)
    results["dense"] = {"tok_s": float(np.median(dense)), "runs": dense,
                        "bytes_per_token": bytes_per_token(engine, cfg.d_ffn, 0)}
    select = SyntheticSelect(pred, cfg, sparsity)
    engine.select = select
    sparse = time_decode(engine, tokens, runs)
    results["sparse"] = {"tok_s": float(np.median(sparse)), "runs": sparse,
                         "bytes_per_token": bytes_per_token(engine, select.mean_active(), pred_params)}
    for r in results.values():
        r["roofline"] = r["tok_s"] * r["bytes_per_token"] / (read_gbs * 1e9)
    overhead = overhead_per_token(cfg, engine.threads)
    out = {"shape": shape, "layers": cfg.n_layers, "threads": engine.threads, "sparsity": sparsity,
           "predictor_hidden": R, "mean_active": select.mean_active(), "read_bandwidth_gbs": read_gbs,
           "read_probes_gbs": bw, **results, "ratio_sparse_dense": results["sparse"]["tok_s"] / results["dense"]["tok_s"],
           "overhead_ms_per_token": overhead * 1e3,
           "overhead_share_sparse": overhead * results["sparse"]["tok_s"]}
    size_gib = bytes_per_token(engine, cfg.d_ffn, 0) / 2**30
    click.echo(f"read bandwidth: {read_gbs:.1f} GB/s (numba probe {bw['numba']:.1f}, numpy {bw['numpy']:.1f})")
    click.echo("| model | size | params | backend | threads | test | t/s | GB/s | roofline |")
    click.echo("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |")
    for name, r in results.items():
        t = np.asarray(r["runs"])
        click.echo(f"| {shape} x{cfg.n_layers} F32 | {size_gib:.2f} GiB | {cfg.n_params / 1e9:.2f} B | numba-cpu {name} | "
                   f"{engine.threads} | tg{tokens} | {t.mean():.2f} ± {t.std():.2f} | {r['tok_s'] * r['bytes_per_token'] / 1e9:.1f} | "
                   f"{r['roofline']:.0%} |")
    click.echo(f"sparse/dense: {out['ratio_sparse_dense']:.2f}x at {sparsity:.0%} predicted sparsity "
               f"(mean {select.mean_active():.0f} of {cfg.d_ffn} neurons; predictors R={R}); "
               f"Python+dispatch overhead {overhead * 1e3:.2f} ms/token = {out['overhead_share_sparse']:.1%} of a sparse token")
    if json_file:
        json_file.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
