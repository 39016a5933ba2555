"""`python -m fast.run [MODEL_DIR] -p PROMPT -n N`: generate with the fast engine, llama.cpp-style."""

from ref.common.errors import UserError, ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import json
import time
from pathlib import Path

import click

from fast.load import DEVICES, POLICIES, load_engine, say_compiling
from ref.common.cli import (FORMAT_CHOICE, ActivationSparsityFlags, Generation, PredictorFlags,
                            activation_sparsity_options, generate_session, generation_options, predictor_options,
                            user_errors)
from ref.common.tokenizer import load_tokenizer
from ref.common.artifacts import EMBEDDED


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@generation_options
@click.option("-t", "--threads", type=int, default=None,
              help="CPU threads [default: the cores other processes leave idle].")
@click.option("--type", "type_", type=FORMAT_CHOICE, default=None,
              help="Weight format to run in [default: as stored; f32 on a GPU].")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
              help="cpu; gpu: every layer on the GPU; hybrid: PowerInfer's split of hot and cold neurons (needs CUDA).")
@click.option("--vram-budget", type=float, default=None, help="GiB of GPU memory (gpu/hybrid) [default: 90% of the card].")
@click.option("--placement", type=click.Path(path_type=Path), default=None, help="Placement file [default: solved for the budget].")
@click.option("--policy", type=click.Choice(POLICIES), default="hybrid", show_default=True,
              help="hybrid: PowerInfer's neuron split; layers: llama.cpp-style whole layers on the GPU.")
@predictor_options
@activation_sparsity_options
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None, help="Write a timing summary as JSON.")
@user_errors
def main(gen: Generation, pred: PredictorFlags, act: ActivationSparsityFlags, threads, type_, device, vram_budget,
         placement, policy, json_file):
    """Generate text from MODEL_DIR (an HF folder or a GGUF file; default: the shipped model) with the numba engine."""
    model_dir = gen.check().model_dir
    pred.check(), act.check()
    if device == "cpu":
        gpu_only = [flag for flag, value in (("--vram-budget", vram_budget), ("--placement", placement),
                                             ("--policy", policy if policy != "hybrid" else None)) if value is not None]
        if gpu_only:
            raise UserError(f"{gpu_only[0]} places weights on a GPU: it needs --device gpu or hybrid")
    if json_file is not None and not json_file.parent.is_dir():
        raise UserError(f"--json {json_file}: folder {json_file.parent} does not exist")
    predictors = pred.options(model_dir)
    t0 = time.perf_counter()
    engine = load_engine(model_dir, device=device, placement=placement, vram_budget=vram_budget, threads=threads,
                         policy=policy, type_=type_, notice=say_compiling, cache_types=gen.cache_types, **predictors,
                         **act.options())
    tok = load_tokenizer(model_dir)
    load_seconds = time.perf_counter() - t0
    given = predictors["predictors"]
    source = f"{model_dir}'s own" if given == EMBEDDED else given
    mode = f"sparse ({source}, threshold {engine.selector.threshold})" if engine.selector.predicts else "dense"
    mode += act.about()
    threads_line = f"{engine.threads} thread{'s' if engine.threads > 1 else ''}"
    about = (f"; {threads_line}; weights {engine.format.name}; FFN {mode}; KV cache {'/'.join(engine.kv_types)}; "
             f"kernels ready in {engine.compile_seconds:.2f} s")
    out, timings = generate_session(engine, tok, gen, load_seconds, about)
    if json_file:
        json_file.write_text(json.dumps({
            "load_seconds": load_seconds, "compile_seconds": engine.compile_seconds, "threads": engine.threads,
            "type": engine.format.name,
            "sparse": engine.selector.predicts, "sparsity": act.sparsity or 0.0, "prompt_tokens": timings.prompt_tokens, "prompt_seconds": timings.prompt_seconds,
            "eval_tokens": timings.eval_tokens, "eval_seconds": timings.eval_seconds,
            "eval_tok_s": timings.eval_tokens / timings.eval_seconds if timings.eval_seconds else 0.0,
            "generated": len(out), "stop": timings.stop}, indent=2) + "\n")


if __name__ == "__main__":
    main()
