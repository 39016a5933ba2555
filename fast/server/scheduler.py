"""Continuous batching: one engine thread owns the model and runs every forward; requests wait in a bounded FIFO
queue, take a KV-cache slot when one is free, and share each step with the others (llama.cpp's server loop).

A step is one `forward` over a batch of runs: each generating request's last sampled token (decodes first, so that
they keep their pace), then pending prompt tokens up to `batch_size` in all (a long prompt is fed in chunks over
several steps, beside the running decodes; a prompt that begins as one seen before starts from the prefix cache's
copy of those positions, `ref.common.prefix`). A request whose prompt is complete samples its next token from its
run's logits with its own sampler and seed, and its text is the same alone, beside others, after the prefix cache and
on a rerun: the engine runs fast.cpu's kernels only (`gemm` off), on which a position's keys, values and logits are
the same bits however the steps group it (a prompt's chunks, the decodes beside it). Text comes out through
`TextStream` (whole UTF-8 characters, stop strings cut and never emitted) as events the HTTP layer reads:
`("text", piece, token)`, then `("done", finish_reason, stats)` or `("error", message, http_status)`. A cancelled
request (a client that went away) leaves its slot at the next step; a request whose own work fails on the engine
thread ends with an error, the others going on (`alone`); `drain` ends them all for a shutdown.

Dimensions: V vocab.
"""

import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fast.load import memory_available
from fast.server.sampling import sample as fast_sample
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.prefix import PrefixCache
from ref.common.sampling import REPEAT_LAST_N, check_keep, penalties, processed, shift_keep


@dataclass
class Params:
    """A request's generation settings (OpenAI's and llama.cpp's fields)."""

    max_tokens: int = -1  # -1: until EOS or the slot's context is full
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = REPEAT_LAST_N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0  # how many top alternatives to report per token (0: no logprobs)
    ignore_eos: bool = False
    cache_prompt: bool = True  # llama.cpp's: reuse cached positions of the prompt's beginning, and cache it


DEFAULT_CACHE_RAM = 8192  # MiB, llama.cpp's --cache-ram


class QueueFull(Exception):
    """The bounded queue is full: the HTTP layer answers 503 with Retry-After."""


class ShuttingDown(Exception):
    """The server is draining (`Scheduler.drain`): the HTTP layer answers 503."""


class TextStream:
    """Decoded text of a request's tokens as it may be shown: whole UTF-8 characters only, and nothing that could be
    the start of a stop string until the next token decides; a stop string ends the text and is never shown."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok, self.stop, self.ids, self.shown = tokenizer, tuple(s for s in stop if s), [], 0
        self.text = ""
        self.start = self.read = 0  # ids[start:] is decoded at each token; ids[:read] are in text
        self.seen = ""  # decode(ids[start:read]), kept from the token before

    def add(self, token: int) -> tuple[str, bool]:
        """The new text to show after `token`, and whether a stop string ended the text."""
        self.ids.append(token)
        self.extend()
        if self.read < len(self.ids):  # an incomplete UTF-8 sequence: wait for the next byte
            return "", False
        text = self.text
        cut = min((i for i in (text.find(s, max(0, self.shown - len(s) + 1)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            return self.take(cut), True
        hold = max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)  # a tail that may grow into a stop string
        return self.take(len(text) - hold), False

    def extend(self) -> None:
        """text = decode(ids) when it ends in whole characters, from a window of the last tokens (vLLM's incremental
        detokenization): decoding every id at every token cost 160 us per token at 1,000 tokens. The window starts
        at a token that decodes to text of its own, so that a decoder's leading-space strip treats the window's text
        and its context alike; anything else is decoded whole."""
        window = self.tok.decode(self.ids[self.start:])
        if window.endswith("\ufffd"):
            return
        if window.startswith(self.seen):
            self.text += window[len(self.seen):]
        else:
            self.text = self.tok.decode(self.ids)
        new = self.ids[self.read:]
        piece = self.tok.decode(new[:1]) if new else ""
        if piece:  # the next window starts at the new tokens
            self.start, self.seen = self.read, piece if len(new) == 1 else self.tok.decode(new)
        else:
            self.seen = window
        self.read = len(self.ids)

    def take(self, end: int) -> str:
        piece, self.shown = self.text[self.shown:max(end, self.shown)], max(end, self.shown)
        return piece

    def flush(self) -> str:
        """At the end without a stop string: what was held back."""
        return self.take(len(self.text))


@dataclass
class Request:
    """One completion: prompt ids, settings, and where its events go (`emit`: on the scheduler's `loop` when it has
    one, else on the engine thread)."""

    prompt: list[int]
    params: Params
    emit: object
    cancelled: threading.Event = field(default_factory=threading.Event)
    # engine-side state
    slot: int = -1
    fed: int = 0
    cached: int = 0  # prompt positions restored from the prefix cache
    shifted: bool = False  # its slot no longer holds its tokens at their positions (a context shift)
    out: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    stream: TextStream | None = None
    rng: np.random.Generator | None = None
    processors: list = field(init=False)  # its logits processors (ref.common.sampling), from its params
    queued_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0

    def __post_init__(self):
        p = self.params
        self.processors = penalties(p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty)


def cache_budget(mib: float | None) -> int:
    """Bytes of prefix cache for --cache-ram MiB, after the model is loaded: None gives llama.cpp's default of
    8,192 MiB or half the memory still available, whichever is less; more than is available is refused."""
    have = memory_available()
    if mib is None:
        return min(DEFAULT_CACHE_RAM << 20, have // 2)
    if mib * 2**20 > have:
        raise UserError(f"--cache-ram {mib:g} MiB: only {have / 2**20:.0f} MiB of memory is available with the model "
                        f"loaded")
    return int(mib * 2**20)


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def deliver(items) -> None:
    for r, event in items:
        r.emit(event)


def logprob_entries(logits: np.ndarray, token: int, top: int) -> dict:
    """The chosen token's log-probability under the model and the `top` most likely alternatives."""
    z = logits.astype(np.float64)
    lp = z - (z.max() + math.log(np.exp(z - z.max()).sum()))  # [V] log-softmax
    best = np.argsort(-lp, kind="stable")[:top]
    return {"token": token, "logprob": float(lp[token]),
            "top": [(int(i), float(lp[i])) for i in best]}


class Scheduler:
    """The engine thread and its request queue. `load()` runs on that thread first (numba's thread count and a CUDA
    context belong to the thread that sets them) and returns (engine, tokenizer)."""

    def __init__(self, load, slots: int, ctx_size: int | None, batch_size: int = 512, max_queue: int = 64,
                 context_shift: bool = False, keep: int = 0, cache_ram: float | None = 0):
        if slots < 1:
            raise UserError(f"-np/--parallel must be >= 1, got {slots}")
        if batch_size < 1:
            raise UserError(f"-b/--batch-size must be >= 1, got {batch_size}")
        if max_queue < 0:
            raise UserError(f"--max-queue must be >= 0, got {max_queue}")
        check_keep(keep)
        if cache_ram is not None and not cache_ram >= 0:
            raise UserError(f"--cache-ram must be >= 0 MiB (0: no prefix cache), got {cache_ram:g}")
        self.cache_ram = cache_ram  # MiB of prefix cache (None: the default, cache_budget)
        self.prefix: PrefixCache | None = None
        self.context_shift, self.keep = context_shift, keep  # llama.cpp's --context-shift, --keep
        self.load, self.slots, self.ctx_size, self.batch_size = load, slots, ctx_size, batch_size
        self.waiting: queue.Queue = queue.Queue()  # accepted requests not yet in a slot (at most max_queue + free slots)
        self.max_queue = max_queue
        self.running: list[Request] = []
        self.engine = self.tokenizer = None
        self.ready, self.failed = threading.Event(), None
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.metrics = Counter()  # requests_total, prompt_tokens_total, tokens_predicted_total, seconds...
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.loop = None  # an asyncio loop to deliver events on: one wake-up per step, not one per token
        self.outbox: list = []
        self.deadline = None  # set by drain: when the requests still running are ended

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    @property
    def ctx(self) -> int:
        """Positions a slot holds: -c, or the model's context."""
        return self.ctx_size or self.engine.config.max_seq_len

    def submit(self, request: Request) -> None:
        """Queue a request (FIFO); QueueFull when `max_queue` requests wait already."""
        if not self.ready.is_set():
            raise UserError("the model is still loading")
        if self.deadline is not None:
            raise ShuttingDown()
        if len(request.prompt) >= self.ctx:
            raise UserError(f"the request exceeds the available context size: {len(request.prompt)} prompt tokens, "
                            f"context {self.ctx} per slot (-c/--ctx-size)")
        request.queued_at = time.perf_counter()
        with self.lock:
            if self.waiting.qsize() >= self.max_queue + max(0, self.slots - len(self.running)):
                self.metrics["requests_rejected_total"] += 1
                raise QueueFull()
            self.waiting.put_nowait(request)
        self.wake.set()

    def queue_depth(self) -> int:
        return self.waiting.qsize()

    def busy_slots(self) -> int:
        return len(self.running)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def drain(self, seconds: float) -> None:
        """Take no new request; let those running and waiting go on for `seconds`, then end them: a running one with
        its final event (finish_reason 'length', what it generated so far), a waiting one with a 503 error."""
        self.deadline = time.monotonic() + seconds
        self.wake.set()

    def end_all(self) -> None:
        for r in list(self.running):
            self.finish(r, "length")
        while True:
            try:
                r = self.waiting.get_nowait()
            except queue.Empty:
                break
            self.send(r, ("error", "the server is shutting down", 503))

    # ---- the engine thread

    def send(self, r: Request, event) -> None:
        self.outbox.append((r, event))

    def flush(self) -> None:
        """Deliver the step's events: all at once on the loop (a cross-thread wake-up costs a pipe write and a pass of
        the loop), or here."""
        items, self.outbox = self.outbox, []
        if not items:
            return
        if self.loop is not None:
            self.loop.call_soon_threadsafe(deliver, items)
        else:
            deliver(items)

    def run(self) -> None:
        try:
            self.engine, self.tokenizer = self.load()
            self.engine.gemm = False  # a GEMM's blocking would make a token's bits depend on its chunk (module doc)
            if self.slots > 1:  # compile the several-sequence step now (about 0.3 s), not during the first requests
                warm = self.engine.new_cache(2, slots=2)
                self.engine.forward(Batch.of([(0, [0]), (1, [0])], warm), warm)
            for dtype in (np.float32, np.float64):  # compiled (or loaded from numba's cache) now, too
                fast_sample(np.empty(1, np.int64), np.zeros((1, 2), dtype), np.zeros(1), np.ones(1),
                            np.zeros(1, np.int64), np.ones(1), np.zeros(1))
            self.cache = self.engine.new_cache(self.ctx, slots=self.slots)
            for s in range(self.slots):
                self.cache.free(s)
            budget = cache_budget(self.cache_ram)
            self.prefix = PrefixCache(budget) if budget else None
        except BaseException as e:  # the HTTP layer reports it on /health
            self.failed = e
            return
        self.ready.set()
        while not self.stopping.is_set():
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.end_all()
                self.flush()
            self.admit()
            if not self.running:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # outside any one request's work (step isolates those): everyone learns of it
                for r in list(self.running):
                    self.finish(r, None, error=failure(e))
            self.flush()

    def admit(self) -> None:
        """Move waiting requests into free slots, oldest first."""
        while len(self.running) < self.slots:
            try:
                r = self.waiting.get_nowait()
            except queue.Empty:
                return
            if r.cancelled.is_set():
                continue
            r.slot, r.started_at = self.cache.allocate(), time.perf_counter()
            r.stream = TextStream(self.tokenizer, r.params.stop)
            r.rng = np.random.default_rng(r.params.seed)
            self.running.append(r)
            self.metrics["requests_total"] += 1
            if self.prefix is not None and r.params.cache_prompt:  # the last prompt token runs: its logits
                r.fed = r.cached = self.alone(r, self.prefix.restore, self.cache, r.slot, r.prompt,
                                              len(r.prompt) - 1) or 0
                self.metrics["prompt_tokens_cached_total"] += r.cached

    def step(self) -> None:
        """One forward: decodes first, then prompt chunks within the batch budget; then each request whose prompt is
        complete samples its next token."""
        for r in [r for r in self.running if r.cancelled.is_set()]:
            self.finish(r, None)
        for r in [r for r in self.running if r.fed == len(r.prompt) and self.cache.lengths[r.slot] == self.ctx]:
            self.alone(r, self.shift, r)  # a full slot that next_token let go on
        decoding = [r for r in self.running if r.fed == len(r.prompt)]
        runs, sampled, prompted = [(r.slot, [r.out[-1]]) for r in decoding], list(decoding), []
        budget = self.batch_size - len(runs)
        for r in self.running:
            if r.fed < len(r.prompt) and budget > 0:
                chunk = r.prompt[r.fed:r.fed + budget]
                runs.append((r.slot, chunk))
                budget -= len(chunk)
                r.fed += len(chunk)
                self.metrics["prompt_tokens_total"] += len(chunk)
                if r.fed == len(r.prompt):
                    sampled.append(r)
                    prompted.append(r)
        if not runs:
            return
        t0 = time.perf_counter()
        logits = self.forward(runs)  # {slot: [V]} of the runs that went through
        self.metrics["seconds_total"] += time.perf_counter() - t0
        self.metrics["decode_steps_total"] += 1
        for r in [r for r in sampled if r.slot not in logits]:
            sampled.remove(r)
        for r in prompted:  # its prompt's positions, for the requests that begin as it does
            if r in sampled:
                self.cache_prefix(r, r.prompt)
        rows = np.stack([logits[r.slot] for r in sampled]) if sampled else np.empty((0, 1), np.float32)  # [B, V]
        for r, t, z in zip(sampled, self.sample_each(sampled, rows), rows):
            if t >= 0:
                self.alone(r, self.next_token, r, int(t), z)

    def alone(self, r: Request, fn, *args):
        """fn(*args), a step of request r's own: if it raises, r ends with the error and the others go on."""
        try:
            return fn(*args)
        except Exception as e:
            if r in self.running:
                self.finish(r, None, error=failure(e))

    def forward(self, runs: list) -> dict:
        """Logits {slot: [V]} of each run's last token, the runs in one forward; should that fail, each run alone, so
        that a run that fails ends its own request only (the cache's lengths as they were before each try)."""
        lengths, by_slot = self.cache.lengths.copy(), {r.slot: r for r in self.running}
        try:
            logits = self.engine.forward(Batch.of(runs, self.cache, last_only=True), self.cache)  # [runs, V]
            return {slot: z for (slot, _), z in zip(runs, logits)}
        except Exception as e:
            self.cache.lengths[:] = lengths
            if len(runs) == 1:
                self.finish(by_slot[runs[0][0]], None, error=failure(e))
                return {}
        out = {}
        for slot, tokens in runs:
            got = self.alone(by_slot[slot], self.engine.forward, Batch.of([(slot, tokens)], self.cache, last_only=True),
                             self.cache)
            if got is not None:
                out[slot] = got[0]
        return out

    def sample_each(self, reqs: list[Request], logits: np.ndarray) -> np.ndarray:
        """`sample` of all rows at once; should that fail, row by row, a row that fails ending its request (token
        -1)."""
        try:
            return self.sample(reqs, logits)
        except Exception:
            pass
        out = np.full(len(reqs), -1, np.int64)
        for i, r in enumerate(reqs):
            t = self.alone(r, self.sample, [r], logits[i:i + 1])
            if t is not None:
                out[i] = t[0]
        return out

    @staticmethod
    def sample(reqs: list[Request], logits: np.ndarray) -> np.ndarray:
        """Each request's next token [B] from its row of logits [B, V], with its own penalties, settings and seed:
        ref's sampler, for all rows in one call (fast.server.sampling)."""
        out = np.empty(len(reqs), np.int64)
        if not reqs:  # a step of prompt chunks only
            return out
        ps = [r.params for r in reqs]
        rows = [i for i, r in enumerate(reqs) if r.processors]
        z = logits.astype(np.float64) if rows else logits  # [B, V]: float32 samples alike (fast.server.sampling.sample)
        for i in rows:
            z[i] = processed(reqs[i].processors, z[i], reqs[i].prompt, reqs[i].out)
        u = np.array([r.rng.random() if p.temperature > 0 else 0.0 for r, p in zip(reqs, ps)])  # [B] each one draw
        fast_sample(out, z, u, np.array([p.temperature for p in ps], np.float64),
                    np.array([p.top_k for p in ps], np.int64), np.array([p.top_p for p in ps], np.float64),
                    np.array([p.min_p for p in ps], np.float64))
        return out

    def next_token(self, r: Request, t: int, logits: np.ndarray) -> None:
        """Take the request's sampled token `t` (logits [V], for logprobs): stream its text, or finish."""
        p = r.params
        if not r.out:
            r.first_token_at = time.perf_counter()
        if t in self.tokenizer.eos_ids and not p.ignore_eos:
            return self.finish(r, "stop")
        r.out.append(t)
        for processor in r.processors:
            processor.accept(t)
        self.metrics["tokens_predicted_total"] += 1
        if p.logprobs:
            r.logprobs.append(logprob_entries(logits, t, p.logprobs))
        piece, stopped = r.stream.add(t)
        if piece:
            self.send(r, ("text", piece, t))
        if stopped:
            return self.finish(r, "stop", flush=False)
        full = len(r.prompt) + len(r.out) >= self.ctx  # prompt and output fill the context: shifted, or done
        if len(r.out) == p.max_tokens or full and not (self.context_shift and self.kept(r) is not None):
            return self.finish(r, "length")

    def kept(self, r: Request) -> int | None:
        """The positions a context shift of request r keeps (--keep of its prompt; -1: all of it), None where that
        leaves nothing to drop."""
        try:
            return shift_keep(len(r.prompt), self.ctx, self.keep)
        except UserError:
            return None

    def shift(self, r: Request) -> None:
        """Request r's full slot shifted (llama.cpp's context shift): the kept positions stay, half the rest go."""
        keep = self.kept(r)
        r.shifted = True
        self.engine.shift(self.cache, r.slot, keep, (self.ctx - keep) // 2)

    def cache_prefix(self, r: Request, tokens: list[int]) -> None:
        """Request r's slot's positions of `tokens` (those it holds) into the prefix cache. A failure here costs
        later requests their reuse, never this one its answer: counted, not raised."""
        if self.prefix is None or not r.params.cache_prompt or r.shifted:
            return
        try:
            self.prefix.store(self.cache, r.slot, tokens[:int(self.cache.lengths[r.slot])])
        except Exception:
            self.metrics["prefix_cache_errors_total"] += 1

    def finish(self, r: Request, reason: str | None, error: str | None = None, flush: bool = True) -> None:
        """Free the request's slot, its positions kept in the prefix cache if it ended well; tell its reader why it
        ended (nothing for a cancelled request)."""
        if reason is not None and error is None:
            self.cache_prefix(r, r.prompt + r.out)
        self.cache.free(r.slot)
        self.running.remove(r)
        if error is not None:
            self.send(r, ("error", error, 500))
            return
        if reason is None:
            return
        rest = r.stream.flush() if flush else ""  # held back for a stop string that did not come
        if rest:
            self.send(r, ("text", rest, None))
        end = time.perf_counter()
        first = r.first_token_at or end
        self.send(r, ("done", reason, {
            "prompt_tokens": len(r.prompt), "cached_tokens": r.cached, "completion_tokens": len(r.out), "text": r.stream.text[:r.stream.shown],
            "logprobs": r.logprobs, "prompt_ms": (first - r.started_at) * 1e3, "predicted_ms": (end - first) * 1e3,
            "queued_ms": (r.started_at - r.queued_at) * 1e3}))
