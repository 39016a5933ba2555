"""Placement solver benchmark: LLaMA-7B/13B/70B shapes with synthetic power-law firing counts.

For each shape and FFN budget (a share of all FFN neurons), solves the ILP with the communication constraint on
(C_l from a hardware profile) and reports solve time, status, gap, and the objective against the greedy top-k made
feasible (`repair`). `binds` counts the layers where the plain greedy top-k would leave fewer than C_l neurons on
the CPU (but some): only there can the ILP beat greedy; with the constraint slack everywhere the two are equal.
"""

import itertools
import json
from pathlib import Path

import click

from placement.budget import HARDWARE
from placement.solver import Groups, greedy, repair, solve
from placement.synthetic import synthetic_counts
from ref.common.cli import user_errors
from ref.common.config import shape_config
from ref.common.errors import UserError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shapes", default="llama-7b,llama-13b,llama-70b", show_default=True)
@click.option("--shares", default="0.25,0.5,0.9,0.99", show_default=True, help="FFN budget as shares of all FFN neurons.")
@click.option("--hardware", default="rtx4090", show_default=True, help="Profile whose C_l applies.")
@click.option("--group", default=64, show_default=True)
@click.option("--time-limit", default=30.0, show_default=True)
@click.option("--backends", default="cpsat", show_default=True, help="cpsat, scip or both: cpsat,scip")
@click.option("--gpus", default="1", show_default=True, help="GPU counts to solve for, the budget split evenly: 1,2,4")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
@user_errors
def main(shapes, shares, hardware, group, time_limit, backends, gpus, json_file):
    """Solve time, gap and objective vs greedy for real model shapes."""
    hw = HARDWARE[hardware]
    rows = []
    click.echo(f"{'shape':10} | {'budget':>6} | {'GPUs':>4} | {'backend':7} | {'groups':>6} | {'C_l':>4} | {'binds':>5} | {'status':8} | "
               f"{'seconds':>7} | {'gap':>8} | obj/greedy")
    for name in shapes.split(","):
        cfg = shape_config(name)
        L, F, D = cfg.n_layers, cfg.d_ffn, cfg.d_model
        counts = synthetic_counts(L, F, seed=0)
        neuron_bytes = cfg.ffn_matrices * D * 2  # fp16 rows of each neuron's bundle
        min_cpu = [hw.min_cpu_neurons(neuron_bytes, D)] * L
        groups = Groups.build(counts, group)
        for share, k in itertools.product(map(float, shares.split(",")), map(int, gpus.split(","))):
            budgets = [int(share * L * F / k) * neuron_bytes] * k
            plain = greedy(groups, [b // neuron_bytes for b in budgets])
            binds = sum(0 < F - int(groups.sizes[l][w >= 0].sum()) < min_cpu[l] for l, w in enumerate(plain))
            g = repair(groups, plain, min_cpu)
            greedy_obj = sum(int(groups.weights[l][w >= 0].sum()) for l, w in enumerate(g))
            for backend in backends.split(","):
                try:
                    p = solve(counts, neuron_bytes, budgets, min_cpu, group, time_limit, backend=backend)
                except UserError as e:  # SCIP finds nothing within the limit on the largest shapes
                    click.echo(f"{name:10} | {share:6.0%} | {k:4d} | {backend:7} | {e}")
                    continue
                row = {"shape": name, "share": share, "gpus": k, "backend": backend,
                       "groups": sum(len(s) for s in groups.sizes),
                       "min_cpu": min_cpu[0], "binds": binds, "status": p.status, "seconds": p.solve_seconds, "gap": p.gap,
                       "objective": p.objective, "greedy": greedy_obj}
                rows.append(row)
                click.echo(f"{name:10} | {share:6.0%} | {k:4d} | {backend:7} | {row['groups']:6d} | {min_cpu[0]:4d} | {binds:5d} | {p.status:8} | "
                           f"{p.solve_seconds:7.2f} | {p.gap:8.1e} | {p.objective / max(greedy_obj, 1):.6f}")
    if json_file:
        json_file.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
