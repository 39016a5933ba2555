"""Pieces shared by `python -m ref` and `python -m fast.run`: llama.cpp's flags, the generation session (streaming,
why it stopped, timing lines), one-line errors."""

import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import click

from ref.common.artifacts import check_replaceable, check_sparsity, default_predictors
from ref.common.batch import KV_DEFAULT, KV_FORMATS
from ref.common.errors import Terminated, UserError, exit_interrupted, lost_interrupts_raised, quit_on_ctrl_c, terminate
from ref.common.formats import FORMATS
from ref.common.gguf_io import is_gguf
from ref.common.sampling import (REPEAT_LAST_N, Timings, check_keep, check_prompt, check_sampling, generate,
                                  shift_keep)

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny-relu-llama"
DEFAULT_PROMPT = "once upon a time"
FORMAT_CHOICE = click.Choice(list(FORMATS), case_sensitive=False)  # --type q4_0, or llama-quantize's Q4_0


@dataclass
class Generation:
    """llama.cpp's model, prompt and sampling flags, as one value; `check` validates them (inside `user_errors`)."""

    model_dir: Path | None
    model: Path | None
    prompt: str | None
    prompt_file: Path | None
    n_predict: int
    seed: int
    temp: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    ctx_size: int
    batch_size: int
    ignore_eos: bool
    context_shift: bool
    keep: int
    cache_type_k: str
    cache_type_v: str

    def check(self) -> "Generation":
        """The flags checked, the model folder resolved (MODEL_DIR or -m), the prompt read (-p or -f)."""
        check_sampling(self.n_predict, self.temp, self.top_k, self.top_p, self.min_p, self.repeat_penalty,
                       self.repeat_last_n)
        if self.seed < -1:
            raise UserError(f"-s/--seed must be >= 0, or -1 (random), got {self.seed}")
        if self.batch_size < 1:
            raise UserError(f"-b/--batch-size must be >= 1, got {self.batch_size}")
        check_keep(self.keep)
        self.model_dir = resolve_model(self.model_dir, self.model)
        if self.prompt is not None and self.prompt_file is not None:
            raise UserError("-p/--prompt and -f/--file both give a prompt: pass one")
        if self.prompt_file is not None:
            if not self.prompt_file.is_file():
                raise UserError(f"-f/--file {self.prompt_file}: no such file")
            self.prompt = self.prompt_file.read_text(encoding="utf-8", errors="replace")
        self.prompt = DEFAULT_PROMPT if self.prompt is None else self.prompt
        return self

    @property
    def cache_types(self) -> tuple[str, str]:
        return cache_types(self.cache_type_k, self.cache_type_v)

    def sampling(self) -> dict:
        """The keyword arguments of `generate` these flags set."""
        return dict(temperature=self.temp, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                    ctx_size=self.ctx_size or None, ignore_eos=self.ignore_eos, batch_size=self.batch_size,
                    context_shift=self.context_shift, keep=self.keep)


KV_FLAGS = [
    click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(KV_FORMATS, case_sensitive=False),
                 default=KV_DEFAULT, show_default=True, help="The KV cache's format for keys (a GPU's: f32)."),
    click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(KV_FORMATS, case_sensitive=False),
                 default=KV_DEFAULT, show_default=True, help="The KV cache's format for values (a GPU's: f32)."),
]


def cache_types(k: str, v: str) -> tuple[str, str]:
    """-ctk, -ctv as load_engine's cache_types."""
    return k.lower(), v.lower()


GENERATION_FLAGS = [
    click.argument("model_dir", required=False, type=click.Path(path_type=Path)),
    click.option("-m", "--model", type=click.Path(path_type=Path), default=None,
                 help="Model folder, as MODEL_DIR [default: the shipped model]."),
    click.option("-p", "--prompt", default=None, help=f"Prompt to start from [default: {DEFAULT_PROMPT!r}]."),
    click.option("-f", "--file", "prompt_file", type=click.Path(path_type=Path), default=None,
                 help="Read the prompt from this file."),
    click.option("-n", "--n-predict", "n_predict", default=64, show_default=True, type=int,
                 help="Tokens to generate (-1: until EOS or a full context)."),
    click.option("-s", "--seed", default=-1, show_default=True, type=int, help="RNG seed (-1: random)."),
    click.option("--temp", default=0.8, show_default=True, type=float, help="Temperature (0: greedy)."),
    click.option("--top-k", default=40, show_default=True, type=int, help="Top-k sampling (0: off)."),
    click.option("--top-p", default=0.95, show_default=True, type=float, help="Top-p sampling (1: off)."),
    click.option("--min-p", default=0.05, show_default=True, type=float, help="Min-p sampling (0: off)."),
    click.option("--repeat-penalty", default=1.0, show_default=True, type=float, help="Repeat penalty (1: off)."),
    click.option("--repeat-last-n", default=REPEAT_LAST_N, show_default=True, type=int,
                 help="Tokens the repeat penalty looks back over (0: off, -1: the whole context)."),
    click.option("-c", "--ctx-size", default=0, show_default=True, type=int, help="Context size (0: the model's)."),
    click.option("-b", "--batch-size", default=512, show_default=True, type=int,
                 help="Prompt tokens per forward pass (each weight read once per batch)."),
    click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-text token."),
    click.option("--context-shift", is_flag=True,
                 help="When the context fills, drop half of the tokens after --keep and go on (llama.cpp's)."),
    click.option("--keep", default=0, show_default=True, type=int,
                 help="Tokens of the prompt a context shift keeps (-1: all of it)."),
    *KV_FLAGS,
]


def flag_group(flags: list, cls=None, keyword: str | None = None):
    """A decorator adding click `flags` to a command: the command receives each value as its own argument, or with
    `cls` (a dataclass whose fields are the flags' names) all of them as one `cls` in the argument `keyword`. The one
    way the CLIs declare a group of flags they share."""
    names = [x.name for x in fields(cls)] if cls is not None else []

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            grouped = {keyword: cls(**{n: kwargs.pop(n) for n in names})} if cls is not None else {}
            return f(*args, **grouped, **kwargs)

        for option in reversed(flags):
            wrapper = option(wrapper)
        return wrapper
    return decorate


def refuse_old_sparsity(ctx, param, value):
    """The scripts' and the planner's --sparsity, now --predicted-sparsity: one line naming the new flag, never
    silently another meaning (--sparsity is activation sparsity in the CLIs)."""
    if value is not None:
        raise click.UsageError("--sparsity is activation sparsity in the CLIs; the predicted FFN sparsity here is "
                               "--predicted-sparsity")


# A hidden --sparsity on a script that takes --predicted-sparsity (its own name: click keeps values by name).
old_sparsity_option = click.option("--sparsity", "old_sparsity", hidden=True, expose_value=False,
                                   callback=refuse_old_sparsity, default=None)


generation_options = flag_group(GENERATION_FLAGS, Generation, "gen")  # llama.cpp's generation flags and defaults
kv_cache_options = flag_group(KV_FLAGS)  # -ctk and -ctv, as the arguments cache_type_k, cache_type_v


@dataclass
class PredictorFlags:
    """The FFN's predictor flags of every CLI that loads a model, with the same defaults (default_predictors,
    ref.sparse.predictors_to_run): sparse with the model's predictors unless --dense."""

    dense: bool
    predictors: Path | None
    predictor_threshold: float | None
    predictor_type: str | None

    def check(self) -> "PredictorFlags":
        if self.dense and self.predictors is not None:
            raise UserError("--dense and --predictors contradict each other")
        finite(self.predictor_threshold, "--predictor-threshold")
        if self.dense and (self.predictor_threshold is not None or self.predictor_type is not None):
            flag = "--predictor-threshold" if self.predictor_threshold is not None else "--predictor-type"
            raise UserError(f"--dense runs no predictors: {flag} has nothing to act on")
        return self

    def options(self, path) -> dict:
        """The keyword arguments of load_engine and ref.load_model these flags set for the model at `path`."""
        return dict(predictors=default_predictors(path, self.predictors, dense=self.dense),
                    predictor_threshold=self.predictor_threshold, predictor_type=self.predictor_type)


PREDICTOR_FLAGS = [
    click.option("--dense", is_flag=True, help="Run the dense FFN (no predictors)."),
    click.option("--predictors", type=click.Path(path_type=Path), default=None,
                 help="Predictors file [default: MODEL_DIR/predictors.safetensors, else the checkpoint's own]."),
    click.option("--predictor-threshold", type=float, default=None, help="Override the predictors' stored threshold."),
    click.option("--predictor-type", type=FORMAT_CHOICE, default=None,
                 help="Format to run the predictors in [default: a checkpoint's own as stored; a file's in the "
                      "weights' format, q8_0 beside f16 and bf16]."),
]
predictor_options = flag_group(PREDICTOR_FLAGS, PredictorFlags, "pred")


@dataclass
class ActivationSparsityFlags:
    """Training-free activation sparsity's flags (ref.activation_sparsity), the same in every CLI that loads a model:
    --sparsity always means this."""

    sparsity: float | None
    sparsity_method: str
    sparsity_file: Path | None

    def check(self) -> "ActivationSparsityFlags":
        if self.sparsity is not None:
            check_sparsity(self.sparsity)
        if self.sparsity is None and self.sparsity_file is not None:
            raise UserError("--sparsity-file holds thresholds for --sparsity S: pass --sparsity too")
        return self

    def options(self) -> dict:
        """The keyword arguments of load_engine and ref.load_model these flags set."""
        return dict(sparsity=self.sparsity, sparsity_method=self.sparsity_method, sparsity_file=self.sparsity_file)

    def about(self) -> str:
        """The run's description of it ('' where off)."""
        return f"; activation sparsity {self.sparsity:g} ({self.sparsity_method})" if self.sparsity else ""


ACTIVATION_SPARSITY_FLAGS = [
    click.option("--sparsity", type=float, default=None,
                 help="Training-free activation sparsity: thin every linear layer's input to this model-wide share, "
                      "by thresholds calibrated for the model (scripts/calibrate_sparsity.py) [default: off]."),
    click.option("--sparsity-method", type=click.Choice(["teal", "wina", "cats"]), default="teal", show_default=True,
                 help="teal: |x|; wina: |x| times the weight column's norm; cats: the FFN by its gate's activation."),
    click.option("--sparsity-file", type=click.Path(path_type=Path), default=None,
                 help="Thresholds file [default: MODEL_DIR/sparsity.safetensors]."),
]
activation_sparsity_options = flag_group(ACTIVATION_SPARSITY_FLAGS, ActivationSparsityFlags, "act")


def generate_session(engine, tok, gen: Generation, load_seconds: float, about: str = "") -> tuple[list[int], Timings]:
    """llama.cpp's session: the seed line, the prompt and the text as it comes, why it stopped (` [end of text]` at
    EOS, a note at a full context), then the timing lines, also when Ctrl-C cuts it short."""
    ids = tok.encode(gen.prompt)
    ctx = check_prompt(ids, engine.config, gen.ctx_size)
    if gen.context_shift:
        shift_keep(len(ids), ctx, gen.keep)
    seed = resolve_seed(gen.seed)
    click.echo(f"seed = {seed}{about}", err=True)
    click.echo(gen.prompt, nl=False)
    timings = Timings()
    try:
        out = generate(engine, ids, gen.n_predict, seed=seed, on_token=Streamer(tok), timings=timings,
                       stop_ids=tok.eos_ids, **gen.sampling())
    except KeyboardInterrupt:
        print_timings(load_seconds, timings)
        raise
    click.echo(" [end of text]" if timings.stop == "eos" else "")
    if timings.stop == "context":
        click.echo(f"context full ({len(ids) + len(out)} tokens): stopped (-c/--ctx-size sets it)", err=True)
    print_timings(load_seconds, timings)
    return out, timings


def user_errors(f):
    """Run a CLI body: a UserError becomes one line on stderr and exit 1; Ctrl-C exits 130, SIGTERM 143, each after
    the body's cleanups (a half-written file removed); a reader that stops reading (`| head`) ends the command, exit
    0. No tracebacks. (SIGKILL cannot be caught: it leaves what it finds.)"""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if signal.getsignal(signal.SIGINT) is quit_on_ctrl_c:  # the body may hold files: a KeyboardInterrupt again
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, terminate)
        try:
            with lost_interrupts_raised():
                return f(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            exit_interrupted()
        except Terminated:
            click.echo("terminated", err=True)
            sys.exit(143)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere
            sys.exit(0)
    return wrapper


def resolve_model(model_dir: Path | None, model: Path | None) -> Path:
    """The model a command runs: MODEL_DIR or -m (not two different ones), else the shipped model; checked to be
    a folder or a GGUF file."""
    if model_dir is not None and model is not None and model_dir != model:
        raise UserError(f"MODEL_DIR {model_dir} and -m/--model {model} name two models")
    path = model_dir or model or DEFAULT_MODEL
    if path == DEFAULT_MODEL and not DEFAULT_MODEL.is_dir():
        raise UserError(f"no MODEL_DIR given, and the shipped model is not at {DEFAULT_MODEL} (an editable install, "
                        "pip install -e ., keeps data/ beside the code): pass MODEL_DIR or -m")
    check_model_dir(path, gguf=True)
    return path


def check_model_dir(path: Path, gguf: bool = False) -> None:
    """A model folder, or where `gguf` says so also a GGUF file (known by its magic)."""
    if not path.exists():
        raise UserError(f"MODEL_DIR {path}: no such folder{' or file' if gguf else ''}")
    if not path.is_dir() and not (gguf and is_gguf(path)):
        raise UserError(f"MODEL_DIR {path}: not a folder{' or a GGUF file' if gguf else ''}")


def resolve_seed(seed: int) -> int:
    return int(time.time_ns() % 2**31) if seed < 0 else seed


def output_file(path: Path, force: bool, flag: str = "-o/--output") -> Path:
    """Where a command writes: into a folder that exists, a file (check_replaceable), over an existing one only with
    --force (checked before any work, so that a long run never ends in an error or silently replaces a shipped
    artifact)."""
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise UserError(f"{flag} {path}: a folder; name the file to write")
    check_replaceable(path, flag)
    if path.exists() and not force:
        raise UserError(f"{flag} {path} exists: pass --force to replace it")
    return path


def positive_list(text: str, flag: str, kind=int, empty: bool = False) -> list:
    """A flag's comma-separated positive numbers of `kind` (blank items skipped; none at all refused unless `empty`)."""
    try:
        out = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = [0]
    if (not out and not empty) or not all(v > 0 and math.isfinite(v) for v in out):
        noun = "integers" if kind is int else "numbers"
        raise click.UsageError(f"{flag} must be positive {noun}, comma-separated, got {text!r}")
    return out


def finite(value: float | None, flag: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value}")
    return value


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


DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"  # the shipped TinyStories text


def resolve_corpus(path: Path | None, split: str) -> Path:
    """A corpus text file: `path` itself, `path/<split>`, or that split of the shipped corpus (data/corpus)."""
    path = DEFAULT_CORPUS if path is None else path
    file = path / split if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"--corpus: {file} not found")
    return file
