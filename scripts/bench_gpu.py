"""GPU benchmark (issue: fast/ on the GPU): per-kernel GB/s against a measured device-to-device copy, then decode
tok/s of the hybrid engine (PowerInfer's neuron placement) against the layer policy (llama.cpp-style whole layers)
at several VRAM budgets, on a synthetic model of a real shape. Prints a short table last."""

import json
import time
from pathlib import Path

import click
import numpy as np
from numba import cuda

from fast import gpu
from fast.bench import SyntheticSelector, random_engine, synthetic_predictors, time_decode
from fast.engine import Selector
from fast.hybrid import require_gpu, to_hybrid
from placement.budget import HARDWARE, plan_budget, whole_layers
from placement.solver import solve
from placement.synthetic import synthetic_counts
from ref.common.cli import FORMAT_CHOICE, old_sparsity_option, positive_list, user_errors
from ref.common.config import SHAPES, shape_config
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.predictor import predictor_size
from ref.quant import blocks, quantize

F32 = np.float32


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of `fn` over repeats, the device synchronised around each run."""
    fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_bandwidths(D: int, F: int, sparsity: float, fmt: str = "f32", input_sparsity: float = 0.5) -> dict:
    """GB/s of the bandwidth-bound kernels (bytes they must read / time) and of a device-to-device copy, weights in
    `fmt` (gpu.Weight: quants or bits plus block scales); sparse_rows reads the down rows as a stored transpose
    [F, D], `input_sparsity` of its inputs zero (activation sparsity's product)."""
    rng = np.random.default_rng(0)
    host = blocks(quantize(rng.random((F, 3, D), dtype=F32) - F32(0.5), fmt))
    bundle, wd = gpu.weight(host).to_device(), gpu.weight(np.ascontiguousarray(host[:, 2])).to_device()
    row_bytes = (bundle.q.nbytes + (bundle.d.nbytes if bundle.kind in gpu.QUANTIZED else 0)) // (3 * F)
    x = cuda.to_device(rng.random((1, D), dtype=F32))
    out_f, out_d = cuda.device_array((1, F), F32), cuda.device_array(D, F32)
    n = int((1 - sparsity) * F)
    active = cuda.to_device(np.sort(rng.choice(F, n, replace=False)).astype(np.int32))
    copy_dst = cuda.device_array_like(bundle.q)
    res = {"copy": 2 * bundle.q.nbytes / timed(lambda: copy_dst.copy_to_device(bundle.q)) / 1e9}  # read + write
    res["matmul"] = F * row_bytes / timed(lambda: gpu.matmul(out_f, x, wd)) / 1e9
    no_bias = cuda.to_device(np.zeros(0, F32))
    res["sparse_ffn"] = n * 3 * row_bytes / timed(lambda: gpu.sparse_ffn(out_d, None, x[0], bundle, no_bias, active, n, 0,
                                                                         F32(0))) / 1e9
    res["dense_ffn"] = F * 3 * row_bytes / timed(lambda: gpu.sparse_ffn(out_d, None, x[0], bundle, no_bias, cuda.to_device(
        np.arange(F, dtype=np.int32)), F, 0, F32(0))) / 1e9
    xs = cuda.to_device((rng.random((1, F), dtype=F32) * (rng.random((1, F)) >= input_sparsity)).astype(F32))
    kept = int(np.count_nonzero(xs.copy_to_host()))
    res["sparse_rows"] = kept * row_bytes / timed(lambda: gpu.sparse_rows(out_d.reshape(1, D), None, xs, wd,
                                                                          gpu.every_input(F), F)) / 1e9
    return res


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", type=click.Choice(list(SHAPES)), default="llama-7b", show_default=True)
@click.option("--budgets", default="0.1,0.25,0.5,1.0", show_default=True, help="VRAM budgets as shares of the model's bytes.")
@click.option("--predicted-sparsity", "sparsity", default=0.9, show_default=True,
              help="Predicted FFN sparsity of the synthetic active sets.")
@old_sparsity_option
@click.option("--activation-sparsity", default=0.5, show_default=True,
              help="Share of zero inputs in the input-sparse product's kernel (sparse_rows).")
@click.option("--tokens", default=8, show_default=True)
@click.option("--runs", default=3, show_default=True)
@click.option("--type", "type_", type=FORMAT_CHOICE, default="f32", show_default=True,
              help="Weight format of the synthetic model and the kernels.")
@click.option("-t", "--threads", type=int, default=None)
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
@user_errors
def main(shape, budgets, sparsity, activation_sparsity, tokens, runs, type_, threads, json_file):
    """Kernel GB/s vs copy, then hybrid vs layer policy decode tok/s per VRAM budget."""
    shares = positive_list(budgets, "--budgets", float)  # above 1: more VRAM than the model's bytes (a micro shape)
    require_gpu("scripts/bench_gpu.py")
    cfg = shape_config(shape)
    kernels = kernel_bandwidths(cfg.d_model, cfg.d_ffn, sparsity, type_, activation_sparsity)
    base = random_engine(cfg, threads, fmt=FORMATS[type_])
    pred = synthetic_predictors(cfg, predictor_size(cfg))
    model_bytes = sum(L.attn.nbytes() + L.ffn.nbytes() for L in base.layers) + base.lm_head.nbytes
    counts = synthetic_counts(cfg.n_layers, cfg.d_ffn, seed=0)
    hw = HARDWARE["h200"]
    rows = []
    for share in shares:
        budget = int(share * model_bytes)
        base.selector = Selector(cfg.d_ffn)
        layers = to_hybrid(base, *whole_layers(cfg, base.format, cfg.max_seq_len, budget))
        t_layers, layers_n = float(np.median(time_decode(layers, tokens, runs))), layers.n_gpu_layers
        del layers
        row = {"budget_share": share, "budget_gib": budget / 2**30, "gpu_layers": layers_n, "layers_tok_s": t_layers}
        try:
            plan = plan_budget(cfg, base.format, cfg.max_seq_len, budget, [pred.n_params // cfg.n_layers] * cfg.n_layers)
        except UserError:  # not even the scratch headroom and one attention fit: all on the CPU
            plan = plan_budget(cfg, base.format, cfg.max_seq_len, 0)
        min_cpu = [hw.min_cpu_neurons(plan.neuron_bytes, cfg.d_model)] * cfg.n_layers
        placed = solve(counts, plan.neuron_bytes, plan.ffn_budget_bytes, min_cpu, time_limit=10)
        base.selector = SyntheticSelector(pred, cfg, sparsity)
        hybrid = to_hybrid(base, placed.gpu_neurons, dense_on_gpu=[n for n, _ in plan.on_gpu])
        t_hybrid = float(np.median(time_decode(hybrid, tokens, runs)))
        row.update(gpu_attention=hybrid.n_gpu_layers, hybrid_tok_s=t_hybrid, speedup=t_hybrid / t_layers,
                   gpu_neurons_share=sum(map(len, placed.gpu_neurons)) / (cfg.n_layers * cfg.d_ffn))
        del hybrid
        rows.append(row)
    out = {"shape": shape, "type": type_, "kernels_gbs": kernels, "decode": rows}
    if json_file:
        json_file.write_text(json.dumps(out, indent=2) + "\n")
    click.echo(f"kernels ({shape} FFN shape, {type_}, {sparsity:.0%} sparse): "
               + ", ".join(f"{k} {v:.0f} GB/s" for k, v in kernels.items())
               + f"; sparse_ffn at {kernels['sparse_ffn'] / kernels['copy']:.0%} of copy")
    click.echo("| budget | GiB | layer policy: GPU layers | t/s | hybrid: GPU attention | GPU neurons | t/s | hybrid / layers |")
    click.echo("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        click.echo(f"| {r['budget_share']:.0%} | {r['budget_gib']:.1f} | {r['gpu_layers']} | {r['layers_tok_s']:.2f} | "
                   f"{r['gpu_attention']} | {r['gpu_neurons_share']:.0%} | {r['hybrid_tok_s']:.2f} | {r['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
