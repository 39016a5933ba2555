import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from placement.budget import GiB, HARDWARE, load_hardware, plan_budget
from placement.place import load_or_place, request
from placement.solver import Groups, greedy, load_placement, save_placement, solve
from ref.artifacts import atomic_save
from ref.config import ModelConfig
from ref.errors import UserError
from tests.helpers import ROOT, SMALL_CONFIG

CFG = ModelConfig.from_dict(SMALL_CONFIG)


def power_law_counts(L, F, seed, tokens=10000):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation((tokens / np.arange(1, F + 1) ** rng.uniform(0.6, 1.4)).astype(np.int64))
                     for _ in range(L)])


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
    top = [g.neurons(l, t) for l, t in enumerate(greedy(g, 500))]
    assert p.objective == objective(counts, top) == objective(counts, p.gpu_neurons)
    assert p.status == "OPTIMAL"


def brute_force(counts, group, capacity, min_cpu):
    g = Groups.build(counts, group)
    flat = [(l, k) for l in range(len(counts)) for k in range(len(g.sizes[l]))]
    best = -1
    for bits in itertools.product([0, 1], repeat=len(flat)):
        taken = [np.zeros(len(s), bool) for s in g.sizes]
        for (l, k), b in zip(flat, bits):
            taken[l][k] = b
        used = [int(g.sizes[l][t].sum()) for l, t in enumerate(taken)]
        F = counts.shape[1]
        if sum(used) > capacity or any(0 < F - u < min(c, F) for u, c in zip(used, min_cpu)):
            continue
        best = max(best, sum(int(g.weights[l][t].sum()) for l, t in enumerate(taken)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_small_instances_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 100, size=(3, 10))  # groups of 3: sizes 3, 3, 3, 1
    capacity = int(rng.integers(4, 25))
    min_cpu = [int(c) for c in rng.integers(2, 8, size=3)]
    p = solve(counts, 1, capacity, min_cpu, group=3)
    assert p.objective == brute_force(counts, 3, capacity, min_cpu) == objective(counts, p.gpu_neurons)
    check_feasible(p, 10, capacity, min_cpu)


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
    plan = plan_budget(CFG, "float16", 64, headroom + 2 * attn + 200)
    assert [n for n, _ in plan.on_gpu] == ["attention.0", "attention.1", "ffn_norms"]
    assert plan.ffn_budget_bytes == 200 - 2 * 32 * 2 and plan.neuron_bytes == 3 * 32 * 2  # output does not fit
    big = plan_budget(CFG, "float16", 64, GiB, predictor_params=[100, 200])
    assert [n for n, _ in big.on_gpu] == ["attention.0", "attention.1", "predictor.0", "predictor.1", "ffn_norms",
                                          "output"]
    assert big.ffn_budget_bytes == GiB - big.headroom_bytes - sum(b for _, b in big.on_gpu)


@pytest.mark.parametrize("gib, message", [(-1, "must be >= 0"), (1e-6, "too small: scratch headroom .* attention.0")])
def test_bad_budgets(gib, message):
    with pytest.raises(UserError, match=message):
        plan_budget(CFG, "float16", 64, int(gib * GiB))


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
    save_placement(tmp_path / "p.safetensors", p, {"budget_bytes": 300})
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
    from ref.profile import save_activations
    from tests.helpers import write_model
    d = write_model(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    save_activations(tmp_path / "a.safetensors", power_law_counts(2, 100, 0), 10000, corpus, d)
    return d, tmp_path / "a.safetensors"


@pytest.mark.parametrize("change", ["budget", "hardware", "dtype", "activations"])
def test_stale_placement_is_never_reused(model_and_acts, tmp_path, change):
    d, acts = model_and_acts
    cfg = ModelConfig.from_hf(d)
    hw = HARDWARE["rtx4090"]
    req = request(cfg, acts, 0.01, hw, "float16", 64, 8, 0)
    out = tmp_path / "p.safetensors"
    _, _, reused = load_or_place(cfg, out, acts, req, hw)
    assert not reused and load_or_place(cfg, out, acts, req, hw)[2]
    if change == "activations":
        from ref.profile import save_activations
        save_activations(acts, power_law_counts(2, 100, 1), 10000, tmp_path / "c.txt", d)
    hw2 = HARDWARE["h200"] if change == "hardware" else hw
    req2 = request(cfg, acts, 0.02 if change == "budget" else 0.01, hw2, "float32" if change == "dtype" else "float16", 64, 8, 0)
    neurons, meta, reused = load_or_place(cfg, out, acts, req2, hw2)
    assert not reused and meta["budget_bytes"] == req2["budget_bytes"] and meta["hardware"] == hw2.name
    assert meta["activations_sha256"] == req2["activations_sha256"] and meta["dtype"] == req2["dtype"]


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
