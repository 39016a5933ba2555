"""`python -m ref [MODEL_DIR] -p PROMPT -n N`: generate with the reference engine (readable, slow)."""

import time
from pathlib import Path

import click
import numpy as np

from ref import load_model
from ref.common.cli import Streamer, check_model_dir, print_timings, resolve_seed, sampling_options, user_errors
from ref.common.sampling import Timings, check_prompt, check_sampling, generate
from ref.common.tokenizer import load_tokenizer


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@sampling_options
@click.option("--predictors", type=click.Path(path_type=Path), default=None, help="Predictors file: predictor-gated sparse FFN.")
@click.option("--float64", "use_f64", is_flag=True, help="Compute in float64 (for verification).")
@user_errors
def main(model_dir, prompt, n_predict, seed, temp, top_k, top_p, min_p, repeat_penalty, ctx_size, predictors, use_f64):
    """Generate text from MODEL_DIR (default: the shipped model) with the NumPy reference engine."""
    check_sampling(n_predict, temp, top_k, top_p, min_p, repeat_penalty)
    check_model_dir(model_dir)
    t0 = time.perf_counter()
    model = load_model(model_dir, predictors=predictors, dtype=np.float64 if use_f64 else np.float32)
    tok = load_tokenizer(model_dir)
    load_seconds = time.perf_counter() - t0
    ids = tok.encode(prompt)
    check_prompt(ids, model.config, ctx_size)
    seed = resolve_seed(seed)
    click.echo(f"seed = {seed}", err=True)
    click.echo(prompt, nl=False)
    timings = Timings()
    generate(model, ids, n_predict, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
             repeat_penalty=repeat_penalty, seed=seed, ctx_size=ctx_size or None,
             on_token=Streamer(tok), timings=timings)
    print_timings(load_seconds, timings)


if __name__ == "__main__":
    main()
