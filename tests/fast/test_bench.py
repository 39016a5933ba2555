"""scripts/bench.py end to end on a micro shape, and its synthetic active sets."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fast.bench import SyntheticSelector, synthetic_predictors
from ref.common.config import shape_config
from tests.helpers import load_script


# On the micro shape the float32 predictors outweigh an f16 FFN's saved bytes: sparse reads more there.
@pytest.mark.parametrize("fmt, sparse_reads_less", [("f32", True), ("f16", False)])
def test_bench_table_and_json(tmp_path, fmt, sparse_reads_less):
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", "--tokens", "2", "--runs", "2", "--type", fmt,
                                                       "--probe-gib", "0.01", "-t", "1", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["type"] == fmt and f"x2 {fmt.upper()} |" in r.output
    assert len(out["rounds"]) == 2 and out["ratio_sparse_dense"] > 0 and out["read_bandwidth_gbs"] > 0
    assert set(out["ratio_by_bus"]) == {"faster", "slower"} and min(out["ratio_by_bus"].values()) > 0
    assert (out["sparse"]["bytes_per_token"] < out["dense"]["bytes_per_token"]) == sparse_reads_less
    assert "| numba-cpu dense | 1 | tg2 |" in r.output and "sparse/dense:" in r.output


@pytest.mark.parametrize("args, message", [(["--sparsity", "1"], "--sparsity must be in"), (["--runs", "0"], "--runs")])
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


def test_bench_beside_busy_processes(tmp_path):
    """--busy: spinning processes beside the run, and the default thread count leaves their core alone."""
    import os
    r = CliRunner().invoke(load_script("bench").main, ["--shape", "micro", "--tokens", "1", "--runs", "1", "--busy", "1",
                                                       "--probe-gib", "0.01", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["busy"] == 1 and out["threads"] <= max(1, len(os.sched_getaffinity(0)) - 1)
    assert "1 busy processes beside it" in r.output
