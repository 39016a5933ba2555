import numpy as np
import pytest

import ref
from ref.common.errors import UserError
from ref.common.sampling import apply_repeat_penalty, check_sampling, sample
from tests.helpers import Ban, write_model


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return ref.load_model(write_model(tmp_path_factory.mktemp("m"), {"eos_token_id": 99}))  # eos out of vocab: never stops


def test_same_seed_same_tokens(small):
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = ref.generate(small, [1, 2], 12, seed=7, **kw)
    assert a == ref.generate(small, [1, 2], 12, seed=7, **kw)
    assert any(ref.generate(small, [1, 2], 12, seed=s, **kw) != a for s in range(8, 12))


def test_greedy_is_argmax_chain(small):
    out = ref.generate(small, [1, 3], 6)
    ids = [1, 3]
    for tok in out:
        assert tok == int(np.argmax(small.logits(np.array(ids))[-1]))
        ids.append(tok)
    assert len(out) == 6


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)])
def test_truncation_to_one_candidate_is_greedy(small, kw):
    base = dict(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0)
    assert ref.generate(small, [1, 4], 8, seed=3, **{**base, **kw}) == ref.generate(small, [1, 4], 8)


def test_sampling_distribution():
    """Draws follow softmax(logits / T) when no truncation applies."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = [sample(logits, rng, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) for _ in range(20000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    hot = [sample(logits, rng, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0) for _ in range(20000)]
    p = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(np.bincount(hot, minlength=4) / len(hot), p / p.sum(), atol=0.015)


def test_top_p_and_min_p_sets():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    top_p = {sample(logits, rng, 1.0, 0, 0.75, 0.0) for _ in range(2000)}
    assert top_p == {0, 1}  # 0.5 + 0.3 is the smallest prefix reaching 0.75
    min_p = {sample(logits, rng, 1.0, 0, 1.0, 0.25) for _ in range(2000)}
    assert min_p == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_repeat_penalty():
    out = apply_repeat_penalty(np.array([2.0, -2.0, 1.0]), [0, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])


def test_eos_stops(tmp_path):
    m = ref.load_model(write_model(tmp_path, {"eos_token_id": 2}))
    greedy = int(np.argmax(m.logits(np.array([1, 3]))[-1]))
    m2 = ref.load_model(write_model(tmp_path / "b", {"eos_token_id": greedy}))
    assert ref.generate(m2, [1, 3], 10) == []


def test_context_full_stops(small):
    out = ref.generate(small, [i % 50 for i in range(1, 60)], 100)
    assert len(out) == 64 - 59
    assert len(ref.generate(small, [1, 2], 100, ctx_size=10)) == 8


@pytest.mark.parametrize("kw, flag", [
    (dict(max_new_tokens=-2), "-n/--n-predict"),
    (dict(repeat_last_n=-2), "--repeat-last-n"),
    (dict(temperature=-0.1), "--temp"),
    (dict(top_p=0.0), "--top-p"),
    (dict(top_p=1.5), "--top-p"),
    (dict(min_p=2.0), "--min-p"),
    (dict(top_k=-3), "--top-k"),
    (dict(repeat_penalty=0.0), "--repeat-penalty"),
])
def test_bad_sampling_settings(kw, flag):
    with pytest.raises(UserError, match=flag):
        check_sampling(**kw)


def test_prompt_longer_than_context(small):
    with pytest.raises(UserError, match="longer than the context"):
        ref.generate(small, [1] * 65, 1)


def test_repeat_last_n_window():
    logits = np.array([2.0, 2.0, 2.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 2.0, last_n=1), [2.0, 1.0, 2.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 2.0, last_n=0), [2.0, 2.0, 2.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 2.0, last_n=-1), [1.0, 1.0, 2.0])


def test_stop_reasons_and_ignore_eos(tmp_path):
    from ref.common.sampling import Timings
    m = ref.load_model(write_model(tmp_path, {"eos_token_id": 2}))
    greedy = int(np.argmax(m.logits(np.array([1, 3]))[-1]))
    m2 = ref.load_model(write_model(tmp_path / "b", {"eos_token_id": greedy}))
    t = Timings()
    assert ref.generate(m2, [1, 3], 10, timings=t) == [] and t.stop == "eos"
    t = Timings()
    assert len(ref.generate(m2, [1, 3], 4, timings=t, ignore_eos=True)) == 4 and t.stop == "length"
    t = Timings()
    assert len(ref.generate(m2, [1, 3], -1, timings=t, ignore_eos=True, ctx_size=9)) == 7 and t.stop == "context"


def test_a_logits_processor_changes_each_token_and_hears_each_one_taken(shipped_model, shipped_tokenizer):
    """generate's `processors` run after the penalties on every token's logits and are told each token taken."""
    ids = shipped_tokenizer.encode("once upon a time")
    free = ref.generate(shipped_model, ids, 12, ignore_eos=True)
    ban = Ban(free[0])
    got = ref.generate(shipped_model, ids, 12, ignore_eos=True, processors=[ban], repeat_penalty=1.3)
    assert free[0] not in got and ban.seen == got and len(got) == 12
