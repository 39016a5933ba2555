import numpy as np
import pytest

import fast
import ref
from fast import Engine, apply_predictors
from fast import blas
from fast.engine import convert, dense_ffn
from fast.layers import Bundles, Dense
from fast.quant import INTERLEAVED, layout_of, plain
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.common.artifacts import Predictors
from ref.quant import Quantized, predictor_format, predictors_beside, quantize, quantize_model
from ref.common.artifacts import default_predictors
from tests.fast.conftest import sparse_engine, sparse_model
from tests.helpers import SHIPPED, assert_close, write_model

PROMPTS = ["once upon a time, there was a little girl named lily.", "the dog ran to the park and"]


@pytest.fixture(scope="module")
def shipped_engine():
    return fast.Engine.load(SHIPPED)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_shipped_dense_logits_match_ref(shipped_engine, shipped_model, shipped_tokenizer, prompt):
    ids = shipped_tokenizer.encode(prompt)
    got, want = shipped_engine.logits(ids), shipped_model.logits(ids)
    for t in range(len(ids)):
        assert_close(got[t], want[t], rtol=1e-4, name=f"position {t}")


def test_shipped_sparse_logits_match_ref(shipped_tokenizer):
    pred = SHIPPED / "predictors.safetensors"
    e, m = apply_predictors(Engine.load(SHIPPED), pred), ref.apply_predictors(ref.Model.load(SHIPPED), pred)  # as stored
    ids = shipped_tokenizer.encode(PROMPTS[0])
    got, want = e.logits(ids), m.logits(ids)
    for t in range(len(ids)):
        assert_close(got[t], want[t], rtol=1e-4, name=f"position {t}")


def test_ref_and_fast_facades_agree_by_default(shipped_tokenizer):
    """ref.load_model and fast.load_engine with the CLIs' default predictors (the shipped ones, which both store in
    q8_0 beside the f16 weights): the same logits, not those of two different models."""
    pred = default_predictors(SHIPPED)
    e, m = fast.load_engine(SHIPPED, predictors=pred, threads=2), ref.load_model(SHIPPED, pred)
    assert layout_of(e.selector.fc1[0]).format.name == "q8_0" and isinstance(m.selector.fc1[0], Quantized)
    ids = shipped_tokenizer.encode(PROMPTS[0])
    assert_close(e.logits(ids), m.logits(ids), rtol=1e-4)


def narrowed_predictors(path, R: int = 16) -> Predictors:
    """The shipped predictors with layer 0 cut to R hidden units (the trainer's smallest rung)."""
    pred = Predictors.load(SHIPPED / "predictors.safetensors", ref.Model.load(SHIPPED).config)
    pred.fc1[0], pred.fc2[0] = pred.fc1[0][:R].copy(), pred.fc2[0][:, :R].copy()
    pred.save(path)
    return pred


def test_predictors_of_any_width_run_as_the_clis_store_them(shipped_tokenizer, tmp_path):
    """A 16-wide layer beside 64-wide ones, stored q8_0 beside f16 weights (padded to whole blocks): fast decodes it
    in its one-call step, and generates what ref does."""
    narrowed_predictors(tmp_path / "p.safetensors")
    e = fast.load_engine(SHIPPED, predictors=tmp_path / "p.safetensors", threads=2)
    m = ref.load_model(SHIPPED, tmp_path / "p.safetensors")
    assert {f.name for f in e.selector.formats} == {"q8_0"} and e.step_layers() is not None
    ids = shipped_tokenizer.encode(PROMPTS[1])
    assert e.generate(ids, 16) == ref.generate(m, ids, 16)


def test_predictors_in_a_format_per_layer_run_layer_by_layer(shipped_tokenizer, tmp_path):
    """Predictors as a file may hold them, layer 0 in f16 and the others in q8_0: no one-call step takes two types
    for one field, so decode runs layer by layer, as ref."""
    pred = narrowed_predictors(tmp_path / "p.safetensors")
    stored = Predictors([quantize(a, "f16" if l == 0 else "q8_0") for l, a in enumerate(pred.fc1)],
                        [quantize(b, "f16" if l == 0 else "q8_0") for l, b in enumerate(pred.fc2)], pred.threshold, {})
    e, m = apply_predictors(Engine.load(SHIPPED), stored), ref.apply_predictors(ref.Model.load(SHIPPED), stored)
    assert e.step_layers() is None
    ids = shipped_tokenizer.encode(PROMPTS[1])
    assert e.generate(ids, 16) == ref.generate(m, ids, 16)


def test_shipped_greedy_32_tokens_match(shipped_engine, shipped_model, shipped_tokenizer):
    ids = shipped_tokenizer.encode(PROMPTS[1])
    assert shipped_engine.generate(ids, 32) == ref.generate(shipped_model, ids, 32)


def test_small_sparse_matches_ref_and_is_sparse(small):
    e = sparse_engine(small)
    m = sparse_model(small)
    ids = np.array([1, 4, 9, 16, 25, 36, 49])
    assert_close(e.logits(ids), m.logits(ids), rtol=1e-4)
    dense = Engine.load(small)
    assert not np.allclose(dense.logits(ids), e.logits(ids), rtol=1e-3)


def test_same_seed_same_sample_in_both_engines(small):
    e, m = Engine.load(small), ref.load_model(small)
    kw = dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=11)
    assert e.generate([1, 2, 3], 20, **kw) == ref.generate(m, [1, 2, 3], 20, **kw)


def test_incremental_decode_matches_whole(small):
    e = sparse_engine(small)
    ids = np.array([1, 3, 5, 7, 9, 11])
    cache = e.new_cache(6)
    parts = [e.forward(Batch.single(ids[:2], cache), cache)]
    parts += [e.forward(Batch.single(ids[t:t + 1], cache), cache) for t in range(2, 6)]
    assert cache.lengths.tolist() == [6]
    assert_close(np.concatenate(parts), e.logits(ids), rtol=1e-5)


def test_repeated_runs_bit_identical(small):
    e = sparse_engine(small)
    ids = np.arange(1, 40) % 50
    first = e.logits(ids)
    for _ in range(3):
        np.testing.assert_array_equal(e.logits(ids), first)


def test_tied_and_odd_ffn(tmp_path):
    d = write_model(tmp_path, {"tie_word_embeddings": True, "intermediate_size": 37})
    ids = np.array([1, 2, 3])
    assert_close(Engine.load(d).logits(ids), ref.load_model(d).logits(ids), rtol=1e-4)


@pytest.mark.parametrize("kw, message", [
    (dict(threads=0), "-t/--threads must be in"),
    (dict(device="tpu"), "--device must be one of"),
    (dict(policy="rows"), "--policy must be one of"),
])
def test_bad_engine_options(small, kw, message):
    with pytest.raises(UserError, match=message):
        fast.load_engine(small, **kw)


def test_predictors_of_another_model(small, tmp_path):
    other = write_model(tmp_path / "o", {"intermediate_size": 64})
    with pytest.raises(UserError, match="predictors.safetensors: layer 0 predictor has fc1"):
        fast.load_engine(other, predictors=small / "predictors.safetensors")


def test_facade_composes_the_transforms(small):
    """load_engine = Engine.load, then apply_predictors (in the format that goes with the weights, q8_0 beside f16,
    every layer's hidden size padded to whole blocks of it), then the warm-up: the same logits, kernels compiled."""
    ids = np.array([1, 2, 3, 4])
    e = fast.load_engine(small, predictors=small / "predictors.safetensors", predictor_threshold=0.5)
    assert e.selector.threshold == np.float32(0.5) and e.compile_seconds > 0
    pred = Predictors.load(small / "predictors.safetensors", e.config)
    pfmt = predictor_format(FORMATS["f16"], e.config.d_model)
    assert pfmt.name == "q8_0" and set(e.selector.formats) == {pfmt}
    R = [-(-a.shape[0] // pfmt.block) * pfmt.block for a in pred.fc1]  # 8 -> 32
    assert e.selector.params == tuple(r * (a.shape[1] + b.shape[0]) for r, a, b in zip(R, pred.fc1, pred.fc2))
    want = apply_predictors(Engine.load(small), predictors_beside(pred, FORMATS["f16"]), 0.5).logits(ids)
    np.testing.assert_array_equal(e.logits(ids), want)


@pytest.mark.parametrize("dtype, fmt", [("F16", "f16"), ("BF16", "bf16"), ("F32", "f32")])
def test_checkpoints_run_in_their_stored_format(tmp_path, dtype, fmt):
    """No float32 copy: the layout keeps the checkpoint's format, and computes what ref computes from it."""
    d = write_model(tmp_path, dtype=dtype)
    e = Engine.load(d)
    assert e.format.name == fmt and e.layers[0].ffn.bundle.dtype == FORMATS[fmt].dtype
    ids = np.array([1, 4, 9, 16, 25])
    assert_close(e.logits(ids), ref.load_model(d).logits(ids), rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "q8_0", "q4_0"])
def test_convert_is_ref_at_that_format(small, fmt):
    """--type: the engine's matrices in another format mean what ref.quant says they mean."""
    ids = np.array([2, 3, 5, 7, 11, 13])
    e = convert(Engine.load(small), FORMATS[fmt])
    assert e.format.name == fmt and plain(e.layers[1].attn.wqkv).dtype == FORMATS[fmt].dtype
    assert (e.layers[1].attn.wqkv.dtype == INTERLEAVED.get(fmt)) == (fmt in INTERLEAVED)  # rows grouped for matmul
    assert_close(e.logits(ids), quantize_model(ref.load_model(small), fmt).logits(ids), rtol=1e-4)


def test_one_token_steps_match_the_prompt_path_after_transforms(small, monkeypatch):
    """A decode token runs every block in one compiled call (cpu.decode_step): its logits equal those of the
    per-layer path (a prompt's rows), dense and with predictors, also after a transform replaced the arrays that
    an earlier step read (convert, apply_predictors)."""
    e, ids, calls = Engine.load(small), np.array([2, 3, 5, 7, 11]), []
    step = fast.cpu.decode_step
    monkeypatch.setattr(fast.cpu, "decode_step", lambda *a: calls.append(1) or step(*a))

    def steps():
        cache = e.new_cache(len(ids))
        return np.concatenate([e.forward(Batch.single(ids[t:t + 1], cache), cache) for t in range(len(ids))])

    steps()
    convert(e, FORMATS["q4_0"])
    assert_close(steps(), e.logits(ids), rtol=1e-5)
    apply_predictors(e, small / "predictors.safetensors")
    assert_close(steps(), e.logits(ids), rtol=1e-5)
    assert len(calls) == 3 * len(ids)


@pytest.mark.parametrize("pick", ["threshold", "ahead"])
def test_several_sequences_decode_in_one_call_as_the_per_layer_path(small, pick, monkeypatch):
    """One new token of each of several sequences (at different positions) runs every block in one compiled call
    (cpu.decode_steps): its logits equal the per-layer path's (Engine.one_call off), with the predictor's threshold
    and with sets drawn ahead (fast.bench.SyntheticSelector: the step passes every layer's picks at once)."""
    from fast.bench import SyntheticSelector, synthetic_predictors

    def steps(one_call):
        e = sparse_engine(small)
        if pick == "ahead":
            e.selector = SyntheticSelector(synthetic_predictors(e.config, 16), e.config, 0.7)
        monkeypatch.setattr(Engine, "one_call", decides if one_call else lambda self, h, runs: False)
        cache, prompts = e.new_cache(slots=3), {0: [1, 4, 9, 16], 1: [2], 2: [5, 10, 15]}
        out = [e.forward(Batch.of(list(prompts.items()), cache), cache)]  # a prompt step: per layer
        for t in range(3):
            out.append(e.forward(Batch.of([(s, [3 * t + s + 1]) for s in prompts], cache), cache))
        return np.concatenate(out)

    calls, step, decides = [], fast.cpu.decode_steps, Engine.one_call
    monkeypatch.setattr(fast.cpu, "decode_steps", lambda *a: calls.append(a[1].shape[0]) or step(*a))
    want = steps(False)
    assert calls == []
    assert_close(steps(True), want, rtol=1e-6)
    assert calls == [3] * 3


def test_decode_step_returns_the_rows_the_batch_asks_for(small, monkeypatch):
    """A one-call decode step computes the output head inside cpu.decode_steps when every row returns logits, and
    leaves it to Engine.output when the batch asks for some rows only (llama.cpp's batch.logits): the same logits."""
    e, heads = sparse_engine(small), []
    step = fast.cpu.decode_steps
    monkeypatch.setattr(fast.cpu, "decode_steps", lambda *a: heads.append(a[0].shape[0]) or step(*a))

    def decode(flags):
        cache = e.new_cache(8, slots=2)
        e.forward(Batch.of([(0, [1, 4, 9]), (1, [2, 7])], cache), cache)
        b = Batch.of([(0, [5]), (1, [3])], cache)
        return e.forward(Batch(b.tokens, b.seqs, b.positions, flags), cache)

    both = decode(None)
    assert_close(decode(np.array([False, True])), both[1:], rtol=1e-6)
    assert_close(decode(np.array([True, True])), both, rtol=1e-6)
    assert heads == [2, 0, 2]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_dense_layout_is_ref_and_bundles_again(small, fmt, monkeypatch):
    """dense_ffn: gate and up rows as one interleaved matrix, the bundles the down rows only; ref's logits at that
    format for one token, for a prompt, and for a prompt in fast.blas's kernels. apply_predictors bundles the rows
    again, exactly as they were."""
    want = quantize_model(ref.load_model(small), fmt)
    e = dense_ffn(convert(Engine.load(small), FORMATS[fmt]))
    f = e.layers[0].ffn
    assert isinstance(f, Dense) and f.gate_up.dtype == INTERLEAVED[fmt] and f.down.shape[1:] == (e.config.d_model // 32,)
    ids = np.array([2, 3, 5, 7, 11, 13])
    assert_close(e.logits(ids[:1]), want.logits(ids[:1]), rtol=1e-4)
    assert_close(e.logits(ids), want.logits(ids), rtol=1e-4)
    with monkeypatch.context() as m:
        m.setattr(blas, "MIN_TOKENS", 1)
        m.setattr(blas, "MIN_WORK", 0)
        assert_close(e.logits(ids), want.logits(ids), rtol=1e-4)
    sparse = apply_predictors(e, small / "predictors.safetensors")
    bundles = convert(Engine.load(small), FORMATS[fmt])
    assert isinstance(sparse.layers[0].ffn, Bundles)
    np.testing.assert_array_equal(sparse.layers[0].ffn.bundle, bundles.layers[0].ffn.bundle)
    np.testing.assert_array_equal(sparse.logits(ids), apply_predictors(bundles, small / "predictors.safetensors").logits(ids))


def test_load_engine_lays_a_dense_run_out_densely(tmp_path):
    """fast.run without predictors (--dense, or none beside the model) runs the dense layout where it has one."""
    d = write_model(tmp_path, {"intermediate_size": 64})
    assert isinstance(fast.load_engine(d, type_="q4_0").layers[0].ffn, Dense)
    assert isinstance(fast.load_engine(d).layers[0].ffn, Bundles)  # float formats keep their bundles
