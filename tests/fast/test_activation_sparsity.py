"""Activation sparsity in the fast engine against ref's (ref.activation_sparsity), every method and format; the
several-sequence step against each sequence alone; sparsity 0 as the dense engine; the CLIs' flags."""

import subprocess
import sys

import numpy as np
import pytest

from fast.load import load_engine
from fast.layers import Bundles
from ref.activation_sparsity import DEFAULT_FILE, apply_activation_sparsity, sparsity_to_run
from ref.common.batch import Batch
from ref.quant import quantize_model
from ref.sparse import load_model
from tests.helpers import ROOT, SHIPPED, SHIPPED_SILU, assert_close

IDS = [1, 45, 300, 12, 99, 7, 1000, 5, 8, 77, 31, 2000]
PREDICTORS = SHIPPED / "predictors.safetensors"


def ref_logits(method, fmt, sparsity=0.5, predictors=None, path=SHIPPED):
    model = load_model(path, predictors)
    if fmt != "f16":
        model = quantize_model(model, fmt)
    ffn = predictors is None
    apply_activation_sparsity(model, method, sparsity_to_run(model.weights, path, sparsity, method, ffn=ffn), ffn=ffn)
    return model.logits(IDS)


def assert_same_model(got, want, name):
    """Logits [T, V] to 1e-5 at most positions: where the two engines' last-bit differences take one input's (one
    neuron's) threshold decision the other way, that position moves, and later ones a little through its keys and
    values, by at most 2e-2."""
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert np.median(err) <= 1e-5 and err.max() <= 2e-2, f"{name}: {err}"
    assert_close(got, want, rtol=2e-2)


def decode(engine, ids):
    cache = engine.new_cache(len(ids))
    return np.stack([engine.forward(Batch.single([t], cache), cache)[0] for t in ids])


@pytest.mark.parametrize("method, fmt", [("teal", "f16"), ("wina", "f16"), ("cats", "f16"), ("teal", "f32"),
                                         ("wina", "bf16"), ("teal", "q8_0"), ("cats", "q8_0"), ("wina", "q4_0"),
                                         ("cats", "q4_0")])
def test_engine_is_refs_model(method, fmt):
    """A prompt in one step and token by token: the logits ref computes with the same thresholds, its thinned
    matrices transposed (and in q8_0 and q4_0 quantized again along their outputs) as the engine's."""
    want = ref_logits(method, fmt)
    engine = load_engine(SHIPPED, type_=fmt, threads=2, sparsity=0.5, sparsity_method=method)
    assert_same_model(engine.logits(IDS), want, f"{method} {fmt} prompt")
    assert_same_model(decode(engine, IDS), want, f"{method} {fmt} decode")


@pytest.mark.parametrize("method, fmt", [("teal", "f16"), ("wina", "f16"), ("cats", "f16"), ("wina", "q4_0"),
                                         ("cats", "q8_0")])
def test_swiglu_twin_is_refs_model(method, fmt):
    """The SwiGLU twin, the model activation sparsity is for: every neuron fires, each input is thinned."""
    want = ref_logits(method, fmt, 0.4, path=SHIPPED_SILU)
    engine = load_engine(SHIPPED_SILU, type_=fmt, threads=2, sparsity=0.4, sparsity_method=method)
    assert_same_model(decode(engine, IDS), want, f"{method} {fmt}")


def test_beside_predictors_only_attention_is_thinned():
    want = ref_logits("wina", "f16", predictors=PREDICTORS)
    engine = load_engine(SHIPPED, predictors=PREDICTORS, threads=2, sparsity=0.5, sparsity_method="wina")
    assert engine.selector.predicts and isinstance(engine.layers[0].ffn, Bundles)
    assert_same_model(decode(engine, IDS), want, "beside predictors")


def test_sequences_decoding_together_are_each_alone():
    """One step of three sequences (their prompts, then a token each) reads the union of their kept inputs; each
    token's product is its own (summed in another order: a threshold decision may go the other way, as in
    assert_same_model)."""
    engine = load_engine(SHIPPED, type_="q8_0", threads=2, sparsity=0.4)
    prompts = [[1, 45, 300], [1, 9, 88, 41, 7], [1, 1000]]
    cache = engine.new_cache(8, slots=3)
    engine.forward(Batch.of(list(enumerate(prompts)), cache), cache)
    together = engine.forward(Batch.of([(s, [11 + s]) for s in range(3)], cache), cache)
    alone = []
    for s, p in enumerate(prompts):
        own = engine.new_cache(8)
        engine.forward(Batch.single(p, own), own)
        alone.append(engine.forward(Batch.single([11 + s], own), own)[0])
    assert_same_model(together, np.stack(alone), "together")


def test_a_long_prompt_is_tokens_thinned_one_by_one():
    """A prompt long enough for BLAS (fast.blas.sparse_rows) computes what decoding it token by token does."""
    ids = np.random.default_rng(0).integers(3, 4000, 300)
    engine = load_engine(SHIPPED_SILU, threads=2, sparsity=0.4, sparsity_method="wina")
    assert_same_model(engine.logits(ids)[-8:], decode(engine, ids)[-8:], "prompt")


def test_sparsity_zero_is_the_dense_engine():
    dense = load_engine(SHIPPED, predictors=None, threads=2).logits(IDS)
    assert np.array_equal(load_engine(SHIPPED, threads=2, sparsity=0.0).logits(IDS), dense)


def cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.parametrize("method", ["teal", "cats"])
def test_run_gives_refs_text(method):
    args = ("-p", "the cat", "-n", "24", "--temp", "0", "--dense", "--sparsity", "0.4", "--sparsity-method", method)
    a, b = cli("fast.run", *args), cli("ref", *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and f"activation sparsity 0.4 ({method})" in a.stderr


@pytest.fixture(scope="module")
def other_models_file(tmp_path_factory):
    """A thresholds file of a 2-layer model of other widths."""
    from ref.activation_sparsity import LEVELS, Thresholds
    path = tmp_path_factory.mktemp("other") / DEFAULT_FILE
    table = np.broadcast_to(LEVELS, (2, 4, len(LEVELS))).astype(np.float32)
    Thresholds({"teal": table}, {}, np.zeros(0), np.array([32, 32, 32, 100]), {}).save(path)
    return path


BAD = [(["--sparsity", "1"], "--sparsity must be in [0, 1), got 1"),
       (["--sparsity", "-0.1"], "--sparsity must be in [0, 1), got -0.1"),
       (["--sparsity", "0.4", "--sparsity-file", "/nonexistent.safetensors"], "/nonexistent.safetensors not found"),
       (["--sparsity", "0.4", "--sparsity-file", "OTHER"], "a file of another model"),
       (["--sparsity", "0.4", "--sparsity-method", "wina", "--sparsity-file", "OTHER"], "another model"),
       (["--sparsity", "0.4", "--sparsity-file", str(SHIPPED_SILU / DEFAULT_FILE)],  # the twin's: the same shapes
        f"{SHIPPED_SILU / DEFAULT_FILE}: thresholds calibrated for another model (fingerprint ")]


# fast.serve checks the range before it starts; a file, on its engine thread as it loads (tests/e2e)
@pytest.mark.parametrize("module, args, expect", [(m, a, e) for m in ("fast.run", "ref", "fast.perplexity", "fast.serve")
                                                  for a, e in BAD if m != "fast.serve" or "--sparsity-file" not in a])
def test_bad_sparsity_is_one_line(other_models_file, module, args, expect):
    extra = {"fast.perplexity": ["-f", ROOT / "data/corpus/val.txt", "--chunks", "1"], "fast.serve": ["--port", "1"]}
    r = cli(module, *[other_models_file if a == "OTHER" else a for a in args], *extra.get(module, ["-n", "2"]))
    assert r.returncode == 1 and "Traceback" not in r.stderr and expect in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
