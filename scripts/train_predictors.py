"""Train PowerInfer's per-layer activation predictors; write predictors.safetensors and print the accuracy table."""

from pathlib import Path

import click

from ref.common.cli import check_model_dir, output_file, resolve_corpus, user_errors
from ref.common.tokenizer import load_tokenizer
from ref.model import Model
from ref.predictor import LADDER, TrainSettings, train_all
from ref.profile import Reservoir, collect_samples, corpus_windows, window_size


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--corpus", type=click.Path(path_type=Path), default=None, help="Text file, or a folder holding train.txt [default: data/corpus].")
@click.option("--max-tokens", type=int, default=None, help="Read at most this many corpus tokens.")
@click.option("--window", type=int, default=None, help="Tokens per forward pass [default: 256, or the context if shorter].")
@click.option("--samples", type=int, default=60000, show_default=True, help="Reservoir size (tokens kept per layer).")
@click.option("--sample-memory", type=float, default=4.0, show_default=True, help="GiB cap for the reservoir; shrinks --samples to fit.")
@click.option("--target-recall", type=float, default=0.97, show_default=True)
@click.option("--budget", type=float, default=0.10, show_default=True, help="All predictors <= this fraction of model parameters.")
@click.option("--epochs", type=int, default=TrainSettings.epochs, show_default=True)
@click.option("--pos-weight", type=float, default=TrainSettings.pos_weight, show_default=True, help="BCE weight of firing neurons.")
@click.option("--max-hidden", type=int, default=LADDER[-1], show_default=True, help="Largest predictor hidden size tried.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="predictors.safetensors to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@user_errors
def main(model_dir, corpus, max_tokens, window, samples, sample_memory, target_recall, budget, epochs, pos_weight,
         max_hidden, seed, output, force):
    """Collect (FFN input, fired mask) samples over a corpus, then train and size one predictor per layer."""
    check_model_dir(model_dir)
    output_file(output, force)
    if max_tokens is not None and max_tokens < 1:
        raise click.UsageError("--max-tokens must be >= 1 (no tokens, no predictors)")
    if not 0 < target_recall <= 1:
        raise click.UsageError("--target-recall must be in (0, 1]")
    if not 0 < budget <= 1:
        raise click.UsageError("--budget must be in (0, 1]")
    corpus = resolve_corpus(corpus, "train.txt")
    model, tok = Model.load(model_dir), load_tokenizer(model_dir)
    c = model.config
    per = Reservoir.bytes_per_sample(c.n_layers, c.d_model, c.d_ffn)
    capacity = max(1, min(samples, int(sample_memory * 2**30) // per))
    click.echo(f"reservoir: room for {capacity:,} tokens x {c.n_layers} layers ({capacity * per / 2**30:.2f} GiB)")
    window = window_size(window, c)
    res = collect_samples(model, corpus_windows(tok, corpus, window, max_tokens), capacity, seed)
    kept = min(res.seen, res.capacity)
    click.echo(f"sampled {kept:,} of the corpus' {res.seen:,} tokens per layer")
    settings = TrainSettings(target_recall=target_recall, budget_fraction=budget, epochs=epochs, pos_weight=pos_weight,
                             seed=seed, ladder=tuple(r for r in LADDER if r <= max_hidden))
    pred, reports = train_all(res, c.n_params, settings)
    pred.save(output)
    click.echo(f"threshold {pred.threshold}; held-out tokens per layer: {max(1, int(kept * settings.held_out)):,}")
    click.echo("layer | hidden | recall | precision | predicted | fired | tried (hidden, recall)")
    for r in reports:
        missed = "  below --target-recall" if r.recall < target_recall else ""
        click.echo(f"{r.layer:5d} | {r.R:6d} | {r.recall:6.3f} | {r.precision:9.3f} | {r.predicted:9.1%} | {r.fired:5.1%} | "
                   f"{r.tried}{missed}")
    below = sum(r.recall < target_recall for r in reports)
    if below:
        click.echo(f"{below} of {len(reports)} layers below --target-recall {target_recall} (more tokens, --max-hidden "
                   "or --budget may reach it)")
    share = pred.n_params / c.n_params
    click.echo(f"predictor parameters: {pred.n_params:,} ({share:.1%} of the model's {c.n_params:,}); wrote {output}")


if __name__ == "__main__":
    main()
