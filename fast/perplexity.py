"""`python -m fast.perplexity MODEL -f TEXT [-c CTX]`: llama.cpp's llama-perplexity contract with the fast engine.

The text is tokenized whole and cut into chunks of -c tokens; as everywhere in this project the corpus separator
<|endoftext|> is a document boundary, each document fed as BOS, text, EOS (ref.profile.corpus_tokens; a text without
separators is one document, as llama.cpp reads it); each chunk starts from an empty cache with
BOS as its first token, and only its second half is scored (each token predicted from at least c/2 tokens of
context). Progress `[i]ppl,` per chunk, then `Final estimate: PPL = X +/- Y` with Y = PPL times the standard error
of the mean negative log-likelihood, as llama.cpp prints it."""

from ref.common.errors import UserError, ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import math
import sys
from pathlib import Path

import click
import numpy as np

from fast.load import load_engine, say_compiling
from ref.common.checkpoint import load_checkpoint
from ref.common.cli import (FORMAT_CHOICE, ActivationSparsityFlags, PredictorFlags, activation_sparsity_options,
                            cache_types, kv_cache_options, predictor_options, resolve_model, user_errors)
from ref.common.tokenizer import load_tokenizer
from ref.profile import corpus_tokens


def chunk_nll(engine, chunk: np.ndarray, bos: int | None) -> np.ndarray:
    """Negative log-likelihoods [c - c/2] of a chunk's second half, the first token replaced by BOS."""
    ids = chunk.copy()
    if bos is not None:
        ids[0] = bos
    logits = engine.logits(ids).astype(np.float64)  # [c, V]
    first = len(ids) // 2
    z = logits[first - 1:-1]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(z)), ids[first:]]


def estimate(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its uncertainty) from per-token NLLs, as llama.cpp's perplexity does."""
    mean, mean2 = float(nll.mean()), float((nll * nll).mean())
    ppl = math.exp(mean)
    var = mean2 - mean * mean
    return ppl, (math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 and len(nll) > 1 else 0.0)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path), required=False)
@click.option("-m", "--model", type=click.Path(path_type=Path), default=None,
              help="Same as MODEL_DIR (an HF folder or a GGUF file).")
@click.option("-f", "--file", "text_file", type=click.Path(path_type=Path), required=True, help="The text to score.")
@click.option("-c", "--ctx-size", "ctx", type=int, default=512, show_default=True,
              help="Tokens per chunk (at most the model's context).")
@click.option("--chunks", type=int, default=-1, show_default=True, help="Score at most this many chunks (-1: all).")
@click.option("-t", "--threads", type=int, default=None,
              help="CPU threads [default: the cores other processes leave idle].")
@click.option("--type", "type_", type=FORMAT_CHOICE, default=None, help="Weight format [default: as stored].")
@predictor_options
@activation_sparsity_options
@kv_cache_options
@user_errors
def main(model_dir, model, text_file, ctx, chunks, threads, type_, pred: PredictorFlags, act: ActivationSparsityFlags,
         cache_type_k, cache_type_v):
    """Perplexity of MODEL_DIR (default: the shipped model) on a text file, scored as llama-perplexity scores it."""
    path = resolve_model(model_dir, model)
    pred.check(), act.check()
    if not text_file.is_file():
        raise UserError(f"-f/--file {text_file}: no such file")
    w = load_checkpoint(path)
    if not 2 <= ctx <= w.config.max_seq_len:
        raise UserError(f"-c/--ctx-size must be in [2, {w.config.max_seq_len}] (the model's context), got {ctx}")
    tok = load_tokenizer(path)
    tokens = np.asarray([i for ids, _ in corpus_tokens(tok, text_file) for i in ids], dtype=np.int64)
    if len(tokens) < 2 * ctx:
        raise UserError(f"-f/--file {text_file}: {len(tokens)} tokens; scoring with -c {ctx} needs at least {2 * ctx}")
    n_chunks = len(tokens) // ctx if chunks < 0 else min(chunks, len(tokens) // ctx)
    engine = load_engine(path, threads=threads, type_=type_, notice=say_compiling,
                         cache_types=cache_types(cache_type_k, cache_type_v), **pred.options(path), **act.options())
    kind = ("predictor-sparse" if engine.selector.predicts else "dense") + act.about()
    click.echo(f"perplexity: {len(tokens):,} tokens, {n_chunks} chunks of {ctx}, scoring the second half of each; "
               f"weights {engine.format.name}, KV cache {'/'.join(engine.kv_types)}, FFN {kind}", err=True)
    nll = []
    for i in range(n_chunks):
        nll.append(chunk_nll(engine, tokens[i * ctx:(i + 1) * ctx], tok.bos_id))
        sys.stdout.write(f"[{i + 1}]{estimate(np.concatenate(nll))[0]:.4f},")
        sys.stdout.flush()
    ppl, unc = estimate(np.concatenate(nll))
    click.echo(f"\nFinal estimate: PPL = {ppl:.4f} +/- {unc:.5f}")


if __name__ == "__main__":
    sys.exit(main())
