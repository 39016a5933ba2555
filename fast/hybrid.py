"""PowerInfer's hybrid engine (paper section 5): hot neurons on the GPU, cold ones on the CPU, at the same time.

A transform over the CPU `Engine`: `to_hybrid` uploads what the placement gives the GPU (attention, norms,
predictors, lm_head and each layer's hot neurons, compact in `gpu_neurons` order) and keeps the host layout
for the rest. Per token and layer the predicted set P splits into P ∩ G, launched on the GPU (asynchronously),
and P \\ G, computed meanwhile by the CPU kernels; the CPU partial sum crosses over through pinned memory and
is added on the GPU. `policy="layers"` is llama.cpp's baseline in the same engine: whole layers on the GPU
(attention and every neuron) up to the budget, the rest wholly on the CPU.

Dimensions: T tokens, D d_model, F FFN neurons, G GPU neurons of a layer, H/K heads, E head dim, V vocab.
"""

from dataclasses import dataclass

import numpy as np
from numba import cuda

from fast import cpu, gpu
from fast.engine import Engine, PredictorSelect
from ref.errors import UserError
from ref.model import KVCache, step_ids

F32 = np.float32
POLICIES = ("hybrid", "layers")


@dataclass
class GpuLayer:
    attn_norm: object  # device [D]
    wq: object  # device [H E, D]
    wk: object  # device [K E, D]
    wv: object  # device [K E, D]
    wo: object  # device [D, H E]
    ffn_norm: object  # device [D]
    w3: object  # device [G, 3, D]: the layer's hot neurons, in gpu_neurons order
    slot: np.ndarray  # host [F]: neuron id -> row of w3, or -1 when the neuron lives on the CPU
    fc1: object = None  # device predictor weights when the engine is sparse
    fc2: object = None


@dataclass
class HybridCache(KVCache):
    """Host cache for CPU layers plus device k/v [capacity, K, E] for each GPU layer."""

    kd: list = None
    vd: list = None


class HybridEngine(Engine):
    """The CPU engine plus a GPU copy of the first `n_gpu_layers` layers' dense parts and hot neurons."""

    def __init__(self, base: Engine, gpu_neurons: list[np.ndarray], n_gpu_layers: int):
        self.__dict__.update(base.__dict__)
        c = self.config
        self.n_gpu_layers, self.gpu_neurons = n_gpu_layers, gpu_neurons
        self.cos_d, self.sin_d = cuda.to_device(self.cos), cuda.to_device(self.sin)
        H, K, E = c.n_heads, c.n_kv_heads, c.head_dim
        self.gpu_layers = []
        sparse = isinstance(self.select, PredictorSelect)
        for l in range(n_gpu_layers):
            L, ids = self.layers[l], gpu_neurons[l]
            slot = np.full(c.d_ffn, -1, np.int32)
            slot[ids] = np.arange(len(ids), dtype=np.int32)
            w3 = np.ascontiguousarray(L.w3[ids]) if len(ids) else np.zeros((1, 3, c.d_model), F32)
            self.gpu_layers.append(GpuLayer(
                cuda.to_device(L.attn_norm), cuda.to_device(np.ascontiguousarray(L.wqkv[: H * E])),
                cuda.to_device(np.ascontiguousarray(L.wqkv[H * E:(H + K) * E])),
                cuda.to_device(np.ascontiguousarray(L.wqkv[(H + K) * E:])), cuda.to_device(L.wo),
                cuda.to_device(L.ffn_norm), cuda.to_device(w3), slot,
                cuda.to_device(self.select.fc1[l]) if sparse else None,
                cuda.to_device(self.select.fc2[l]) if sparse else None))
        self.out_on_gpu = n_gpu_layers == c.n_layers
        if self.out_on_gpu:
            self.norm_d, self.lm_head_d = cuda.to_device(self.norm), cuda.to_device(self.lm_head)
        self.y_cpu = cuda.pinned_array((1, c.d_model), F32)  # the CPU partial sum, staged for the copy to the GPU

    def new_cache(self, capacity: int | None = None) -> HybridCache:
        c = self.config
        cap = capacity or c.max_seq_len
        host = KVCache.empty(c, cap, F32)
        kd = [cuda.to_device(np.zeros((cap, c.n_kv_heads, c.head_dim), F32)) for _ in range(self.n_gpu_layers)]
        vd = [cuda.to_device(np.zeros((cap, c.n_kv_heads, c.head_dim), F32)) for _ in range(self.n_gpu_layers)]
        return HybridCache(host.k, host.v, 0, kd, vd)

    def gpu_attention_block(self, l: int, h_d, cache: HybridCache):
        """ref's attention block on the GPU; h_d [T, D] on the device, updated in place."""
        c, G = self.config, self.gpu_layers[l]
        T, s0, H, K, E = h_d.shape[0], cache.length, c.n_heads, c.n_kv_heads, c.head_dim
        x = cuda.device_array((T, c.d_model), F32)
        gpu.rmsnorm(x, h_d, G.attn_norm, c.rms_norm_eps)
        q, k, v = (cuda.device_array((T, n * E), F32) for n in (H, K, K))
        gpu.matmul(q, x, G.wq)
        gpu.matmul(k, x, G.wk)
        gpu.matmul(v, x, G.wv)
        q3 = q.reshape(T, H, E)
        gpu.rope(q3, q3, self.cos_d, self.sin_d, s0)
        gpu.rope(cache.kd[l][s0:s0 + T], k.reshape(T, K, E), self.cos_d, self.sin_d, s0)
        cache.vd[l][s0:s0 + T].copy_to_device(v.reshape(T, K, E))
        att = cuda.device_array((T, H, E), F32)
        gpu.attention(att, q3, cache.kd[l][:s0 + T], cache.vd[l][:s0 + T], s0, cuda.device_array((T * H, s0 + T), F32))
        o = cuda.device_array((T, c.d_model), F32)
        gpu.matmul(o, att.reshape(T, H * E), G.wo)
        gpu.add(h_d, o)

    def active_set(self, l: int, h_d_row) -> np.ndarray:
        """Predicted (or, dense, all) neuron ids of one token, on the host for the split. The predictor runs on
        the GPU; a benchmark's synthetic selector (`draw`) then replaces its answer, as on the CPU."""
        G = self.gpu_layers[l]
        if G.fc1 is None:
            return self.select.all
        F = self.config.d_ffn
        logits, hidden = gpu.scratch("pred_logits", F), gpu.scratch("pred_hidden", G.fc1.shape[0])
        active = gpu.scratch("active", F, np.int32)
        gpu.predictor(logits, hidden, h_d_row, G.fc1, G.fc2)
        n = gpu.predicted_set(active, logits, self.select.threshold)
        if hasattr(self.select, "draw"):
            return self.select.draw(l)
        return active[:n].copy_to_host() if n else np.empty(0, np.int32)

    def gpu_ffn_block(self, l: int, h_d) -> None:
        """Split FFN: y = y_gpu(P ∩ G) + y_cpu(P \\ G), the two halves computed at the same time; h_d += y."""
        c, G, L = self.config, self.gpu_layers[l], self.layers[l]
        T = h_d.shape[0]
        x_d = cuda.device_array((T, c.d_model), F32)
        gpu.rmsnorm(x_d, h_d, G.ffn_norm, c.rms_norm_eps)
        x = x_d.copy_to_host()  # [T, D]: the CPU half's input
        y_d, y_cpu_d = gpu.scratch("y_gpu", c.d_model).reshape(1, -1), gpu.scratch("y_cpu", c.d_model).reshape(1, -1)
        for t in range(T):
            active = self.active_set(l, h_d[t])
            slots = G.slot[active]
            hot, cold = np.ascontiguousarray(slots[slots >= 0]), np.ascontiguousarray(active[slots < 0])
            hot_d = gpu.scratch("hot", max(len(hot), 1), np.int32)
            if len(hot):
                hot_d.copy_to_device(hot)
            gpu.sparse_ffn(y_d[0], None, x_d[t], G.w3, hot_d, len(hot), self.kind, self.thr)  # launched, not waited for
            cpu.sparse_ffn(self.y_cpu[0], self.acc, x[t], L.w3, cold, len(cold), self.kind, self.thr)
            y_cpu_d.copy_to_device(self.y_cpu)
            gpu.add(h_d[t:t + 1], y_d)
            gpu.add(h_d[t:t + 1], y_cpu_d)

    def forward(self, ids, cache: HybridCache) -> np.ndarray:
        """Logits [T, V]; GPU layers first, then (layer policy) the CPU layers, the residual crossing once."""
        c = self.config
        ids = step_ids(ids, cache, c)
        T = len(ids)
        h_d = cuda.to_device(self.embed[ids])
        for l in range(self.n_gpu_layers):
            self.gpu_attention_block(l, h_d, cache)
            self.gpu_ffn_block(l, h_d)
        if self.out_on_gpu:
            cache.length += T
            x_d = cuda.device_array((T, c.d_model), F32)
            gpu.rmsnorm(x_d, h_d, self.norm_d, c.rms_norm_eps)
            logits = cuda.device_array((T, c.vocab_size), F32)
            gpu.matmul(logits, x_d, self.lm_head_d)
            return logits.copy_to_host()
        h = h_d.copy_to_host()
        for l in range(self.n_gpu_layers, c.n_layers):
            h += self.attention_block(l, h, cache)
            h += self.ffn_block(l, h)
        cache.length += T
        return self.output(h)


def require_gpu(device: str) -> None:
    if not cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU found (numba.cuda.is_available() is False)")


def layer_policy_count(engine: Engine, budget_bytes: int) -> int:
    """llama.cpp's -ngl: how many whole layers (attention and all FFN weights, float32) fit the budget, the output
    layer's weights reserved first only when every layer fits."""
    L0 = engine.layers[0]
    per_layer = (L0.attn_norm.nbytes + L0.wqkv.nbytes + L0.wo.nbytes + L0.ffn_norm.nbytes + L0.w3.nbytes)
    n = min(engine.config.n_layers, budget_bytes // per_layer)
    if n == engine.config.n_layers and n * per_layer + engine.lm_head.nbytes + engine.norm.nbytes > budget_bytes:
        n -= 1
    return int(max(n, 0))


def to_hybrid(engine: Engine, gpu_neurons: list[np.ndarray] | None = None, policy: str = "hybrid",
              budget_bytes: int | None = None) -> HybridEngine:
    """Apply a placement: `hybrid` takes per-layer GPU neuron ids (all layers' dense parts on the GPU); `layers`
    takes a budget and offloads whole layers."""
    require_gpu("hybrid")
    c = engine.config
    if policy == "layers":
        n = layer_policy_count(engine, budget_bytes or 0)
        return HybridEngine(engine, [np.arange(c.d_ffn, dtype=np.int32)] * n, n)
    if policy != "hybrid":
        raise UserError(f"--policy must be one of {', '.join(POLICIES)}, got '{policy}'")
    if gpu_neurons is None or len(gpu_neurons) != c.n_layers:
        raise UserError(f"placement: need GPU neuron ids for each of the {c.n_layers} layers")
    for l, ids in enumerate(gpu_neurons):
        if len(ids) and (ids.min() < 0 or ids.max() >= c.d_ffn):
            raise UserError(f"placement: layer {l} has neuron ids outside [0, {c.d_ffn}): a placement for another model?")
    return HybridEngine(engine, [np.asarray(g, np.int32) for g in gpu_neurons], c.n_layers)


def device_hardware():
    """The placement profile of the current device: a known card by name, else rtx4090's links with its memory."""
    from placement.budget import HARDWARE, Hardware
    _, total = cuda.current_context().get_memory_info()
    name = getattr(cuda.get_current_device(), "name", b"simulator")  # the simulator's device has no name
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, hw in HARDWARE.items():
        if key.replace("rtx", "") in name.lower().replace(" ", ""):
            return hw
    base = HARDWARE["rtx4090"]
    vram = int(total) if np.isfinite(total) else base.vram_bytes
    return Hardware(f"device:{name}", vram, base.gpu_bandwidth, base.cpu_bandwidth, base.pcie_bandwidth,
                    base.pcie_latency, base.sync_cost)


def place_engine(engine: Engine, model_dir, device: str, placement=None, vram_budget: float | None = None,
                 policy: str = "hybrid") -> HybridEngine:
    """Engine.load's GPU half: budget the card, then solve (or reuse a matching) placement and upload it."""
    from pathlib import Path

    from placement.budget import GiB
    from placement.place import load_or_place, request
    from placement.solver import load_placement

    require_gpu(device)
    c, model_dir = engine.config, Path(model_dir)
    hw = device_hardware()
    if vram_budget is not None and vram_budget * GiB > hw.vram_bytes:
        raise UserError(f"--vram-budget {vram_budget:g} GiB is larger than the GPU's {hw.vram_bytes / GiB:.1f} GiB")
    budget = int(vram_budget * GiB) if vram_budget is not None else int(0.9 * hw.vram_bytes)
    if device == "gpu" or policy == "layers":
        hybrid = to_hybrid(engine, policy="layers", budget_bytes=budget)
        if device == "gpu" and hybrid.n_gpu_layers < c.n_layers:
            raise UserError(f"--device gpu: the model does not fit --vram-budget {budget / GiB:.2f} GiB "
                            f"({hybrid.n_gpu_layers} of {c.n_layers} layers do); use --device hybrid")
        return hybrid
    if placement is not None:
        neurons, meta = load_placement(placement, c.n_layers, c.d_ffn)
    else:
        acts = model_dir / "activations.safetensors"
        req = request(c, acts, budget / GiB, hw, "float32", c.max_seq_len, 64, "auto")
        cache = model_dir / f"placement.{hw.name.replace(':', '_').replace(' ', '_')}.{budget}.safetensors"
        pred = model_dir / "predictors.safetensors"
        neurons, meta, _ = load_or_place(c, cache, acts, req, hw, pred if pred.is_file() else None)
    missing = [f"attention.{l}" for l in range(c.n_layers) if f"attention.{l}" not in meta.get("dense_on_gpu", [])]
    if missing:
        raise UserError(f"--vram-budget {budget / GiB:.3f} GiB: the hybrid engine needs every layer's attention on the "
                        f"GPU and {missing[0]} does not fit; raise the budget or use --device cpu")
    return to_hybrid(engine, neurons)
