"""Prefix caching: the keys and values of prompts seen before, kept in host memory and copied into a new request's
slot, so that only the rest of its prompt is prefilled (vLLM's automatic prefix caching, llama.cpp's --cache-ram).

A position's keys and values depend on the tokens up to it only, so the cached positions of any token run that
begins a prompt are that prompt's first positions. The cache is a tree of blocks of up to BLOCK tokens, each keyed
by its own tokens under its parent (the tokens before it): a match compares the tokens themselves, so a request can
never be handed positions of another text, and a block's first m tokens serve a prompt that shares only those. The
blocks are read-only and shared by every slot; a request gets copies in its own slot. Within the budget of bytes,
the least recently used leaf goes first (a block is used whenever a block below it is, so leaves are the oldest).
Dimensions: L layers, K key-value heads, B a block's positions, E' items a head stores per position.
"""

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from ref.common.batch import KVCache

BLOCK = 64  # tokens a block holds: a prompt matches to the token, a block is stored and evicted whole


@dataclass(eq=False)
class Block:
    """Positions of `tokens` after those of its parent's path: keys and values per layer, each [K, B, E']."""

    tokens: tuple
    parent: "Block | None"
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    children: dict = field(default_factory=dict)  # tokens -> Block
    used: int = 0  # the cache's clock when it was last matched or stored

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v))


def common(a: tuple, b: tuple) -> int:
    """Length of the common beginning of a and b."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixCache:
    """Blocks of cached positions within `budget` bytes (their arrays' bytes), for the caches of one engine."""

    def __init__(self, budget: int):
        self.root, self.budget, self.nbytes, self.blocks = Block((), None), budget, 0, 0
        self.clock = itertools.count(1)
        self.leaves: list = []  # heap of (used, order, block): stale entries are skipped when popped
        self.order = itertools.count()

    def match(self, tokens) -> list[tuple[Block, int]]:
        """The path of blocks that begins `tokens`: each block with how many of its tokens match (all but maybe the
        last's)."""
        path, node, i = [], self.root, 0
        while i < len(tokens) and node.children:
            want = tuple(tokens[i:i + BLOCK])
            child = node.children.get(want)
            m = len(want)
            if child is None:  # the child sharing the most of its first tokens, if any
                child, m = max(((c, common(c.tokens, want)) for c in node.children.values()), key=lambda cm: cm[1])
                if m == 0:
                    break
            path.append((child, m))
            if m < len(child.tokens) or m < BLOCK:
                break
            node, i = child, i + m
        return path

    def restore(self, cache: KVCache, seq: int, tokens, limit: int) -> int:
        """The cached positions of the longest cached beginning of `tokens`, at most `limit`, copied into the empty
        slot `seq`, which then holds them: how many."""
        path = self.match(tokens)
        n = min(limit, sum(m for _, m in path))
        if n <= 0:
            return 0
        cache.reserve(seq, n)
        now, a = next(self.clock), 0
        for block, m in path:
            m = min(m, n - a)
            if m <= 0:
                break
            self.touch(block, now)
            for l in range(len(cache.k)):
                for slot, held in ((cache.k[l][seq], block.k[l]), (cache.v[l][seq], block.v[l])):
                    cache.copy_heads(slot[:, a:a + m], held[:, :m])
            a += m
        cache.lengths[seq] = n
        return n

    def store(self, cache: KVCache, seq: int, tokens) -> int:
        """Slot `seq`'s first len(tokens) positions, which hold `tokens`, kept as blocks (those not cached yet, as
        long as the budget holds them, evicting the least recently used): how many positions the cache holds now."""
        now, node, i = next(self.clock), self.root, 0
        while i < len(tokens):
            want = tuple(tokens[i:i + BLOCK])
            child = node.children.get(want)
            if child is None:
                need = len(want) * cache.bytes_per_token()
                if not self.make_room(need, node):
                    break
                child = Block(want, node)
                for l in range(len(cache.k)):
                    for held, slot in ((child.k, cache.k[l][seq]), (child.v, cache.v[l][seq])):
                        K, R, E = slot.shape
                        copy = np.empty((K, len(want), E), slot.dtype)  # [K, B, E']
                        cache.copy_heads(copy, slot[:, i:i + len(want)])
                        held.append(copy)
                node.children[want] = child
                self.nbytes += child.nbytes
                self.blocks += 1
            self.touch(child, now)
            node, i = child, i + len(want)
        return i

    def touch(self, block: Block, now: int) -> None:
        block.used = now
        heapq.heappush(self.leaves, (now, next(self.order), block))
        if len(self.leaves) > 4 * self.blocks + 64:  # stale entries outnumber the blocks: rebuild
            self.leaves = [(b.used, next(self.order), b) for b in self.walk() if not b.children]
            heapq.heapify(self.leaves)

    def walk(self):
        stack = list(self.root.children.values())
        while stack:
            b = stack.pop()
            stack.extend(b.children.values())
            yield b

    def make_room(self, need: int, keep: Block) -> bool:
        """Evict least recently used leaves (never `keep`, the block about to get a child) until `need` more bytes fit
        the budget: whether they do."""
        if need > self.budget:
            return False
        held = []
        while self.nbytes + need > self.budget and self.leaves:
            used, order, b = heapq.heappop(self.leaves)
            if b.parent is None or b.children or used != b.used:
                continue  # evicted already, a parent now, or touched since
            if b is keep:
                held.append((used, order, b))
                continue
            del b.parent.children[b.tokens]
            self.nbytes -= b.nbytes
            self.blocks -= 1
            if not b.parent.children and b.parent is not self.root:
                heapq.heappush(self.leaves, (b.parent.used, next(self.order), b.parent))
            b.parent = None
        for entry in held:
            heapq.heappush(self.leaves, entry)
        return self.nbytes + need <= self.budget
