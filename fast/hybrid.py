"""PowerInfer's hybrid engine (paper section 5): hot neurons on the GPU, cold ones on the CPU, at the same time.

A transform over the CPU `Engine`: `to_hybrid` uploads what the placement gives the GPU (per layer: attention
with its KV cache, predictor, hot neurons compact in `gpu_neurons` order; the output layer) and keeps the host
layout for the rest. Each block runs where its weights are and the residual stream follows, copied only when
it changes sides. Per token and layer the predicted set P splits into P ∩ G, launched on the GPU
(asynchronously), and P \\ G, computed meanwhile by the CPU kernels; the other side's partial sum crosses over
through pinned memory and is added where the residual lives. `policy="layers"` is llama.cpp's baseline in the
same engine: whole layers on the GPU (attention and every neuron) up to the budget, the rest wholly on the CPU.

Dimensions: T tokens, D d_model, F FFN neurons, G GPU neurons of a layer, H/K heads, E head dim, V vocab.
"""

from dataclasses import dataclass

import numpy as np
from numba import cuda

from fast import cpu, gpu
from fast.engine import POLICIES, Engine, PredictorSelect
from ref.errors import UserError
from ref.model import KVCache, step_ids

F32 = np.float32


@dataclass
class GpuLayer:
    """What layer l keeps on the GPU; a part left None runs on the CPU."""

    attention: tuple | None  # device (attn_norm [D], wq [H E, D], wk [K E, D], wv [K E, D], wo [D, H E])
    predictor: tuple | None  # device (fc1 [R, D], fc2 [F, R])
    ffn_norm: object  # device [D]
    w3: object  # device [max(G, 1), 3, D]: the layer's hot neurons in gpu_neurons order
    slot: np.ndarray  # host [F]: neuron id -> row of w3, or -1 when the neuron lives on the CPU
    hot_all: object  # device [G]: every row of w3 (the split of a step where all F neurons are active)
    cold_all: np.ndarray  # host [F - G]: the CPU's neurons (same)

    @property
    def splits_ffn(self) -> bool:
        return len(self.cold_all) < len(self.slot) or self.predictor is not None


@dataclass
class HybridCache(KVCache):
    """Host cache for CPU-attention layers plus device k/v [capacity, K, E] for GPU-attention ones (else None)."""

    kd: list = None
    vd: list = None


class Residual:
    """The residual stream h [T, D], kept where the last block ran and copied only when the other side needs it."""

    def __init__(self, h: np.ndarray):
        self.a, self.on_gpu = h, False

    def gpu(self):
        if not self.on_gpu:
            self.a, self.on_gpu = cuda.to_device(self.a), True
        return self.a

    def cpu(self) -> np.ndarray:
        if self.on_gpu:
            self.a, self.on_gpu = self.a.copy_to_host(), False
        return self.a


class HybridEngine(Engine):
    """The CPU engine plus, per layer, what the placement put on the GPU: attention (with its KV cache),
    predictor and hot neurons; the output layer too when `output` was placed."""

    def __init__(self, base: Engine, gpu_neurons: list[np.ndarray], dense_on_gpu: set[str]):
        self.__dict__.update(base.__dict__)
        c = self.config
        self.gpu_neurons, self.dense_on_gpu = gpu_neurons, set(dense_on_gpu)
        self.sparse = isinstance(self.select, PredictorSelect)
        self.cos_d, self.sin_d = cuda.to_device(self.cos), cuda.to_device(self.sin)
        self.gpu_layers = [self.upload_layer(l) for l in range(c.n_layers)]
        self.out_on_gpu = "output" in self.dense_on_gpu
        if self.out_on_gpu:
            self.norm_d, self.lm_head_d = cuda.to_device(self.norm), cuda.to_device(self.lm_head)
        # The halves' partial sums, staged in pinned memory for the copy to the other side.
        self.y_cpu, self.y_gpu = cuda.pinned_array((1, c.d_model), F32), cuda.pinned_array((1, c.d_model), F32)

    def upload_layer(self, l: int) -> GpuLayer:
        c, L, ids = self.config, self.layers[l], self.gpu_neurons[l]
        H, K, E = c.n_heads, c.n_kv_heads, c.head_dim
        attention = predictor = None
        if f"attention.{l}" in self.dense_on_gpu:
            attention = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in (
                L.attn_norm, L.wqkv[: H * E], L.wqkv[H * E:(H + K) * E], L.wqkv[(H + K) * E:], L.wo))
        if self.sparse and f"predictor.{l}" in self.dense_on_gpu:
            predictor = (cuda.to_device(self.select.fc1[l]), cuda.to_device(self.select.fc2[l]))
        slot = np.full(c.d_ffn, -1, np.int32)
        slot[ids] = np.arange(len(ids), dtype=np.int32)
        w3 = np.ascontiguousarray(L.w3[ids]) if len(ids) else np.zeros((1, 3, c.d_model), F32)
        return GpuLayer(attention, predictor, cuda.to_device(L.ffn_norm), cuda.to_device(w3), slot,
                        cuda.to_device(np.arange(max(len(ids), 1), dtype=np.int32)), np.flatnonzero(slot < 0).astype(np.int32))

    @property
    def n_gpu_layers(self) -> int:
        """Layers whose attention runs on the GPU."""
        return sum(G.attention is not None for G in self.gpu_layers)

    def new_cache(self, capacity: int | None = None) -> HybridCache:
        c = self.config
        cap = capacity or c.max_seq_len
        host = KVCache.empty(c, cap, F32)
        shape = (cap, c.n_kv_heads, c.head_dim)
        kd = [cuda.to_device(np.zeros(shape, F32)) if G.attention else None for G in self.gpu_layers]
        vd = [cuda.to_device(np.zeros(shape, F32)) if G.attention else None for G in self.gpu_layers]
        return HybridCache(host.k, host.v, 0, kd, vd)

    def gpu_attention_block(self, l: int, h_d, cache: HybridCache):
        """ref's attention block on the GPU; h_d [T, D] on the device, updated in place."""
        c = self.config
        attn_norm, wq, wk, wv, wo = self.gpu_layers[l].attention
        T, s0, H, K, E = h_d.shape[0], cache.length, c.n_heads, c.n_kv_heads, c.head_dim
        x = gpu.scratch("attn_x", (T, c.d_model))
        gpu.rmsnorm(x, h_d, attn_norm, c.rms_norm_eps)
        q, k, v = (gpu.scratch(name, (T, n * E)) for name, n in (("q", H), ("k", K), ("v", K)))
        gpu.matmul(q, x, wq)
        gpu.matmul(k, x, wk)
        gpu.matmul(v, x, wv)
        q3 = q.reshape(T, H, E)
        gpu.rope(q3, q3, self.cos_d, self.sin_d, s0)
        gpu.rope(cache.kd[l][s0:s0 + T], k.reshape(T, K, E), self.cos_d, self.sin_d, s0)
        cache.vd[l][s0:s0 + T].copy_to_device(v.reshape(T, K, E))
        att = gpu.scratch("att", (T, H, E))
        gpu.attention(att, q3, cache.kd[l][:s0 + T], cache.vd[l][:s0 + T], s0, gpu.scratch("scores", (T * H, s0 + T)))
        o = gpu.scratch("attn_out", (T, c.d_model))
        gpu.matmul(o, att.reshape(T, H * E), wo)
        gpu.add(h_d, o)

    def active_set(self, l: int, h: Residual, t: int) -> np.ndarray:
        """Predicted (or, dense, all) neuron ids of token t, on the host for the split. The predictor runs where its
        weights are; a benchmark's synthetic selector (`draw`) then replaces its answer, as on the CPU."""
        if not self.sparse:
            return self.select.all
        G = self.gpu_layers[l]
        if G.predictor is None:
            active, n = self.select(l, h.a[t])
            return active[:n]
        fc1, fc2 = G.predictor
        F = self.config.d_ffn
        logits, hidden = gpu.scratch("pred_logits", F), gpu.scratch("pred_hidden", fc1.shape[0])
        active = gpu.scratch("active", F, np.int32)
        gpu.predictor(logits, hidden, h.a[t], fc1, fc2)
        n = gpu.predicted_set(active, logits, self.select.threshold)
        if hasattr(self.select, "draw"):
            return self.select.draw(l)
        return active[:n].copy_to_host() if n else np.empty(0, np.int32)

    def split_ffn_block(self, l: int, h: Residual) -> None:
        """h += y_gpu(P ∩ G) + y_cpu(P \\ G): the GPU half is launched, the CPU half computed meanwhile, and the
        other side's partial crosses over to where the residual lives."""
        c, G, L = self.config, self.gpu_layers[l], self.layers[l]
        if G.predictor is not None:
            h.gpu()
        elif self.sparse:
            h.cpu()
        T, D = h.a.shape
        if h.on_gpu:
            x_d = gpu.scratch("ffn_x", (T, D))
            gpu.rmsnorm(x_d, h.a, G.ffn_norm, c.rms_norm_eps)
            x = x_d.copy_to_host()  # [T, D]
        else:
            x = np.empty_like(h.a)
            cpu.rmsnorm(x, h.a, L.ffn_norm, c.rms_norm_eps)
            x_d = gpu.scratch("ffn_x", (T, D))
            x_d.copy_to_device(x)
        y_d, y_cpu_d = gpu.scratch("y_gpu", (1, D)), gpu.scratch("y_cpu", (1, D))
        for t in range(T):
            active = self.active_set(l, h, t)
            if len(active) == c.d_ffn:
                hot_d, n_hot, cold = G.hot_all, len(G.slot) - len(G.cold_all), G.cold_all
            else:
                slots = G.slot[active]
                hot, cold = slots[slots >= 0], np.ascontiguousarray(active[slots < 0])
                hot_d, n_hot = gpu.scratch("hot", max(len(hot), 1), np.int32), len(hot)
                if n_hot:
                    hot_d.copy_to_device(hot)
            if n_hot:  # launched, not waited for
                gpu.sparse_ffn(y_d[0], None, x_d[t], G.w3, hot_d, n_hot, self.kind, self.thr)
            if len(cold):
                cpu.sparse_ffn(self.y_cpu[0], self.acc, x[t], L.w3, cold, len(cold), self.kind, self.thr)
            if h.on_gpu:
                if n_hot:
                    gpu.add(h.a[t:t + 1], y_d)
                if len(cold):
                    y_cpu_d.copy_to_device(self.y_cpu)
                    gpu.add(h.a[t:t + 1], y_cpu_d)
            else:
                if n_hot:
                    y_d.copy_to_host(self.y_gpu)
                    h.a[t] += self.y_gpu[0]
                if len(cold):
                    h.a[t] += self.y_cpu[0]

    def forward(self, ids, cache: HybridCache) -> np.ndarray:
        """Logits [T, V]; each block runs where the placement put it, the residual following."""
        c = self.config
        ids = step_ids(ids, cache, c)
        h = Residual(self.embed[ids])  # [T, D]
        for l, G in enumerate(self.gpu_layers):
            if G.attention is not None:
                self.gpu_attention_block(l, h.gpu(), cache)
            else:
                x = h.cpu()
                x += self.attention_block(l, x, cache)
            if G.splits_ffn:
                self.split_ffn_block(l, h)
            else:
                x = h.cpu()
                x += self.ffn_block(l, x)
        cache.length += len(ids)
        if not self.out_on_gpu:
            return self.output(h.cpu())
        x_d = gpu.scratch("out_x", (len(ids), c.d_model))
        gpu.rmsnorm(x_d, h.gpu(), self.norm_d, c.rms_norm_eps)
        logits = gpu.scratch("logits", (len(ids), c.vocab_size))
        gpu.matmul(logits, x_d, self.lm_head_d)
        return logits.copy_to_host()


def require_gpu(device: str) -> None:
    if not cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU found (numba.cuda.is_available() is False)")


def layer_policy_count(engine: Engine, budget_bytes: int) -> int:
    """llama.cpp's -ngl: how many whole layers (attention with its KV cache and all FFN weights, float32) fit the
    budget, the output layer's weights reserved first only when every layer fits."""
    from placement.budget import dense_parts
    c, L0 = engine.config, engine.layers[0]
    attention = dense_parts(c, "float32", c.max_seq_len, [])[0][1]  # attention.0: weights, norm and KV cache
    per_layer = attention + L0.ffn_norm.nbytes + L0.w3.nbytes
    n = min(c.n_layers, budget_bytes // per_layer)
    if n == c.n_layers and n * per_layer + engine.lm_head.nbytes + engine.norm.nbytes > budget_bytes:
        n -= 1
    return int(max(n, 0))


def dense_names(n_layers: int, output: bool = True) -> list[str]:
    """Names of the dense parts a placement may put on the GPU (placement.budget.dense_parts): those of the first
    `n_layers` layers, and with `output` the FFN norms and the output layer."""
    return ([f"{part}.{l}" for part in ("attention", "predictor") for l in range(n_layers)]
            + (["ffn_norms", "output"] if output else []))


def to_hybrid(engine: Engine, gpu_neurons: list[np.ndarray] | None = None, policy: str = "hybrid",
              budget_bytes: int | None = None, dense_on_gpu=None) -> HybridEngine:
    """Apply a placement: `hybrid` takes per-layer GPU neuron ids and the dense parts on the GPU (default: all);
    `layers` takes a budget and offloads whole layers, the first ones first."""
    require_gpu("hybrid")
    c = engine.config
    if policy == "layers":
        n = layer_policy_count(engine, budget_bytes or 0)
        neurons = [np.arange(c.d_ffn if l < n else 0, dtype=np.int32) for l in range(c.n_layers)]
        return HybridEngine(engine, neurons, set(dense_names(n, output=n == c.n_layers)))
    if policy != "hybrid":
        raise UserError(f"--policy must be one of {', '.join(POLICIES)}, got '{policy}'")
    if gpu_neurons is None or len(gpu_neurons) != c.n_layers:
        raise UserError(f"placement: need GPU neuron ids for each of the {c.n_layers} layers")
    for l, ids in enumerate(gpu_neurons):
        if len(ids) and (ids.min() < 0 or ids.max() >= c.d_ffn):
            raise UserError(f"placement: layer {l} has neuron ids outside [0, {c.d_ffn}): a placement for another model?")
    known = dense_names(c.n_layers)
    dense = known if dense_on_gpu is None else list(dense_on_gpu)
    unknown = sorted(set(dense) - set(known))
    if unknown:
        raise UserError(f"placement: unknown dense part '{unknown[0]}' for a {c.n_layers}-layer model: "
                        "a placement for another model, or from an older version (solve it again)")
    return HybridEngine(engine, [np.asarray(g, np.int32) for g in gpu_neurons], set(dense))


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
    return to_hybrid(engine, neurons, dense_on_gpu=meta.get("dense_on_gpu", []))
