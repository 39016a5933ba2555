"""Batched forward: several sequences in one step, each computed as if it were alone (ref's semantics), on ref and
the fast CPU engine, in every place a batch can differ from one sequence: mixed prompt lengths, prefill beside decode,
a slot freed and reused, a prompt crossing the FFN chunk, an empty predicted set beside a full one."""

import numpy as np
import pytest

import fast.blas
import fast.layers
import ref
import ref.common.batch
from fast import Engine
from fast.engine import Selector, convert
from ref.common.batch import MIN_ROOM, Batch
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.quant import quantize_model
from ref.sparse import SparseFFN
from tests.fast.conftest import sparse_engine, sparse_model
from tests.helpers import assert_close

IDS = {0: [1, 4, 9, 16, 25, 36, 49, 3], 1: [2, 7, 11, 13], 2: [5, 10, 15, 20, 30, 40]}
# Each step: (sequence, how many of its next tokens) runs; prompts beside decodes, lengths all different.
SCHEDULE = [[(0, 5), (1, 2)], [(0, 1), (2, 4), (1, 1)], [(1, 1), (2, 2), (0, 2)]]


@pytest.fixture(autouse=True, params=["cpu", "blas"])
def step_kernels(request, monkeypatch):
    """Every test twice: steps of two or more tokens on fast.cpu's kernels, then on fast.blas's GEMMs (the
    prompt-chunk kernels, which otherwise start at blas.MIN_TOKENS and MIN_WORK, blas.GEMM_TOKENS for a float
    product, and for a sparse FFN only where the chunk computes fast.layers.GEMM_SHARE of its union)."""
    gemm = request.param == "blas"
    monkeypatch.setattr(fast.blas, "MIN_TOKENS", 2 if gemm else 10**9)
    monkeypatch.setattr(fast.blas, "MIN_WORK", 0 if gemm else 10**9)
    monkeypatch.setattr(fast.blas, "GEMM_TOKENS", 2 if gemm else 10**9)
    monkeypatch.setattr(fast.layers, "GEMM_SHARE", 0.0 if gemm else 2.0)


def engines(d):
    """(name, engine) pairs run batched, and the ref model each is checked against alone."""
    sparse_ref = sparse_model(d)
    return {"ref dense": (ref.load_model(d), ref.load_model(d)),
            "ref sparse": (sparse_ref, sparse_ref),
            "fast dense": (Engine.load(d), ref.load_model(d)),
            "fast sparse": (sparse_engine(d), sparse_ref),
            "fast sparse q8_0": (convert(sparse_engine(d), FORMATS["q8_0"]),
                                 quantize_model(sparse_model(d), "q8_0"))}


def run_schedule(engine, schedule, slots=3, capacity=None):
    """Logits per sequence, gathered from the rows of each batched step."""
    cache = engine.new_cache(capacity, slots=slots)
    done, out = {s: 0 for s in IDS}, {s: [] for s in IDS}
    for step in schedule:
        batch = Batch.of([(s, IDS[s][done[s]:done[s] + n]) for s, n in step], cache)
        logits = engine.forward(batch, cache)
        for s, a, b in batch.runs():
            out[s].append(logits[a:b])
        for s, n in step:
            done[s] += n
    assert cache.lengths.tolist() == [done[s] for s in sorted(IDS)][:slots]
    return {s: np.concatenate(parts) for s, parts in out.items() if parts}, done


@pytest.mark.parametrize("name", ["ref dense", "ref sparse", "fast dense", "fast sparse", "fast sparse q8_0"])
def test_batched_equals_each_sequence_alone(small, name):
    engine, oracle = engines(small)[name]
    got, done = run_schedule(engine, SCHEDULE)
    for s in IDS:
        assert_close(got[s], oracle.logits(IDS[s][:done[s]]), rtol=1e-4, name=f"{name} sequence {s}")


def test_prompts_crossing_the_ffn_chunk(small, monkeypatch):
    """Runs of 5 and 4 tokens with 3-token FFN chunks: chunks span two sequences."""
    monkeypatch.setattr(fast.layers, "FFN_CHUNK", 3)
    got, done = run_schedule(sparse_engine(small), [[(0, 5), (2, 4)], [(2, 1), (0, 1)]])
    oracle = sparse_model(small)
    for s in (0, 2):
        assert_close(got[s], oracle.logits(IDS[s][:done[s]]), rtol=1e-4)


def test_freed_slot_is_reused_and_others_are_untouched(small):
    for engine in (sparse_engine(small), sparse_model(small)):
        cache = engine.new_cache(slots=2)
        engine.forward(Batch.of([(0, IDS[0][:3]), (1, IDS[1][:2])], cache), cache)
        keys = [k[0].copy() for k in cache.k]
        cache.free(1)
        assert cache.lengths.tolist() == [3, 0] and cache.allocate() == 1
        with pytest.raises(UserError, match="no free cache slot"):
            cache.allocate()
        got = engine.forward(Batch.of([(1, IDS[2][:4]), (0, IDS[0][3:4])], cache), cache)
        assert_close(got[:4], engine.logits(IDS[2][:4]), rtol=1e-5)
        assert_close(got[4:], engine.logits(IDS[0][:4])[3:], rtol=1e-5)
        for k, before in zip(cache.k, keys):
            np.testing.assert_array_equal(k[0][:, :3], before[:, :3])


class Alternating(Selector):
    """No predictor; the sets alternate: nothing, then every neuron (token 0 of a batch gets none, token 1 all)."""

    def __init__(self, d_ffn):
        super().__init__(d_ffn)
        self.calls = 0

    def pick(self, l, logits):
        self.calls += 1
        return self.all[:0] if self.calls % 2 else self.all


def test_an_empty_predicted_set_beside_a_full_one(small):
    engine = Engine.load(small)
    engine.selector = Alternating(engine.config.d_ffn)
    cache = engine.new_cache(slots=2)
    got = engine.forward(Batch.of([(0, [7]), (1, [9])], cache), cache)
    nothing = ref.load_model(small)
    nothing.ffn_block = SparseFFN(nothing, lambda l, h, x, wg, wu: np.zeros(0, np.int32))
    assert_close(got[0], nothing.logits([7])[0], rtol=1e-4)
    assert_close(got[1], ref.load_model(small).logits([9])[0], rtol=1e-4)


def test_greedy_generations_unchanged_by_batching(small):
    engine, n = sparse_engine(small), 6
    alone = {s: engine.generate(IDS[s], n) for s in IDS}
    cache = engine.new_cache(slots=3)
    logits = engine.forward(Batch.of([(s, IDS[s]) for s in IDS], cache, last_only=True), cache)  # [3, V]
    out = {s: [] for s in IDS}
    for _ in range(n):
        for s, row in zip(IDS, logits):
            out[s].append(int(np.argmax(row)))
        logits = engine.forward(Batch.of([(s, [out[s][-1]]) for s in IDS], cache), cache)
    assert out == alone


def test_last_only_returns_each_runs_last_logits(small):
    engine = sparse_engine(small)
    for last_only, rows in ((False, [0, 1, 2, 3, 4, 5, 6]), (True, [2, 6])):
        cache = engine.new_cache(slots=2)
        got = engine.forward(Batch.of([(0, IDS[0][:3]), (1, IDS[1])], cache, last_only), cache)
        full = np.concatenate([engine.logits(IDS[0][:3]), engine.logits(IDS[1])])
        assert_close(got, full[rows], rtol=1e-5)


def test_cache_memory_follows_what_the_sequences_hold(small):
    engine = Engine.load(small)
    cache = engine.new_cache(64, slots=16)
    assert cache.nbytes == 0
    engine.forward(Batch.of([(3, IDS[0])], cache), cache)
    per_token = cache.bytes_per_token()
    assert per_token == 2 * engine.config.n_layers * engine.config.n_kv_heads * engine.config.head_dim * 4
    assert cache.nbytes == min(64, MIN_ROOM) * per_token  # one slot's room, not 16 slots x the context
    cache.free(3)
    assert cache.nbytes == 0


def test_slots_grow_keeping_what_they_hold(small, monkeypatch):
    """Rooms of 2, 4, 8: every step that grows a slot copies its keys and values, and the logits do not change."""
    monkeypatch.setattr(ref.common.batch, "MIN_ROOM", 2)
    engine = sparse_engine(small)
    got, done = run_schedule(engine, SCHEDULE)
    for s in IDS:
        assert_close(got[s], engine.logits(IDS[s][:done[s]]), rtol=1e-5)


def bad_batches(cache):
    """(batch, message) for a cache whose sequence 0 holds 2 tokens, sequence 1 is allocated and empty, sequence 2
    freed; capacity 4."""
    return [
        (Batch.of([(2, [1])], cache), "sequence 2 is not allocated"),
        (Batch.of([(5, [1])], cache), "sequence 5 has no cache slot"),
        (Batch.of([(1, [1, 2]), (0, [1, 2, 3])], cache), "context full: sequence 0 holds 2 \\+ 3"),
        (Batch(np.array([1, 2, 3]), np.array([0, 1, 0]), np.array([2, 0, 3])), "sequence 0 has two runs"),
        (Batch(np.array([1]), np.array([0]), np.array([0])), "continue its cached positions from 2"),
        (Batch.of([(1, [1]), (0, [60])], cache), "token id out of range"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_batches_touch_no_sequence(small, case):
    """One clear line each; no sequence's cache or length changes."""
    for engine in (sparse_engine(small), ref.load_model(small)):
        cache = engine.new_cache(4, slots=3)
        engine.forward(Batch.single([3, 4], cache), cache)
        cache.free(2)
        keys = [k[0].copy() for k in cache.k]
        batch, message = bad_batches(cache)[case]
        with pytest.raises(UserError, match=message):
            engine.forward(batch, cache)
        assert cache.lengths.tolist() == [2, 0, 0] and cache.used.tolist() == [True, True, False]
        for k, before in zip(cache.k, keys):
            np.testing.assert_array_equal(k[0], before)
        assert all(k[1] is None and k[2] is None for k in cache.k)
