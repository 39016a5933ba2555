"""Samplers (llama.cpp's chain and defaults) and the decode loop, shared by every engine.

Chain order as llama.cpp: logits processors (penalties) -> top-k -> top-p -> min-p -> temperature -> draw.
Dimensions: V vocab.
"""

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ref.common.batch import Batch
from ref.common.errors import UserError

REPEAT_LAST_N = 64  # llama.cpp's default window for the repeat penalty


def check_sampling(max_new_tokens=0, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                   repeat_last_n=REPEAT_LAST_N) -> None:
    """One-line errors naming the CLI flag for out-of-range sampling settings."""
    if max_new_tokens < -1:
        raise UserError(f"-n/--n-predict must be >= 0, or -1 (until EOS or a full context), got {max_new_tokens}")
    if repeat_last_n < -1:
        raise UserError(f"--repeat-last-n must be >= 0, or -1 (the whole context), got {repeat_last_n}")
    if not temperature >= 0:
        raise UserError(f"--temp must be >= 0, got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 turns it off), got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:
        raise UserError(f"--min-p must be in [0, 1], got {min_p}")
    if not repeat_penalty > 0:
        raise UserError(f"--repeat-penalty must be > 0, got {repeat_penalty}")


def check_prompt(ids, cfg, ctx_size=None) -> int:
    """The context size to use (the model's when `ctx_size` is 0 or None); the prompt must fit in it."""
    ctx = ctx_size or cfg.max_seq_len
    if not 0 < ctx <= cfg.max_seq_len:
        raise UserError(f"-c/--ctx-size {ctx} exceeds the model's context of {cfg.max_seq_len}" if ctx > 0
                        else f"-c/--ctx-size must be >= 0, got {ctx}")
    if not len(ids):
        raise UserError("empty prompt: nothing to condition on")
    check_fits(len(ids), ctx)
    return ctx


def check_keep(keep: int) -> None:
    if keep < -1:
        raise UserError(f"--keep must be >= 0, or -1 (the whole prompt), got {keep}")


def shift_keep(n_prompt: int, ctx: int, keep: int) -> int:
    """The positions a context shift keeps (--keep of the prompt; -1: all of it); one must be left to drop."""
    keep = min(n_prompt if keep < 0 else keep, n_prompt)
    if (ctx - keep) // 2 < 1:
        raise UserError(f"--keep {keep}: a context of {ctx} has no positions after them to drop (--context-shift)")
    return keep


def check_fits(n_tokens: int, ctx: int) -> None:
    if n_tokens > ctx:
        raise UserError(f"prompt of {n_tokens} tokens is longer than the context ({ctx})")


def apply_repeat_penalty(logits: np.ndarray, history, penalty: float, last_n: int = REPEAT_LAST_N) -> np.ndarray:
    """Divide positive, multiply negative logits of tokens seen in the last `last_n` (CTRL's penalty; -1: all)."""
    window = history if last_n < 0 else history[len(history) - last_n:]
    if penalty == 1.0 or not len(window):
        return logits
    out = logits.copy()
    seen = np.unique(np.asarray(window, dtype=np.int64))
    out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    return out


class Processor:
    """One request's change to its next token's logits before the sampler draws (a penalty; a logit bias or a
    grammar's mask would be others): z [V] float64 -> z, from the request's prompt and the tokens it has taken;
    `accept(token)` after each token it takes, for a processor that keeps state (a grammar's position)."""

    def __call__(self, z: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        """Nothing to advance: the penalties read the history they are given."""


@dataclass(frozen=True)
class RepeatPenalty(Processor):
    """llama.cpp's repeat penalty over the last `last_n` tokens of prompt and output (apply_repeat_penalty)."""

    penalty: float
    last_n: int = REPEAT_LAST_N

    def __call__(self, z, prompt, out):
        return apply_repeat_penalty(z, prompt + out, self.penalty, self.last_n)


@dataclass(frozen=True)
class PresencePenalty(Processor):
    """OpenAI's presence and frequency penalties over the output: logit -= presence [count > 0] + frequency count."""

    presence: float
    frequency: float

    def __call__(self, z, prompt, out):
        if not out:
            return z
        z = z.copy()
        for tok, n in Counter(out).items():
            z[tok] -= self.presence + self.frequency * n
        return z


def penalties(repeat_penalty=1.0, repeat_last_n=REPEAT_LAST_N, presence=0.0, frequency=0.0) -> list[Processor]:
    """The processors these settings ask for, in their order (presence and frequency, then repeat); none that would
    change nothing."""
    return ([PresencePenalty(presence, frequency)] if presence or frequency else []) + (
        [RepeatPenalty(repeat_penalty, repeat_last_n)] if repeat_penalty != 1.0 else [])


def processed(processors, logits: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
    """logits [V] through each processor in order, in float64 (the logits as they are where there is none)."""
    z = np.asarray(logits, dtype=np.float64) if processors else logits
    for processor in processors:
        z = processor(z, prompt, out)
    return z


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def sample(logits: np.ndarray, rng: np.random.Generator, temperature=0.0, top_k=40, top_p=0.95,
           min_p=0.05) -> int:
    """One token id from logits [V] (processed: `processed`); temperature 0 is greedy (argmax)."""
    logits = np.asarray(logits, dtype=np.float64)  # [V]
    if temperature == 0:
        return int(np.argmax(logits))
    if 0 < top_k < len(logits):  # a stable sort's first k, found by a partition (a full sort costs 6x)
        kth = -np.partition(-logits, top_k - 1)[top_k - 1]  # the k-th largest value
        above = np.flatnonzero(logits > kth)
        top = np.concatenate([above, np.flatnonzero(logits == kth)[: top_k - len(above)]])
        order = top[np.lexsort((top, -logits[top]))]  # most likely first, ties by id
    else:
        order = np.argsort(-logits, kind="stable")  # candidates, most likely first
    if top_p < 1:
        cum = np.cumsum(softmax(logits[order]))
        order = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest prefix reaching top_p
    if min_p > 0:
        p = softmax(logits[order])
        order = order[p >= min_p * p[0]]
    p = softmax(logits[order] / temperature)
    i = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
    return int(order[min(i, len(order) - 1)])


@dataclass
class Timings:
    """Seconds and tokens of the prompt pass and of the decode steps, for llama.cpp-style reports."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    eval_tokens: int = 0
    eval_seconds: float = 0.0
    stop: str = ""  # why generation ended: "eos", "length" (-n reached) or "context" (the context is full)


def generate(model, ids, max_new_tokens, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
             seed=None, ctx_size=None, on_token=None, timings: Timings | None = None, repeat_last_n=REPEAT_LAST_N,
             ignore_eos=False, batch_size=512, stop_ids=None, context_shift=False, keep=0,
             processors=()) -> list[int]:
    """New token ids after the prompt `ids`; stops at EOS (any of `stop_ids`, default the config's; not returned;
    never with `ignore_eos`), after
    `max_new_tokens` (-1: no limit), or when prompt and output fill the context. `timings.stop` says which. With
    `context_shift` a full context does not stop it: the model's `shift` keeps the first `keep` positions (-1: the
    prompt's) and drops half of the rest (llama.cpp's --context-shift, --keep). `processors` change each next token's
    logits after the penalties (`Processor`: a bias, a grammar's mask), each told every token taken.

    `model` is any engine with `config`, `new_cache(capacity)`, `forward(batch, cache) -> logits [T, V]` (and
    `shift(cache, seq, keep, discard)` for a context shift); the prompt goes through it `batch_size` tokens at a
    time (llama.cpp's -b).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n)
    if batch_size < 1:
        raise UserError(f"-b/--batch-size must be >= 1, got {batch_size}")
    cfg = model.config
    stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
    ctx = check_prompt(ids, cfg, ctx_size)
    ids = [int(i) for i in ids]
    timings = timings if timings is not None else Timings()
    if max_new_tokens == 0:
        timings.stop = "length"
        return []
    keep = shift_keep(len(ids), ctx, keep) if context_shift else 0
    limit = (-1 if context_shift else ctx - len(ids)) if max_new_tokens < 0 else max_new_tokens
    rng, chain = np.random.default_rng(seed), penalties(repeat_penalty, repeat_last_n) + list(processors)
    cache = model.new_cache(ctx if limit < 0 else min(ctx, len(ids) + limit))
    t0 = time.perf_counter()
    for i in range(0, len(ids), batch_size):
        logits = model.forward(Batch.single(ids[i:i + batch_size], cache, last_only=True), cache)[-1]  # [V]
    timings.prompt_tokens, timings.prompt_seconds = len(ids), time.perf_counter() - t0
    out: list[int] = []
    t0 = time.perf_counter()
    try:
        while True:
            tok = sample(processed(chain, logits, ids, out), rng, temperature, top_k, top_p, min_p)
            if tok in stop_ids and not ignore_eos:
                timings.stop = "eos"
                break
            out.append(tok)
            for processor in chain:
                processor.accept(tok)
            if on_token is not None:
                on_token(tok)
            held = int(cache.lengths[0])  # `tok` goes to position `held`
            if held + 1 == ctx and not context_shift or len(out) == limit:  # prompt and output fill the context
                timings.stop = "context" if held + 1 == ctx and not context_shift else "length"
                break
            if held == ctx:
                model.shift(cache, 0, keep, (held - keep) // 2)
            logits = model.forward(Batch.single([tok], cache), cache)[-1]
            timings.eval_tokens += 1
    finally:  # Ctrl-C too: the timing lines report what ran
        timings.eval_seconds = time.perf_counter() - t0
    return out
