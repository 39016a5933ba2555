"""Decode benchmark: a synthetic model of a real shape, dense vs predictor-sparse (or with activation sparsity:
--activation-sparsity), against the machine's read bandwidth measured in the same run. Prints a llama-bench-like
table.

Shared machines are noisy (the bandwidth a token gets moves within a second), so the measurements are interleaved
token by token: dense token, probe pass, sparse token, probe pass, ... Each token's roofline fraction is taken
against the probe passes on either side of it, the sparse/dense ratio step by step, and both are reported as
medians over all tokens of all rounds.
"""

import json
import tempfile
from pathlib import Path

import click
import numpy as np

from fast.bench import (LlamaCpp, ReadProbe, SyntheticSelector, bracketed_decode, busy_cores, bytes_per_token,
                        dense_twin, overhead_per_token, prefill_rounds, random_engine, random_gguf,
                        sequence_rounds, server_twin, synthetic_predictors, thinned_twin)
from ref.common.batch import KV_FORMATS
from ref.common.cli import FORMAT_CHOICE, cache_types, old_sparsity_option, positive_list, user_errors
from ref.common.config import SHAPES, shape_config
from ref.predictor import predictor_size
from ref.common.formats import FORMATS
from ref.quant import predictor_format, predictors_beside, quantize_predictors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", type=click.Choice(list(SHAPES)), default="tinyllama-1.1b", show_default=True)
@click.option("--predicted-sparsity", "sparsity", type=float, default=0.9, show_default=True,
              help="Predicted FFN sparsity: 1 - |P| / F (0: no predictors).")
@click.option("--activation-sparsity", type=float, default=None,
              help="The sparse run thins every linear layer's input (TEAL; thresholds drawn to drop this share of "
                   "each site's inputs): all of them with --predicted-sparsity 0, else attention's beside the "
                   "predictors.")
@old_sparsity_option
@click.option("--layers", type=int, default=None, help="Use only this many layers (a 7B shape in float32 needs 27 GB).")
@click.option("--type", "type_", type=FORMAT_CHOICE, default="f32", show_default=True,
              help="Weight format of the synthetic model.")
@click.option("--predictor-type", type=FORMAT_CHOICE, default=None,
              help="Format of the predictors [default: the weights', q8_0 for f16 and bf16].")
@click.option("-t", "--threads", type=int, default=None, help="[default: the cores other processes leave idle]")
@click.option("--busy", type=click.IntRange(min=0), default=0, show_default=True,
              help="Run this many spinning processes beside the benchmark (a machine something else uses).")
@click.option("--tokens", type=int, default=16, show_default=True, help="Decode steps per run.")
@click.option("--depth", type=click.IntRange(min=0), default=0, show_default=True,
              help="Cached positions before the decode steps (llama-bench's -d): a prompt of this many tokens, run "
                   "once, each round decoding after it.")
@click.option("--runs", type=int, default=7, show_default=True, help="Rounds of --tokens steps each, after one warm-up.")
@click.option("--probe-gib", type=float, default=1.0, show_default=True, help="Size of one read-bandwidth probe pass.")
@click.option("--pp", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also time an N-token prompt (prefill), dense, sparse, and dense on the server's kernels (0: no).")
@click.option("--sequences", default="", show_default=False, metavar="B[,B...]",
              help="Also time B sequences decoding together, one forward per step, and B = 1 the same way (comma-separated: a "
                   "curve).")
@click.option("--peer", "with_peer", is_flag=True,
              help="Also time llama.cpp (llama-cpp-python, the 'peer' extra) on a random GGUF of the same shape and format.")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(KV_FORMATS, case_sensitive=False),
              default="f16", show_default=True, help="Every engine's KV cache format for keys (llama-bench's default).")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(KV_FORMATS, case_sensitive=False),
              default="f16", show_default=True, help="... for values.")
@user_errors
def main(shape, sparsity, activation_sparsity, layers, type_, predictor_type, threads, busy, tokens, depth, runs,
         probe_gib, pp, sequences, with_peer, json_file, cache_type_k, cache_type_v):
    """Dense and sparse decode tok/s, bytes per token and roofline fraction, side by side."""
    with busy_cores(busy):
        run(shape, sparsity, layers, type_, predictor_type, threads, busy, tokens, runs, probe_gib, pp, sequences,
            with_peer, json_file, activation_sparsity, depth, cache_types(cache_type_k, cache_type_v))


def run(shape, sparsity, layers, type_, predictor_type, threads, busy, tokens, runs, probe_gib, pp, sequences, with_peer,
        json_file, activation_sparsity=None, depth=0, kv=("f16", "f16")):
    if not 0 <= sparsity < 1:
        raise click.UsageError("--predicted-sparsity must be in [0, 1)")
    if activation_sparsity is not None and not 0 < activation_sparsity < 1:
        raise click.UsageError("--activation-sparsity must be in (0, 1)")
    if runs < 1 or tokens < 1:
        raise click.UsageError("--runs and --tokens must be >= 1")
    batches = positive_list(sequences, "--sequences", empty=True)
    batches = sorted({1, *batches}) if batches else []  # B = 1 timed the same way: the scaling's denominator
    cfg = shape_config(shape, layers, context=max(2048, depth + tokens, pp))
    if with_peer and cfg.family != "llama":
        raise click.UsageError(f"--peer times llama.cpp on a GGUF of the LLaMA family (llama, qwen2, qwen3), which "
                               f"{shape} is not")
    engine = random_engine(cfg, threads, fmt=FORMATS[type_])
    R = predictor_size(cfg)
    pred = synthetic_predictors(cfg, R)
    if predictor_type:
        pfmt, pred = FORMATS[predictor_type], quantize_predictors(pred, predictor_type)
    else:  # as fast.load stores them: the format that goes with the weights
        pfmt, pred = predictor_format(engine.format, cfg.d_model), predictors_beside(pred, engine.format)
    # dense: laid out as fast.run lays out a run without predictors (dense_twin); sparse: the bundles and predictors
    engine.selector = SyntheticSelector(pred, cfg, sparsity)
    engines = {"dense": dense_twin(engine), "sparse": engine}
    kept = 1.0
    if activation_sparsity is not None:  # the sparse run: the dense one thinned, or the predictors' beside thinning
        engines["sparse"] = engine = thinned_twin(engines["dense"] if sparsity == 0 else engine, activation_sparsity,
                                                  ffn=sparsity == 0)
        kept = 1 - activation_sparsity
    for e in engines.values():  # every engine's KV cache in -ctk/-ctv, as llama.cpp's
        e.kv_types = kv
    probe = ReadProbe(probe_gib)
    with tempfile.TemporaryDirectory() as tmp:
        peer = None
        if with_peer:  # llama.cpp on a random GGUF of the same shape and format, timed token by token among ours
            random_gguf(cfg, engine.format, Path(tmp) / "peer.gguf")
            peer = LlamaCpp(Path(tmp) / "peer.gguf", engine.threads, max(depth + tokens, pp) + 2, kv)
        held = {}  # each engine's cache after the --depth prompt, run once
        rounds = [bracketed_decode(engines, probe, tokens, r, peer, depth, held)
                  for r in range(runs + 1)][1:]  # round 0 compiles
        del held
        prefill = prefill_rounds({**engines, "server": server_twin(engines["dense"])}, pp, runs, peer) if pp else {}
    together = {B: sequence_rounds(engines, B, tokens, runs) for B in batches}
    names = [*engines, *([LlamaCpp.name] if peer else [])]
    predicting = isinstance(engine.selector, SyntheticSelector)  # not: activation sparsity alone (--predicted-sparsity 0)
    active = engine.selector.mean_active() if predicting else cfg.d_ffn  # neurons a sparse token computes
    nbytes = {"dense": bytes_per_token(engines["dense"], cfg.d_ffn, depth=depth),
              "sparse": bytes_per_token(engine, active, kept, depth)}
    nbytes[LlamaCpp.name] = nbytes["dense"]  # the same dense model and KV formats
    seconds = {name: np.concatenate([r[name]["seconds"] for r in rounds]) for name in names}  # every token
    around = {name: np.concatenate([r[name]["around"] for r in rounds]) for name in names}  # its probe passes, GB/s
    tok_s = {name: [tokens / sum(r[name]["seconds"]) for r in rounds] for name in names}  # per round
    results = {name: {"tok_s": float(np.median(tok_s[name])), "runs": tok_s[name], "bytes_per_token": nbytes[name],
                      "roofline": float(np.median(nbytes[name] / seconds[name] / (around[name] * 1e9)))}
               for name in names}
    probes = np.concatenate([r["probes"] for r in rounds])
    steps = seconds["dense"] / seconds["sparse"]  # step-by-step token-time ratios
    by_bus = np.argsort((around["dense"] + around["sparse"]) / 2)  # steps by the speed of their probe passes
    halves = {"slower": by_bus[: max(1, len(steps) // 2)], "faster": by_bus[len(steps) // 2:]}  # one step: both halves
    overhead = overhead_per_token(cfg, engine.threads)
    out = {"shape": shape, "type": type_, "predictor_type": pfmt.name, "layers": cfg.n_layers, "threads": engine.threads, "busy": busy,
           "depth": depth,
           "sparsity": sparsity, "activation_sparsity": activation_sparsity,
           "predictor_hidden": R, "mean_active": active,
           "read_bandwidth_gbs": float(np.median(probes)), "read_peak_gbs": float(probes.max()), **results,
           "rounds": [{"read_gbs": float(np.median(r["probes"])), **{name: tok_s[name][i] for name in names}}
                      for i, r in enumerate(rounds)],
           "ratio_sparse_dense": float(np.median(steps)),
           "ratio_by_bus": {half: float(np.median(steps[pick])) for half, pick in halves.items()},
           "overhead_ms_per_token": overhead * 1e3, "overhead_share_sparse": overhead * results["sparse"]["tok_s"]}
    if pp:  # t/s: median of the runs
        out["pp"] = {"tokens": pp, **{f"{name}_tok_s": pp / float(np.median(t)) for name, t in prefill.items()}}
    curve = []
    agg = {B: {name: B * tokens / float(np.median(t)) for name, t in secs.items()} for B, secs in together.items()}
    for B in together:  # t/s: median of the runs; scaling against B = 1 timed the same way
        curve.append({"B": B, "tok_s": agg[B]["sparse"], "per_sequence_tok_s": agg[B]["sparse"] / B,
                      "scaling": agg[B]["sparse"] / agg[1]["sparse"], "union_neurons": engine.selector.mean_union(B) if predicting else cfg.d_ffn,
                      "dense": {"tok_s": agg[B]["dense"], "per_sequence_tok_s": agg[B]["dense"] / B,
                                "scaling": agg[B]["dense"] / agg[1]["dense"]}})
    if curve:  # the single record when one B was asked for, else the curve
        out["sequences"] = curve[-1] if len(curve) == 2 else curve
    if peer:  # step by step, as sparse/dense
        out["ratio_vs_llama_cpp"] = {name: float(np.median(seconds[LlamaCpp.name] / seconds[name])) for name in engines}
    size_gib = nbytes["dense"] / 2**30
    click.echo(f"read bandwidth: {out['read_bandwidth_gbs']:.1f} GB/s (median of {len(probes)} probe passes of "
               f"{probe.a.nbytes / 2**30:.2f} GiB between the tokens; best {out['read_peak_gbs']:.1f}); roofline = a token's "
               f"bytes/s over the passes either side of it, median over tokens; {busy} busy processes beside it")
    click.echo("| model | size | params | backend | threads | test | t/s | GB/s | roofline |")
    click.echo("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |")
    for name, r in results.items():
        t = np.asarray(r["runs"])
        backend = "llama.cpp cpu dense" if name == LlamaCpp.name else f"numba-cpu {name}"
        click.echo(f"| {shape} x{cfg.n_layers} {type_.upper()} | {size_gib:.2f} GiB | {cfg.n_params / 1e9:.2f} B | {backend} | "
                   f"{engine.threads} | tg{tokens}{f' @ d{depth}' if depth else ''} | {t.mean():.2f} ± {t.std():.2f} | "
                   f"{r['tok_s'] * r['bytes_per_token'] / 1e9:.1f} | "
                   f"{r['roofline']:.0%} |")
    for name, t in prefill.items():
        backend = "llama.cpp cpu dense" if name == LlamaCpp.name else f"numba-cpu {name}"
        click.echo(f"| {shape} x{cfg.n_layers} {type_.upper()} | {size_gib:.2f} GiB | {cfg.n_params / 1e9:.2f} B | {backend} | "
                   f"{engine.threads} | pp{pp} | {pp / np.median(t):.2f} ± {np.std(pp / np.asarray(t)):.2f} | | |")
    for c in curve:
        for name in engines:
            r = c if name == "sparse" else c[name]
            click.echo(f"| {shape} x{cfg.n_layers} {type_.upper()} | {size_gib:.2f} GiB | {cfg.n_params / 1e9:.2f} B | "
                       f"numba-cpu {name} | {engine.threads} | tg{tokens} x{c['B']} | {r['tok_s']:.2f} | | |")
    for c in curve:
        click.echo(f"{c['B']} sequences together: sparse {c['tok_s']:.2f} tok/s = {c['scaling']:.2f}x one sequence "
                   f"({c['per_sequence_tok_s']:.2f} each; union of their sets {c['union_neurons']:.0f} of {cfg.d_ffn} "
                   f"neurons), dense {c['dense']['tok_s']:.2f} tok/s = {c['dense']['scaling']:.2f}x")
    click.echo(f"sparse/dense: {out['ratio_sparse_dense']:.2f}x (median of step-by-step token-time ratios; "
               f"{out['ratio_by_bus']['faster']:.2f}x on the steps with the faster half of probe passes, "
               f"{out['ratio_by_bus']['slower']:.2f}x on the slower half) at "
               + (f"{sparsity:.0%} predicted sparsity (mean {out['mean_active']:.0f} of {cfg.d_ffn} neurons; predictors "
                  f"R={R}, {pfmt.name})" if predicting else "no predictors")
               + (f", {activation_sparsity:.0%} activation sparsity (TEAL)" if activation_sparsity else "") + "; "
               f"Python+dispatch overhead {overhead * 1e3:.2f} ms/token = {out['overhead_share_sparse']:.1%} of a sparse token")
    if peer:
        click.echo(f"vs llama.cpp (dense, same shape and format, KV cache {kv[0]}/{kv[1]} both, same run; "
                   "median of step-by-step token-time ratios): "
                   + ", ".join(f"{name} {r:.2f}x" for name, r in out["ratio_vs_llama_cpp"].items()))
    if json_file:
        json_file.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
