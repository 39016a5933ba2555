"""Decode attention at depth: one token's attention over every layer's cached keys and values (fast.cpu.self_attention,
the kernel a decode step runs), per KV cache format, against the machine's read bandwidth measured in the same run.

A layer's slot holds `depth` positions; a token walks all layers' slots as a decode step does (22 of TinyLlama's:
92 MB of f32 keys and values at depth 2,048, more than the caches), then the slots are rewound. Attention,
probe pass, attention, ...: each pass's GB/s is set against the probe passes on either side of it, and the table
reports medians.

Dimensions: L layers, K kv heads, S depth, E head dim.
"""

import time

import click
import numba
import numpy as np

from fast import cpu
from fast.bench import ReadProbe
from fast.engine import rope_tables
from ref.common.batch import kv_format
from ref.common.cli import positive_list, user_errors
from ref.common.config import SHAPES, shape_config
from ref.quant import blocks, quantize

F32 = np.float32


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", type=click.Choice(list(SHAPES)), default="tinyllama-1.1b", show_default=True)
@click.option("--depths", default="512,1024,2048,4096", show_default=True, metavar="S[,S...]",
              help="Cached positions before the token.")
@click.option("--layers", type=int, default=None, help="Use only this many layers [default: the shape's].")
@click.option("--runs", type=click.IntRange(min=1), default=15, show_default=True, help="Tokens timed per depth.")
@click.option("--probe-gib", type=float, default=0.5, show_default=True, help="Size of one read-bandwidth probe pass.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="[default: numba's]")
@click.option("--kv", "kv_types", default="f32,f16", show_default=True, metavar="T[,T...]",
              help="KV cache formats to time, keys and values alike (f32, f16, bf16, q8_0).")
@user_errors
def main(shape, depths, layers, runs, probe_gib, threads, kv_types):
    """Decode attention GB/s and roofline fraction per depth."""
    depths = positive_list(depths, "--depths")
    if threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    cfg = shape_config(shape, layers, context=max(depths) + 1)
    L, H, K, E = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = rope_tables(cfg)
    rng = np.random.default_rng(0)
    probe = ReadProbe(probe_gib)
    formats = [kv_format(name.strip(), "--kv", E) for name in kv_types.split(",") if name.strip()]
    print(f"| shape | KV | depth | KV MB read | ms / token (all {L} layers) | GB/s | roofline |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for S in depths:
        for fmt in formats:
            slots = [tuple(blocks(quantize(rng.standard_normal((K, S + 1, E)), fmt)) for _ in range(2))
                     for _ in range(L)]  # [K, room, E / block] each, as fast.engine's cache holds them
            qkv = rng.standard_normal((1, (H + 2 * K) * E)).astype(F32)
            att = np.empty((1, H * E), F32)

            def token():
                t0 = time.perf_counter()
                for k, v in slots:
                    cpu.self_attention(att, qkv, k, v, cos, sin, S)
                return time.perf_counter() - t0
            token()
            nbytes = 2 * L * K * (S + 1) * fmt.row_bytes(E)
            seconds, fractions, probes = [], [], [probe()]
            for _ in range(runs):
                seconds.append(token())
                probes.append(probe())
                fractions.append(nbytes / seconds[-1] / 1e9 / ((probes[-2] + probes[-1]) / 2))
            ms = float(np.median(seconds)) * 1e3
            print(f"| {shape} | {fmt.name} | {S} | {nbytes / 1e6:.4g} | {ms:.2f} | {nbytes / ms / 1e6:.1f} | "
                  f"{100 * float(np.median(fractions)):.0f} % |")
    print(f"\nthreads: {numba.get_num_threads()}; read probe: {np.median(probes):.1f} GB/s (median of the last depth's)")


if __name__ == "__main__":
    main()
