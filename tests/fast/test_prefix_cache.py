"""Prefix caching (ref.common.prefix, the server's --cache-ram): what is restored is what was stored, to the token; a
prompt continued from restored positions gives the logits of a cold prefill; the scheduler's greedy outputs are the
same with and without the cache, for requests alone or sharing blocks at once; eviction keeps within the budget,
least recently used first."""

import numpy as np
import pytest

import ref.common.prefix
from fast.server.scheduler import Params, Request, Scheduler, cache_budget
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.prefix import PrefixCache
from ref.common.tokenizer import load_tokenizer
from tests.fast.conftest import sparse_engine, sparse_model
from tests.helpers import SHIPPED, assert_close, serve_requests

A = [5, 9, 3, 17, 22, 8, 4, 11, 30, 6, 13]
B = A[:6] + [40, 41, 42]  # shares A's first 6 tokens: a block and a half at BLOCK = 4
C = [7, 7, 21, 33, 12, 19, 28, 2]


@pytest.fixture
def blocks_of_4(monkeypatch):
    monkeypatch.setattr(ref.common.prefix, "BLOCK", 4)


@pytest.fixture(scope="module")
def engines(small):
    return sparse_model(small), sparse_engine(small)


def filled(m, ids, slots=2):
    """A cache whose slot 0 holds ids, the others free."""
    cache = m.new_cache(32, slots=slots)
    m.forward(Batch.single(ids, cache), cache)
    for seq in range(1, slots):
        cache.free(seq)
    return cache


def held(cache, seq, n):
    """Slot seq's first n positions, keys and values of every layer."""
    return [a[seq][:, :n] for a in (*cache.k, *cache.v)]


@pytest.mark.parametrize("engine", [0, 1])
def test_restored_positions_are_the_stored_ones(engines, blocks_of_4, engine):
    """A and B share 6 tokens: B gets exactly those 6 positions (a whole block and 2 of the next), an unrelated
    prompt none, A itself all but its last (the limit); each restored array equals the slot it came from."""
    m = engines[engine]
    cache = filled(m, A)
    prefix = PrefixCache(1 << 20)
    assert prefix.store(cache, 0, A) == len(A) and prefix.blocks == 3
    assert prefix.nbytes == len(A) * cache.bytes_per_token()
    for ids, want in ((B, 6), (C, 0), (A, len(A) - 1), (A[:3], 3)):
        seq = cache.allocate()
        assert prefix.restore(cache, seq, ids, len(ids) if ids != A else len(A) - 1) == want
        assert cache.lengths[seq] == want
        for got, expected in zip(held(cache, seq, want) if want else [], held(cache, 0, want)):
            np.testing.assert_array_equal(got, expected)
        cache.free(seq)


@pytest.mark.parametrize("engine", [0, 1])
def test_a_prompt_continued_from_the_cache_gives_the_cold_logits(engines, blocks_of_4, engine):
    """B's logits after its 6 restored positions: those of B's cold prefill from position 6 on (1e-5)."""
    m = engines[engine]
    cache = filled(m, A)
    prefix = PrefixCache(1 << 20)
    prefix.store(cache, 0, A)
    seq = cache.allocate()
    assert prefix.restore(cache, seq, B, len(B) - 1) == 6
    got = m.forward(Batch.single(B[6:], cache, seq), cache)  # [3, V]
    assert_close(got, m.logits(B)[6:], rtol=1e-5)


def test_eviction_keeps_the_budget_least_recently_used_first(engines, blocks_of_4):
    """A budget of 4 blocks: A (2), then C (2) fill it; A used again; D's block evicts C's last block, not A's; a
    block larger than the budget is not stored; the bytes never exceed the budget."""
    m = engines[0]
    a, c, d = A[:8], C, [44, 45, 46, 47]
    cache = m.new_cache(32, slots=3)
    for seq, ids in enumerate((a, c, d)):
        m.forward(Batch.single(ids, cache, seq), cache)
    prefix = PrefixCache(16 * cache.bytes_per_token())
    assert prefix.store(cache, 0, a) == 8 and prefix.store(cache, 1, c) == 8 and prefix.nbytes == prefix.budget
    probe = m.new_cache(32)
    probe.free(0)
    probe.allocate()
    assert prefix.restore(probe, 0, a, 8) == 8
    probe.free(0)
    assert prefix.store(cache, 2, d) == 4 and prefix.nbytes == prefix.budget
    for ids, want in ((a, 8), (c, 4), (d, 4)):
        probe.allocate()
        assert prefix.restore(probe, 0, ids, 8) == want
        probe.free(0)
    assert PrefixCache(3 * cache.bytes_per_token()).store(cache, 0, a) == 0


def test_budget_refused_beyond_the_memory():
    with pytest.raises(UserError, match="--cache-ram"):
        cache_budget(1 << 40)
    with pytest.raises(UserError, match="--cache-ram"):
        Scheduler(None, 1, None, cache_ram=-1)
    assert cache_budget(0) == 0 and 0 < cache_budget(None) <= 8192 << 20


def test_the_server_gives_the_same_tokens_with_the_cache():
    """The shipped model, greedy: a long prompt alone, then four at once that begin as it does (two sharing part of
    it, one the whole of it, one opting out with cache_prompt false): each one's tokens as without the cache, the
    cached counts reported (within 1 token of the shared part, whole blocks of it at least)."""
    from fast.load import load_engine
    tok = load_tokenizer(SHIPPED)
    engine = load_engine(SHIPPED, threads=1)
    story = tok.encode((SHIPPED.parent / "corpus" / "val.txt").read_text()[:2000])[:150]
    prompts = [story, story[:70] + tok.encode(" The dog was happy.", bos=False),
               story[:100] + tok.encode(" Lily cried.", bos=False), story, story]

    def serve(cache_ram):
        sched = Scheduler(lambda: (engine, tok), slots=4, ctx_size=256, cache_ram=cache_ram).start()
        first, = serve_requests(sched, [Request(story, Params(temperature=0.0, max_tokens=6), None)])
        rest = serve_requests(sched, [Request(p, Params(temperature=0.0, max_tokens=6, cache_prompt=i < 3), None)
                                      for i, p in enumerate(prompts[1:])])
        sched.stop()
        return [e[-1] for e in (first, *rest)]

    cold, warm = serve(0), serve(4)
    assert all(e[0] == "done" for e in cold + warm)
    assert [e[2]["text"] for e in warm] == [e[2]["text"] for e in cold]
    assert [e[2]["cached_tokens"] for e in cold] == [0] * 5
    assert [e[2]["cached_tokens"] for e in warm] == [0, 70, 100, len(story) - 1, 0]
