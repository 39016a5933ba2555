"""`python -m ref [MODEL_DIR] -p PROMPT -n N`: generate with the reference engine (readable, slow)."""

from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import time

import click
import numpy as np

from ref import load_model
from ref.common.batch import kv_format
from ref.common.cli import (ActivationSparsityFlags, Generation, PredictorFlags, activation_sparsity_options,
                            generate_session, generation_options, predictor_options, user_errors)
from ref.common.tokenizer import load_tokenizer


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@generation_options
@predictor_options
@activation_sparsity_options
@click.option("--float64", "use_f64", is_flag=True, help="Compute in float64 (for verification).")
@user_errors
def main(gen: Generation, pred: PredictorFlags, act: ActivationSparsityFlags, use_f64):
    """Generate text from MODEL_DIR (an HF folder or a GGUF file; default: the shipped model) with the NumPy
    reference engine: the same model as fast.run's with the same flags."""
    model_dir = gen.check().model_dir
    pred.check(), act.check()
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype=np.float64 if use_f64 else np.float32, **pred.options(model_dir),
                       **act.options())
    model.kv_types = tuple(kv_format(name, flag, model.config.head_dim).name
                           for name, flag in zip(gen.cache_types, ("-ctk", "-ctv")))
    tok = load_tokenizer(model_dir)
    mode = f"sparse (threshold {model.selector.threshold})" if getattr(model, "selector", None) else "dense"
    generate_session(model, tok, gen, time.perf_counter() - t0, f"; FFN {mode}{act.about()}; KV cache {'/'.join(model.kv_types)}")


if __name__ == "__main__":
    main()
