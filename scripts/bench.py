"""Decode benchmark (DESIGN section 5): a synthetic model of a real shape, dense vs predictor-sparse, against the
machine's read bandwidth measured in the same run. Prints a llama-bench-like table.

Shared machines are noisy, so the measurements are interleaved: each round probes the read bandwidth (sustained
over about a second, as long as a run), then runs dense, then sparse; ratios and roofline fractions are taken
within a round and reported as medians over rounds.
"""

import json
from pathlib import Path

import click
import numpy as np

from fast.bench import (SHAPES, ReadProbe, SyntheticSelect, bytes_per_token, decode_tok_s, overhead_per_token,
                        predictor_size, random_engine, shape_config, synthetic_predictors)
from fast.engine import DenseSelect
from ref.cli import user_errors


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default="tinyllama-1.1b", show_default=True)
@click.option("--sparsity", type=float, default=0.9, show_default=True, help="Predicted sparsity: 1 - |P| / F.")
@click.option("--predictor-live", type=float, default=1.0, show_default=True,
              help="Share of predictor hidden units left nonzero by relu (the CPU skips the others' fc2 rows).")
@click.option("--layers", type=int, default=None, help="Use only this many layers (a 7B shape in float32 needs 27 GB).")
@click.option("-t", "--threads", type=int, default=None, help="[default: all cores]")
@click.option("--tokens", type=int, default=16, show_default=True, help="Decode steps per run.")
@click.option("--runs", type=int, default=7, show_default=True, help="Rounds (probe, dense, sparse), after one warm-up.")
@click.option("--probe-gib", type=float, default=1.0, show_default=True, help="Size of the read-bandwidth probe.")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
@user_errors
def main(shape, sparsity, predictor_live, layers, threads, tokens, runs, probe_gib, json_file):
    """Dense and sparse decode tok/s, bytes per token and roofline fraction, side by side."""
    if not 0 <= sparsity < 1:
        raise click.UsageError("--sparsity must be in [0, 1)")
    if not 0 < predictor_live <= 1:
        raise click.UsageError("--predictor-live must be in (0, 1]")
    if runs < 1 or tokens < 1:
        raise click.UsageError("--runs and --tokens must be >= 1")
    cfg = shape_config(shape, layers)
    engine = random_engine(cfg, threads)
    R = predictor_size(cfg)
    pred = synthetic_predictors(cfg, R)
    selects = {"dense": DenseSelect(cfg.d_ffn), "sparse": SyntheticSelect(pred, cfg, sparsity, len(engine.acc),
                                                                        predictor_live)}
    probe = ReadProbe(probe_gib)
    rounds = []
    for r in range(runs + 1):  # round 0 compiles and faults pages in; it is not counted
        bw = probe()
        row = {"read_gbs": bw["sustained"], "read_peak_gbs": bw["peak"]}
        for name, select in selects.items():
            engine.select = select
            row[name] = decode_tok_s(engine, tokens, r)
        if r:
            rounds.append(row)
    nbytes = {"dense": bytes_per_token(engine, cfg.d_ffn),
              "sparse": bytes_per_token(engine, selects["sparse"].mean_active(), selects["sparse"])}
    median = lambda f: float(np.median([f(row) for row in rounds]))  # noqa: E731
    results = {name: {"tok_s": median(lambda row: row[name]), "runs": [row[name] for row in rounds],
                      "bytes_per_token": nbytes[name],
                      "roofline": median(lambda row: row[name] * nbytes[name] / (row["read_gbs"] * 1e9))}
               for name in selects}
    overhead = overhead_per_token(cfg, engine.threads)
    out = {"shape": shape, "layers": cfg.n_layers, "threads": engine.threads, "sparsity": sparsity,
           "predictor_hidden": R, "predictor_live_units": selects["sparse"].live_fraction(), "mean_active": selects["sparse"].mean_active(),
           "read_bandwidth_gbs": median(lambda row: row["read_gbs"]), "rounds": rounds, **results,
           "ratio_sparse_dense": median(lambda row: row["sparse"] / row["dense"]),
           "overhead_ms_per_token": overhead * 1e3, "overhead_share_sparse": overhead * results["sparse"]["tok_s"]}
    size_gib = nbytes["dense"] / 2**30
    click.echo(f"read bandwidth: {out['read_bandwidth_gbs']:.1f} GB/s sustained over 1 s (median of {runs} probes, one "
               f"per round; best single pass {median(lambda row: row['read_peak_gbs']):.1f})")
    click.echo("| model | size | params | backend | threads | test | t/s | GB/s | roofline |")
    click.echo("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |")
    for name, r in results.items():
        t = np.asarray(r["runs"])
        click.echo(f"| {shape} x{cfg.n_layers} F32 | {size_gib:.2f} GiB | {cfg.n_params / 1e9:.2f} B | numba-cpu {name} | "
                   f"{engine.threads} | tg{tokens} | {t.mean():.2f} ± {t.std():.2f} | {r['tok_s'] * r['bytes_per_token'] / 1e9:.1f} | "
                   f"{r['roofline']:.0%} |")
    click.echo(f"sparse/dense: {out['ratio_sparse_dense']:.2f}x (median of per-round ratios) at {sparsity:.0%} predicted "
               f"sparsity (mean {out['mean_active']:.0f} of {cfg.d_ffn} neurons; predictors R={R}, "
               f"{out['predictor_live_units']:.0%} of hidden units live); "
               f"Python+dispatch overhead {overhead * 1e3:.2f} ms/token = {out['overhead_share_sparse']:.1%} of a sparse token")
    if json_file:
        json_file.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
