"""Accuracy of sparse execution: perplexity for dense, predictor-sparse and oracle-sparse, and per-layer recall, with
the weights in their stored format or in the one --type names, the predictors in the one --predictor-type names; with
--activation-sparsity, the perplexity of each calibrated method at each sparsity and the sparsity each site realised
(the model's predictors kept for its FFN with --predictors)."""

import json
from pathlib import Path

import click
import numpy as np

from ref.common.artifacts import Predictors
from ref.common.cli import check_model_dir, resolve_corpus, user_errors
from ref.common.tokenizer import load_tokenizer
from ref.evaluate import measure_predictors, perplexity
from ref.model import Model
from ref.common.formats import FORMATS, format_of
from ref.common.config import ModelConfig
from ref.profile import corpus_windows, window_size
from ref.quant import quantize_model, quantize_predictors
from ref.activation_sparsity import METHODS, SITES, apply_activation_sparsity, model_sparsity, sparsity_to_run
from ref.common.errors import UserError
from ref.sparse import apply_oracle, apply_predictors


def activation_table(load, windows, model_dir: Path, levels: list[float], methods: list[str], predictors,
                     sparsity_file, allocation: str | None = None) -> dict:
    """Perplexity of the dense model (predictor-sparse with `predictors`) and of each method at each sparsity, with
    the share of entries each site dropped (the FFN's sites only without predictors)."""
    def base():
        m = load()
        return m if predictors is None else apply_predictors(m, Predictors.load(predictors, m.config))

    passes = 1 + len(methods) * len(levels)
    ppl_dense, n = perplexity(base(), windows(), f"dense (pass 1 of {passes})")
    rows = []
    for method in methods:
        for s in levels:
            m = base()
            cut = sparsity_to_run(m.weights, model_dir, s, method, sparsity_file, allocation, predictors is None)
            apply_activation_sparsity(m, method, cut, ffn=predictors is None)
            ppl, _ = perplexity(m, windows(), f"{method} {s:g} (pass {len(rows) + 2} of {passes})")
            realised = np.nan_to_num(m.thinning.realised())  # [L, 4]
            rows.append({"method": method, "sparsity": s, "perplexity": ppl,
                         "model_sparsity": model_sparsity(m, method, realised),
                         "sites": dict(zip(SITES, realised.mean(0).tolist())), "layers": realised.tolist()})
    return {"tokens": n, "dense": ppl_dense, "rows": rows}


def print_activation_table(t: dict, predictors) -> None:
    click.echo(f"{t['tokens']:,} tokens; dense{' (predictor-sparse FFN)' if predictors else ''} perplexity "
               f"{t['dense']:.4f}")
    click.echo("method | target | perplexity | vs dense | realised model-wide | " + " | ".join(SITES))
    for r in t["rows"]:
        click.echo(f"{r['method']:6} | {r['sparsity']:6.0%} | {r['perplexity']:10.4f} | "
                   f"{r['perplexity'] / t['dense'] - 1:+8.2%} | {r['model_sparsity']:19.1%} | "
                   + " | ".join(f"{r['sites'][s]:{len(s)}.1%}" for s in SITES))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--predictors", type=click.Path(path_type=Path), default=None, help="[default: MODEL_DIR/predictors.safetensors]")
@click.option("--corpus", type=click.Path(path_type=Path), default=None, help="Text file, or a folder holding val.txt [default: data/corpus].")
@click.option("--max-tokens", type=int, default=None, help="Score at most this many tokens.")
@click.option("--window", type=int, default=None, help="Tokens per forward pass [default: 256, or the context if shorter].")
@click.option("--predictor-threshold", type=float, default=None, help="Override the stored threshold.")
@click.option("--type", "type_", default=None, help=f"Weight format: {', '.join(FORMATS)} [default: as stored].")
@click.option("--predictor-type", default=None, help=f"Store the predictors in this format: {', '.join(FORMATS)} [default: as saved, f32].")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON.")
@click.option("--activation-sparsity", default=None,
              help="Comma-separated sparsities: score activation sparsity (MODEL_DIR/sparsity.safetensors) instead.")
@click.option("--methods", default="teal,wina", show_default=True, help="With --activation-sparsity: the methods.")
@click.option("--sparsity-file", type=click.Path(path_type=Path), default=None,
              help="With --activation-sparsity: the thresholds [default: MODEL_DIR/sparsity.safetensors].")
@click.option("--allocation", type=click.Choice(["uniform", "greedy"]), default=None,
              help="With --activation-sparsity: each block's sites at the target, or the file's greedy allocation "
                   "[default: greedy where the file has it].")
@user_errors
def main(model_dir, predictors, corpus, max_tokens, window, predictor_threshold, type_, predictor_type, json_file,
         activation_sparsity, methods, sparsity_file, allocation):
    """Perplexity on held-out text for dense, predictor-sparse and oracle-sparse execution, or for activation
    sparsity."""
    check_model_dir(model_dir)
    fmt = format_of(type_) if type_ else None
    pfmt = format_of(predictor_type, "--predictor-type") if predictor_type else None
    corpus = resolve_corpus(corpus, "val.txt")
    given_predictors, predictors = predictors, predictors or model_dir / "predictors.safetensors"
    tok = load_tokenizer(model_dir)
    window = window_size(window, ModelConfig.from_hf(model_dir))

    def windows():
        return corpus_windows(tok, corpus, window, max_tokens)

    def load():
        return Model.load(model_dir) if fmt is None else quantize_model(Model.load(model_dir), fmt)

    if activation_sparsity is not None:
        try:
            levels = [float(v) for v in activation_sparsity.split(",")]
        except ValueError:
            raise UserError(f"--activation-sparsity: {activation_sparsity!r} is not a comma-separated list of numbers") from None
        chosen = [m.strip() for m in methods.split(",")]
        if any(m not in METHODS for m in chosen):
            raise UserError(f"--methods: choose from {', '.join(METHODS)}, got {methods!r}")
        table = activation_table(load, windows, model_dir, levels, chosen, given_predictors, sparsity_file, allocation)
        print_activation_table(table, given_predictors)
        if json_file:
            json_file.write_text(json.dumps(table, indent=2) + "\n")
        return

    ppl_dense, n = perplexity(load(), windows(), "dense (pass 1 of 4)")
    ppl_oracle, _ = perplexity(apply_oracle(load()), windows(), "oracle (pass 2 of 4)")
    loaded = Predictors.load(predictors, load().config)
    sparse = apply_predictors(load(), loaded if pfmt is None else quantize_predictors(loaded, pfmt), predictor_threshold)
    ppl_pred, _ = perplexity(sparse, windows(), "predictor (pass 3 of 4)")
    layers = measure_predictors(sparse, windows(), "recall (pass 4 of 4)")

    click.echo(f"{n:,} tokens of {corpus}; weights {fmt.name if fmt else 'as stored'}; "
               f"predictors {pfmt.name if pfmt else 'as saved'}")
    click.echo("execution        | perplexity | vs dense")
    for name, p in (("dense", ppl_dense), ("oracle-sparse", ppl_oracle), ("predictor-sparse", ppl_pred)):
        click.echo(f"{name:16} | {p:10.4f} | {p / ppl_dense - 1:+.4%}")
    click.echo("layer | recall | precision | predicted | fired | predicted/fired")
    for r in layers:
        click.echo(f"{r['layer']:5d} | {r['recall']:6.3f} | {r['precision']:9.3f} | {r['predicted_fraction']:9.1%} | "
                   f"{r['fired_fraction']:5.1%} | {r['predicted_fraction'] / max(r['fired_fraction'], 1e-12):15.2f}")
    mean = lambda k: sum(r[k] for r in layers) / len(layers)  # noqa: E731
    click.echo(f" mean | {mean('recall'):6.3f} | {mean('precision'):9.3f} | {mean('predicted_fraction'):9.1%} | "
               f"{mean('fired_fraction'):5.1%} | threshold {sparse.selector.threshold}")
    if json_file:
        out = {"tokens": n, "type": fmt.name if fmt else None, "predictor_type": pfmt.name if pfmt else None, "perplexity": {"dense": ppl_dense, "oracle": ppl_oracle, "predictor": ppl_pred},
               "threshold": sparse.selector.threshold, "layers": layers}
        json_file.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
