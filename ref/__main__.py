"""`python -m ref [MODEL_DIR] -p PROMPT -n N`: generate with the reference engine (readable, slow)."""

from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import time
from pathlib import Path

import click
import numpy as np

from ref import load_model
from ref.common.cli import Generation, generate_session, generation_options, user_errors
from ref.common.tokenizer import load_tokenizer


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@generation_options
@click.option("--predictors", type=click.Path(path_type=Path), default=None, help="Predictors file: predictor-gated sparse FFN.")
@click.option("--float64", "use_f64", is_flag=True, help="Compute in float64 (for verification).")
@user_errors
def main(gen: Generation, predictors, use_f64):
    """Generate text from MODEL_DIR (default: the shipped model) with the NumPy reference engine."""
    gen.check()
    t0 = time.perf_counter()
    model = load_model(gen.model_dir, predictors=predictors, dtype=np.float64 if use_f64 else np.float32)
    tok = load_tokenizer(gen.model_dir)
    generate_session(model, tok, gen, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
