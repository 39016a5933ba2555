"""Calibrate training-free activation sparsity (TEAL, WINA, CATS) for a model: write the thresholds of every sparsity
level at each (layer, site), from the dense model's scores on a corpus, to MODEL_DIR/sparsity.safetensors; then
`python -m fast.run MODEL_DIR --sparsity 0.4` runs it."""

from pathlib import Path

import click
import numpy as np

from ref.activation_sparsity import (DEFAULT_FILE, GREEDY_TARGETS, METHODS, SITES, Thresholds, calibrate,
                                     greedy_allocation, model_sparsity, widths)
from ref.common.artifacts import model_fingerprint, sha256_file
from ref.common.cli import check_model_dir, output_file, resolve_corpus, user_errors
from ref.common.errors import UserError
from ref.common.progress import Progress
from ref.common.tokenizer import load_tokenizer
from ref.model import Model
from ref.profile import corpus_windows, window_size


def methods_of(text: str) -> tuple[str, ...]:
    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"--methods: {', '.join(unknown) or 'none given'}; choose from {', '.join(METHODS)}")
    return methods


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help=f"Thresholds file to write [default: MODEL_DIR/{DEFAULT_FILE}].")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--corpus", type=click.Path(path_type=Path), default=None,
              help="Text file, or a folder holding train.txt [default: data/corpus].")
@click.option("--max-tokens", type=int, default=16384, show_default=True, help="Tokens of the corpus to score.")
@click.option("--window", type=int, default=None, help="Tokens per forward pass [default: 256, or the context].")
@click.option("--methods", default=",".join(METHODS), show_default=True, help="Methods to calibrate, comma-separated.")
@click.option("--greedy", is_flag=True,
              help="Also allocate each block's sparsity among its sites by TEAL's greedy search (slower).")
@click.option("--greedy-windows", type=int, default=2, show_default=True,
              help="Windows of the corpus the greedy search measures each block's error on.")
@user_errors
def main(model_dir, output, force, corpus, max_tokens, window, methods, greedy, greedy_windows):
    """Calibrate activation-sparsity thresholds for MODEL_DIR (an HF folder or a GGUF file)."""
    check_model_dir(model_dir, gguf=True)
    methods = methods_of(methods)
    if max_tokens < 1 or greedy_windows < 1:
        raise UserError("--max-tokens and --greedy-windows must be >= 1")
    if output is None:
        if not model_dir.is_dir():
            raise UserError(f"MODEL_DIR {model_dir} is a file: name the thresholds file with -o")
        output = model_dir / DEFAULT_FILE
    output_file(output, force)
    corpus = resolve_corpus(corpus, "train.txt")
    model, tok = Model.load(model_dir), load_tokenizer(model_dir)
    window = window_size(window, model.config)
    progress = Progress("calibrate", max_tokens)
    tables, tokens, inputs = calibrate(model, corpus_windows(tok, corpus, window, max_tokens), methods,
                                       greedy_windows if greedy else 0, lambda n, frac: progress.update(n))
    progress.close()
    meta = {"methods": list(methods), "corpus": corpus.name, "corpus_sha256": sha256_file(corpus), "tokens": tokens,
            "window": window, "model": model_fingerprint(model.weights)}
    th = Thresholds(tables, {}, np.zeros(0), widths(model.config), meta)
    if greedy:
        for m in methods:
            click.echo(f"greedy allocation for {m}...", err=True)
            th.greedy[m] = greedy_allocation(model, th, m, inputs)
        th.targets = GREEDY_TARGETS
    th.save(output)
    click.echo(f"{tokens:,} tokens of {corpus} scored; wrote {output}")
    click.echo("method | site thresholds at 50% (mean over layers: " + ", ".join(SITES) + ") | model-wide at 50%")
    for m in methods:
        levels = th.levels(model.config, m, 0.5, "greedy" if m in th.greedy else "uniform")
        cut = th.cut(m, levels)
        click.echo(f"{m:6} | {' '.join(f'{v:9.4g}' for v in cut.mean(0))} | {model_sparsity(model, m, levels):.1%}")


if __name__ == "__main__":
    main()
