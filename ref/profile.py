"""Activation profiling (PowerInfer section 5.1): how often each FFN neuron fires on a corpus, and
(FFN-block input, fired mask) samples for predictor training.

Both stream the corpus window by window: memory is fixed by the counts and the reservoir, not the corpus.
Dimensions: T window tokens, D d_model, F FFN neurons, L layers, N reservoir samples.
"""

from pathlib import Path

import numpy as np

from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.progress import Progress
from ref.model import Model, ffn_activation, fired, require_sparse

CHUNK_BYTES = 1 << 20
DOC_SEPARATOR = "<|endoftext|>"  # the corpus' document separator: a boundary between stories, never text


def corpus_tokens(tokenizer, path: Path):
    """Yield (token ids, fraction of the file read): the corpus as the model was trained on it, each document (the
    text between DOC_SEPARATORs, stripped) as BOS, its tokens, EOS. Streams: a document longer than a few chunks is
    sent in pieces, BOS before its first only."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: corpus file not found")
    size = max(path.stat().st_size, 1)
    bos, eos = [tokenizer.bos_id] if tokenizer.bos_id is not None else [], list(tokenizer.eos_ids[:1])

    def text_ids(text: str, first: bool) -> list[int]:
        ids = tokenizer.encode(text)[len(bos):]
        return bos + ids if first else ids

    pending, read, open_doc = "", 0, False
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            text = f.read(CHUNK_BYTES)
            text += f.readline() if text else ""  # end the chunk at a line boundary so no word is split
            read += len(text.encode("utf-8"))
            *done, pending = (pending + text).split(DOC_SEPARATOR)
            if not text:
                done, pending = done + [pending], ""
            ids = []
            for doc in done:
                if doc.strip() or open_doc:
                    ids += text_ids(doc.strip(), not open_doc) + eos
                open_doc = False
            if len(pending) > 4 * CHUNK_BYTES:  # a long document: its text so far
                ids += text_ids(pending.lstrip() if not open_doc else pending, not open_doc)
                pending, open_doc = "", True
            yield ids, min(read / size, 1.0)
            if not text:
                return


WINDOW = 256  # tokens per forward pass over a corpus, unless the context is shorter


def window_size(window: int | None, cfg) -> int:
    """--window as given (checked against the model's context), or WINDOW cut to the context."""
    if window is None:
        return min(WINDOW, cfg.max_seq_len)
    if not 2 <= window <= cfg.max_seq_len:
        raise UserError(f"--window must be in [2, {cfg.max_seq_len}] (the model's context), got {window}")
    return window


def corpus_windows(tokenizer, path: Path, window: int, max_tokens: int | None = None):
    """Yield (ids [<= window], fraction done): the corpus' token stream (`corpus_tokens`) cut into windows of
    `window` tokens, at most `max_tokens` in all; done is the share of the file read, or of max_tokens sent where
    that is larger (whichever ends the stream first), so that a progress line's ETA is the run's."""
    buf: list[int] = []
    sent, lo = 0, 0.0
    for ids, hi in corpus_tokens(tokenizer, path):
        buf += ids
        while len(buf) >= window or (hi >= 1.0 and buf):
            n = min(window, len(buf), max_tokens - sent if max_tokens is not None else window)
            left = len(buf) - n  # tokens of this read not yet sent: the fraction read, pro rata
            read = hi - (hi - lo) * min(left / max(len(ids), 1), 1.0)
            sent += n
            yield np.asarray(buf[:n], dtype=np.int64), max(read, sent / max_tokens if max_tokens else 0.0)
            del buf[:n]
            if max_tokens is not None and sent >= max_tokens:
                return
        lo = hi


def observe_ffn(model: Model, observer) -> Model:
    """Dense FFN that also reports observer(l, h [T, D], fired mask [T, F]): the profiling transform."""
    c = model.config
    require_sparse(c.ffn_kind)

    def block(l, h):
        g, u = model.ffn_gate_up(l, h)  # [T, F]
        observer(l, h, fired(c.ffn_kind, g, u, c.act_threshold))
        return model.linear(ffn_activation(c.ffn_kind, g, u, c.act_threshold), f"layers.{l}.wd")

    model.ffn_block = block
    return model


def run_corpus(model: Model, windows, label: str) -> int:
    """Run every window (corpus_windows) through the model (fresh cache each); returns the tokens seen."""
    progress = Progress(label, 1.0)
    tokens = 0
    for ids, frac in windows:
        cache = model.new_cache(len(ids))
        model.forward(Batch.single(ids, cache), cache)
        tokens += len(ids)
        progress.update(len(ids), done=frac)
    progress.close()
    return tokens


def profile_activations(model: Model, windows) -> tuple[np.ndarray, int]:
    """Per-layer firing counts [L, F] int64 and the number of tokens profiled."""
    c = model.config
    counts = np.zeros((c.n_layers, c.d_ffn), dtype=np.int64)  # [L, F]

    def count(l, h, mask):
        counts[l] += mask.sum(0)

    saved = model.ffn_block
    observe_ffn(model, count)
    try:
        tokens = run_corpus(model, windows, "profile")
    finally:
        model.ffn_block = saved
    return counts, tokens


class Reservoir:
    """Uniform sample of N tokens' (h [D], fired mask [F]) per layer (Vitter's algorithm R), the same tokens in
    every layer. Masks are bit-packed: a LLaMA-7B-shaped reservoir costs N * L * (4D + F/8) bytes."""

    def __init__(self, n_layers: int, d_model: int, d_ffn: int, capacity: int, seed: int):
        # np.full, not np.zeros: touch every page now, so the memory a run needs shows at its start.
        self.h = np.full((n_layers, capacity, d_model), 0, np.float32)  # [L, N, D]
        self.bits = np.full((n_layers, capacity, (d_ffn + 7) // 8), 0, np.uint8)  # [L, N, F/8]
        self.d_ffn, self.capacity, self.seen = d_ffn, capacity, 0
        self.rng = np.random.default_rng(seed)
        self.slots = np.empty(0, np.int64)

    @property
    def n_layers(self) -> int:
        return self.h.shape[0]

    @staticmethod
    def bytes_per_sample(n_layers: int, d_model: int, d_ffn: int) -> int:
        return n_layers * (4 * d_model + (d_ffn + 7) // 8)

    def next_window(self, T: int) -> None:
        """Decide which of the next T tokens enter the reservoir, and where (-1: dropped)."""
        k = self.seen + np.arange(T)
        slots = np.where(k < self.capacity, k, -1)
        late = k >= self.capacity
        j = self.rng.integers(0, k[late] + 1)
        slots[late] = np.where(j < self.capacity, j, -1)
        self.slots, self.seen = slots, self.seen + T

    def add(self, l: int, h: np.ndarray, mask: np.ndarray) -> None:
        keep = self.slots >= 0
        self.h[l, self.slots[keep]] = h[keep]
        self.bits[l, self.slots[keep]] = np.packbits(mask[keep], axis=-1)

    def layer(self, l: int) -> tuple[np.ndarray, np.ndarray]:
        """(h [n, D] float32, mask [n, F] bool) of layer l."""
        n = min(self.seen, self.capacity)
        return self.h[l, :n], np.unpackbits(self.bits[l, :n], axis=-1, count=self.d_ffn).astype(bool)


def collect_samples(model: Model, windows, capacity: int, seed: int = 0) -> Reservoir:
    """Sample (FFN-block input before the norm, fired mask) pairs per layer over a corpus."""
    c = model.config
    res = Reservoir(c.n_layers, c.d_model, c.d_ffn, capacity, seed)

    def windows_with_slots():
        for ids, frac in windows:
            res.next_window(len(ids))
            yield ids, frac

    saved = model.ffn_block
    observe_ffn(model, lambda l, h, mask: res.add(l, h, mask))
    try:
        run_corpus(model, windows_with_slots(), "collect")
    finally:
        model.ffn_block = saved
    return res


def firing_stats(counts: np.ndarray, tokens: int) -> list[dict]:
    """Per layer: mean fired fraction per token, fraction of neurons covering 80% of firings, share of the top 1%."""
    out = []
    for l, c in enumerate(counts):
        s = np.sort(c)[::-1].astype(np.float64)
        total = max(s.sum(), 1.0)
        cover = int(np.searchsorted(np.cumsum(s) / total, 0.8)) + 1
        top = max(1, int(round(0.01 * len(s))))
        out.append({"layer": l, "fired_fraction": s.sum() / max(tokens, 1) / len(s),
                    "neurons_for_80pct": cover / len(s), "top1pct_share": s[:top].sum() / total})
    return out
