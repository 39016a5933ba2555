"""scripts/bench.py end to end on a micro shape, and its synthetic active sets."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fast.bench import SyntheticSelector, synthetic_predictors
from ref.common.config import shape_config
from tests.helpers import load_script


# On the micro shape float32 predictors outweigh an f16 FFN's saved bytes: sparse reads more there (by default the
# predictors take the weights' format).
@pytest.mark.parametrize("fmt, ptype, sparse_reads_less", [("f32", "f32", True), ("f16", "f16", True), ("f16", "f32", False)])
def test_bench_table_and_json(tmp_path, fmt, ptype, sparse_reads_less):
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", "--tokens", "2", "--runs", "2", "--type", fmt,
                                                       *(["--predictor-type", ptype] if ptype != fmt else []),
                                                       "--probe-gib", "0.01", "-t", "1", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["type"] == fmt and out["predictor_type"] == ptype and f"x2 {fmt.upper()} |" in r.output
    assert len(out["rounds"]) == 2 and out["ratio_sparse_dense"] > 0 and out["read_bandwidth_gbs"] > 0
    assert set(out["ratio_by_bus"]) == {"faster", "slower"} and min(out["ratio_by_bus"].values()) > 0
    assert (out["sparse"]["bytes_per_token"] < out["dense"]["bytes_per_token"]) == sparse_reads_less
    assert "| numba-cpu dense | 1 | tg2 |" in r.output and "sparse/dense:" in r.output


@pytest.mark.parametrize("args, message", [(["--predicted-sparsity", "1"], "--predicted-sparsity must be in"),
                                           (["--sparsity", "0.9"], "here is --predicted-sparsity"),
                                           (["--runs", "0"], "--runs")])
def test_bench_bad_options(args, message):
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", *args])
    assert r.exit_code == 2 and message in r.output


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_synthetic_sets_have_the_asked_size(sparsity):
    cfg = shape_config("tiny")
    selector = SyntheticSelector(synthetic_predictors(cfg, 256), cfg, sparsity)
    assert abs(selector.mean_active() / cfg.d_ffn - (1 - sparsity)) < 0.02
    s = selector.pick(0, np.ones(cfg.d_ffn, np.float32))
    assert np.all(np.diff(s) > 0) and s.dtype == np.int32 and len(s) < cfg.d_ffn


def test_synthetic_given_sets_are_the_next_picks():
    """given_sets hands out every layer's next set at once (pre-joined), the sets pick would have drawn, also after
    the layers' draws went apart."""
    cfg = shape_config("tiny")
    a, b = (SyntheticSelector(synthetic_predictors(cfg, 16), cfg, 0.7, pool=4) for _ in range(2))
    L = cfg.n_layers
    for step in range(6):
        if step == 3:
            a.pick(1, None), b.pick(1, None)  # layer 1 one draw ahead of the others
        given, bounds = a.given_sets(L)
        want = [b.pick(l, None) for l in range(L)]
        assert given.dtype == np.int32 and bounds.tolist() == [0, *np.cumsum([len(s) for s in want])]
        assert given.tolist() == np.concatenate(want).tolist()
    assert a.calls == b.calls


def test_bench_beside_busy_processes(tmp_path):
    """--busy: spinning processes beside the run, and the default thread count leaves their core alone."""
    import os
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", "--tokens", "1", "--runs", "1", "--busy", "1",
                                                       "--probe-gib", "0.01", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["busy"] == 1 and out["threads"] <= max(1, len(os.sched_getaffinity(0)) - 1)
    assert "1 busy processes beside it" in r.output


def test_bench_quantized_with_its_predictor_format(tmp_path):
    """A block format on a shape whose rows are whole blocks; q4_0's predictors default to q4_0."""
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "tiny", "--layers", "1", "--tokens", "2", "--runs", "1",
                                                       "--type", "q4_0", "--probe-gib", "0.01", "-t", "1",
                                                       "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["type"] == "q4_0" and out["predictor_type"] == "q4_0" and "predictors R=" in r.output
    assert out["sparse"]["bytes_per_token"] < out["dense"]["bytes_per_token"]


def test_random_gguf_is_a_model_we_and_llama_cpp_read(tmp_path):
    """The peer's file: a valid GGUF of the shape (our reader checks every tensor's shape), SentencePiece vocabulary."""
    from fast.bench import random_gguf
    from ref.common.formats import FORMATS
    from ref.common.gguf_io import read_gguf
    cfg = shape_config("tiny", 2)
    random_gguf(cfg, FORMATS["q8_0"], tmp_path / "r.gguf")
    ck = read_gguf(tmp_path / "r.gguf")
    assert ck.kind == "gguf" and ck.config.n_layers == 2 and ck.config.d_ffn == cfg.d_ffn and ck.predictors is None
    assert ck.tensors["layers.1.wg"].format.name == "q8_0"


def test_bench_peer(tmp_path):
    """--peer: llama.cpp timed in the same run where llama-cpp-python is installed; one clear line where not."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        r = CliRunner().invoke(load_script("bench").main, ["--shape", "tiny", "--layers", "1", "--peer"])
        assert r.exit_code == 1 and "--peer needs llama-cpp-python" in r.output
        return
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "tiny", "--layers", "1", "--tokens", "2", "--runs", "1",
                                                       "--type", "q8_0", "--probe-gib", "0.01", "-t", "1", "--peer",
                                                       "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["llama.cpp"]["tok_s"] > 0 and set(out["ratio_vs_llama_cpp"]) == {"dense", "sparse"}
    assert "| llama.cpp cpu dense |" in r.output


def test_bench_prompt_processing(tmp_path):
    """--pp N: an N-token prompt from an empty cache, dense and sparse, in the table and the JSON."""
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", "--tokens", "1", "--runs", "1", "--pp", "9",
                                                       "--probe-gib", "0.01", "-t", "1", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    pp = json.loads((tmp_path / "b.json").read_text())["pp"]
    assert pp["tokens"] == 9 and pp["dense_tok_s"] > 0 and pp["sparse_tok_s"] > 0
    assert "| numba-cpu sparse | 1 | pp9 |" in r.output


@pytest.mark.parametrize("shape", ["opt-1.3b", "falcon-7b", "falcon-40b"])
def test_random_engine_of_every_family(shape):
    """The benchmarks' synthetic model is laid out by Engine.load, for any family (a narrow cut of the real shape)."""
    from dataclasses import replace

    from fast.bench import random_engine
    cfg = shape_config(shape, layers=2)
    H = max(1, cfg.n_heads // 16)
    small = replace(cfg, d_model=cfg.head_dim * H, n_heads=H, n_kv_heads=max(1, cfg.n_kv_heads // 16), d_ffn=256,
                    vocab_size=300, max_seq_len=16)
    logits = random_engine(small, 1).logits([1, 2, 3])
    assert logits.shape == (3, 300) and np.isfinite(logits).all()


def test_bench_at_depth(tmp_path):
    """--depth D: decode after a D-token prompt run once; each round starts from D cached positions again, and the
    bytes a token reads count their keys and values."""
    args = ["--shape", "micro", "--tokens", "2", "--runs", "2", "--probe-gib", "0.01", "-t", "1", "--json"]
    outs = []
    for depth in (0, 40):
        r = CliRunner().invoke(load_script("bench").main, [*args, str(tmp_path / f"b{depth}.json"), "--depth", str(depth)])
        assert r.exit_code == 0, r.output
        outs.append(json.loads((tmp_path / f"b{depth}.json").read_text()))
    assert "| tg2 @ d40 |" in r.output and outs[1]["depth"] == 40 and outs[1]["sparse"]["tok_s"] > 0
    cfg = shape_config("micro")
    kv = 2 * cfg.n_layers * 40 * cfg.n_kv_heads * cfg.head_dim * 2  # f16 keys and values (-ctk, -ctv: llama.cpp's)
    for name in ("dense", "sparse"):
        assert outs[1][name]["bytes_per_token"] - outs[0][name]["bytes_per_token"] == kv


def test_rounds_at_depth_start_from_the_same_prompt():
    from fast.bench import ReadProbe, bracketed_decode, random_engine
    engine = random_engine(shape_config("micro"), 1)
    held = {}
    for r in range(3):
        bracketed_decode({"dense": engine}, ReadProbe(0.001), 3, r, depth=10, held=held)
        assert held["dense"].lengths[0] == 13


def test_bench_attention_table():
    """scripts/bench_attention.py: a row per depth and KV format, its bytes those of the format; a bad format is one
    line."""
    args = ["--shape", "tinyllama-1.1b", "--layers", "1", "--depths", "8,40", "--runs", "1", "--probe-gib", "0.01",
            "-t", "1"]
    r = CliRunner().invoke(load_script("bench_attention").main, [*args, "--kv", "f32"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("| tinyllama")]
    assert [row.split("|")[2:4] for row in rows] == [[" f32 ", " 8 "], [" f32 ", " 40 "]]
    assert float(rows[0].split("|")[4]) == pytest.approx(2 * 4 * 9 * 64 * 4 / 1e6, rel=1e-3)  # K, V; 4 heads of 64
    bad = CliRunner().invoke(load_script("bench_attention").main, [*args, "--kv", "q4_0"])
    assert bad.exit_code == 1 and "--kv: the KV cache is stored in" in bad.output
