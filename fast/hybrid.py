"""PowerInfer's hybrid engine (the paper's section 5): hot neurons on the GPU, cold ones on the CPU, at the same time.

`to_hybrid(engine, gpu_neurons, dense_on_gpu)` applies a placement it is given (`placement` decides; this module
never does) to a loaded CPU engine, which the hybrid engine holds and runs its CPU blocks with. It uploads, in the
engine's weight format (gpu.Weight), what the placement gives the GPU: per layer attention (with its KV cache),
predictor and hot neurons (compact, in `gpu_neurons` order); the output layer. Which side runs each block is fixed
then, as data: each block runs where its weights are and the residual stream follows, copied only when it changes
sides. Per token, a layer whose neurons are split computes P ∩ G on the GPU (launched, not waited for) while the CPU
kernels compute P \\ G; the other side's partial sum crosses over through pinned memory and is added where the
residual lives (ref.sparse's `hybrid_ffn`).

Dimensions: T tokens, D d_model, F FFN neurons, G GPU neurons of a layer, H/K heads, E head dim, V vocab.
"""

from dataclasses import dataclass

import numpy as np
from numba import cuda

from fast import cpu, gpu
from fast.engine import Decoder, Engine, bundled
from fast.layers import Bundles, CatsBundles, Thin, ThinnedFFN
from ref.model import ATTN_NORM, FFN_NORM
from ref.common.artifacts import dense_names
from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.errors import UserError

F32 = np.float32


@dataclass
class GpuAttention:
    """A layer's attention on the GPU, device arrays as gpu.attention_block takes them (fast.layers' Fused, or
    Thinned: wqkv and wo the stored transposes)."""

    norm_w: object  # [D] or [0]: the norm before attention (fast.engine.Engine.norm_weights)
    norm_b: object
    wqkv: object  # gpu.Weight [(H + 2K) E, D]
    bqkv: object
    qk_norms: object
    wo: object  # gpu.Weight [D, H E]
    bo: object
    thin: tuple | None  # activation sparsity's attn_in and attn_out score weights and thresholds (w0, t0, w1, t1)


@dataclass
class GpuBundles:
    """A layer's hot neurons on the GPU (fast.layers' Bundles and CatsBundles), split from the CPU's per token."""

    bundle: object  # device gpu.Weight, rows [P max(G, 1), D]: the layer's hot neurons in gpu_neurons order
    bu: object  # device [G] the hot neurons' up-row bias (non-gated), or [0]
    bd: object  # device [D] the down matrix's bias, or [0]
    slot: np.ndarray  # host [F]: neuron id -> row of bundle, or -1 when the neuron lives on the CPU
    hot_all: object  # device [G]: every row of bundle (the split of a step where all F neurons are active)
    cold_all: np.ndarray  # host [F - G]: the CPU's neurons (same)
    kind: tuple  # (kind, threshold) of the bundles' activation (the variant's kind: CATS's, where chosen)


@dataclass
class GpuThinnedFFN:
    """A thinned FFN (fast.layers.ThinnedFFN) on the GPU, whole: its input is read by every neuron."""

    gate_up_t: object  # device gpu.Weight [D, 2F]
    down_t: object  # device gpu.Weight [F, D]
    bu: object
    bd: object
    kind: tuple
    thin: tuple  # ffn_in's and ffn_hidden's score weights and thresholds (w2, t2, w3, t3)


@dataclass
class GpuLayer:
    """What layer l keeps on the GPU; a part left None runs on the CPU."""

    attention: GpuAttention | None
    predictor: tuple | None  # device (fc1 [R, D], fc2 [F, R]) as gpu.Weight
    ffn_norm: tuple  # device (w, b): the norm before the FFN (fast.engine.Engine.norm_weights)
    ffn: GpuBundles | GpuThinnedFFN | None
    run_ffn: object = None  # the HybridEngine method that runs the FFN block where its parts are


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

    def add(self, o) -> None:
        """h += o, o a block's output [T, D] on either side (moved to the residual's side if it is not there)."""
        on_host = isinstance(o, np.ndarray)
        if self.on_gpu:
            gpu.add(self.a, cuda.to_device(o) if on_host else o)
        else:
            self.a += o if on_host else o.copy_to_host()


class HybridEngine(Decoder):
    """A CPU engine (`host`) plus, per layer, what the placement put on the GPU: attention (with its KV cache),
    predictor and hot neurons; the output layer too when `output` was placed."""

    def __init__(self, host: Engine, gpu_neurons: list[np.ndarray], dense_on_gpu: set[str]):
        c = self.config = host.config
        self.host, self.selector, self.threads, self.format = host, host.selector, host.threads, host.format
        self.gpu_neurons, self.dense_on_gpu = gpu_neurons, set(dense_on_gpu)
        self.cos_d, self.sin_d = cuda.to_device(host.cos), cuda.to_device(host.sin)
        self.gpu_layers = [self.upload_layer(l) for l in range(c.n_layers)]
        self.block = HYBRID_BLOCKS[c.block].__get__(self)
        # Where each block runs, chosen once: the forward pass has no branches on the placement.
        self.attention = [self.cpu_attention if G.attention is None else self.gpu_attention for G in self.gpu_layers]
        self.ffn = [G.run_ffn for G in self.gpu_layers]
        self.output = self.cpu_output
        if "output" in self.dense_on_gpu:
            self.norm_d = cuda.to_device(host.norm), cuda.to_device(host.norm_b)
            self.lm_head_d = gpu.weight(host.lm_head).to_device()
            self.project_out_d = None if host.project_out is None else gpu.weight(host.project_out).to_device()
            self.output = self.gpu_output
        # The halves' partial sums, staged in pinned memory for the copy to the other side.
        self.y_cpu, self.y_gpu = cuda.pinned_array((1, c.d_model), F32), cuda.pinned_array((1, c.d_model), F32)

    def upload_layer(self, l: int) -> GpuLayer:
        L, sel = self.host.layers[l], self.selector
        attention = predictor = None
        if f"attention.{l}" in self.dense_on_gpu:
            A = L.attn
            norm_w, norm_b = map(cuda.to_device, self.host.norm_weights(L, ATTN_NORM))
            attention = GpuAttention(norm_w=norm_w, norm_b=norm_b, wqkv=gpu.weight(A.wqkv).to_device(),
                                     bqkv=cuda.to_device(A.bqkv), qk_norms=cuda.to_device(A.qk_norms),
                                     wo=gpu.weight(A.wo).to_device(), bo=cuda.to_device(A.bo),
                                     thin=None if A.thin is None else sites(A.thin, 0, 1))
        if sel.predicts and f"predictor.{l}" in self.dense_on_gpu:
            predictor = (gpu.weight(sel.fc1[l]).to_device(), gpu.weight(sel.fc2[l]).to_device())
        G = GpuLayer(attention=attention, predictor=predictor, ffn=None,
                     ffn_norm=tuple(cuda.to_device(a) for a in self.host.norm_weights(L, FFN_NORM)))
        GPU_FFN[type(L.ffn)](self, l, L.ffn, G)
        return G

    def bundles_on_gpu(self, l: int, ffn, G: GpuLayer) -> None:
        """Bundles (and CatsBundles): the placement's neurons of layer l on the GPU, the rest on the CPU; the block
        runs all on one side where the other has none of its neurons (nor its predictor), else split per token."""
        ids, F = self.gpu_neurons[l], self.config.d_ffn
        slot = np.full(F, -1, np.int32)
        slot[ids] = np.arange(len(ids), dtype=np.int32)
        bundle = ffn.bundle[ids] if len(ids) else np.zeros((1, *ffn.bundle.shape[1:]), ffn.bundle.dtype)
        G.ffn = GpuBundles(bundle=gpu.weight(bundle).to_device(),
                           bu=cuda.to_device(ffn.bu[ids] if ffn.bu.size else ffn.bu), bd=cuda.to_device(ffn.bd),
                           slot=slot, hot_all=cuda.to_device(np.arange(max(len(ids), 1), dtype=np.int32)),
                           cold_all=np.flatnonzero(slot < 0).astype(np.int32), kind=ffn.kind(self.host))
        if len(ids) == 0 and G.predictor is None:
            G.run_ffn = self.cpu_ffn
        elif len(ids) == F and (G.predictor is not None or not self.selector.predicts):
            G.run_ffn = self.gpu_ffn
        else:
            G.run_ffn = self.hybrid_ffn_block

    def thinned_on_gpu(self, l: int, ffn, G: GpuLayer) -> None:
        """ThinnedFFN: every neuron of layer l on the GPU, or none (its input is read by every neuron)."""
        ids, F = self.gpu_neurons[l], self.config.d_ffn
        if len(ids) == 0:
            G.run_ffn = self.cpu_ffn
            return
        if len(ids) < F:
            raise UserError(f"placement: layer {l} splits an FFN that activation sparsity (teal, wina) thins "
                            "as a whole; place whole layers (--policy layers)")
        self.gpu_neurons[l] = np.arange(F, dtype=np.int32)
        G.ffn = GpuThinnedFFN(gate_up_t=gpu.weight(ffn.gate_up_t).to_device(),
                              down_t=gpu.weight(ffn.down_t).to_device(), bu=cuda.to_device(ffn.bu),
                              bd=cuda.to_device(ffn.bd), kind=ffn.kind(self.host), thin=sites(ffn.thin, 2, 3))
        G.run_ffn = self.gpu_thinned_ffn

    def gpu_thinned_ffn(self, l: int, h: Residual) -> None:
        """A thinned FFN (fast.layers.ThinnedFFN) all on the GPU."""
        f, h_d = self.gpu_layers[l].ffn, h.gpu()
        y_d = gpu.scratch("y_thinned", h_d.shape)
        gpu.thinned_ffn_block(y_d, h_d, *self.gpu_layers[l].ffn_norm, f.gate_up_t, f.down_t, f.bu, f.bd, *f.kind,
                              f.thin, self.host.eps)
        gpu.add(h_d, y_d)

    @property
    def n_gpu_layers(self) -> int:
        """Layers whose attention runs on the GPU."""
        return sum(G.attention is not None for G in self.gpu_layers)

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        """Each layer's keys and values where its attention runs: no host cache for a layer attending on the GPU."""
        def alloc(shape, dtype, l):
            zeros = np.zeros(shape, dtype)
            return zeros if self.gpu_layers[l].attention is None else cuda.to_device(gpu.kv_plain(zeros))

        def copy(dst, src):  # a slot growing, or a cached prefix stored or restored: host or device, either way
            if not isinstance(dst, np.ndarray):
                dst.copy_to_device(gpu.kv_plain(src))
            elif isinstance(src, np.ndarray):
                dst[...] = src
            else:
                src.copy_to_host(gpu.kv_plain(dst))
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, F32, slots, alloc, copy, self.kv_types)

    def shift(self, cache: KVCache, seq: int, keep: int, discard: int) -> None:
        """Decoder.shift, the slots of layers attending on the GPU through host copies (a shift is rare)."""
        device = [l for l in range(self.config.n_layers) if self.gpu_layers[l].attention is not None]
        held = {l: (cache.k[l][seq], cache.v[l][seq]) for l in device}
        for l in device:
            cache.k[l][seq], cache.v[l][seq] = (gpu.kv_host(a, fmt) for a, fmt in zip(held[l], cache.formats))
        try:
            super().shift(cache, seq, keep, discard)
        finally:
            for l in device:
                held[l][0].copy_to_device(gpu.kv_plain(cache.k[l][seq]))
                held[l][1].copy_to_device(gpu.kv_plain(cache.v[l][seq]))
                cache.k[l][seq], cache.v[l][seq] = held[l]

    def cpu_attention(self, l: int, h: Residual, batch: Batch, cache: KVCache) -> np.ndarray:
        return self.host.attention_block(l, h.cpu(), batch, cache)

    def gpu_attention(self, l: int, h: Residual, batch: Batch, cache: KVCache):
        """ref's attention block on the GPU, a sequence's run at a time; its output [T, D] stays there."""
        A, h_d = self.gpu_layers[l].attention, h.gpu()
        o = gpu.scratch("attn_out", h_d.shape)
        for seq, a, b in batch.runs():
            gpu.attention_block(o[a:b], h_d[a:b], A.norm_w, A.norm_b, A.wqkv, A.bqkv, A.qk_norms, A.wo, A.bo,
                                cache.k[l][seq], cache.v[l][seq], self.cos_d, self.sin_d, batch.positions[a],
                                self.host.eps, A.thin)
        return o

    def cpu_ffn(self, l: int, h: Residual) -> None:
        x = h.cpu()
        x += self.host.ffn_block(l, x)

    def gpu_ffn(self, l: int, h: Residual) -> None:
        """Every neuron of the layer on the GPU: the whole block there (gpu.ffn_block), nothing copied to the host
        but the predictor's logits."""
        G, host, h_d = self.gpu_layers[l], self.host, h.gpu()
        f, y_d = G.ffn, gpu.scratch("y_gpu", (1, self.config.d_model))
        for t in range(h_d.shape[0]):
            hot_d, n_hot, _ = self.split(f, self.active_set(l, h, t))
            gpu.ffn_block(y_d[0], None, h_d[t], *G.ffn_norm, f.bundle, f.bu, f.bd, hot_d, n_hot, *f.kind, host.eps)
            gpu.add(h_d[t:t + 1], y_d)

    def active_set(self, l: int, h: Residual, t: int) -> np.ndarray:
        """Host ids of the neurons token t computes: the selector's pick from the predictor, run where it lives."""
        G, sel = self.gpu_layers[l], self.selector
        if G.predictor is None:
            return self.host.active_set(l, h.a[t])
        fc1, fc2 = G.predictor
        logits, hidden = gpu.scratch("pred_logits", (1, self.config.d_ffn)), gpu.scratch("pred_hidden", (1, fc1.rows))
        gpu.predictor(logits, hidden, h.a[t:t + 1], fc1, fc2)
        return sel.pick(l, logits[0].copy_to_host(sel.logits))

    def split(self, f: GpuBundles, active: np.ndarray) -> tuple[object, int, np.ndarray]:
        """A token's active set as (rows of f.bundle on the device, their count, the CPU's neuron ids)."""
        if len(active) == self.config.d_ffn:
            return f.hot_all, len(f.slot) - len(f.cold_all), f.cold_all
        slots = f.slot[active]
        hot, cold = slots[slots >= 0], np.ascontiguousarray(active[slots < 0])
        hot_d = gpu.scratch("hot", max(len(hot), 1), np.int32)
        if len(hot):
            hot_d.copy_to_device(hot)
        return hot_d, len(hot), cold

    def ffn_input(self, l: int, h: Residual) -> tuple[np.ndarray, object]:
        """x = the FFN's norm of h [T, D] on both sides, computed where the residual is (where the predictor runs, if
        it does)."""
        G = self.gpu_layers[l]
        if G.predictor is not None:
            h.gpu()
        elif self.selector.predicts:
            h.cpu()
        x_d = gpu.scratch("ffn_x", h.a.shape)
        if h.on_gpu:
            gpu.norm(x_d, h.a, *G.ffn_norm, self.host.eps)
            return x_d.copy_to_host(), x_d
        x = np.empty_like(h.a)
        cpu.norm(x, h.a, *self.host.norm_weights(self.host.layers[l], FFN_NORM), self.host.eps)
        x_d.copy_to_device(x)
        return x, x_d

    def hybrid_ffn_block(self, l: int, h: Residual) -> None:
        """h += y_gpu(P ∩ G) + y_cpu(P \\ G) (+ bd): the GPU half is launched, the CPU half computed meanwhile, and
        the other side's partial crosses over to where the residual lives."""
        f, L, host = self.gpu_layers[l].ffn, self.host.layers[l].ffn, self.host
        x, x_d = self.ffn_input(l, h)
        y_d, y_cpu_d = gpu.scratch("y_gpu", (1, x.shape[1])), gpu.scratch("y_cpu", (1, x.shape[1]))
        for t in range(x.shape[0]):
            hot_d, n_hot, cold = self.split(f, self.active_set(l, h, t))
            if n_hot:  # launched, not waited for
                gpu.sparse_ffn(y_d[0], None, x_d[t], f.bundle, f.bu, hot_d, n_hot, *f.kind)
            if len(cold):
                cpu.sparse_ffn(self.y_cpu[0], host.acc, x[t], L.bundle, L.bu, cold, len(cold), *f.kind)
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
        if L.bd.size:  # once, whichever side computed the neurons
            gpu.add_bias(h.a, f.bd) if h.on_gpu else cpu.add_bias(h.a, L.bd)

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each block runs where the placement put it, the residual
        following."""
        runs = check_batch(batch, cache, self.config)
        h = Residual(self.host.embed_tokens(batch))  # [T, D]
        for l in range(self.config.n_layers):
            self.block(l, h, batch, cache)
        advance(cache, runs)
        rows = batch.output_rows()
        if len(rows) < len(batch):
            h = Residual(np.ascontiguousarray(h.cpu()[rows]))
        return self.output(h)

    def cpu_output(self, h: Residual) -> np.ndarray:
        return self.host.output(h.cpu())

    def gpu_output(self, h: Residual) -> np.ndarray:
        c, T = self.config, h.a.shape[0]
        x_d = gpu.scratch("out_x", (T, c.d_model))
        gpu.norm(x_d, h.gpu(), *self.norm_d, self.host.eps)
        if self.project_out_d is not None:
            x_d, x = gpu.scratch("out_w", (T, self.project_out_d.rows)), x_d
            gpu.matmul(x_d, x, self.project_out_d)
        logits = gpu.scratch("logits", (T, c.vocab_size))
        gpu.matmul(logits, x_d, self.lm_head_d)
        return logits.copy_to_host()


def pre_norm_block(e: HybridEngine, l: int, h: Residual, batch: Batch, cache: KVCache) -> None:
    """fast.engine's blocks with each part where the placement put it."""
    h.add(e.attention[l](l, h, batch, cache))
    e.ffn[l](l, h)


def post_norm_block(e: HybridEngine, l: int, h: Residual, batch: Batch, cache: KVCache) -> None:
    L, eps = e.host.layers[l], e.host.eps
    h.add(e.attention[l](l, h, batch, cache))
    cpu.norm(h.cpu(), h.a, L.attn_norm, L.attn_norm_b, eps)
    e.ffn[l](l, h)
    cpu.norm(h.cpu(), h.a, L.ffn_norm, L.ffn_norm_b, eps)


def parallel_block(e: HybridEngine, l: int, h: Residual, batch: Batch, cache: KVCache) -> None:
    """Attention's output held back while the FFN reads the layer input and adds to it."""
    o = e.attention[l](l, h, batch, cache)
    e.ffn[l](l, h)
    h.add(o)


HYBRID_BLOCKS = {"pre_norm": pre_norm_block, "post_norm": post_norm_block, "parallel": parallel_block,
                 "parallel_shared": parallel_block}


def sites(thin: Thin, a: int, b: int) -> tuple:
    """Activation sparsity's score weights (on the device) and thresholds of two sites of a layer: (wa, ta, wb, tb)."""
    return cuda.to_device(thin.w[a]), thin.t[a], cuda.to_device(thin.w[b]), thin.t[b]


# Each FFN variant's GPU half (fast.layers): what it uploads of a layer and which method runs its block. Dense and
# StoredDown are bundled before (to_hybrid); a mixture of experts adds its entry here.
GPU_FFN = {Bundles: HybridEngine.bundles_on_gpu, CatsBundles: HybridEngine.bundles_on_gpu,
           ThinnedFFN: HybridEngine.thinned_on_gpu}


def require_gpu(who: str) -> None:
    if not cuda.is_available():
        raise UserError(f"{who}: no CUDA GPU found (numba.cuda.is_available() is False)")


def to_hybrid(engine: Engine, gpu_neurons: list[np.ndarray], dense_on_gpu=None) -> HybridEngine:
    """Apply a placement: per-layer GPU neuron ids and the dense parts on the GPU (default: all of them)."""
    require_gpu("the hybrid engine")
    c = engine.config
    if len(gpu_neurons) != c.n_layers:
        raise UserError(f"placement: need GPU neuron ids for each of the {c.n_layers} layers, got {len(gpu_neurons)}")
    for l, ids in enumerate(gpu_neurons):
        if len(ids) and (ids.min() < 0 or ids.max() >= c.d_ffn):
            raise UserError(f"placement: layer {l} has neuron ids outside [0, {c.d_ffn}): a placement for another model?")
    known = dense_names(c.n_layers)
    dense = known if dense_on_gpu is None else list(dense_on_gpu)
    unknown = sorted(set(dense) - set(known))
    if unknown:
        raise UserError(f"placement: unknown dense part '{unknown[0]}' for a {c.n_layers}-layer model: "
                        "a placement for another model, or from an older version (solve it again)")
    # the split reads neuron bundles (an engine laid out densely, dense_ffn, has them again)
    return HybridEngine(bundled(engine), [np.asarray(g, np.int32) for g in gpu_neurons], set(dense))


def device_identity() -> tuple[str, int]:
    """The current CUDA device's name and memory in bytes (the simulator's device has neither: 'simulator', 0)."""
    _, total = cuda.current_context().get_memory_info()
    name = getattr(cuda.get_current_device(), "name", b"simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name, int(total) if np.isfinite(total) else 0
