"""The planner's CPU-only decode predictions (placement.cost.cpu_only) against scripts/bench.py on this machine:
shapes x formats, dense and sparse, each case a bench run whose own read probe gives the bandwidth the prediction
uses (its FLOP/s: the cpu-only profile's, this machine's). Prints predicted, measured and the error per case, and how
many are within 15 %; with --passes N, every case N times in turn and each case's median error (the machine drifts
between minutes: a single run of a case can stray by more than 15 % at the same probe).

With --calibrate it measures the CPU kernels' constants (placement.cost.Kernels) instead, on shapes the check does
not predict (CALIBRATION), and prints them: the sparse FFN's share of the probe on its block alone (neuron_share),
then the dense share and the arithmetic fitted to whole tokens with it (fit); --passes N runs every case N times,
all taken together (the machine's bandwidth and arithmetic drift between minutes).

    python scripts/plan_check.py --passes 3
    python scripts/plan_check.py --calibrate --passes 2 --tokens 16 --runs 5
"""

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from fast import cpu
from fast.bench import ReadProbe, SyntheticSelector, overhead_per_token, random_engine, synthetic_predictors
from fast.engine import FFN_NORM, set_threads
from placement.budget import HARDWARE
from placement.cost import CPU_KERNELS, Kernels, Parts, cpu_only, cpu_seconds, cpu_token_bytes, flops_per_byte
from placement.synthetic import firing
from ref.common.cli import old_sparsity_option
from ref.common.config import shape_config
from ref.common.formats import FORMATS
from ref.predictor import predictor_size

ROOT = Path(__file__).resolve().parent.parent

CASES = [("tinyllama-1.1b", None), ("opt-1.3b", None), ("llama-7b", 8)]  # (shape, layers)
# Shapes the check does not predict, and the tokens each calibrates: LLaMA-13B's 5,120-wide rows and Llama-3.2-1B's
# 2,048-wide ones; Falcon-7B's sparse token (one kv head: its FFN is a fifth of its bytes, where LLaMA's is a tenth).
CALIBRATION = [("llama-13b", 4, ("dense", "sparse")), ("falcon-7b", 16, ("sparse",)),
               ("llama-3.2-1b", 8, ("dense", "sparse"))]
FLOPS = HARDWARE["cpu-only"].cpu_flops  # this machine's
NEURON_PASS = 64 * 2**20  # bytes of neurons a pass of neuron_share reads: twice the L3, so that they come from memory


def bench(shape: str, layers: int | None, fmt: str, sparsity: float, threads: int, tokens: int, runs: int) -> dict:
    """One scripts/bench.py run in its own process (its memory goes with it): its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--shape", shape, "--type", fmt, "--predicted-sparsity",
               str(sparsity), "--tokens", str(tokens), "--runs", str(runs), "-t", str(threads), "--probe-gib", "0.5",
               "--json", str(out), *(["--layers", str(layers)] if layers else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise click.ClickException(f"{' '.join(cmd[1:])}: {r.stderr.strip().splitlines()[-1:]}")
        return json.loads(out.read_text())


def neuron_share(shape: str, fmt: str, sparsity: float, threads: int, probe: ReadProbe, rounds: int = 5) -> float:
    """The sparse FFN block's share of the read probe's bandwidth on a token's neurons (Kernels.sparse), measured
    alone: each round a probe pass (which leaves none of them in the caches), the block of every layer of a random
    engine in turn over a power-law set each (SyntheticSelector), a probe pass; bytes counted as the planner counts
    them (whole bundles), time less the same calls' over empty sets (a call's fixed time, which Kernels.layer_seconds
    holds); the median of the rounds. Alone, because in a whole token the neurons are a tenth to a fifth of its
    bytes: a fit of whole tokens leaves their share a residual of a small part of the time."""
    one = parts(shape, 1, fmt)
    per_layer = cpu_token_bytes(one, active(one, sparsity))[1]
    cfg = dataclasses.replace(shape_config(shape, int(np.ceil(NEURON_PASS / per_layer))), vocab_size=64)
    e = random_engine(cfg, threads, fmt=FORMATS[fmt])
    sel = SyntheticSelector(synthetic_predictors(cfg, 16), cfg, sparsity)
    h, y = np.random.default_rng(0).standard_normal(cfg.d_model).astype(np.float32), np.empty(cfg.d_model, np.float32)
    none = np.zeros(0, np.int32)

    def block(empty: bool) -> tuple[float, float]:
        """(bytes, seconds) of every layer's block in turn."""
        n, t0 = 0.0, time.perf_counter()
        for l, L in enumerate(e.layers):
            active = none if empty else sel.pick(l, None)
            f = L.ffn
            cpu.ffn_block(y, e.acc, h, *e.norm_weights(L, FFN_NORM), f.bundle, f.bu, f.bd, active, len(active), e.kind,
                          e.thr, e.eps)
            n += len(active) * L.ffn.bundle[0].nbytes
        return n, time.perf_counter() - t0

    block(False)
    shares = []
    for _ in range(rounds):
        fixed = min(block(True)[1] for _ in range(3))
        before = probe()
        n, t = block(False)
        shares.append(n / (t - fixed) / ((before + probe()) / 2 * 1e9))
    return float(np.median(shares))


def fit(runs: list, fmt, sparse: float) -> tuple[float, float]:
    """(dense, compute) of Kernels from runs (whole-row bytes, neuron bytes, bandwidth, seconds less the fixed part),
    the neurons at the `sparse` share, each predicted as cpu_seconds does: for each arithmetic rate C on a grid, the
    dense share by least squares in relative error over the runs slower than C's roofline (the memory-bound ones),
    the C whose predictions err least in log."""
    best = None
    for C in [np.inf, *np.geomspace(10e9, 200e9, 120)]:
        memory = [r for r in runs if r[3] > 1.02 * (r[0] + r[1]) / C] or runs
        a = np.array([d / B / t for d, n, B, t in memory])  # 1 = a / dense + (n / B t) / sparse
        rest = np.array([1 - n / (B * sparse) / t for d, n, B, t in memory])
        inverse = float(a @ rest / (a @ a))
        if inverse <= 0:
            continue
        k = Kernels(dense={fmt.name: 1 / inverse}, sparse={fmt.name: sparse},
                    compute={fmt.name: C * flops_per_byte(fmt) / FLOPS})
        err = [np.log(cpu_seconds(d, n, fmt, B, k, FLOPS) / t) for d, n, B, t in runs]
        if best is None or np.sum(np.square(err)) < best[0]:
            best = (np.sum(np.square(err)), k)
    k = best[1]
    return k.dense[fmt.name], float(k.compute[fmt.name])


def parts(shape: str, layers: int | None, fmt: str) -> Parts:
    cfg = shape_config(shape, layers)
    return Parts.of(cfg, FORMATS[fmt], predictor_hidden=predictor_size(cfg))


def active(p: Parts, sparsity: float) -> np.ndarray:
    """The expected neurons a sparse token of p computes per layer [L] at the power law's `sparsity`."""
    return np.full(p.cfg.n_layers, firing(p.cfg.d_ffn, sparsity).sum())


def predict(p: Parts, fmt: str, sparsity: float, bandwidth: float, kernels: Kernels = CPU_KERNELS) -> tuple:
    """(dense, sparse) predictions at `bandwidth` bytes/s."""
    return (cpu_only(p, FORMATS[fmt], bandwidth, None, kernels, flops=FLOPS),
            cpu_only(p, FORMATS[fmt], bandwidth, active(p, sparsity), kernels, flops=FLOPS))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--formats", default="f16,q8_0,q4_0", show_default=True)
@click.option("--predicted-sparsity", "sparsity", type=float, default=0.9, show_default=True,
              help="Predicted FFN sparsity of the synthetic active sets.")
@old_sparsity_option
@click.option("-t", "--threads", type=int, default=2, show_default=True)
@click.option("--tokens", type=int, default=8, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--calibrate", is_flag=True, help="Measure placement.cost.CPU_KERNELS' constants instead.")
@click.option("--passes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Times to run every case: the check judges each case by its median error; --calibrate fits "
                   "them all together.")
def main(formats, sparsity, threads, tokens, runs, calibrate, passes):
    """Predicted vs measured CPU-only decode (or, with --calibrate, the constants the prediction uses)."""
    formats = formats.split(",")
    if calibrate:
        # A step's fixed time, a + b L: the benchmark's step over near-empty matrices at 2 and 32 layers.
        small, large = (overhead_per_token(shape_config("tinyllama-1.1b", n), threads) for n in (2, 32))
        per_layer = (large - small) / 30
        fixed_kernels = Kernels(token_seconds=small - 2 * per_layer, layer_seconds=per_layer)
        set_threads(threads)
        probe = ReadProbe(0.5)
        runs_, shares = {fmt: [] for fmt in formats}, {fmt: [] for fmt in formats}
        for fmt in formats * passes:  # a pass of every format, then the next
            for shape, layers, tokens_used in CALIBRATION:
                shares[fmt].append(neuron_share(shape, fmt, sparsity, threads, probe))
                b = bench(shape, layers, fmt, sparsity, threads, tokens, runs)
                p = parts(shape, layers, fmt)
                B, fixed = b["read_bandwidth_gbs"] * 1e9, fixed_kernels.fixed(p.cfg.n_layers)
                read = {"dense": cpu_token_bytes(p, None), "sparse": cpu_token_bytes(p, active(p, sparsity))}
                for kind in tokens_used:
                    runs_[fmt].append((*read[kind], B, 1 / b[kind]["tok_s"] - fixed))
                click.echo(f"{fmt} {shape} x{layers}: neurons alone {shares[fmt][-1]:.2f} of the probe; probe "
                           f"{B / 1e9:.1f} GB/s, dense {b['dense']['tok_s']:.2f} t/s, sparse "
                           f"{b['sparse']['tok_s']:.2f} t/s; bytes ours / bench's: dense "
                           f"{sum(read['dense']) / b['dense']['bytes_per_token']:.3f}, sparse "
                           f"{sum(read['sparse']) / b['sparse']['bytes_per_token']:.3f}")
        sparse = {fmt: float(np.median(shares[fmt])) for fmt in formats}
        kernels = {fmt: fit(runs_[fmt], FORMATS[fmt], sparse[fmt]) for fmt in formats}
        click.echo(f"Kernels(dense={ {f: round(k[0], 2) for f, k in kernels.items()} }, "
                   f"sparse={ {f: round(v, 2) for f, v in sparse.items()} }, "
                   f"token_seconds={fixed_kernels.token_seconds:.2e}, layer_seconds={per_layer:.2e}, "
                   f"compute={ {f: round(k[1], 2) for f, k in kernels.items()} })")
        return
    click.echo("| pass | shape | type | probe GB/s | dense predicted / measured t/s | error "
               "| sparse predicted / measured t/s | error |")
    click.echo("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    errors = {}  # (case, dense or sparse) -> one error per pass
    for n, (shape, layers), fmt in ((n, c, f) for n in range(passes) for c in CASES for f in formats):
        b = bench(shape, layers, fmt, sparsity, threads, tokens, runs)
        B = b["read_bandwidth_gbs"] * 1e9
        d, s = predict(parts(shape, layers, fmt), fmt, sparsity, B)
        name = f"{shape}" + (f" x{layers}" if layers else "") + f" | {fmt}"
        e = {"dense": d.tok_s / b["dense"]["tok_s"] - 1, "sparse": s.tok_s / b["sparse"]["tok_s"] - 1}
        for kind in e:
            errors.setdefault((name, kind), []).append(e[kind])
        click.echo(f"| {n + 1} | {name} | {B / 1e9:.1f} | {d.tok_s:.2f} / {b['dense']['tok_s']:.2f} | "
                   f"{e['dense']:+.1%} | {s.tok_s:.2f} / {b['sparse']['tok_s']:.2f} | {e['sparse']:+.1%} |")
    every = np.concatenate(list(errors.values()))
    click.echo(f"{np.sum(np.abs(every) <= 0.15)} of {every.size} runs' predictions within 15 % of the measured "
               f"decode; median |error| {float(np.median(np.abs(every))):.1%}")
    if passes > 1:
        median = {key: float(np.median(v)) for key, v in errors.items()}
        click.echo("\n| shape | type | dense: median error | sparse: median error |\n| --- | --- | ---: | ---: |")
        for name in dict.fromkeys(name for name, _ in median):
            click.echo(f"| {name} | {median[name, 'dense']:+.1%} | {median[name, 'sparse']:+.1%} |")
        click.echo(f"{sum(abs(m) <= 0.15 for m in median.values())} of {len(median)} cases within 15 % (the median "
                   f"error of {passes} passes each)")

if __name__ == "__main__":
    main()
