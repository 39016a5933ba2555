"""Pieces shared by `python -m ref` and `python -m fast.run`: llama.cpp's flags, streaming, timing lines, errors."""

import functools
import sys
import time
from pathlib import Path

import click

from ref.common.errors import UserError
from ref.common.sampling import Timings

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny-relu-llama"


def sampling_options(f):
    """llama.cpp's generation flags, names and defaults."""
    options = [
        click.argument("model_dir", required=False, type=click.Path(path_type=Path), default=DEFAULT_MODEL),
        click.option("-p", "--prompt", default="once upon a time", show_default=True, help="Prompt to start from."),
        click.option("-n", "--n-predict", "n_predict", default=64, show_default=True, type=int, help="Tokens to generate."),
        click.option("-s", "--seed", default=-1, show_default=True, type=int, help="RNG seed (-1: random)."),
        click.option("--temp", default=0.8, show_default=True, type=float, help="Temperature (0: greedy)."),
        click.option("--top-k", default=40, show_default=True, type=int, help="Top-k sampling (0: off)."),
        click.option("--top-p", default=0.95, show_default=True, type=float, help="Top-p sampling (1: off)."),
        click.option("--min-p", default=0.05, show_default=True, type=float, help="Min-p sampling (0: off)."),
        click.option("--repeat-penalty", default=1.0, show_default=True, type=float, help="Penalty on the last 64 tokens (1: off)."),
        click.option("-c", "--ctx-size", default=0, show_default=True, type=int, help="Context size (0: the model's)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def user_errors(f):
    """Run a CLI body: a UserError becomes one line on stderr and exit 1; Ctrl-C exits 130. No tracebacks."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
    return wrapper


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise UserError(f"MODEL_DIR {path}: no such folder")
    if not path.is_dir():
        raise UserError(f"MODEL_DIR {path}: not a folder")


def resolve_seed(seed: int) -> int:
    return int(time.time_ns() % 2**31) if seed < 0 else seed


class Streamer:
    """Prints text as tokens arrive; decodes the whole tail so multi-byte characters come out whole."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, tok: int) -> None:
        self.ids.append(tok)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next byte
            return
        click.echo(text[len(self.printed):], nl=False)
        sys.stdout.flush()
        self.printed = text


def print_timings(load_seconds: float, t: Timings) -> None:
    """llama.cpp's closing lines: load, prompt eval and eval with ms per token and tokens per second."""
    def line(name, seconds, n, unit):
        per = seconds * 1e3 / n if n else 0.0
        rate = n / seconds if seconds > 0 else 0.0
        click.echo(f"{name:>18} = {seconds * 1e3:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {rate:8.2f} tokens per second)", err=True)
    click.echo(f"\n\n{'load time':>18} = {load_seconds * 1e3:10.2f} ms", err=True)
    line("prompt eval time", t.prompt_seconds, t.prompt_tokens, "tokens")
    line("eval time", t.eval_seconds, t.eval_tokens, "runs  ")
    total = load_seconds + t.prompt_seconds + t.eval_seconds
    click.echo(f"{'total time':>18} = {total * 1e3:10.2f} ms / {t.prompt_tokens + t.eval_tokens:5d} tokens", err=True)


SHARED_CORPUS = Path(__file__).resolve().parents[3] / "shared" / "corpus"


def resolve_corpus(path: Path | None, split: str) -> Path:
    """A corpus text file: `path` itself, `path/<split>`, or the shared TinyStories split when it exists."""
    if path is None:
        if not SHARED_CORPUS.is_dir():
            raise UserError(f"--corpus: no default corpus ({SHARED_CORPUS} does not exist); pass --corpus PATH")
        path = SHARED_CORPUS
    file = path / split if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"--corpus: {file} not found")
    return file
