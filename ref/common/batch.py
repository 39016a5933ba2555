"""What a forward step reads and writes besides the weights: a batch of tokens, each tagged with its sequence and
position, and the KV cache whose slots hold the sequences.

Every engine's `forward(batch, cache)` takes these. A batch is one or more runs, each a sequence's next tokens in
position order continuing what its slot holds (a prompt chunk, or one decode token), in consecutive rows; each
sequence is computed as if it were alone. A slot's arrays grow with what it holds (doubling, up to the capacity),
so the cache's memory follows the tokens the sequences hold, not slots x context.
A slot's keys and values are head-major, [K, R, E]: each key-value head's positions are contiguous, so decode
attention streams one run of memory per head.
Dimensions: N batch tokens, L layers, C capacity per slot (the context size), R a slot's room, K key-value heads,
E head dim.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format, format_of

KV_FORMATS = ("f32", "f16", "bf16", "q8_0")  # what a KV cache stores (llama.cpp's -ctk, -ctv)
# The CLIs' and the server's default. Not llama.cpp's f16: keys rounded to f16 turn the engines' last-bit differences
# (float sums in another order) into whole f16 steps now and then, and greedy text from ref and fast parted at a
# near-tie (the shipped model, TEAL 40 %, "the cat"); in f32, bf16 and q8_0 it did not.
KV_DEFAULT = "f32"
MIN_ROOM = 128  # positions a slot gets when it first holds any (then doubling): small prompts do not reallocate


def kv_format(name: str, flag: str, E: int) -> Format:
    """The KV cache format called `name` for heads of E dims."""
    fmt = format_of(name, flag)
    if fmt.name not in KV_FORMATS:
        raise UserError(f"{flag}: the KV cache is stored in {', '.join(KV_FORMATS)}, not {fmt.name}")
    if E % fmt.block:
        raise UserError(f"{flag} {fmt.name}: a head of {E} dims is not whole blocks of {fmt.block}")
    return fmt


def host_zeros(shape, dtype, l):
    return np.zeros(shape, dtype)


def host_copy(dst, src):
    dst[...] = src


@dataclass
class KVCache:
    """Keys and values per layer and slot, k[l][s] and v[l][s] each [K, R_s, E / block] (a host array, or a device
    array where layer l's attention runs on the GPU; None while slot s holds nothing), each slot's length and whether
    it is allocated. `formats` are the keys' and the values' (llama.cpp's -ctk, -ctv: f32 stores `dtype`, the others
    rows of their blocks, `Format.dtype`). `alloc(shape, dtype, l)` makes layer l's arrays and `copy(dst, src)` copies
    a contiguous run between them and host arrays (a slot growing, a cached prefix stored or restored).
    """

    k: list
    v: list
    lengths: np.ndarray  # [slots] int64
    used: np.ndarray  # [slots] bool
    capacity: int
    dtype: np.dtype
    shape: tuple  # (K, E)
    alloc: object = host_zeros
    copy: object = host_copy
    version: int = 0  # counts changes of the slots' arrays (growth, free), for views an engine keeps of them
    formats: tuple = (FORMATS["f32"], FORMATS["f32"])  # the keys', the values'

    @staticmethod
    def empty(cfg: ModelConfig, capacity: int, dtype, slots: int = 1, alloc=None, copy=None,
              formats: tuple = ("f32", "f32")) -> "KVCache":
        """A cache for `slots` sequences of up to `capacity` positions each, every slot allocated and empty, its keys
        and values stored in `formats` (names: f32, f16, bf16, q8_0)."""
        L, E = cfg.n_layers, cfg.head_dim
        formats = tuple(kv_format(name, flag, E) for name, flag in zip(formats, ("-ctk", "-ctv")))
        return KVCache([[None] * slots for _ in range(L)], [[None] * slots for _ in range(L)],
                       np.zeros(slots, np.int64), np.ones(slots, bool), int(capacity), np.dtype(dtype),
                       (cfg.n_kv_heads, E), alloc or host_zeros, copy or host_copy, 0, formats)

    def storage(self, fmt: Format) -> tuple[int, np.dtype]:
        """(items per position of a head, their dtype) of an array stored in `fmt`."""
        return (self.shape[1], self.dtype) if fmt.name == "f32" else (self.shape[1] // fmt.block, fmt.dtype)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def allocate(self) -> int:
        """A free slot for a new sequence (the lowest), now allocated and empty."""
        free = np.flatnonzero(~self.used)
        if not len(free):
            raise UserError(f"no free cache slot (all {self.slots} hold a sequence)")
        self.used[free[0]] = True
        return int(free[0])

    def free(self, seq: int) -> None:
        """Forget sequence `seq` and release its slot's memory; the slot can be allocated again."""
        self.check_slot(seq)
        self.lengths[seq], self.used[seq] = 0, False
        for layer in (*self.k, *self.v):
            layer[seq] = None
        self.version += 1

    def check_slot(self, seq: int) -> None:
        if not 0 <= seq < self.slots:
            raise UserError(f"sequence {seq} has no cache slot (the cache has {self.slots})")
        if not self.used[seq]:
            raise UserError(f"sequence {seq} is not allocated (its slot is free)")

    def reserve(self, seq: int, n: int) -> None:
        """Room for n positions in slot `seq`: its arrays grow (doubling, at least MIN_ROOM, at most the capacity) and
        keep what they hold."""
        held = self.k[0][seq]
        room = 0 if held is None else held.shape[1]
        if n <= room:
            return
        room = min(self.capacity, max(n, 2 * room, MIN_ROOM))
        length = int(self.lengths[seq])
        for l in range(len(self.k)):
            for arrays, fmt in zip((self.k[l], self.v[l]), self.formats):
                K, (E, dtype) = self.shape[0], self.storage(fmt)
                new = self.alloc((K, room, E), dtype, l)
                if length:
                    self.copy_heads(new[:, :length], arrays[seq][:, :length])
                arrays[seq] = new
        self.version += 1

    def copy_heads(self, dst, src) -> None:
        """dst = src, runs of positions [K, m, E'] (a slot's, or a host array's), a head at a time: each copy one
        contiguous run, host or device."""
        for kv in range(self.shape[0]):
            self.copy(dst[kv], src[kv])

    def shift(self, seq: int, keep: int, discard: int, rotate) -> None:
        """llama.cpp's context shift of slot `seq` (host arrays): positions keep..keep+discard-1 dropped, the later
        ones moved down by `discard`, each layer's moved keys passed through rotate(keys [K, m, E]) -> [K, m, E]
        (RoPE's rotation back by `discard` positions); the slot then holds `discard` positions fewer."""
        self.check_slot(seq)
        n = int(self.lengths[seq])
        if keep < 0 or discard < 1 or keep + discard > n:
            raise UserError(f"sequence {seq}: cannot drop {discard} positions after the first {keep} of {n}")
        for l in range(len(self.k)):
            k, v = self.k[l][seq], self.v[l][seq]  # [K, room, E]
            k[:, keep:n - discard] = rotate(k[:, keep + discard:n])
            v[:, keep:n - discard] = v[:, keep + discard:n].copy()  # overlapping ranges: through a copy
        self.lengths[seq] = n - discard

    @property
    def nbytes(self) -> int:
        """Bytes the slots' arrays take now."""
        return sum(a.nbytes for layer in (*self.k, *self.v) for a in layer if a is not None)

    def bytes_per_token(self) -> int:
        """Cache bytes one position takes: keys and values of every layer, each in its format."""
        K = self.shape[0]
        return len(self.k) * K * sum(n * dtype.itemsize for n, dtype in map(self.storage, self.formats))


@dataclass(frozen=True)
class Batch:
    """One forward step's tokens, each with its sequence (cache slot) and position, and whether the step returns its
    logits (llama.cpp's batch.logits; default every token)."""

    tokens: np.ndarray  # [N] int64
    seqs: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    logits: np.ndarray | None = None  # [N] bool, or None: every token

    @staticmethod
    def single(ids, cache: KVCache, seq: int = 0, last_only: bool = False) -> "Batch":
        """`ids` continuing sequence `seq` after its cached positions (llama.cpp's llama_batch_get_one); with
        `last_only` the step returns the last token's logits only."""
        return Batch.of([(seq, ids)], cache, last_only)

    @staticmethod
    def of(runs, cache: KVCache, last_only: bool = False) -> "Batch":
        """[(seq, ids), ...]: each sequence's next tokens after its cached positions, one run per sequence; with
        `last_only` the step returns each run's last logits only."""
        runs = [(seq, np.array(ids, dtype=np.int64).reshape(-1)) for seq, ids in runs]
        # Per row, as lists: three numpy calls instead of a dozen. Each call's code is out of the caches by the next
        # decode step (its weights pass through them): one token's batch took 147 us after a read pass, now 66 to 80.
        seqs, positions, logits = [], [], []
        for seq, ids in runs:
            n, start = len(ids), int(cache.lengths[seq]) if 0 <= seq < cache.slots else 0
            seqs += [seq] * n
            positions += range(start, start + n)
            logits += [not last_only] * (n - 1) + [True] * bool(n)
        tokens = runs[0][1] if len(runs) == 1 else np.concatenate([ids for _, ids in runs] + [np.zeros(0, np.int64)])
        return Batch(tokens, np.array(seqs, np.int64), np.array(positions, np.int64),
                     None if all(logits) else np.array(logits, bool))

    def __len__(self) -> int:
        return len(self.tokens)

    def runs(self) -> list[tuple[int, int, int]]:
        """(sequence, first row, end row) of each run of consecutive rows of one sequence."""
        return self._runs

    @cached_property
    def _runs(self) -> list[tuple[int, int, int]]:  # every layer asks: found once (a 16-run step's 6 layers: 0.2 ms)
        seqs = self.seqs.tolist()
        cuts = [0, *(i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1]), len(seqs)]
        return [(seqs[a], a, b) for a, b in zip(cuts, cuts[1:])] if seqs else []

    def output_rows(self) -> np.ndarray:
        """The rows whose logits the step returns."""
        return np.arange(len(self)) if self.logits is None else np.flatnonzero(self.logits)


def check_batch(batch: Batch, cache: KVCache, cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """The batch's runs (Batch.runs), checked before anything is written: each continues an allocated sequence's
    cached positions and fits its slot, no sequence has two runs, every token is in the vocabulary. Then each slot has
    room for its run; an engine appends the runs to their slots and calls `advance`."""
    n, runs = len(batch), batch.runs()
    if len(batch.seqs) != n or len(batch.positions) != n or (batch.logits is not None and len(batch.logits) != n):
        raise UserError("a batch needs a sequence and a position for each token (and a logits flag, if any)")
    seen = set()
    for seq, a, b in runs:
        cache.check_slot(seq)
        if seq in seen:
            raise UserError(f"sequence {seq} has two runs in one batch: a sequence's tokens must be consecutive rows")
        seen.add(seq)
        start = int(cache.lengths[seq])
        if start + b - a > cache.capacity:
            raise UserError(f"context full: sequence {seq} holds {start} + {b - a} tokens > context size {cache.capacity}")
    # Each row at its sequence's cached length plus its place in its run; as lists, as Batch.of builds them (one
    # token's check after a read pass: 73 -> 40 us).
    positions = batch.positions.tolist()
    for seq, a, b in runs:
        start = int(cache.lengths[seq])
        if positions[a:b] != list(range(start, start + b - a)):
            raise UserError(f"sequence {seq}: the batch's positions must continue its cached positions from {start}")
    tokens = batch.tokens.tolist()
    if n and (min(tokens) < 0 or max(tokens) >= cfg.vocab_size):
        raise UserError(f"token id out of range [0, {cfg.vocab_size})")
    for seq, a, b in runs:
        cache.reserve(seq, int(cache.lengths[seq]) + b - a)
    return runs


def advance(cache: KVCache, runs) -> None:
    """Each run's sequence now holds its tokens too."""
    for seq, a, b in runs:
        cache.lengths[seq] += b - a
