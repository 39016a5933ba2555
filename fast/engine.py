"""The fast engine: ref's model, laid out once for the numba kernels of `fast.cpu`.

`Engine.load` only loads, keeping the checkpoint's weight format (no float32 copy of an f16 or bf16 model) unless
asked for another.
Features are transforms applied to a loaded engine: `convert` stores its matrices in another format (--type),
`apply_predictors` gives it a predicting `Selector`, `fast.hybrid.to_hybrid` puts a placement's share on the GPU;
the block code asks the selector which neurons to compute and does not know which one it has.

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
V vocab, R predictor hidden size, C accumulator chunks.
"""

import math
import os
import time
import weakref
from itertools import accumulate
from pathlib import Path

import numba
import numpy as np
from numba.typed import List
from threadpoolctl import threadpool_limits

from fast import blas, cpu, layers
from fast.kernel_cache import first_compile
from fast.layers import (EMPTY, NO_NORMS, Bundles, CatsBundles, Fused, Layer, StoredDown, Thin, ThinnedFFN,
                         as_format, as_matmul, transposed)
from fast.quant import for_matmul, for_sparse, n_rows
from ref import sparse
from ref.common.artifacts import Predictors, site_widths
from ref.common.batch import Batch, KVCache, advance, check_batch
from ref.common.checkpoint import load_checkpoint
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format
from ref.common.safetensors import upcast
from ref.common.sampling import check_fits, generate
from ref.common.weights import Weights
from ref.model import ATTN_NORM, FFN_NORM, qkv_rows, rope_angles, shift_context
from ref.quant import Quantized, blocks, quantize_predictors, stored_format, tensor_format, values

F32 = np.float32
NO_SETS, NO_BOUNDS = np.zeros(0, np.int32), np.zeros(0, np.int64)  # cpu.decode_step's given sets: none


def joined(sets: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer sets as one int32 array and the bounds [L + 1] of each layer's part (Selector.given_sets)."""
    return np.concatenate(sets).astype(np.int32, copy=False), np.array([0, *accumulate(len(s) for s in sets)])


def tied_head(embed: np.ndarray, fmt: Format) -> np.ndarray:
    """The output head of a model whose head is its embedding: the table itself, or in q8_0 and q4_0 a copy laid
    out for matmul, as llama.cpp duplicates it for its repacked kernels (the head reads at the matmul's pace, where
    plain rows of blocks read at about half of it: Llama-3.2 1B's 128k-token head is a fifth of a token)."""
    return for_matmul(embed) if fmt.quantized else embed


def vector(w: Weights, name: str) -> np.ndarray:
    """A norm's or bias's float32 values; EMPTY where the checkpoint has none."""
    return np.ascontiguousarray(upcast(w[name], F32)) if name in w.tensors else EMPTY


def layout(w: Weights, l: int, fmt: Format) -> Layer:
    """Block l with its matrices in `fmt`: q, k, v fused as [q | k | v] (a fused checkpoint matrix reordered so,
    ref.model.qkv_rows); each neuron's gate row, up row and down column in one bundle (the down matrix transposed,
    as PowerInfer's ffn_down_t); norms and biases as the checkpoint has them."""
    c, p = w.config, f"layers.{l}."

    def vec(name):
        return vector(w, p + name)

    def mat(name):
        return as_format(w[p + name], fmt, p + name)

    if c.fused_qkv:
        rows = qkv_rows(c.n_heads, c.n_kv_heads, c.head_dim)
        wqkv, bqkv = for_matmul(mat("wqkv")[rows]), vec("wqkv.bias")[rows] if c.bias else EMPTY
    else:
        wqkv = for_matmul(mat("wq"), mat("wk"), mat("wv"))  # [q | k | v]
        bqkv = np.concatenate([vec("wq.bias"), vec("wk.bias"), vec("wv.bias")])
    qk_norms = np.stack([vec("q_norm"), vec("k_norm")]) if c.qk_norm else NO_NORMS
    attn = Fused(wqkv=wqkv, wo=as_matmul(w[p + "wo"], fmt, p + "wo"), bqkv=bqkv, bo=vec("wo.bias"), qk_norms=qk_norms)
    if isinstance(w[p + "wd"], Quantized):  # llama.cpp's ffn_down, quantized along F: run as stored, dense
        ffn = StoredDown(gate_up=for_matmul(mat("wg"), mat("wu")), down=as_matmul(w[p + "wd"], fmt, p + "wd"),
                         bu=vec("wu.bias"), bd=vec("wd.bias"))
    else:
        rows = ["wg", "wu"] if c.gated else ["wu"]
        bundle = np.empty((c.d_ffn, len(rows) + 1, c.d_model // fmt.block), fmt.dtype)
        for i, name in enumerate(rows):
            bundle[:, i] = mat(name)
        bundle[:, -1] = as_format(w[p + "wd"].T, fmt, p + "wd")
        ffn = Bundles(bundle=for_sparse(bundle), bu=vec("wu.bias"), bd=vec("wd.bias"))
    return Layer(attn_norm=vec("attn_norm"), attn_norm_b=vec("attn_norm.bias"), ffn_norm=vec("ffn_norm"),
                 ffn_norm_b=vec("ffn_norm.bias"), attn=attn, ffn=ffn)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [P, E/2] for every position, computed in float64 as ref.model.rope does; a family without RoPE
    rotates by 0 (cos 1, sin 0), so that one attention kernel serves all."""
    ang = rope_angles(np.arange(cfg.max_seq_len), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [P, E/2]
    if cfg.positions != "rope":
        ang = np.zeros_like(ang)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


class Selector(sparse.Selector):
    """ref's active-set seam with the pick as a kernel: predictor weights as rows of their format's blocks
    (float32 as trained, or as `ref.quant.quantize_predictors` stored them), plus the host scratch an engine runs
    the predictor into (`logits` [F], `hidden` [max R])."""

    def __init__(self, d_ffn: int, predictors: Predictors | None = None, threshold: float = 0.0):
        super().__init__(d_ffn, predictors, threshold)
        self.formats = self.params = ()  # the formats the predictor matrices are stored in; each layer's parameters
        if self.predicts:
            self.formats = tuple(dict.fromkeys(tensor_format(t) for t in (*self.fc1, *self.fc2)))
            self.params = tuple(math.prod(a.shape) + math.prod(b.shape) for a, b in zip(self.fc1, self.fc2))
            self.fc1 = [for_matmul(blocks(a)) for a in self.fc1]  # [R, D]
            self.fc2 = [for_matmul(blocks(b)) for b in self.fc2]  # [F, R]
            self.hidden = np.empty(max(n_rows(a) for a in self.fc1), F32)
        self.threshold = F32(threshold)
        self.logits, self.active = np.empty(d_ffn, F32), np.empty(d_ffn, np.int32)

    ahead = False  # a subclass whose pick ignores the logits (sets drawn in advance): a step may ask before it runs

    def given_sets(self, n_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
        """One token's sets of every layer before its predictor runs, where the pick does not read the logits (no
        predictor: every neuron; a subclass's `ahead` pick), as one array and where each layer's starts: layer l's
        set is sets[bounds[l]:bounds[l + 1]] (what cpu.decode_step reads); None where the predictor's threshold
        decides."""
        if self.predicts and not self.ahead:
            return None
        return joined([self.pick(l, None) for l in range(n_layers)])

    @property
    def by_threshold(self) -> bool:
        """Whether the picks are the plain threshold of the predictor's logits, which a kernel may then apply itself
        (a subclass's own pick decides otherwise)."""
        return self.predicts and type(self).pick is Selector.pick and type(self).pick_rows is Selector.pick_rows

    def pick(self, l: int, logits: np.ndarray | None) -> np.ndarray:
        return self.all if logits is None else self.active[: cpu.predicted_set(self.active, logits, self.threshold)]

    def pick_rows(self, l: int, logits: np.ndarray | None, T: int) -> np.ndarray:
        if type(self).pick is not Selector.pick:  # a subclass's own pick decides
            return super().pick_rows(l, logits, T)
        return np.ones((T, len(self.all)), np.uint8) if logits is None else (logits >= self.threshold).view(np.uint8)


class Decoder:
    """ref's contracts on top of an engine's `config`, `new_cache` and `forward(batch, cache)`."""

    compile_seconds = 0.0
    kv_types = ("f32", "f32")  # the formats new caches store keys and values in (fast.load.set_kv_types)
    # Whether a prompt chunk may run GEMMs (fast.engine.kernels): faster from a few dozen tokens of a wide model, but
    # a GEMM's blocking makes a token's bits depend on the chunk around it; the server turns it off.
    gemm = True

    def logits(self, ids) -> np.ndarray:
        """Float32 logits [T, V] for a whole sequence from a fresh cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_fits(len(ids), self.config.max_seq_len)
        cache = self.new_cache(max(len(ids), 1))
        return self.forward(Batch.single(ids, cache), cache)

    def generate(self, ids, max_new_tokens, **kwargs) -> list[int]:
        return generate(self, ids, max_new_tokens, **kwargs)

    def shift(self, cache: KVCache, seq: int, keep: int, discard: int) -> None:
        """ref.model.shift_context on this engine's cache (a rare step: numpy's rope, as ref's, on float32 keys)."""
        shift_context(self.config, cache, seq, keep, discard)

    def warm_up(self, notice=None, sequences: int = 1) -> None:
        """Compile (or load the cached) kernels of a short prompt and of a decode step, and with `sequences` > 1 of a
        step decoding two sequences together (the server's), timed as `compile_seconds` (llama.cpp warms up too): the
        first prompt otherwise paid for loading its kernels, 50 ms of the shipped model's 5-token prompt against 1 ms
        after. notice(self), if given, is called once if a kernel must compile."""
        t0 = time.perf_counter()
        with first_compile(lambda: notice and notice(self)):
            cache = self.new_cache(4, slots=2)
            self.forward(Batch.single([0, 0], cache), cache)
            self.forward(Batch.single([0], cache), cache)
            if sequences > 1:
                self.forward(Batch.single([0], cache, seq=1), cache)
                self.forward(Batch.of([(0, [0]), (1, [0])], cache), cache)
        self.compile_seconds = time.perf_counter() - t0


class Engine(Decoder):
    """Prefill and decode on the CPU with a preallocated KV cache."""

    file_predictors = None  # the checkpoint's own predictors (a PowerInfer file's, TurboSparse's)

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: np.ndarray, norm: np.ndarray,
                 lm_head: np.ndarray, threads: int | None = None, fmt: Format = FORMATS["f32"], norm_b=EMPTY,
                 pos_embed=None, project_in=None, project_out=None):
        c = self.config = config
        self.layers, self.embed, self.norm, self.lm_head, self.format = layers, embed, norm, lm_head, fmt
        self.norm_b = norm_b  # [D] the final LayerNorm's bias (norm and norm_b EMPTY: no final norm)
        self.pos_embed = pos_embed  # [P + 2, D] OPT's learned positions, float32
        self.project_in, self.project_out = project_in, project_out  # OPT-350m's [D, W], [W, D]
        self.block = BLOCKS[c.block].__get__(self)
        self.threads = set_threads(threads)
        self.cos, self.sin = rope_tables(c)
        self.kind, self.thr = cpu.KINDS[c.ffn_kind], F32(c.act_threshold)
        self.eps = F32(c.norm_eps)  # one type for every kernel's eps: a float64 compiles each kernel a second time
        self.acc = np.empty((2 * self.threads, c.d_model), F32)  # per-chunk private accumulators
        self.selector = Selector(c.d_ffn)
        self.no_picks = np.zeros((c.n_layers, 0, 0), np.uint8)  # decode_step's picks where the threshold decides
        self._step = None  # (selector, step_layers' list) until a transform changes the layers (layers_changed)
        self._slots = self._rows = None  # slot_lists' and step_rows' lists, with the cache and version they are of
        self.run = None  # the longest run of the step `forward` runs (kernels); None outside one

    @staticmethod
    def load(path: str | Path | Weights, threads: int | None = None, fmt: Format | None = None) -> "Engine":
        """Lay out an HF folder or GGUF file for the kernels, dense, its matrices in the format they are stored in or
        in `fmt` (--type: converted a layer at a time as they are laid out, so that memory never holds the model
        twice). Features are transforms applied to the result; a PowerInfer file's predictors wait in
        `file_predictors`. `path` may be a checkpoint loaded already (ref.common.checkpoint.load_checkpoint)."""
        w = path if isinstance(path, Weights) else load_checkpoint(path)
        cfg, path = w.config, w.source
        fmt = fmt or stored_format(w)
        layers = []
        for l in range(cfg.n_layers):
            layers.append(layout(w, l, fmt))
            w.release()  # the layout is a copy: keep one, not the file's pages too

        embed = as_format(w["embed"], fmt, "embed")
        lm_head = tied_head(embed, fmt) if cfg.tie_word_embeddings else as_matmul(w["lm_head"], fmt, "lm_head")
        projections = [as_matmul(w[n], fmt, n) for n in ("project_in", "project_out")] if cfg.embed_dim else [None, None]
        w.release()  # interleaved, lm_head is a copy too
        engine = Engine(cfg, layers, embed, vector(w, "norm"), lm_head, threads, fmt, vector(w, "norm.bias"),
                        vector(w, "pos_embed") if cfg.positions == "learned" else None, *projections)
        engine.file_predictors = w.predictors
        return engine

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> KVCache:
        return KVCache.empty(self.config, capacity or self.config.max_seq_len, F32, slots, formats=self.kv_types)

    def active_set(self, l: int, h: np.ndarray) -> np.ndarray:
        """Ids of the neurons layer l computes for one token h [D]: the selector's pick from the predictor run here."""
        sel = self.selector
        if not sel.predicts:
            return sel.pick(l, None)
        cpu.predictor(sel.logits.reshape(1, -1), sel.hidden[: n_rows(sel.fc1[l])].reshape(1, -1), h.reshape(1, -1),
                      sel.fc1[l], sel.fc2[l])
        return sel.pick(l, sel.logits)

    def active_sets(self, l: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer l's sets for T tokens h [T, D] as their union (sorted ids [U]) and which token computes which union
        neuron (mask [T, F] uint8: its first U columns); the predictor reads its weights once for all T."""
        sel, T, F = self.selector, h.shape[0], self.config.d_ffn
        if sel.predicts:
            logits = np.empty((T, F), F32)
            self.kernels(T, h.shape[1]).predictor(logits, np.empty((T, n_rows(sel.fc1[l])), F32), h, sel.fc1[l],
                                                  sel.fc2[l])
        picked = sel.pick_rows(l, logits if sel.predicts else None, T)  # [T, F]: token t computes neuron i
        union, mask = np.empty(F, np.int32), np.empty((T, F), np.uint8)
        n = cpu.union_mask(union, mask, np.ascontiguousarray(picked, np.uint8))
        return union[:n], mask  # mask [T, F]: its first n columns are the union's, the others undefined

    def attention_block(self, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """Self-attention of the block input h [T, D] after its norm (ATTN_NORM: none in a post-norm block), RoPE
        where the family has it, each sequence's run attending to its own slot, to which it appends its keys and
        values: the layer's attention variant (fast.layers)."""
        L = self.layers[l]
        return L.attn.forward(self, l, h, *self.norm_weights(L, ATTN_NORM), batch, cache)

    def ffn_block(self, l: int, h: np.ndarray) -> np.ndarray:
        """The FFN of the block input h [T, D] after its norm (FFN_NORM): the layer's FFN variant (fast.layers)."""
        L = self.layers[l]
        return L.ffn.forward(self, l, h, *self.norm_weights(L, FFN_NORM))

    def attend(self, l: int, qk_norms: np.ndarray, qkv: np.ndarray, batch: Batch, cache: KVCache) -> np.ndarray:
        """The attention of projected rows qkv [T, (H + 2K) E] (each head's q and k normed by qk_norms where the family
        says so, RoPE, each sequence's keys and values appended to its slot).  -> [T, H E]."""
        c, T, runs = self.config, qkv.shape[0], batch.runs()
        cpu.qk_norm(qkv, qk_norms, c.n_kv_heads, self.eps)
        att = np.empty((T, c.n_heads * c.head_dim), F32)  # [T, H E]
        if len(runs) == T > 1:  # one token of each of several sequences (one run reads its own slot: a hybrid
            # engine's cache holds device arrays for the layers attending on the GPU)
            k_caches, v_caches = self.slot_lists(cache)[l]
            cpu.decode_attention(att, qkv, k_caches, v_caches, batch.seqs, batch.positions, self.cos, self.sin)
        else:
            for seq, a, b in runs:
                self.kernels(b - a, c.d_model).self_attention(att[a:b], qkv[a:b], cache.k[l][seq],
                                                              cache.v[l][seq], self.cos, self.sin, batch.positions[a])
        return att

    def norm_weights(self, L: Layer, table: dict) -> tuple[np.ndarray, np.ndarray]:
        """The (weight, bias) of the norm before attention or the FFN in this block (ref.model's ATTN_NORM or
        FFN_NORM); EMPTY twice for none."""
        name = table[self.config.block]
        return (EMPTY, EMPTY) if name is None else (getattr(L, name), getattr(L, name + "_b"))

    def slot_lists(self, cache: KVCache) -> list[tuple[List, List]]:
        """Per layer, the cache's key and value slot arrays as numba typed lists (an empty array for a free slot), kept
        for the cache the engine last ran until its arrays change (KVCache.version)."""
        kept = self._slots
        if kept is None or kept[0]() is not cache or kept[1] != cache.version:
            empty = [np.zeros((cache.shape[0], 0, n), dtype) for n, dtype in map(cache.storage, cache.formats)]
            lists = [tuple(List([a if a is not None else none for a in arrays[l]])
                           for arrays, none in zip((cache.k, cache.v), empty)) for l in range(len(cache.k))]
            kept = self._slots = (weakref.ref(cache), cache.version, lists)
        return kept[2]

    def forward(self, batch: Batch, cache: KVCache) -> np.ndarray:
        """Logits [N, V] of the batch's output rows; each sequence's slot grows by its run. Every block in one
        compiled call (cpu.decode_step) where the step, the layout and the selector allow it (one_call)."""
        runs = check_batch(batch, cache, self.config)
        self.run = max(b - a for _, a, b in runs)
        try:
            h = self.embed_tokens(batch)  # [T, D]
            layers = self.step_layers() if self.one_call(h, runs) else None
            logits = None
            if layers is not None:
                logits = self.decode_step(h, batch, cache, layers)
            else:
                for l in range(self.config.n_layers):
                    self.block(l, h, batch, cache)
            advance(cache, runs)
            return self.output(np.ascontiguousarray(h[batch.output_rows()])) if logits is None else logits
        finally:
            self.run = None

    def kernels(self, T: int, D: int):
        """The module `kernels` of the step `forward` runs (outside one: of T tokens in one run), width D; fast.cpu's
        where `gemm` is off."""
        return kernels(self.run or T, D) if self.gemm else cpu

    def one_call(self, h: np.ndarray, runs: list) -> bool:
        """Whether a step of h [T, D] may run as cpu.decode_step: one token, or one token of each of several
        sequences whose blocks the per-layer path would run as one compiled call each (attention_block's decoding
        case, ffn_block's ffn_batch_block case)."""
        return h.shape[0] == 1 or (len(runs) == h.shape[0] and self.ffn_in_one_call(h))

    def ffn_in_one_call(self, h: np.ndarray) -> bool:
        """Whether the FFN block of several tokens h [T, D] runs as cpu.ffn_batch_block: one chunk on fast.cpu's
        kernels, its sets the predictor's threshold or a pick drawn ahead."""
        sel, T = self.selector, h.shape[0]
        return ((sel.by_threshold or sel.predicts and sel.ahead) and T <= layers.FFN_CHUNK
                and self.kernels(T, h.shape[1]) is cpu)

    def step_layers(self) -> list | None:
        """Per layer, the fields of cpu.StepLayer but the cache's slots, by name, kept until a transform changes the
        layers (layers_changed) or the selector is replaced; None where the step does not apply: a variant it does
        not run (fast.layers' `steps`: Fused attention and Bundles only), a selector whose own pick reads the logits,
        or layers whose arrays differ in type (a format per layer: one compiled step takes one type per field)."""
        sel, post = self.selector, self.config.block == "post_norm"
        if self._step is not None and self._step[0] is sel:  # every decode step: what was decided when it was built
            return self._step[1]
        if not all(L.attn.steps and L.ffn.steps for L in self.layers) or (sel.predicts and not sel.by_threshold
                                                                           and not sel.ahead):
            self._step = (sel, None)
        else:
            none = np.zeros((0, 0), F32)  # fc1, fc2 without a predictor
            fields = []
            for l, L in enumerate(self.layers):
                (attn_w, attn_b), (ffn_w, ffn_b) = self.norm_weights(L, ATTN_NORM), self.norm_weights(L, FFN_NORM)
                fields.append(dict(attn_w=attn_w, attn_b=attn_b, ffn_w=ffn_w, ffn_b=ffn_b,
                                   post_attn_w=L.attn_norm if post else EMPTY,
                                   post_attn_b=L.attn_norm_b if post else EMPTY,
                                   post_ffn_w=L.ffn_norm if post else EMPTY, post_ffn_b=L.ffn_norm_b if post else EMPTY,
                                   **L.attn.step_fields(), **L.ffn.step_fields(),
                                   fc1=sel.fc1[l] if sel.predicts else none, fc2=sel.fc2[l] if sel.predicts else none))
            uniform = len({tuple(numba.typeof(a) for a in f.values()) for f in fields}) == 1
            self._step = (sel, fields if uniform else None)
        return self._step[1]

    def layers_changed(self) -> None:
        """Forget what was built from the layers' arrays: every transform that replaces one calls it."""
        self._step = self._rows = None

    def decode_step(self, h: np.ndarray, batch: Batch, cache: KVCache, layers: list) -> np.ndarray | None:
        """Every block for one token of each sequence of the batch, h [T, D], in place, as cpu.decode_step; and the
        output head where the step returns every row's logits and nothing projects before the head (-> [T, V]),
        else None (Engine.output then runs it)."""
        sel, L, T = self.selector, self.config.n_layers, h.shape[0]
        given, bounds = (sel.given_sets(L) if T == 1 else None) or (NO_SETS, NO_BOUNDS)  # one array (a list: 0.2 ms)
        picks = (np.stack([sel.pick_rows(l, None, T) for l in range(L)]).view(np.uint8) if T > 1 and sel.ahead
                 else self.no_picks)  # several tokens' sets [L, T, F], or none: the threshold's
        head = self.project_out is None and (batch.logits is None or len(batch.output_rows()) == T)
        logits = np.empty((T, n_rows(self.lm_head)) if head else (0, 0), F32)
        rows, model = self.step_rows(layers, cache)
        step = cpu.decode_step if T == 1 else cpu.decode_steps
        step(logits, h, rows, batch.seqs, batch.positions,
             cpu.StepSets(threshold=sel.threshold, given=given, bounds=bounds, picks=picks), model)
        return logits if head else None

    def step_rows(self, layers: list, cache: KVCache) -> tuple[List, tuple]:
        """step_layers' fields with each layer's key and value slots (slot_lists), as one typed list of cpu.StepLayer,
        and the step's cpu.StepModel: what cpu.decode_step reads, kept until the cache's arrays or the layers
        change."""
        kept = self._rows
        if kept is None or kept[0]() is not cache or kept[1] != cache.version or kept[2] is not layers:
            rows = List()
            for fields, (k_slots, v_slots) in zip(layers, self.slot_lists(cache)):
                rows.append(cpu.StepLayer(**fields, k_slots=k_slots, v_slots=v_slots))
            model = cpu.StepModel(cos=self.cos, sin=self.sin, eps=self.eps, acc=self.acc, kind=self.kind, thr=self.thr,
                                  block=cpu.BLOCKS[self.config.block], out_w=self.norm, out_b=self.norm_b,
                                  lm_head=self.lm_head)
            kept = self._rows = (weakref.ref(cache), cache.version, layers, (rows, model))
        return kept[3]

    def embed_tokens(self, batch: Batch) -> np.ndarray:
        """The residual stream entering layer 0 (ref.model's embed): embeddings, projected where narrower, plus the
        learned positions where the family has them.  -> [T, D]."""
        h = np.empty((len(batch.tokens), self.config.embed_dim or self.config.d_model), F32)  # [T, W]
        cpu.embed(h, self.embed, batch.tokens)
        if self.project_in is not None:
            h = self.project(h, self.project_in)
        if self.pos_embed is not None:
            h += self.pos_embed[np.asarray(batch.positions) + 2]
        return h

    def project(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T [T, N] with the kernels for T tokens (the embedding's projections, the output head)."""
        out = np.empty((x.shape[0], n_rows(w)), F32)
        self.kernels(*x.shape).matmul(out, x, w)
        return out

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits [T, V] = lm_head . norm(h) (no norm where the config has none; OPT-350m projects first)."""
        x = np.empty_like(h)
        cpu.norm(x, h, self.norm, self.norm_b, self.eps)
        if self.project_out is not None:
            x = self.project(x, self.project_out)
        return self.project(x, self.lm_head)


def pre_norm_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """LLaMA's block (and OPT's, Falcon-RW's) on the residual stream h [T, D], in place: h += attention(norm(h));
    h += ffn(norm(h))."""
    h += e.attention_block(l, h, batch, cache)
    h += e.ffn_block(l, h)


def post_norm_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """OPT-350m's block: h = norm(h + attention(h)); h = norm(h + ffn(h))."""
    L, eps = e.layers[l], e.eps
    h += e.attention_block(l, h, batch, cache)
    cpu.norm(h, h, L.attn_norm, L.attn_norm_b, eps)
    h += e.ffn_block(l, h)
    cpu.norm(h, h, L.ffn_norm, L.ffn_norm_b, eps)


def parallel_block(e: Engine, l: int, h: np.ndarray, batch: Batch, cache: KVCache) -> None:
    """Falcon's block: attention and FFN both read the layer input, h += attention(norm(h)) + ffn(norm'(h))."""
    y = e.ffn_block(l, h)
    h += e.attention_block(l, h, batch, cache)
    h += y


BLOCKS = {"pre_norm": pre_norm_block, "post_norm": post_norm_block, "parallel": parallel_block,
          "parallel_shared": parallel_block}


def kernels(run: int, D: int):
    """The kernels of a step whose longest run (one sequence's consecutive tokens) is `run` tokens of width D
    (d_model): fast.cpu's, or where the run (a prompt chunk) reaches blas.MIN_TOKENS and run D blas.MIN_WORK,
    fast.blas's (same contracts). Decided by the run, not the step's tokens: on fast.cpu's kernels a token's result
    is the same bits beside any others and as a prompt's or a decode's, which a GEMM's blocking does not promise, so
    decodes, however many sequences run together, keep that."""
    return blas if run >= blas.MIN_TOKENS and run * D >= blas.MIN_WORK else cpu


def free_cores(sample_seconds: float = 0.1) -> int:
    """How many of this process's cores other processes leave idle, from /proc/stat over `sample_seconds`: the
    default -t. A kernel cuts its work into equal shares per thread and waits for the last, so one thread on a core
    that another process keeps busy makes every kernel wait for it (measured on 2 cores with one busy: the default
    of every core was 2 to 5 times slower than -t 1)."""
    cpus = os.sched_getaffinity(0)

    def idle_and_total() -> dict[int, tuple[int, int]]:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    fields = [int(v) for v in line.split()[1:8]]
                    out[int(line.split()[0][3:])] = (fields[3] + fields[4], sum(fields))  # idle + iowait, all
        return out

    try:
        a = idle_and_total()
        time.sleep(sample_seconds)
        b = idle_and_total()
    except OSError:  # no /proc: every core
        return len(cpus)
    idle = sum((b[c][0] - a[c][0]) / max(b[c][1] - a[c][1], 1) for c in cpus if c in a and c in b)
    return max(1, min(len(cpus), round(idle)))


def set_threads(threads: int | None) -> int:
    """Map -t/--threads onto numba's thread pool and fast.blas's (default: the cores other processes leave idle,
    `free_cores`)."""
    # A decode token launches about 130 parallel kernels a few microseconds apart, between which libgomp's workers
    # went to sleep (an empty launch: 5 to 9 us, 1.6 us with workers spinning); spinning up to 300000 times (libgomp's
    # default where it does not throttle) bridges the gaps and still sleeps when idle (0.009 CPU-seconds per idle
    # second either way). libgomp reads it when numba first starts its workers (set_num_threads below); a value in
    # the environment wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")
    most = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        threads = min(most, free_cores())
    if not 1 <= threads <= most:
        raise UserError(f"-t/--threads must be in [1, {most}], got {threads}")
    numba.set_num_threads(threads)
    threadpool_limits(1, user_api="blas")  # fast.blas splits its products among -t threads itself
    return threads


def convert(engine: Engine, fmt: Format) -> Engine:
    """Store the engine's matrices in another format (--type), a layer at a time, so that memory holds one layer in
    both formats at most."""
    for L in engine.layers:
        L.attn, L.ffn = L.attn.convert(fmt), L.ffn.convert(fmt)
    engine.embed = as_format(engine.embed, fmt)
    engine.lm_head = (tied_head(engine.embed, fmt) if engine.config.tie_word_embeddings
                      else as_matmul(engine.lm_head, fmt))
    engine.project_in, engine.project_out = (None if w is None else as_matmul(w, fmt)
                                             for w in (engine.project_in, engine.project_out))
    engine.format = fmt
    engine.layers_changed()
    return engine


def dense_ffn(engine: Engine) -> Engine:
    """The dense layout, for an engine without predictors: each layer's FFN as fast.layers.Dense where its variant
    has a faster dense form (gated bundles in q8_0 and q4_0: TinyLlama's FFN, q4_0, 2 threads: 28 -> 18 ms a token);
    float formats keep their bundles (their row products are as fast). apply_predictors bundles the rows again."""
    if not engine.format.quantized:
        return engine
    for L in engine.layers:
        L.ffn = L.ffn.dense()
    engine.layers_changed()
    return engine


def bundled(engine: Engine) -> Engine:
    """Each neuron's rows bundled again (fast.layers.Bundles, the layout the sparse kernels read), undoing dense_ffn;
    llama.cpp's ffn_down re-laid as PowerInfer's ffn_down_t (StoredDown.rows)."""
    for L in engine.layers:
        L.ffn = L.ffn.bundled(engine.format)
    engine.layers_changed()
    return engine


def column_norms(wt: np.ndarray) -> np.ndarray:
    """||W[:, i]||_2 from the stored transpose's rows, in float64 as ref's (WINA's score weights).  -> [K]."""
    v = values(wt).astype(np.float64)
    return np.sqrt((v * v).sum(1)).astype(F32)


def apply_activation_sparsity(engine: Engine, method: str, cut: np.ndarray, ffn: bool = True,
                              thin_type: type = Thin) -> Engine:
    """Training-free activation sparsity (ref.activation_sparsity.apply_activation_sparsity) with thresholds cut
    [L, 4]: the attention as fast.layers.Thinned, and for TEAL and WINA the FFN as ThinnedFFN where `ffn` (not beside
    predictors); CATS's FFN as CatsBundles, which skip a neuron by its gate's activation (cpu.CATS). Each layer's
    sites are one `thin_type` (Thin, or a subclass that watches the scores: fast.bench.thinned_twin)."""
    c, fmt = engine.config, engine.format
    cats = method == "cats" and ffn
    if cats:
        if c.ffn_kind == "fatrelu":
            raise UserError("--sparsity-method cats: a FATReLU FFN has a threshold of its own; use teal or wina")
        bundled(engine)
    widths = site_widths(c)
    for l, L in enumerate(engine.layers):
        thin = thin_type((), np.array(cut[l], F32))
        L.attn = L.attn.thinned(fmt, l, thin)
        sites = [L.attn.wqkv, L.attn.wo]
        if cats:
            L.ffn = CatsBundles(bundle=L.ffn.bundle, bu=L.ffn.bu, bd=L.ffn.bd, thin=thin)
        elif ffn:
            *gate_up, down_t = L.ffn.rows(fmt)
            L.ffn = ThinnedFFN(gate_up_t=transposed(np.concatenate(gate_up), fmt, f"layers.{l}.gate_up"),
                               down_t=np.ascontiguousarray(down_t), thin=thin, bu=L.ffn.bu, bd=L.ffn.bd)
            sites += [L.ffn.gate_up_t, L.ffn.down_t]
        else:
            thin.t[2:] = np.inf  # the predictors' FFN: no site of it thinned
        w = [column_norms(m) if method == "wina" else np.ones(n, F32) for m, n in zip(sites, widths)]
        thin.w = tuple(w + [np.ones(n, F32) for n in widths[len(w):]])
    engine.layers_changed()
    return engine


def apply_predictors(engine: Engine, predictors, threshold: float | None = None, fmt: Format | None = None) -> Engine:
    """Predictor-gated sparse FFN, from a predictors file or loaded `Predictors` (the stored threshold unless given),
    their weights stored in `fmt` if given (--predictor-type)."""
    pred, threshold = sparse.resolve_predictors(engine.config, predictors, threshold)
    bundled(engine)
    engine.selector = Selector(engine.config.d_ffn, pred if fmt is None else quantize_predictors(pred, fmt), threshold)
    return engine
