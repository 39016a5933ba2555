"""The hybrid CPU-GPU engine against ref, under the CUDA simulator in CI (on the device in scripts/device_check.sh)."""

import numpy as np
import pytest

import fast
import ref
from fast import Engine, apply_predictors
from fast import gpu
from fast.hybrid import GpuThinnedFFN, to_hybrid
from placement.budget import whole_layers
from ref.common.artifacts import Predictors
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from tests.helpers import assert_close, write_model

TINY = {"hidden_size": 8, "intermediate_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 16, "max_position_embeddings": 16, "eos_token_id": 99}
IDS = np.array([1, 5, 9])
pytestmark = pytest.mark.usefixtures("small_launches")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_model(tmp_path_factory.mktemp("tiny"), TINY, seed=3)
    cfg = ref.ModelConfig.from_hf(d)
    rng = np.random.default_rng(1)
    pred = Predictors([rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2)],
                      [rng.standard_normal((12, 4)).astype(np.float32) for _ in range(2)], 0.0, {"threshold": "0.0"})
    pred.save(d / "predictors.safetensors")
    want = ref.load_model(d, predictors=d / "predictors.safetensors").logits(IDS)
    return d, cfg, want


def cpu_engine(d):
    return apply_predictors(Engine.load(d), d / "predictors.safetensors")


SPLITS = {"none": lambda rng: [np.empty(0, np.int32)] * 2, "all": lambda rng: [np.arange(12, dtype=np.int32)] * 2,
          "random": lambda rng: [np.sort(rng.choice(12, 5, replace=False)).astype(np.int32) for _ in range(2)]}
DENSE = {"all": None, "cpu attention": ["attention.0", "predictor.1", "output"],  # the residual changes sides
         "cpu predictors": ["attention.0", "attention.1", "ffn_norms"], "none": []}


@pytest.mark.parametrize("split, dense", [("none", "all"), ("all", "all"), ("random", "cpu attention"),
                                          ("random", "cpu predictors"), ("all", "none"), ("all", "cpu predictors")])
def test_hybrid_logits_match_ref(tiny, split, dense):
    d, cfg, want = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS[split](np.random.default_rng(7)), dense_on_gpu=DENSE[dense])
    assert_close(hybrid.logits(IDS), want, rtol=1e-4)


def test_host_cache_only_where_attention_runs_on_the_cpu(tiny):
    d, _, _ = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS["random"](np.random.default_rng(3)), dense_on_gpu=DENSE["cpu attention"])
    cache = hybrid.new_cache()
    hybrid.forward(Batch.single(IDS, cache), cache)
    assert [isinstance(k[0], np.ndarray) for k in cache.k] == [False, True]


@pytest.mark.parametrize("kv", [("f32", "f32"), ("bf16", "f16")])
def test_hybrid_context_shift_matches_ref(tiny, kv):
    """A context shift over a layer attending on the GPU (its slot through the host) and one on the CPU, keys and
    values in KV formats: the logits of the prompt and after the same shift as ref's."""
    d, _, _ = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS["random"](np.random.default_rng(3)), dense_on_gpu=DENSE["cpu attention"])
    model = ref.load_model(d, predictors=d / "predictors.safetensors")
    got = []
    for m in (model, hybrid):
        m.kv_types = kv
        cache = m.new_cache(8)
        got.append(m.forward(Batch.single([1, 5, 9, 2, 3, 7, 11, 4], cache), cache))
        m.shift(cache, 0, 1, 3)
        got[-1] = np.concatenate([got[-1], m.forward(Batch.single([6, 8], cache), cache)])
    assert_close(got[1], got[0], rtol=1e-4)


def test_hybrid_prefix_cache_restores_a_prompt_as_ref(tiny, monkeypatch):
    """Positions stored from a slot on both sides (layer 0 attending on the GPU) and restored into another: the rest
    of a prompt that shares 5 of them gives ref's cold logits."""
    import ref.common.prefix
    monkeypatch.setattr(ref.common.prefix, "BLOCK", 2)
    d, _, _ = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS["random"](np.random.default_rng(3)), dense_on_gpu=DENSE["cpu attention"])
    model = ref.load_model(d, predictors=d / "predictors.safetensors")
    a, b = [1, 5, 9, 2, 3, 7, 11], [1, 5, 9, 2, 3, 4, 6]
    cache = hybrid.new_cache(slots=2)
    cache.free(1)
    hybrid.forward(Batch.single(a, cache), cache)
    prefix = ref.common.prefix.PrefixCache(1 << 20)
    assert prefix.store(cache, 0, a) == 7
    seq = cache.allocate()
    assert prefix.restore(cache, seq, b, 6) == 5
    assert_close(hybrid.forward(Batch.single(b[5:], cache, seq), cache), model.logits(b)[5:], rtol=1e-4)


def test_hybrid_batches_of_sequences_match_each_alone(tiny, monkeypatch):
    """Two sequences' prompts, then prefill beside decode, on slots that grow (room 2, then 4: keys copied on the
    device and on the host), as ref computes each sequence alone."""
    import ref.common.batch
    monkeypatch.setattr(ref.common.batch, "MIN_ROOM", 2)
    d, _, _ = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS["random"](np.random.default_rng(3)), dense_on_gpu=DENSE["cpu attention"])
    model = ref.load_model(d, predictors=d / "predictors.safetensors")
    a, b = [1, 5, 9, 2], [3, 7, 11]
    cache = hybrid.new_cache(slots=2)
    first = hybrid.forward(Batch.of([(0, a[:3]), (1, b[:1])], cache), cache)
    second = hybrid.forward(Batch.of([(1, b[1:]), (0, a[3:])], cache), cache)
    assert_close(np.concatenate([first[:3], second[2:]]), model.logits(a), rtol=1e-4)
    assert_close(np.concatenate([first[3:], second[:2]]), model.logits(b), rtol=1e-4)


def test_hybrid_decode_matches_ref(tiny):
    """Prefill then one-token steps through the KV caches on both sides (attention of layer 1 on the CPU)."""
    d, cfg, want = tiny
    hybrid = to_hybrid(cpu_engine(d), SPLITS["random"](np.random.default_rng(3)), dense_on_gpu=DENSE["cpu attention"])
    cache = hybrid.new_cache()
    got = [hybrid.forward(Batch.single(IDS[:2], cache), cache), hybrid.forward(Batch.single(IDS[2:], cache), cache)]
    assert_close(np.concatenate(got), want, rtol=1e-4)


def test_solver_split_through_the_facade_and_repeatable(tiny):
    d, cfg, want = tiny
    from ref.common.artifacts import save_activations
    counts = np.random.default_rng(2).integers(0, 100, size=(2, 12))
    (d / "c.txt").write_text("x")
    save_activations(d / "activations.safetensors", counts, 100, d / "c.txt", d)
    from placement.budget import GiB, plan_budget
    empty = plan_budget(cfg, FORMATS["f16"], cfg.max_seq_len, 10**9, [4 * 8 + 12 * 4] * 2)  # as stored
    budget = 10**9 - empty.ffn_budget_bytes + 18 * empty.neuron_bytes  # dense parts plus 18 of the 24 neurons
    before = sorted(p.name for p in d.iterdir())
    e = fast.load_engine(d, device="hybrid", predictors=d / "predictors.safetensors", vram_budget=budget / GiB)
    hot = [len(g) for g in e.gpu_neurons]
    assert sorted(hot) == [0, 12]  # C_l > F here: each layer is all GPU or all CPU, and one layer fits
    first = e.logits(IDS)
    assert_close(first, want, rtol=1e-4)
    np.testing.assert_array_equal(e.logits(IDS), first)
    assert sorted(p.name for p in d.iterdir()) == before  # the placement lives in memory: nothing written


def test_layer_policy_matches_ref(tiny):
    d, cfg, want = tiny
    base = cpu_engine(d)
    L0 = base.layers[0]
    kv = 2 * cfg.max_seq_len * cfg.n_kv_heads * cfg.head_dim * 4
    one_layer = L0.attn_norm.nbytes + L0.attn.nbytes() + L0.ffn_norm.nbytes + int(L0.ffn.nbytes()) + kv
    e = to_hybrid(base, *whole_layers(cfg, base.format, cfg.max_seq_len, one_layer + 10))
    assert e.n_gpu_layers == 1
    assert_close(e.logits(IDS), want, rtol=1e-4)


def test_placement_of_another_model(tiny):
    d, cfg, _ = tiny
    with pytest.raises(UserError, match="outside \\[0, 12\\)"):
        to_hybrid(cpu_engine(d), [np.array([3, 40], np.int32)] * 2)
    with pytest.raises(UserError, match="unknown dense part 'attention.7'"):
        to_hybrid(cpu_engine(d), [np.array([3], np.int32)] * 2, dense_on_gpu=["attention.7"])
    with pytest.raises(UserError, match="larger than the GPU"):
        fast.load_engine(d, device="hybrid", vram_budget=10_000)


def test_shipped_placement_loads():
    """The shipped placement names only dense parts the engine knows (solved by the README's command)."""
    from ref.common.artifacts import dense_names, load_placement
    from tests.helpers import SHIPPED
    neurons, meta = load_placement(SHIPPED / "placement.safetensors", 6, 1024)
    assert set(meta["dense_on_gpu"]) <= set(dense_names(6)) and len(neurons) == 6


def test_bench_gpu_smoke(tmp_path):
    """scripts/bench_gpu.py end to end on a micro shape (its real run is scripts/device_check.sh's)."""
    import json

    from click.testing import CliRunner
    from tests.helpers import load_script
    r = CliRunner().invoke(load_script("bench_gpu").main, ["--shape", "micro", "--tokens", "1", "--runs", "1", "--budgets", "40", "-t", "1",
                                        "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "b.json").read_text())["decode"][0]
    assert row["gpu_layers"] == 2 and row["hybrid_tok_s"] > 0 and "hybrid / layers" in r.output


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
def test_hybrid_in_a_weight_format(tmp_path, fmt):
    """The GPU share in the engine's format (no f32 copy): the split engine computes what ref computes at that
    format, the CPU's and the GPU's halves alike."""
    d = write_model(tmp_path, {**TINY, "hidden_size": 32, "intermediate_size": 32}, seed=4)
    engine = fast.load_engine(d, type_=fmt)
    neurons = [np.sort(np.random.default_rng(l).choice(32, 12, replace=False)).astype(np.int32) for l in range(2)]
    hybrid = to_hybrid(engine, neurons, dense_on_gpu=["attention.0", "predictor.1", "output"])
    assert hybrid.format.name == fmt and hybrid.gpu_layers[0].ffn.bundle.kind == gpu.KINDS[fmt]
    want = ref.quant.quantize_model(ref.load_model(d), fmt).logits(IDS)
    assert_close(hybrid.logits(IDS), want, rtol=1e-4)


CUT = np.array([[0.3, 0.05, 0.3, 0.05]] * 2)  # thresholds [L, 4] keeping about half of each site's inputs


def thinned(d, method, fmt=None, predictors=False):
    """The CPU engine with activation sparsity, and ref's logits with the same thresholds."""
    from fast.engine import apply_activation_sparsity
    from ref.activation_sparsity import apply_activation_sparsity as ref_apply_activation_sparsity
    model = ref.load_model(d, predictors=d / "predictors.safetensors" if predictors else None)
    model = ref.quant.quantize_model(model, fmt) if fmt else model
    engine = fast.load_engine(d, type_=fmt) if fmt else Engine.load(d)
    engine = cpu_engine(d) if predictors else engine
    want = ref_apply_activation_sparsity(model, method, CUT, ffn=not predictors).logits(IDS)
    return apply_activation_sparsity(engine, method, CUT, ffn=not predictors), want


@pytest.mark.parametrize("method, split, dense, predictors", [
    ("teal", "all", "all", False), ("wina", "all", "all", False), ("cats", "all", "all", False),
    ("cats", "random", "cpu attention", False),  # CATS's neurons split as predicted ones
    ("wina", "layer 0", "layer 0", False),  # the residual crosses over between a thinned GPU and CPU layer
    ("teal", "random", "cpu attention", True)])  # predictors keep the FFN: attention thinned on both sides
def test_activation_sparsity_on_the_gpu_is_refs_model(tiny, method, split, dense, predictors):
    d, _, _ = tiny
    engine, want = thinned(d, method, predictors=predictors)
    neurons = ([np.arange(12, dtype=np.int32), np.empty(0, np.int32)] if split == "layer 0"
               else SPLITS[split](np.random.default_rng(7)))
    hybrid = to_hybrid(engine, neurons, dense_on_gpu=["attention.0"] if dense == "layer 0" else DENSE[dense])
    assert_close(hybrid.logits(IDS), want, rtol=1e-4)
    cache = hybrid.new_cache()  # a prompt, then a token at a time
    got = [hybrid.forward(Batch.single(IDS[:2], cache), cache), hybrid.forward(Batch.single(IDS[2:], cache), cache)]
    assert_close(np.concatenate(got), want, rtol=1e-4)


def test_a_thinned_ffn_split_between_the_sides_is_refused(tiny):
    d, _, _ = tiny
    engine, _ = thinned(d, "teal")
    with pytest.raises(UserError, match="layer 0 splits an FFN that activation sparsity"):
        to_hybrid(engine, SPLITS["random"](np.random.default_rng(7)))


@pytest.mark.parametrize("fmt, method", [("q4_0", "wina"), ("bf16", "teal"), ("q8_0", "cats")])
def test_activation_sparsity_on_the_gpu_in_a_weight_format(tmp_path, fmt, method):
    """The stored transposes in the engine's format on the card (q8_0, q4_0 quantized along their outputs)."""
    d = write_model(tmp_path, {**TINY, "hidden_size": 64, "intermediate_size": 32}, seed=4)  # k, v: 32 columns
    engine, want = thinned(d, method, fmt)
    hybrid = to_hybrid(engine, [np.arange(32, dtype=np.int32)] * 2)
    assert hybrid.gpu_layers[0].attention.wqkv.kind == gpu.KINDS[fmt]
    assert_close(hybrid.logits(IDS), want, rtol=1e-4)


def test_device_gpu_runs_a_calibrated_sparsity(tiny, tmp_path):
    """fast.load_engine(--device gpu --sparsity S): thresholds from the file, every layer on the card."""
    from ref.activation_sparsity import LEVELS, Thresholds, apply_activation_sparsity, sparsity_to_run
    from ref.common.artifacts import model_fingerprint
    d, cfg, _ = tiny
    table = np.broadcast_to(LEVELS, (2, 4, len(LEVELS))).astype(np.float32)  # threshold = level
    weights = ref.load_model(d).weights
    Thresholds({"wina": table}, {}, np.zeros(0), np.array([8, 8, 8, 12]),
               {"model": model_fingerprint(weights)}).save(tmp_path / "s.safetensors")
    e = fast.load_engine(d, device="gpu", vram_budget=0.5, sparsity=0.4, sparsity_method="wina",
                         sparsity_file=tmp_path / "s.safetensors")
    assert e.n_gpu_layers == 2 and all(isinstance(G.ffn, GpuThinnedFFN) for G in e.gpu_layers)
    cut = sparsity_to_run(weights, d, 0.4, "wina", tmp_path / "s.safetensors")
    assert_close(e.logits(IDS), apply_activation_sparsity(ref.load_model(d), "wina", cut).logits(IDS), rtol=1e-4)
