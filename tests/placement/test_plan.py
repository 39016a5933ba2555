"""The planner (placement.cost, python -m placement.plan): its bytes are the engine's, its times follow from them, its
plans keep to the budgets; the command answers in one line when asked wrongly."""

import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest

from placement.budget import GiB, HARDWARE
from placement.cost import (CPU_PROMPT, GPU_EFFICIENCY, Kernels, Parts, cpu_only, layers_on_gpu, neurons_placed,
                            prompt_seconds)
from placement.synthetic import firing
from ref.common.config import shape_config
from ref.common.formats import FORMATS
from tests.helpers import ROOT

FLAT = Kernels(dense={f: 1.0 for f in FORMATS}, sparse={f: 0.5 for f in FORMATS}, token_seconds=1e-4,
               layer_seconds=1e-5)


@pytest.mark.parametrize("fmt", ["f32", "q4_0"])
def test_parts_are_the_bytes_the_engine_reads(fmt):
    """Dense and sparse, the planner's bytes a token reads are fast.bench's count over the engine's own matrices,
    plus the norms' vectors (which that count leaves out)."""
    from fast.bench import SyntheticSelector, bytes_per_token, dense_twin, random_engine, synthetic_predictors
    from ref.predictor import predictor_size
    from ref.quant import predictors_beside
    cfg = shape_config("tiny", 2)
    engine = random_engine(cfg, 1, fmt=FORMATS[fmt])
    R = predictor_size(cfg)
    engine.selector = SyntheticSelector(predictors_beside(synthetic_predictors(cfg, R), engine.format), cfg, 0.8)
    p = Parts.of(cfg, FORMATS[fmt], predictor_hidden=R)
    active, norms = engine.selector.mean_active(), (cfg.n_layers + 1) * cfg.d_model * 4
    assert cfg.n_layers * (p.attention + cfg.d_ffn * p.neuron) + p.output == bytes_per_token(dense_twin(engine),
                                                                                              cfg.d_ffn) + norms
    assert cfg.n_layers * (p.attention + p.predictor + active * p.neuron) + p.output == pytest.approx(
        bytes_per_token(engine, active) + norms)


def test_cpu_time_is_bytes_over_bandwidth_plus_the_fixed_step():
    cfg = shape_config("tiny", 3)
    p = Parts.of(cfg, FORMATS["f16"], depth=100, predictor_hidden=64)
    d = cpu_only(p, FORMATS["f16"], 10e9, None, FLAT)
    assert d.cpu_bytes == 3 * (p.attention + cfg.d_ffn * p.neuron) + p.output
    assert d.seconds == pytest.approx(d.cpu_bytes / 10e9 + 1e-4 + 3e-5)
    active = np.full(3, 100.0)
    s = cpu_only(p, FORMATS["f16"], 10e9, active, FLAT)
    assert s.seconds == pytest.approx((3 * (p.attention + p.predictor) + p.output) / 10e9
                                      + 300 * p.neuron / 5e9 + 1e-4 + 3e-5)
    assert Parts.of(cfg, FORMATS["f16"], depth=100).attention - Parts.of(cfg, FORMATS["f16"]).attention == 2 * 100 * 4 * 32 * 2


def test_arithmetic_bounds_the_cpu_where_its_memory_is_fast():
    """Given the CPU's FLOP/s, a step takes the longer of its reads and its multiply-adds (2 FLOPs a weight at the
    kernels' compute share): the reads' time where the arithmetic is faster, the arithmetic's where the memory is."""
    cfg, fmt = shape_config("tiny", 3), FORMATS["q4_0"]
    p, K = Parts.of(cfg, fmt), dataclasses.replace(FLAT, compute={"q4_0": 0.5})
    memory, flops = p.dense_token / 10e9, 2 * p.dense_token * 32 / 18  # q4_0: 32 weights in 18 bytes
    arithmetic = flops / (0.5 * 2e10)
    assert arithmetic > memory
    assert cpu_only(p, fmt, 10e9, None, K).seconds - K.fixed(3) == pytest.approx(memory)  # no FLOP/s: the reads
    assert cpu_only(p, fmt, 10e9, None, K, flops=2e10).seconds - K.fixed(3) == pytest.approx(arithmetic)
    assert cpu_only(p, fmt, 10e9, None, K, flops=1e12).seconds - K.fixed(3) == pytest.approx(memory)
    sparse = cpu_only(p, fmt, 1e15, np.full(3, 100.0), K, flops=2e10)
    assert sparse.seconds - K.fixed(3) == pytest.approx(sparse.cpu_bytes * 32 / 18 * 2 / (0.5 * 2e10))


def test_gpu_plans_keep_to_the_budget_and_gain_with_it():
    """llama.cpp's layers and PowerInfer's neurons within 1, 2 and 4 GiB: GPU memory within the budget, nothing on
    the CPU once everything fits, decode no slower with more memory; PowerInfer reads less than llama.cpp."""
    cfg = shape_config("tinyllama-1.1b")
    fmt, hw = FORMATS["q4_0"], HARDWARE["rtx4090"]
    p = Parts.of(cfg, fmt, predictor_hidden=256)
    probs = np.stack([firing(cfg.d_ffn, 0.9)] * cfg.n_layers)
    last = {}
    for gib in (1, 2, 4):
        layers = layers_on_gpu(p, fmt, hw, 30e9, 2048, gib * GiB, FLAT)
        ours = neurons_placed(p, fmt, hw, 30e9, 2048, [gib * GiB], probs, [256 * (cfg.d_model + cfg.d_ffn)] * 22,
                              kernels=FLAT)
        for r in (layers, ours):
            assert sum(r.gpu_resident) <= gib * GiB
            assert r.tok_s >= last.get(r.plan[:5], 0) * 0.999
            last[r.plan[:5]] = r.tok_s
        assert ours.cpu_bytes + sum(ours.gpu_bytes) < layers.cpu_bytes + sum(layers.gpu_bytes)
    assert ours.cpu_bytes == 0 and ours.seconds == pytest.approx(
        sum(ours.gpu_bytes) / (hw.gpu_bandwidth * GPU_EFFICIENCY) + FLAT.fixed(22))
    two = neurons_placed(p, fmt, hw, 30e9, 2048, [GiB // 2, GiB // 2], probs, [256 * (cfg.d_model + cfg.d_ffn)] * 22,
                         kernels=FLAT)
    assert len(two.gpu_bytes) == 2 and all(b <= GiB // 2 for b in two.gpu_resident)


def test_prompts_and_memory_follow_where_the_weights_are():
    """A prompt token: 2 FLOPs a weight at each side's rate (CPU only: the CPU's; with a card: faster, and all on it
    once everything fits). The host holds what the card does not: every weight, predictor and position on the CPU
    alone; the weights a card holds, and its layers' keys and values, leave the host."""
    cfg = shape_config("tinyllama-1.1b")
    fmt, hw = FORMATS["q4_0"], HARDWARE["rtx4090"]
    p = Parts.of(cfg, fmt, predictor_hidden=256)
    flops = 2 * p.weights * cfg.d_model / fmt.row_bytes(cfg.d_model)
    assert flops == pytest.approx(2 * (cfg.n_params - cfg.vocab_size * cfg.d_model), rel=2e-3)  # embeddings: looked up
    dense = cpu_only(p, fmt, 30e9, None, FLAT, ctx=2048)
    assert prompt_seconds(dense, p, fmt, hw) == pytest.approx(flops / (hw.cpu_flops * CPU_PROMPT["q4_0"]))
    kv = 22 * 2048 * p.kv_position
    assert dense.host_resident == p.weights + kv and p.kv_position == 2 * 4 * 64 * 2  # f16 keys and values
    sparse = cpu_only(p, fmt, 30e9, np.full(22, 500.0), FLAT, ctx=2048)
    assert sparse.host_resident == dense.host_resident + 22 * p.predictor
    probs = np.stack([firing(cfg.d_ffn, 0.9)] * cfg.n_layers)
    last = prompt_seconds(dense, p, fmt, hw)
    for gib in (0.3, 4):
        layers = layers_on_gpu(p, fmt, hw, 30e9, 2048, int(gib * GiB), FLAT)
        ours = neurons_placed(p, fmt, hw, 30e9, 2048, [int(gib * GiB)], probs, [256 * (cfg.d_model + cfg.d_ffn)] * 22,
                              kernels=FLAT)
        n = int(layers.plan.split("-ngl ")[1].rstrip(")"))
        assert 0 < layers.gpu_weights < p.weights and layers.host_resident == pytest.approx(
            p.weights - layers.gpu_weights + (22 - n) * 2048 * p.kv_position) if gib < 1 else layers.host_resident == 0
        for r in (layers, ours):
            assert prompt_seconds(r, p, fmt, hw) < last and r.host_resident < sparse.host_resident
    assert ours.gpu_weights == p.weights and ours.host_resident == 0
    assert prompt_seconds(ours, p, fmt, hw) == pytest.approx(flops / (hw.gpu_flops * 0.5))


def plan(*args):
    return subprocess.run([sys.executable, "-m", "placement.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_a_70b_plan_on_four_gpus_in_seconds():
    t0 = time.perf_counter()
    r = plan("llama-70b", "--hardware", "rtx4090", "--gpus", "4", "--type", "q4_0", "--predicted-sparsity", "0.9")
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 60  # the 10 s target is measured in docs/benchmarks.md, not asserted here
    lines = r.stdout.splitlines()
    for plan_name in ("CPU only, dense", "CPU only, sparse", "llama.cpp layers (-ngl 80)", "PowerInfer"):
        assert any(line.startswith(f"| {plan_name}") for line in lines), r.stdout


@pytest.mark.parametrize("args, message", [
    (["llama-9b"], "MODEL_OR_SHAPE: 'llama-9b' is neither a model folder nor a shape"),
    (["tiny", "--vram", "99"], "--vram 99 GiB: the rtx4090 has 24 GiB"),
    (["tiny", "--predicted-sparsity", "1.5"], "--predicted-sparsity must be in [0, 1), got 1.5"),
    (["tiny", "--sparsity", "0.9"], "--sparsity is activation sparsity in the CLIs; the predicted FFN sparsity here is "
                                    "--predicted-sparsity"),
    (["tiny", "--hardware", "rtx9090"], "--hardware: unknown profile 'rtx9090'"),
    (["tiny", "--ram", "0"], "--ram must be a positive number of GiB, got 0"),
])
def test_bad_requests_are_one_line(args, message):
    r = plan(*args)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"error: {message}" or message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_profiled_folder_plans_on_its_own_firing(tmp_path):
    """A model folder with activations.safetensors: its firing, not a power law, decides the placement."""
    from ref.common.safetensors import write_safetensors
    from tests.helpers import write_model
    d = write_model(tmp_path / "m", {"intermediate_size": 128})
    counts = np.zeros((2, 128), np.int64)
    counts[:, :13] = 1000  # 10 % of the neurons fire on every token, the rest never
    write_safetensors(d / "activations.safetensors", {**{f"layers.{l}.counts": counts[l] for l in range(2)},
                                                      "tokens": np.array([1000], np.int64)})
    r = plan(str(d), "--hardware", "cpu-only", "--json", "--type", "f32")
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout)
    assert out["firing"].startswith("profiled firing")
    dense, sparse = out["plans"]
    assert dense["plan"] == "CPU only, dense" and sparse["cpu_bytes"] < dense["cpu_bytes"]
    assert dense["host_resident_bytes"] == out["weights_bytes"] + out["kv_bytes"] and dense["fits_ram"]
    assert dense["prompt_tok_s"] > 0 and dense["prompt_tok_s"] == sparse["prompt_tok_s"]  # prompts run dense
    r = plan(str(d), "--hardware", "cpu-only", "--type", "f32", "--ram", "1e-6")
    assert r.returncode == 0 and r.stdout.count("(over --ram)") == 2, r.stdout
