"""Profile how often each FFN neuron fires over a corpus; write activations.safetensors and print the power-law table."""

from pathlib import Path

import click

from ref.common.artifacts import save_activations
from ref.common.cli import check_model_dir, output_file, resolve_corpus, user_errors
from ref.common.tokenizer import load_tokenizer
from ref.model import Model
from ref.profile import corpus_windows, firing_stats, profile_activations, window_size


def print_table(stats: list[dict]) -> None:
    click.echo("layer | fired per token | neurons for 80% of firings | top 1% share")
    for s in stats:
        click.echo(f"{s['layer']:5d} | {s['fired_fraction']:15.1%} | {s['neurons_for_80pct']:26.1%} | {s['top1pct_share']:12.1%}")


def pyplot():
    """matplotlib's pyplot (the optional `plot` extra), checked before the profile runs, not after."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    return plt


def plot(plt, stats_counts, path: Path) -> None:
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    for l, c in enumerate(stats_counts):
        s = np.sort(c)[::-1].astype(float)
        ax.plot(np.arange(1, len(s) + 1) / len(s), np.cumsum(s) / max(s.sum(), 1), label=f"layer {l}", lw=1)
    ax.set(xlabel="fraction of neurons (most frequent first)", ylabel="share of all firings", title="FFN firing concentration")
    ax.grid(alpha=0.3)
    if len(stats_counts) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--corpus", type=click.Path(path_type=Path), default=None, help="Text file, or a folder holding train.txt [default: data/corpus].")
@click.option("--max-tokens", type=int, default=None, help="Stop after this many tokens.")
@click.option("--window", type=int, default=None, help="Tokens per forward pass [default: 256, or the context if shorter].")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="activations.safetensors to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--plot", "plot_file", type=click.Path(path_type=Path), default=None, help="Draw cumulative firing curves (matplotlib).")
@user_errors
def main(model_dir, corpus, max_tokens, window, output, force, plot_file):
    """Count, per layer, the tokens on which each FFN neuron fires."""
    check_model_dir(model_dir)
    output_file(output, force)
    plt = pyplot() if plot_file else None
    corpus = resolve_corpus(corpus, "train.txt")
    model, tok = Model.load(model_dir), load_tokenizer(model_dir)
    window = window_size(window, model.config)
    counts, tokens = profile_activations(model, corpus_windows(tok, corpus, window, max_tokens))
    save_activations(output, counts, tokens, corpus, model_dir)
    print_table(firing_stats(counts, tokens))
    click.echo(f"{tokens:,} tokens profiled; wrote {output}")
    if plot_file:
        plot(plt, counts, plot_file)
        click.echo(f"wrote {plot_file}")


if __name__ == "__main__":
    main()
