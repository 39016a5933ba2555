import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from placement.budget import GiB, HARDWARE, hardware_for, load_hardware, plan_budget, whole_layers
from placement.place import place, request
from placement.solver import Groups, greedy, solve
from placement.synthetic import synthetic_counts
from ref.common.artifacts import atomic_save, load_placement, save_placement
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from tests.helpers import ROOT, SMALL_CONFIG

CFG = ModelConfig.from_dict(SMALL_CONFIG)
F16 = FORMATS["f16"]


def power_law_counts(L, F, seed):
    return synthetic_counts(L, F, seed, tokens=10000)


def objective(counts, placed):
    return sum(int(counts[l][n].sum()) for l, n in enumerate(placed))


def check_feasible(p, F, capacity, min_cpu):
    assert sum(len(n) for n in p.gpu_neurons) <= capacity
    for l, n in enumerate(p.gpu_neurons):
        cpu = F - len(n)
        assert cpu == 0 or cpu >= min(min_cpu[l], F), f"layer {l}: {cpu} CPU neurons, C_l = {min_cpu[l]}"
        assert np.all(np.diff(n) > 0) and n.dtype == np.int32


@pytest.mark.parametrize("seed", range(3))
def test_without_communication_constraint_equals_greedy_top_k(seed):
    counts = power_law_counts(5, 256, seed)
    p = solve(counts, neuron_bytes=1, ffn_budget_bytes=500, min_cpu=[0] * 5, group=16)
    g = Groups.build(counts, 16)
    top = [g.neurons(l, w >= 0) for l, w in enumerate(greedy(g, [500]))]
    assert p.objective == objective(counts, top) == objective(counts, p.gpu_neurons)
    assert p.status == "OPTIMAL"


def brute_force(counts, group, capacities, min_cpu):
    """The best objective over every assignment of every group to the CPU (-1) or a GPU."""
    g = Groups.build(counts, group)
    flat = [(l, k) for l in range(len(counts)) for k in range(len(g.sizes[l]))]
    best = -1
    for choice in itertools.product(range(-1, len(capacities)), repeat=len(flat)):
        where = [np.full(len(s), -1) for s in g.sizes]
        for (l, k), d in zip(flat, choice):
            where[l][k] = d
        if any(sum(int(g.sizes[l][w == d].sum()) for l, w in enumerate(where)) > cap
               for d, cap in enumerate(capacities)):
            continue
        used = [int(g.sizes[l][w >= 0].sum()) for l, w in enumerate(where)]
        F = counts.shape[1]
        if any(0 < F - u < min(c, F) for u, c in zip(used, min_cpu)):
            continue
        best = max(best, sum(int(g.weights[l][w >= 0].sum()) for l, w in enumerate(where)))
    return best


@pytest.mark.parametrize("seed, gpus", [(s, 1) for s in range(6)] + [(s, 2) for s in range(3)])
def test_small_instances_equal_brute_force(seed, gpus):
    """One GPU, or two of other sizes: CP-SAT's objective is the best over every assignment, each GPU within its
    capacity, the communication constraint kept."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 100, size=(3 if gpus == 1 else 2, 10))  # groups of 3: sizes 3, 3, 3, 1
    capacities = [int(c) for c in rng.integers(4, 25 // gpus, size=gpus)]
    min_cpu = [int(c) for c in rng.integers(2, 8, size=len(counts))]
    best = brute_force(counts, 3, capacities, min_cpu)
    for backend in ("cpsat", "scip"):
        p = solve(counts, 1, capacities if gpus > 1 else capacities[0], min_cpu, group=3, backend=backend)
        assert p.objective == objective(counts, p.gpu_neurons) <= best <= p.bound + 1e-9
        assert p.objective == best or backend == "cpsat" and gpus > 1  # several GPUs on CP-SAT: within a group a GPU
        check_feasible(p, 10, sum(capacities), min_cpu)
        assert len(p.device_neurons) == gpus
        for d, cap in enumerate(capacities):
            assert sum(len(n) for n in p.device_neurons[d]) <= cap
        for l in range(len(counts)):  # the GPUs' neurons apart, together the layer's GPU neurons
            parts = np.concatenate([p.device_neurons[d][l] for d in range(gpus)])
            assert len(set(parts.tolist())) == len(parts) and sorted(parts.tolist()) == p.gpu_neurons[l].tolist()


@pytest.mark.parametrize("seed", range(5))
def test_solutions_respect_budget_and_constraint(seed):
    rng = np.random.default_rng(100 + seed)
    L, F = int(rng.integers(2, 9)), int(rng.integers(50, 400))
    counts = power_law_counts(L, F, seed)
    capacity = int(rng.integers(0, L * F))
    min_cpu = [int(rng.integers(0, F))] * L
    p = solve(counts, 2, 2 * capacity + 1, min_cpu, group=int(rng.integers(1, 40)))
    check_feasible(p, F, capacity, min_cpu)
    assert p.bound >= p.objective


def test_budget_order_and_whole_parts():
    attn = 2 * 32 * 32 * 2 + 2 * 32 * 16 * 2 + 32 * 2 + 2 * 64 * 16 * 2  # fp16: wq, wo, wk, wv, norm, KV cache
    headroom = 4 * 512 * (50 + 200 + 256)
    plan = plan_budget(CFG, F16, 64, headroom + 2 * attn + 200)
    assert [n for n, _ in plan.on_gpu] == ["attention.0", "attention.1", "ffn_norms"]
    assert plan.ffn_budget_bytes == 200 - 2 * 32 * 2 and plan.neuron_bytes == 3 * 32 * 2  # output does not fit
    big = plan_budget(CFG, F16, 64, GiB, predictor_params=[100, 200])
    assert [n for n, _ in big.on_gpu] == ["attention.0", "attention.1", "predictor.0", "predictor.1", "ffn_norms",
                                          "output"]
    assert big.ffn_budget_bytes == GiB - big.headroom_bytes - sum(b for _, b in big.on_gpu)


@pytest.mark.parametrize("gib, message", [(-1, "must be >= 0"), (1e-6, "too small: scratch headroom .* attention.0")])
def test_bad_budgets(gib, message):
    with pytest.raises(UserError, match=message):
        plan_budget(CFG, F16, 64, int(gib * GiB))


def test_hardware_profiles(tmp_path):
    assert set(HARDWARE) >= {"rtx4090", "rtx2080ti", "h200", "cpu-only"}
    hw = HARDWARE["rtx4090"]
    n = hw.min_cpu_neurons(neuron_bytes=3 * 4096 * 2, d_model=4096)
    overhead = hw.sync_cost + hw.pcie_latency + 4 * 4096 / hw.pcie_bandwidth
    assert (n - 1) * 3 * 4096 * 2 / hw.cpu_bandwidth < overhead <= n * 3 * 4096 * 2 / hw.cpu_bandwidth
    assert HARDWARE["cpu-only"].min_cpu_neurons(1, 1) == 0
    with pytest.raises(UserError, match="unknown profile 'rtx9090' \\(known: rtx4090, rtx2080ti, h200, cpu-only"):
        load_hardware("rtx9090")
    f = tmp_path / "my.json"
    f.write_text(json.dumps({**HARDWARE["rtx4090"].__dict__, "name": "mine"}))
    assert load_hardware(str(f)).name == "mine"
    f.write_text(json.dumps({"name": "x"}))
    with pytest.raises(UserError, match="lacks field"):
        load_hardware(str(f))


def test_placement_file_round_trip_and_validation(tmp_path):
    counts = power_law_counts(12, 64, 0)
    p = solve(counts, 1, 300, [0] * 12, group=8)
    save_placement(tmp_path / "p.safetensors", p.gpu_neurons, {"budget_bytes": 300, **p.report()})
    got, meta = load_placement(tmp_path / "p.safetensors", 12, 64)
    for a, b in zip(got, p.gpu_neurons):  # 12 layers: numeric, not string, order
        np.testing.assert_array_equal(a, b)
    assert meta["budget_bytes"] == 300 and meta["status"] == "OPTIMAL"
    atomic_save(tmp_path / "bad.safetensors", {"layers.0.gpu_neurons": np.array([3, 1], np.int32)}, {})
    with pytest.raises(UserError, match="bad.safetensors: layer 0 gpu_neurons must be sorted"):
        load_placement(tmp_path / "bad.safetensors")
    with pytest.raises(UserError, match="p.safetensors: placement for 12 layers, the model has 2"):
        load_placement(tmp_path / "p.safetensors", 2, 64)


@pytest.fixture
def model_and_acts(tmp_path):
    from ref.common.artifacts import save_activations
    from tests.helpers import write_model
    d = write_model(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    save_activations(tmp_path / "a.safetensors", power_law_counts(2, 100, 0), 10000, corpus, d)
    return d, tmp_path / "a.safetensors"


def test_placement_file_records_its_request(model_and_acts, tmp_path):
    """What a placement was solved for travels with it: budget, hardware, format, activations hash, dense parts."""
    d, acts = model_and_acts
    cfg = ModelConfig.from_hf(d)
    hw = HARDWARE["rtx4090"]
    req = request(cfg, acts, 0.01, hw, F16, 64, 8, 0)
    p, plan, meta = place(cfg, acts, req, hw, [])
    save_placement(tmp_path / "p.safetensors", p.gpu_neurons, meta)
    neurons, got = load_placement(tmp_path / "p.safetensors", cfg.n_layers, cfg.d_ffn)
    assert {k: got[k] for k in req} == req and got["format"] == "f16" and got["status"] == p.status
    assert got["dense_on_gpu"] == [n for n, _ in plan.on_gpu] and [len(n) for n in neurons] == [len(n) for n in p.gpu_neurons]


def test_whole_layers_is_llamacpp_layer_offload():
    """-ngl: whole layers first to last, the output layer only when every layer fits too."""
    parts = plan_budget(CFG, F16, 64, 0).on_cpu
    per_layer = dict(parts)["attention.0"] + 32 * 2 + 100 * 3 * 32 * 2  # attention + KV cache, FFN norm, neurons
    output = dict(parts)["output"]
    for budget, n, out in [(per_layer - 1, 0, False), (per_layer, 1, False), (2 * per_layer + output - 1, 1, False),
                           (2 * per_layer + output, 2, True)]:
        neurons, dense = whole_layers(CFG, F16, 64, budget)
        assert [len(g) for g in neurons] == [100] * n + [0] * (2 - n)
        assert sum(x.startswith("attention.") for x in dense) == n and ("output" in dense) == out


def test_device_hardware_by_name():
    assert hardware_for("NVIDIA H200", 150 * GiB).name == "h200"
    assert hardware_for("NVIDIA GeForce RTX 4090", 0).name == "rtx4090"
    other = hardware_for("Tesla T4", 15 * GiB)
    assert other.name == "device:Tesla T4" and other.vram_bytes == 15 * GiB


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "placement", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_json(model_and_acts, tmp_path):
    d, acts = model_and_acts
    r = run_cli(d, "--activations", acts, "--vram-budget", "0.01", "--hardware", "rtx4090", "--group", "8",
                "--min-cpu-neurons", "0", "-o", tmp_path / "p.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"status", "objective", "bound", "gap", "solve_seconds", "budget_bytes", "dense_on_gpu", "ffn_budget_bytes",
            "neuron_bytes", "gpu_neurons", "min_cpu_neurons"} <= set(out)
    assert out["gpu_neurons"] == [len(n) for n in load_placement(tmp_path / "p.safetensors")[0]]


@pytest.mark.parametrize("args, message", [
    (["--vram-budget", "-1"], "--vram-budget must be >= 0"),
    (["--vram-budget", "30"], "exceeds the rtx4090's 24 GiB"),
    (["--vram-budget", "0.000001"], "too small"),
    (["--hardware", "gtx1080"], "unknown profile 'gtx1080'"),
    (["--min-cpu-neurons", "many"], "--min-cpu-neurons must be 'auto' or an integer"),
])
def test_cli_bad_input(model_and_acts, tmp_path, args, message):
    d, acts = model_and_acts
    base = {"--vram-budget": "0.01", "--hardware": "rtx4090"}
    base.update(dict(zip(args[::2], args[1::2])))
    flat = [x for kv in base.items() for x in kv]
    r = run_cli(d, "--activations", acts, "-o", tmp_path / "p.safetensors", *flat)
    assert r.returncode == 1 and "Traceback" not in r.stderr and message in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "p.safetensors").exists()


def test_cli_activations_of_another_model(model_and_acts, tmp_path):
    d, _ = model_and_acts
    atomic_save(tmp_path / "other.safetensors", {"layers.0.counts": np.zeros(100, np.int64), "tokens": np.array([1])}, {})
    r = run_cli(d, "--activations", tmp_path / "other.safetensors", "--vram-budget", "0.01", "--hardware", "rtx4090",
                "-o", tmp_path / "p.safetensors")
    assert r.returncode == 1 and "other.safetensors: activations for 1 layers, the model has 2" in r.stderr


def test_cli_replaces_a_file_only_with_force(model_and_acts, tmp_path):
    d, acts = model_and_acts
    out = tmp_path / "p.safetensors"
    out.write_bytes(b"precious")
    args = [d, "--activations", acts, "--vram-budget", "0.01", "--hardware", "rtx4090", "-o", out]
    r = run_cli(*args)
    assert r.returncode == 1 and "p.safetensors exists: pass --force to replace it" in r.stderr
    assert out.read_bytes() == b"precious"
    assert run_cli(*args, "--force").returncode == 0 and load_placement(out)[0]
