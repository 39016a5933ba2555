"""What a decode token costs where: the bytes each device reads under a plan (the CPU alone, llama.cpp's whole layers
on the GPU, PowerInfer's neurons placed by the ILP) and the seconds those bytes take on a hardware profile.

Decoding one token is bound by the bytes it reads. A device's time for a part is its bytes over its read bandwidth
times the share of it its kernels reach (`Kernels` for this project's CPU kernels, measured; `GPU_EFFICIENCY` for a
card); each layer adds the engine's fixed time per layer (Python and dispatch). A layer split between the CPU and
the GPUs waits for the slowest side, then pays a synchronisation, a small transfer's latency and its partial sum
over PCIe (the overheads of `Hardware.min_cpu_neurons`); llama.cpp's layers run one after another, the hidden state
crossing PCIe where they change sides. The firing probability of each neuron (a profile's counts over its tokens,
or a power law with mean 1 - sparsity) gives the expected neurons a token reads on each side.
Dimensions: L layers, D d_model, F FFN neurons, K kv heads, E head dim, V vocab, R predictor hidden size.
"""

from dataclasses import dataclass, field

import numpy as np

from placement.budget import Hardware, dense_parts, plan_budget, whole_layers
from placement.solver import solve
from ref.common.config import ModelConfig
from ref.common.formats import FORMATS, Format
from ref.quant import predictor_format

# The share of its spec bandwidth a card's matrix-vector kernels stream: llama.cpp's and PowerInfer's reach 75 to
# 90 % on recent NVIDIA cards; this project's GPU kernels have not yet been timed on a device (bench_gpu.py will).
GPU_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Kernels:
    """What this project's CPU kernels reach (scripts/plan_check.py --calibrate), per weight format: of the read
    probe's bandwidth, `dense` rows read whole (attention, predictors, a dense FFN, the output layer) and a `sparse`
    FFN's scattered neurons (its block measured alone); of the CPU's FLOP/s (Hardware.cpu_flops), `compute`, the
    multiply-adds of a decode step's rows at 2 FLOPs a weight, where memory does not bound it; a decode step's fixed
    time, `token_seconds` plus `layer_seconds` a layer."""

    dense: dict = field(default_factory=dict)
    sparse: dict = field(default_factory=dict)
    token_seconds: float = 0.0
    layer_seconds: float = 0.0
    compute: dict = field(default_factory=dict)

    def fixed(self, L: int) -> float:
        return self.token_seconds + L * self.layer_seconds


# Measured on the CI machine (2-core AMD EPYC with AVX-512 VNNI, 2 threads) on shapes the checks do not predict
# (scripts/plan_check.py's CALIBRATION), two passes together: python scripts/plan_check.py --calibrate --passes 2
# --tokens 16 --runs 5 (the sparse share the median of the FFN block alone, the rest fitted to whole tokens around
# it). Formats it did not measure take their nearest one's (f32, bf16: f16's).
CPU_KERNELS = Kernels(dense={"f32": 0.94, "f16": 0.94, "bf16": 0.94, "q8_0": 0.85, "q4_0": 0.88},
                      sparse={"f32": 0.93, "f16": 0.93, "bf16": 0.93, "q8_0": 0.67, "q4_0": 0.49},
                      token_seconds=2.5e-5, layer_seconds=3.0e-5,
                      compute={"f32": 0.23, "f16": 0.23, "bf16": 0.23, "q8_0": 0.44, "q4_0": 0.63})


@dataclass(frozen=True)
class Parts:
    """Bytes a decode token reads of each part of a model in a format, with `depth` positions cached."""

    attention: int  # a layer's q, k, v, o weights and norm, and its keys and values at the depth
    neuron: int  # one FFN neuron's rows
    predictor: int  # a layer's predictor (0: none)
    output: int  # the final norm and the output layer
    cfg: ModelConfig
    kv_position: int = 0  # a layer's keys and values of one position
    depth: int = 0  # the positions `attention` reads the keys and values of

    @property
    def attention_weights(self) -> int:
        return self.attention - self.depth * self.kv_position

    @property
    def dense_token(self) -> int:
        """Bytes a dense decode token reads: every layer's weights, keys and values at the depth, the output layer."""
        return self.cfg.n_layers * (self.attention + self.cfg.d_ffn * self.neuron) + self.output

    @property
    def weights(self) -> int:
        """Every layer's weights and the output layer's: what a dense prompt token multiplies."""
        return self.dense_token - self.cfg.n_layers * self.depth * self.kv_position

    @staticmethod
    def of(cfg: ModelConfig, fmt: Format, depth: int = 0, kv: Format = FORMATS["f16"],
           predictor_hidden: int = 0) -> "Parts":
        D, E, H, K = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        vector = 4  # a norm's weights: float32 in the engines
        attention = 2 * fmt.nbytes((H * E, D)) + 2 * fmt.nbytes((K * E, D)) + D * vector
        kv_position = 2 * K * kv.row_bytes(E)
        attention += depth * kv_position
        R = predictor_hidden
        pfmt = predictor_format(fmt, D)
        R += -R % pfmt.block  # padded to whole blocks (ref.quant.pad_hidden)
        predictor = pfmt.nbytes((R, D)) + pfmt.nbytes((cfg.d_ffn, R)) if R else 0
        return Parts(attention, cfg.ffn_matrices * fmt.row_bytes(D), predictor,
                     D * vector + fmt.nbytes((cfg.vocab_size, D)), cfg, kv_position, depth)


@dataclass
class Prediction:
    """One plan's decode: bytes a token reads per device, seconds per token, and the GPU memory the plan holds."""

    plan: str
    cpu_bytes: float
    gpu_bytes: list  # per GPU
    seconds: float
    gpu_resident: list = field(default_factory=list)  # bytes per GPU
    note: str = ""
    gpu_weights: float = 0.0  # of the weights, the bytes the GPUs hold (a prompt's GPU share)
    host_resident: float = 0.0  # bytes the host holds: the weights and predictors left to it, its keys and values
    prompt_seconds: float = 0.0  # a prompt token's (prompt_seconds)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds

    @property
    def prompt_tok_s(self) -> float:
        return 1.0 / self.prompt_seconds if self.prompt_seconds else 0.0


# A prompt is bound by its multiply-adds, every neuron's (a prompt's tokens together fire nearly all): the share of the
# CPU's float32 peak (Hardware.cpu_flops) this project's prompt path reaches, from scripts/bench.py --pp 512 on the
# TinyLlama shape, dense, 2 threads, against the cpu-only profile's 200 GFLOP/s (f32 95.3, q8_0 107.7, q4_0 118.6
# tokens/s at 2.07 GFLOP a token: integer dot products pass the float peak); f16 and bf16 take f32's (their rows are
# widened to float32 for the same GEMM).
CPU_PROMPT = {"f32": 0.99, "f16": 0.99, "bf16": 0.99, "q8_0": 1.11, "q4_0": 1.23}
# The share of a card's FP16 tensor peak its prompt GEMMs reach: an assumption (llama.cpp's cuBLAS and MMQ paths
# reach 40 to 70 % on large batches) until bench_gpu.py times one.
GPU_PROMPT_EFFICIENCY = 0.5
PROMPT_BATCH = 512  # llama.cpp's -b: a batch this large runs the host's layers on the card, their weights copied


def prompt_seconds(pred: Prediction, p: Parts, fmt: Format, hw: Hardware) -> float:
    """Seconds per prompt token: 2 multiply-add FLOPs per weight, each side's weights at its rate; where a card is
    used, the host's weights either computed by the CPU or copied over PCIe once per batch and computed on the
    card, whichever is faster (llama.cpp offloads a large batch's host matrices)."""
    per_byte = flops_per_byte(fmt)
    gpu_rate = hw.gpu_flops * GPU_PROMPT_EFFICIENCY
    host = p.weights - pred.gpu_weights
    t = host * per_byte / (hw.cpu_flops * CPU_PROMPT[fmt.name])
    if pred.gpu_weights and gpu_rate:
        t = min(t, host / (hw.pcie_bandwidth * PROMPT_BATCH) + host * per_byte / gpu_rate)
        t += pred.gpu_weights * per_byte / gpu_rate
    return t


def flops_per_byte(fmt: Format) -> float:
    """A matrix-vector product's FLOPs per byte of weights in fmt: a multiply and an add per weight."""
    return 2 * fmt.block / fmt.block_bytes


def cpu_seconds(dense: float, sparse: float, fmt: Format, bandwidth: float, kernels: Kernels,
                flops: float = 0.0) -> float:
    """Seconds the CPU takes for `dense` bytes of whole rows and `sparse` bytes of scattered neurons: their reads,
    dense / (bandwidth e_dense) + sparse / (bandwidth e_sparse), or where `flops` is given and the arithmetic takes
    longer, (dense + sparse) FLOPs per byte / (flops x compute) (a roofline: on two cores a quantized token at a
    fast probe is bound by its multiply-adds, the down rows' axpy slowest of them)."""
    t = dense / (bandwidth * kernels.dense[fmt.name]) + sparse / (bandwidth * kernels.sparse[fmt.name])
    if flops and fmt.name in kernels.compute:
        t = max(t, (dense + sparse) * flops_per_byte(fmt) / (flops * kernels.compute[fmt.name]))
    return t


def gpu_seconds(nbytes: float, hw: Hardware) -> float:
    """Seconds a card takes to read `nbytes`: its spec bandwidth times what its kernels stream of it."""
    return nbytes / (hw.gpu_bandwidth * GPU_EFFICIENCY)


def cpu_token_bytes(p: Parts, active: np.ndarray | None) -> tuple[float, float]:
    """(whole rows, scattered neurons) in bytes a token reads with every part on the CPU; `active` the expected
    neurons it computes per layer [L] (None: dense, every neuron, no predictor)."""
    if active is None:
        return p.dense_token, 0.0
    return p.cfg.n_layers * (p.attention + p.predictor) + p.output, float(np.sum(active)) * p.neuron


def cpu_only(p: Parts, fmt: Format, bandwidth: float, active: np.ndarray | None,
             kernels: Kernels = CPU_KERNELS, ctx: int = 0, flops: float = 0.0) -> Prediction:
    """Every part on the CPU (`bandwidth` bytes/s, `flops` FLOP/s: cpu_seconds); `active` the expected neurons a
    token computes per layer [L] (None: dense, every neuron, no predictor); the host holds every weight and `ctx`
    positions of keys and values."""
    L = p.cfg.n_layers
    dense, sparse = cpu_token_bytes(p, active)
    name = "CPU only, dense" if active is None else "CPU only, sparse"
    t = cpu_seconds(dense, sparse, fmt, bandwidth, kernels, flops) + kernels.fixed(L)
    host = p.weights + (0 if active is None else L * p.predictor) + L * ctx * p.kv_position
    return Prediction(name, dense + sparse, [], t, host_resident=host)


def hop(hw: Hardware, D: int) -> float:
    """Seconds a layer split between sides pays: a synchronisation, a small transfer, D floats over PCIe."""
    return hw.sync_cost + hw.pcie_latency + 4 * D / hw.pcie_bandwidth


def layers_on_gpu(p: Parts, fmt: Format, hw: Hardware, bandwidth: float, ctx: int, budget: int,
                  kernels: Kernels = CPU_KERNELS, flops: float = 0.0) -> Prediction:
    """llama.cpp's -ngl: as many whole layers (with their KV cache for ctx) as fit the budget, dense; the rest on
    the CPU; the output layer on the GPU only when every layer is."""
    cfg = p.cfg
    L, F = cfg.n_layers, cfg.d_ffn
    neurons, dense_on_gpu = whole_layers(cfg, fmt, ctx, budget)
    n = sum(len(x) > 0 for x in neurons)
    out_on_gpu = "output" in dense_on_gpu
    layer = p.attention + F * p.neuron
    gpu = n * layer + (p.output if out_on_gpu else 0)
    cpu = (L - n) * layer + (0 if out_on_gpu else p.output)
    t = gpu_seconds(gpu, hw) + cpu_seconds(cpu, 0, fmt, bandwidth, kernels, flops)
    t += kernels.fixed(L) + (2 * hop(hw, cfg.d_model) if 0 < n < L or n and not out_on_gpu else 0)
    parts = dict(dense_parts(cfg, fmt, ctx, []))  # what whole_layers counted: each layer with its KV cache
    held = n * (parts["attention.0"] + parts["ffn_norms"] // L + F * p.neuron) + (parts["output"] if out_on_gpu else 0)
    weights_on_gpu = n * (p.attention_weights + F * p.neuron) + (p.output if out_on_gpu else 0)
    host = p.weights - weights_on_gpu + (L - n) * ctx * p.kv_position
    return Prediction(f"llama.cpp layers (-ngl {n})", cpu, [gpu], t, [held], f"{n} of {L} layers on the GPU",
                      weights_on_gpu, host)


def neurons_placed(p: Parts, fmt: Format, hw: Hardware, bandwidth: float, ctx: int, budgets: list[int],
                   firing: np.ndarray, predictor_params: list[int], group: int = 64,
                   kernels: Kernels = CPU_KERNELS, flops: float = 0.0) -> Prediction:
    """PowerInfer: the dense parts that fit whole on the first GPU in PowerInfer's order, then the ILP's neurons on
    every GPU (`solve`, one FFN budget each; the other GPUs lose only the scratch headroom), the rest on the CPU;
    firing [L, F] each neuron's probability. A layer's sides run at once: its time is the slowest side's, plus a hop
    per GPU it waits for where it is split."""
    cfg = p.cfg
    L, F, D = cfg.n_layers, cfg.d_ffn, cfg.d_model
    plan = plan_budget(cfg, fmt, ctx, budgets[0], predictor_params)
    ffn = [plan.ffn_budget_bytes] + [max(0, b - plan.headroom_bytes) for b in budgets[1:]]
    counts = np.round(firing * 1e6).astype(np.int64)  # the ILP's weights: expected firings per million tokens
    min_cpu = [hw.min_cpu_neurons(p.neuron, D)] * L
    placed = solve(counts, p.neuron, ffn if len(ffn) > 1 else ffn[0], min_cpu, group)
    on_gpu = {name for name, _ in plan.on_gpu}
    k = len(budgets)
    cpu_dense = cpu_sparse = 0.0
    gpu, t = [0.0] * k, 0.0
    for l in range(L):
        sides = [0.0] * k
        attention_here = f"attention.{l}" in on_gpu
        predictor_here = f"predictor.{l}" in on_gpu
        sides[0] += (p.attention if attention_here else 0) + (p.predictor if predictor_here else 0)
        dense_cpu = (0 if attention_here else p.attention) + (0 if predictor_here else p.predictor)
        taken = np.zeros(F, bool)
        for d in range(k):
            ids = placed.device_neurons[d][l]
            taken[ids] = True
            sides[d] += float(firing[l][ids].sum()) * p.neuron
        sparse_cpu = float(firing[l][~taken].sum()) * p.neuron
        cpu_dense, cpu_sparse = cpu_dense + dense_cpu, cpu_sparse + sparse_cpu
        t_cpu = cpu_seconds(dense_cpu, sparse_cpu, fmt, bandwidth, kernels, flops)
        t_gpu = [gpu_seconds(s, hw) for s in sides]
        busy = [d for d in range(k) if sides[d] > 0]
        t += max([t_cpu, *t_gpu]) + (len(busy) * hop(hw, D) if busy and t_cpu > 0 else 0)
        gpu = [g + s for g, s in zip(gpu, sides)]
    if "output" in on_gpu:
        gpu[0] += p.output
        t += gpu_seconds(p.output, hw)
    else:
        cpu_dense += p.output
        t += cpu_seconds(p.output, 0, fmt, bandwidth, kernels, flops)
    t += kernels.fixed(L)
    resident = [budgets[0] - plan.ffn_budget_bytes + sum(len(n) for n in placed.device_neurons[0]) * p.neuron]
    resident += [sum(len(n) for n in placed.device_neurons[d]) * p.neuron for d in range(1, k)]
    share = sum(len(n) for n in placed.gpu_neurons) / (L * F)
    cover = sum(float(firing[l][placed.gpu_neurons[l]].sum()) for l in range(L)) / max(float(firing.sum()), 1e-30)
    note = (f"{sum(n.startswith('attention.') for n in on_gpu)} of {L} attention layers and {share:.0%} of the FFN "
            f"neurons ({cover:.0%} of the firings) on the GPU{'s' if k > 1 else ''}")
    attention_on_gpu = sum(f"attention.{l}" in on_gpu for l in range(L))
    weights_on_gpu = (attention_on_gpu * p.attention_weights + sum(map(len, placed.gpu_neurons)) * p.neuron
                      + (p.output if "output" in on_gpu else 0))
    predictors_on_cpu = sum(f"predictor.{l}" not in on_gpu for l in range(L)) * p.predictor
    host = p.weights - weights_on_gpu + predictors_on_cpu + (L - attention_on_gpu) * ctx * p.kv_position
    return Prediction("PowerInfer (neurons by the ILP)", cpu_dense + cpu_sparse, gpu, t, resident, note,
                      weights_on_gpu, host)
