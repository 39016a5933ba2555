"""What the GPU holds before any FFN neuron, what it costs in bytes, and the hardware it runs on.

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, L layers.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ref.common.artifacts import dense_names
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format

GiB = 2**30
PREFILL_CHUNK = 512  # tokens per prefill pass; sizes the scratch headroom


@dataclass(frozen=True)
class Hardware:
    """A machine's numbers that placement needs. Bandwidths in bytes/s, times in seconds."""

    name: str
    vram_bytes: int
    gpu_bandwidth: float
    cpu_bandwidth: float  # what the CPU's FFN kernels stream from DRAM with all threads
    pcie_bandwidth: float
    pcie_latency: float  # one small transfer, host <-> device
    sync_cost: float  # per-layer event/stream synchronisation between the executors
    cpu_flops: float = 0.0  # the CPU's float32 multiply-add peak, FLOP/s (2 per FMA): what bounds a prompt
    gpu_flops: float = 0.0  # the card's FP16 tensor peak with float32 accumulation, FLOP/s (dense)

    def min_cpu_neurons(self, neuron_bytes: int, d_model: int) -> int:
        """C_l: the fewest CPU neurons worth a CPU/GPU round trip.

        A layer split across both executors pays, per token, t_sync + t_latency + 4D / B_pcie to merge the CPU
        partial sum into the GPU's. Its CPU part takes at most n * neuron_bytes / B_cpu. A CPU part smaller than
        the overhead it causes is not worth having: C_l = ceil(B_cpu * (t_sync + t_latency + 4D / B_pcie) / neuron_bytes).
        """
        if self.vram_bytes == 0:
            return 0
        overhead = self.sync_cost + self.pcie_latency + 4 * d_model / self.pcie_bandwidth
        return math.ceil(self.cpu_bandwidth * overhead / neuron_bytes)


HARDWARE = {
    # RTX 4090 desktop: 24 GiB GDDR6X at 1008 GB/s (NVIDIA spec sheet); PCIe 4.0 x16, ~25 GB/s achieved of 32
    # (nvbandwidth-style pinned copies); DDR5-5600 dual channel, ~60 GB/s achieved of 89.6 (STREAM triad);
    # ~10 us for a small cudaMemcpyAsync, ~20 us for an event wait plus thread wake-up (PowerInfer paper, section 7).
    # FP16 tensor with FP32 accumulate 165.2 TFLOPS (NVIDIA Ada whitepaper); the paper's i9-13900K: 8 P-cores x 2
    # AVX2 FMA units x 8 lanes x 2 FLOP at 5.4 GHz plus 16 E-cores x 1 x 8 x 2 at 4.3 GHz, about 1.5 TFLOPS.
    "rtx4090": Hardware("rtx4090", 24 * GiB, 1008e9, 60e9, 25e9, 10e-6, 20e-6, 1.5e12, 165.2e12),
    # RTX 2080 Ti: 11 GiB GDDR6 at 616 GB/s (NVIDIA spec sheet); PCIe 3.0 x16, ~12 GB/s achieved of 15.8;
    # DDR4-3200 dual channel, ~40 GB/s achieved of 51.2 (the PowerInfer paper's low-end PC).
    # FP16 tensor with FP32 accumulate 53.8 TFLOPS (NVIDIA Turing whitepaper, GeForce); i7-12700K: 8 P-cores x 2 x 8
    # x 2 at 4.9 GHz plus 4 E-cores x 1 x 8 x 2 at 3.8 GHz, about 1.5 TFLOPS.
    "rtx2080ti": Hardware("rtx2080ti", 11 * GiB, 616e9, 40e9, 12e9, 10e-6, 20e-6, 1.5e12, 53.8e12),
    # H200 SXM: 141 GB HBM3e at 4.8 TB/s (NVIDIA spec sheet; ~139 GiB usable); PCIe 5.0 x16 host link,
    # ~50 GB/s achieved of 64; 8-channel DDR5 host, ~250 GB/s achieved.
    # FP16 tensor 989 TFLOPS dense (NVIDIA H200 spec sheet); a 2 x 48-core AVX-512 host, about 6 TFLOPS.
    "h200": Hardware("h200", 139 * GiB, 4.8e12, 250e9, 50e9, 5e-6, 10e-6, 6e12, 989e12),
    # No GPU: everything on the CPU (PowerInfer's CPU-only mode); the bandwidths are this project's 2-core CI machine.
    # Its FLOP/s: what fast.quant.floats.axpy_tile reaches on data in L1 with both cores (about 100 GFMA/s).
    "cpu-only": Hardware("cpu-only", 0, 1.0, 23e9, 1.0, 0.0, 0.0, 200e9, 0.0),
}
HARDWARE_FIELDS = tuple(Hardware.__dataclass_fields__)


def hardware_for(device_name: str, vram_bytes: int) -> Hardware:
    """The profile of a CUDA device: a known card by its name, else rtx4090's links with the device's memory."""
    for key, hw in HARDWARE.items():
        if key.replace("rtx", "") in device_name.lower().replace(" ", ""):
            return hw
    base = HARDWARE["rtx4090"]
    return Hardware(f"device:{device_name}", vram_bytes or base.vram_bytes, base.gpu_bandwidth, base.cpu_bandwidth,
                    base.pcie_bandwidth, base.pcie_latency, base.sync_cost, base.cpu_flops, base.gpu_flops)


def load_hardware(name_or_file: str) -> Hardware:
    """A named profile, or a JSON file with the same fields (name, vram_bytes, gpu_bandwidth, ...)."""
    if name_or_file in HARDWARE:
        return HARDWARE[name_or_file]
    path = Path(name_or_file)
    if not path.suffix == ".json":
        raise UserError(f"--hardware: unknown profile '{name_or_file}' (known: {', '.join(HARDWARE)}; or a .json file)")
    if not path.is_file():
        raise UserError(f"--hardware: {path} not found")
    try:
        raw = json.loads(path.read_text())
        fields = {k: raw[k] for k in HARDWARE_FIELDS}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--hardware: {path} is not valid JSON") from None
    except (KeyError, TypeError) as e:
        raise UserError(f"--hardware: {path} lacks field {e} (needs {', '.join(HARDWARE_FIELDS)})") from None
    extra = set(raw) - set(HARDWARE_FIELDS)
    if extra:
        raise UserError(f"--hardware: {path} has unknown field(s) {sorted(extra)}")
    if any(not isinstance(fields[k], (int, float)) or fields[k] < 0 for k in HARDWARE_FIELDS[1:]):
        raise UserError(f"--hardware: {path}: every field but name must be a number >= 0")
    return Hardware(**fields)


@dataclass
class Budget:
    """How a VRAM budget is spent: dense parts first (PowerInfer's order), then FFN neurons."""

    budget_bytes: int
    headroom_bytes: int
    on_gpu: list = field(default_factory=list)  # [(name, bytes)] placed whole
    on_cpu: list = field(default_factory=list)  # [(name, bytes)] that did not fit
    ffn_budget_bytes: int = 0
    neuron_bytes: int = 0


def dense_parts(cfg: ModelConfig, fmt: Format, ctx: int, predictor_params: list[int]) -> list[tuple[str, int]]:
    """Dense GPU candidates in PowerInfer's order (ref.common.artifacts.dense_names) with their bytes: attention of
    every layer (with that layer's KV cache for `ctx` tokens: attention runs where its cache is), predictors, FFN
    norms, final norm and lm_head. Matrices in the weights' format, vectors and caches in its vector format."""
    vb = FORMATS[fmt.vector].block_bytes
    D, E, H, K = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    attn = 2 * fmt.nbytes((H * E, D)) + 2 * fmt.nbytes((K * E, D)) + D * vb  # wq, wo, wk, wv, attn_norm
    kv = 2 * ctx * K * E * vb
    sizes = [attn + kv] * cfg.n_layers + [n * vb for n in predictor_params]
    sizes += [cfg.n_layers * D * vb, D * vb + fmt.nbytes((cfg.vocab_size, D))]  # FFN norms; final norm and lm_head
    names = [f"attention.{l}" for l in range(cfg.n_layers)] + [f"predictor.{l}" for l in range(len(predictor_params))]
    return list(zip(names + dense_names(0), sizes))  # dense_names(0): the parts that follow the layers' own


def plan_budget(cfg: ModelConfig, fmt: Format, ctx: int, budget_bytes: int,
                predictor_params: list[int] | None = None) -> Budget:
    """Place the dense parts that fit whole, in order, after a scratch headroom; the rest is the FFN neuron budget.

    Headroom: one prefill chunk's float32 activations and logits, 4 * PREFILL_CHUNK * (V + 2F + 8D) bytes.
    """
    if budget_bytes < 0:
        raise UserError(f"--vram-budget must be >= 0, got {budget_bytes / GiB:g} GiB")
    neuron = cfg.ffn_matrices * fmt.row_bytes(cfg.d_model)
    parts = dense_parts(cfg, fmt, ctx, predictor_params or [])
    if budget_bytes == 0:
        return Budget(0, 0, [], parts, 0, neuron)
    headroom = 4 * PREFILL_CHUNK * (cfg.vocab_size + 2 * cfg.d_ffn + 8 * cfg.d_model)
    if budget_bytes < headroom + parts[0][1]:
        raise UserError(f"--vram-budget {budget_bytes / GiB:.3f} GiB is too small: scratch headroom "
                        f"({headroom / 2**20:.1f} MiB) and {parts[0][0]} ({parts[0][1] / 2**20:.1f} MiB) do not fit")
    left = budget_bytes - headroom
    plan = Budget(budget_bytes, headroom, neuron_bytes=neuron)
    for name, size in parts:
        if size <= left:
            plan.on_gpu.append((name, size))
            left -= size
        else:
            plan.on_cpu.append((name, size))
    plan.ffn_budget_bytes = left
    return plan


def whole_layers(cfg: ModelConfig, fmt: Format, ctx: int, budget_bytes: int) -> tuple[list[np.ndarray], list[str]]:
    """llama.cpp's -ngl as a placement (GPU neurons per layer, dense parts on the GPU): as many whole layers
    (attention with its KV cache, FFN norm, every neuron) as fit the budget, the first ones first; the output layer
    too only when every layer and it fit."""
    parts = dict(dense_parts(cfg, fmt, ctx, []))
    neurons = cfg.d_ffn * cfg.ffn_matrices * fmt.row_bytes(cfg.d_model)
    per_layer = parts["attention.0"] + parts["ffn_norms"] // cfg.n_layers + neurons
    n = min(cfg.n_layers, max(budget_bytes, 0) // per_layer)
    if n == cfg.n_layers and n * per_layer + parts["output"] > budget_bytes:
        n -= 1
    neurons = [np.arange(cfg.d_ffn if l < n else 0, dtype=np.int32) for l in range(cfg.n_layers)]
    return neurons, dense_names(n, output=n == cfg.n_layers)
