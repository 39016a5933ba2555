"""Context shift (llama.cpp's --context-shift, --keep): a full slot keeps its first positions, drops half of the
rest and moves the others down, their keys rotated back; ref defines it (ref.model.shift_context), the engines, the
generation loop and the server's scheduler follow it."""


import numpy as np
import pytest

from fast.server.scheduler import Params, Request, Scheduler
from ref.common.batch import Batch, KVCache
from ref.common.errors import UserError
from ref.common.sampling import generate
from ref.common.tokenizer import load_tokenizer
from ref.model import rope
from ref.common.config import ModelConfig
from tests.fast.conftest import sparse_engine, sparse_model
from tests.helpers import SHIPPED, SMALL_CONFIG, assert_close, serve_requests


def test_shift_moves_the_later_positions_down():
    """Positions keep..keep+discard-1 go, the later ones move down (rotate sees exactly them), the first stay."""
    cache = KVCache.empty(ModelConfig.from_dict(SMALL_CONFIG), 16, np.float32)
    cache.reserve(0, 10)
    for layer in (*cache.k, *cache.v):
        layer[0][:] = np.arange(layer[0].shape[1], dtype=np.float32)[None, :, None]  # position p holds p
    cache.lengths[0] = 10
    seen = []
    cache.shift(0, 2, 3, lambda k: (seen.append(k[0, :, 0].tolist()), -k)[1])
    assert cache.lengths[0] == 7 and seen[0] == [5, 6, 7, 8, 9]
    assert cache.k[0][0][0, :7, 0].tolist() == [0, 1, -5, -6, -7, -8, -9]
    assert cache.v[0][0][0, :7, 0].tolist() == [0, 1, 5, 6, 7, 8, 9]
    for keep, discard in ((0, 0), (-1, 2), (5, 3), (0, 8)):
        with pytest.raises(UserError, match="cannot drop"):
            cache.shift(0, keep, discard, lambda k: k)


def test_rotating_back_composes():
    """rope at p, then at -d, is rope at p - d: a shifted key is the key its token would have at its new position."""
    rng = np.random.default_rng(0)
    x, p, d = rng.standard_normal((6, 2, 8)), np.arange(20, 26), 7
    assert_close(rope(rope(x, p, 500.0), np.full(6, -d), 500.0), rope(x, p - d, 500.0), rtol=1e-12)


@pytest.fixture(scope="module")
def engines(small):
    return sparse_model(small), sparse_engine(small)


@pytest.mark.parametrize("keep", [0, 3, -1])
def test_generation_goes_on_past_a_full_context_as_ref(engines, keep):
    """Greedy generation with a 16-token context, a 5-token prompt and 40 tokens asked: several shifts, the same
    tokens from ref and fast; without --context-shift it stops at the full context."""
    ref_model, engine = engines
    ids = [3, 17, 9, 4, 22]
    kw = dict(temperature=0.0, ctx_size=16, ignore_eos=True, context_shift=True, keep=keep)
    want = generate(ref_model, ids, 40, **kw)
    assert len(want) == 40
    assert generate(engine, ids, 40, **kw) == want
    assert len(generate(engine, ids, 40, temperature=0.0, ctx_size=16, ignore_eos=True)) == 11


def test_shifted_logits_agree_with_ref(engines):
    """The logits of a token after a shift (keys rotated back, values moved), ref against fast."""
    got = []
    for model in engines:
        cache = model.new_cache(12)
        model.forward(Batch.single(list(range(3, 15)), cache), cache)
        model.shift(cache, 0, 2, 5)
        got.append(model.forward(Batch.single([7, 8], cache), cache))
    assert_close(got[1], got[0], rtol=1e-4)


def test_keep_must_leave_something_to_drop(engines):
    with pytest.raises(UserError, match="--keep"):
        generate(engines[1], list(range(3, 13)), 20, temperature=0.0, ctx_size=11, context_shift=True, keep=-1)


def test_the_server_shifts_a_full_slot_as_generate_does():
    """A request asking for more tokens than its slot holds: with --context-shift the scheduler gives the tokens
    generate gives with a context shift; without, it ends at the full context ('length')."""
    from fast.load import load_engine
    tok = load_tokenizer(SHIPPED)
    engine = load_engine(SHIPPED, threads=1)
    prompt = tok.encode("Once upon a time")

    def serve(shift):
        sched = Scheduler(lambda: (engine, tok), slots=2, ctx_size=24, context_shift=shift, keep=2).start()
        r = Request(prompt, Params(temperature=0.0, max_tokens=50, ignore_eos=True), None)
        events, = serve_requests(sched, [r])
        sched.stop()
        return r.out, events[-1]

    out, last = serve(True)
    assert last[:2] == ("done", "length") and len(out) == 50
    assert out == generate(engine, prompt, 50, temperature=0.0, ctx_size=24, ignore_eos=True, context_shift=True,
                           keep=2)
    out, last = serve(False)
    assert last[:2] == ("done", "length") and len(out) == 24 - len(prompt)
