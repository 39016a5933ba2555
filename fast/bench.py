"""Decode benchmark pieces: synthetic real-shape models, power-law active sets, and a read-bandwidth probe.

Dimensions: D d_model, F FFN neurons, H/K query/key-value heads, E head dim, V vocab, L layers, R predictor hidden.
"""

import dataclasses
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from pathlib import Path

import numpy as np

from fast import cpu
from fast.engine import Engine, Selector, apply_activation_sparsity, dense_ffn, joined
from fast.layers import Thin
from placement.synthetic import firing
from ref.common.artifacts import Predictors
from ref.common.batch import Batch
from ref.common.config import ModelConfig
from ref.common.errors import UserError
from ref.common.formats import FORMATS, Format
from ref.common.gguf_io import Planned, model_kv, rope_freqs, write_gguf
from ref.common.names import expected_shapes, gguf_architecture, gguf_name
from ref.common.weights import Weights
from ref.quant import Quantized, quantize

F32 = np.float32


class RandomTensors(Mapping):
    """A config's tensors by our names (ref.common.names.expected_shapes), each drawn when it is read: matrices
    uniform with values scaled to keep activations O(1), norms 1, biases 0. Laid out by Engine.load, they make a
    synthetic model of any family holding one tensor at a time beside the layout."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.shapes, self.seed = expected_shapes(cfg), seed

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if len(shape) == 1:
            return (np.zeros if name.endswith(".bias") else np.ones)(shape, F32)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return (rng.random(shape, dtype=F32) - F32(0.5)) * F32(2 * np.sqrt(3 / shape[-1]))

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def random_engine(cfg: ModelConfig, threads: int, seed: int = 0, fmt: Format | None = None) -> Engine:
    """Random weights laid out as Engine.load lays out a checkpoint, in `fmt` (default float32): converted a layer
    at a time, so that a 7B shape in q4_0 never holds the model in float32."""
    return Engine.load(Weights(cfg, RandomTensors(cfg, seed)), threads, fmt)


def twin(engine: Engine) -> Engine:
    """A new engine on the same arrays, each layer's record its own: a transform of it replaces arrays in its layers
    only (what it lays out again is one more copy of those)."""
    e = engine
    return Engine(e.config, [dataclasses.replace(L) for L in e.layers], e.embed, e.norm, e.lm_head, e.threads, e.format,
                  e.norm_b, e.pos_embed, e.project_in, e.project_out)


def dense_twin(engine: Engine) -> Engine:
    """The engine's weights laid out for a dense run as fast.run lays them out (dense_ffn, no predictors), sharing
    all but the FFN layout with it: one more FFN's memory at most."""
    return dense_ffn(twin(engine))


def server_twin(engine: Engine) -> Engine:
    """The engine's arrays with the server's kernels (`gemm` off: fast.cpu's only, a token the same bits beside any
    others)."""
    served = twin(engine)
    served.selector, served.kv_types, served.gemm = engine.selector, engine.kv_types, False
    return served


@dataclass
class WatchedThin(Thin):
    """A layer's activation-sparsity sites that keep each site's scores |x| w while `watching` (thinned_twin)."""

    scores: list = field(default_factory=lambda: [[] for _ in range(4)])
    watching: bool = True

    def inputs(self, out: np.ndarray, ids: np.ndarray, x: np.ndarray, site: int) -> int:
        if self.watching:
            self.scores[site].append(np.abs(x) * self.w[site])
        return super().inputs(out, ids, x, site)

    def activations(self, a: np.ndarray, ids: np.ndarray, gu: np.ndarray, bu: np.ndarray, kind: int, thr) -> int:
        n = super().activations(a, ids, gu, bu, kind, thr)
        if self.watching:  # at t = 0 only its zeros are dropped, which are 0 here too
            self.scores[3].append(np.abs(a) * self.w[3])
        return n


def thinned_twin(engine: Engine, sparsity: float, ffn: bool, tokens: int = 4) -> Engine:
    """The engine's weights with activation sparsity (TEAL), thresholds drawn so that `sparsity` of each site's
    inputs is dropped on its first decode tokens (random weights have no corpus to be calibrated on): thinned at
    t = 0, `tokens` steps run with each site's scores watched (WatchedThin), then each threshold set to their
    quantile. The FFN's sites too where `ffn` (else the engine's predictors keep it)."""
    thinned = twin(engine)
    thinned.selector = engine.selector
    apply_activation_sparsity(thinned, "teal", np.zeros((engine.config.n_layers, 4), F32), ffn, thin_type=WatchedThin)
    decode_tok_s(thinned, tokens)
    for L in thinned.layers:
        thin = L.attn.thin
        for s, seen in enumerate(thin.scores):
            if seen:
                thin.t[s] = np.quantile(np.concatenate([v.ravel() for v in seen]), sparsity)
        thin.watching, thin.scores = False, None
    return thinned


class SyntheticSelector(Selector):
    """The engines run its real-size predictor (their cost is real); its pick is an active set drawn from a power-law
    neuron frequency profile with mean size (1 - sparsity) F: p_i ∝ rank_i^-alpha, capped at 1. Each call draws the
    next of `pool` pre-drawn sets of the layer, so the tokens of a batch get different sets."""

    ahead = True  # the pick ignores the logits

    def __init__(self, pred: Predictors, cfg: ModelConfig, sparsity: float, seed: int = 0, pool: int = 128,
                 alpha: float = 1.0):
        super().__init__(cfg.d_ffn, pred, 0.0)
        rng = np.random.default_rng(seed)
        F = cfg.d_ffn
        p = firing(F, sparsity, alpha)
        # Per layer a fixed permutation decides which neurons are hot; each token draws neuron i with p[perm[i]].
        self.sets = [[np.flatnonzero(rng.random(F) < p[perm]).astype(np.int32) for _ in range(pool)]
                     for perm in (rng.permutation(F) for _ in range(cfg.n_layers))]
        self.masks = []  # per layer [pool, F] uint8: the sets as rows, for pick_rows
        for layer in self.sets:
            m = np.zeros((pool, F), np.uint8)
            for i, s in enumerate(layer):
                m[i, s] = 1
            self.masks.append(m)
        # Draw k of every layer joined as given_sets returns them: a real predictor's step has no such work to do
        self.joined = [joined([layer[k] for layer in self.sets]) for k in range(pool)]
        self.calls = [0] * cfg.n_layers

    def pick(self, l: int, logits: np.ndarray) -> np.ndarray:
        """The next pre-drawn active set of layer l, whatever the predictor said."""
        self.calls[l] += 1
        return self.sets[l][self.calls[l] % len(self.sets[l])]

    def given_sets(self, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's next set (pick), joined as Selector.given_sets returns them."""
        k = self.calls[0] + 1
        if self.calls != [k - 1] * n_layers:
            return super().given_sets(n_layers)
        self.calls = [k] * n_layers
        return self.joined[k % len(self.joined)]

    def pick_rows(self, l: int, logits: np.ndarray, T: int) -> np.ndarray:
        """The next T sets of layer l as a mask [T, F], at once (a real predictor's threshold is one comparison)."""
        rows = (self.calls[l] + 1 + np.arange(T)) % len(self.sets[l])
        self.calls[l] += T
        return self.masks[l][rows]

    def mean_active(self) -> float:
        return float(np.mean([len(s) for layer in self.sets for s in layer]))

    def mean_union(self, n: int) -> float:
        """Mean size of the union of n consecutive sets of a layer: the neurons a batch of n tokens reads."""
        sizes = [len(np.unique(np.concatenate([layer[(i + k) % len(layer)] for k in range(n)])))
                 for layer in self.sets for i in range(0, len(layer), n)]
        return float(np.mean(sizes))


def synthetic_predictors(cfg: ModelConfig, R: int, seed: int = 0) -> Predictors:
    rng = np.random.default_rng(seed)
    return Predictors([(rng.random((R, cfg.d_model), dtype=F32) - F32(0.5)) for _ in range(cfg.n_layers)],
                      [(rng.random((cfg.d_ffn, R), dtype=F32) - F32(0.5)) for _ in range(cfg.n_layers)], 0.0, {})


class ReadProbe:
    """Streaming-read bandwidth of this machine in GB/s: one pass over a fixed array (numba prange, 4 rows in
    flight per worker), the roofline's denominator."""

    def __init__(self, gib: float = 1.0):
        cols = 1 << 14
        rows = max(4, int(gib * 2**30 / 4 / cols) // 4 * 4)
        self.a, self.out = np.ones((rows, cols), F32), np.empty(rows // 4, F32)
        cpu.read_bandwidth_probe(self.out, self.a)  # compile and fault the pages in

    def __call__(self) -> float:
        t0 = time.perf_counter()
        cpu.read_bandwidth_probe(self.out, self.a)
        return self.a.nbytes / (time.perf_counter() - t0) / 1e9


def prompt_tokens(n: int, vocab: int) -> np.ndarray:
    """A benchmark's prompt of n tokens, at least one (a decode round's at its depth, a timed prefill's)."""
    return (np.arange(max(n, 1)) * 7 + 1) % vocab


def bracketed_decode(engines: dict, probe: ReadProbe, tokens: int, seed: int = 0, peer=None, depth: int = 0,
                     held: dict | None = None) -> dict:
    """One round: `tokens` decode steps for each engine in turn (each with its own selector; and for the `peer`,
    llama.cpp, if given), every token between two probe passes, after a prompt of `depth` tokens. With `held`, each
    engine's prefilled cache is kept there and later rounds start from it again (their steps overwrite the last
    round's), as the peer rewinds its own: a long prompt is run once.

    On a shared machine the bandwidth a token gets moves within a second, so each token is compared with the
    passes just before and after it (`around`), and the engines with each other step by step. Returns per
    engine the token seconds and the mean of the passes around each token, and all passes (`probes`)."""
    V = next(iter(engines.values())).config.vocab_size
    prompt, held = prompt_tokens(depth, V), {} if held is None else held
    steps = {}
    for name, engine in engines.items():
        cache = held.get(name)
        if cache is None:
            cache = held[name] = engine.new_cache(len(prompt) + tokens)
            engine.forward(Batch.single(prompt, cache), cache)
        cache.lengths[0] = len(prompt)

        def step(token, engine=engine, cache=cache):
            engine.forward(Batch.single([token], cache), cache)
        steps[name] = step
    if peer is not None:
        if held.get(peer.name) is None:
            peer.prefill(prompt)
            held[peer.name] = True
        peer.rewind(len(prompt))
        steps[peer.name] = peer.step
    out = {name: {"seconds": [], "around": []} for name in steps}
    probes = [probe()]
    for i in range(tokens):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step((7 * i + seed) % V)
            out[name]["seconds"].append(time.perf_counter() - t0)
            probes.append(probe())
            out[name]["around"].append((probes[-2] + probes[-1]) / 2)
    return {**out, "probes": probes}


class LlamaCpp:
    """llama.cpp through llama-cpp-python (an optional extra: pip install -e '.[peer]'), decoding a GGUF one token at
    a time on the CPU: the peer `scripts/bench.py --peer` times in the same run."""

    name = "llama.cpp"

    def __init__(self, path, threads: int, n_ctx: int, kv=("f16", "f16")):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise UserError("--peer needs llama-cpp-python (pip install -e '.[peer]'; it compiles llama.cpp)") from None
        k, v = (FORMATS[name] for name in kv)
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                         type_k=k.ggml_type, type_v=v.ggml_type, flash_attn=v.quantized,  # its quantized V needs it
                         verbose=False)

    def step(self, token: int) -> None:
        self.llm.eval([token])

    def prefill(self, tokens) -> None:
        """A prompt from an empty cache, in llama.cpp's batches."""
        self.llm.reset()
        self.llm.eval([int(t) for t in tokens])

    def rewind(self, n: int) -> None:
        """Keep the first n cached positions: the next step writes position n (eval drops the cache past it)."""
        self.llm.n_tokens = n


def prefill_rounds(engines: dict, n: int, runs: int, peer=None) -> dict:
    """Seconds of an n-token prompt from an empty cache, per engine (and the peer), the runs interleaved."""
    tokens = prompt_tokens(n, next(iter(engines.values())).config.vocab_size)
    out = {name: [] for name in [*engines, *([peer.name] if peer else [])]}
    for _ in range(runs + 1):  # the first round compiles
        for name, engine in engines.items():
            cache = engine.new_cache(n)
            t0 = time.perf_counter()
            engine.forward(Batch.single(tokens, cache), cache)
            out[name].append(time.perf_counter() - t0)
        if peer is not None:
            t0 = time.perf_counter()
            peer.prefill(tokens)
            out[peer.name].append(time.perf_counter() - t0)
    return {name: seconds[1:] for name, seconds in out.items()}


def sequence_rounds(engines: dict, B: int, tokens: int, runs: int) -> dict:
    """Seconds of `tokens` steps of B sequences decoding together (one token each per step, one forward), per
    engine, the runs interleaved; each sequence starts from a one-token prompt."""
    out = {name: [] for name in engines}
    for r in range(runs + 1):  # the first round compiles
        for name, engine in engines.items():
            V, cache = engine.config.vocab_size, engine.new_cache(tokens + 1, slots=B)
            engine.forward(Batch.of([(s, [1 + s]) for s in range(B)], cache), cache)
            t0 = time.perf_counter()
            for i in range(tokens):
                engine.forward(Batch.of([(s, [(7 * i + 13 * s + r) % V]) for s in range(B)], cache), cache)
            out[name].append(time.perf_counter() - t0)
    return {name: seconds[1:] for name, seconds in out.items()}


def random_gguf(cfg: ModelConfig, fmt: Format, path, seed: int = 0) -> int:
    """A llama.cpp GGUF of this shape and format with random weights (values do not change a dense token's time;
    block scales kept small), and a SentencePiece vocabulary of the right size. Returns its size."""
    rng = np.random.default_rng(seed)

    def tensor(shape):
        if len(shape) == 1:
            return np.ones(shape, F32)
        if fmt.quantized:
            b = np.zeros((*shape[:-1], shape[-1] // fmt.block), fmt.dtype)
            b["d"] = np.float16(0.01).view(np.uint16)
            b["qs"] = rng.integers(0, 256, b["qs"].shape, dtype=np.uint8).view(b["qs"].dtype)
            return Quantized(fmt, b.view(np.uint8), shape)
        return quantize(rng.standard_normal(shape, dtype=F32) * F32(0.02), fmt)

    planned = [Planned(gguf_name(cfg, n), s, fmt if len(s) == 2 else FORMATS["f32"], lambda s=s: tensor(s))
               for n, s in expected_shapes(cfg).items()]
    V = cfg.vocab_size
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(V - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)
    kv = model_kv(cfg, fmt, "random") + [
        ("add_tokenizer_model", "llama"), ("add_token_list", tokens), ("add_token_scores", [0.0] * V),
        ("add_token_types", types), ("add_bos_token_id", 1), ("add_eos_token_id", 2), ("add_unk_token_id", 0)]
    return write_gguf(Path(path), "gguf", gguf_architecture(cfg), kv, rope_freqs(cfg) + planned)


@contextmanager
def busy_cores(n: int):
    """n processes spinning on the CPU while the block runs: a machine something else uses too (bench.py --busy)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # let them start spinning before anything measures the cores
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def bytes_per_token(engine: Engine, active_neurons: float, kept: float = 1.0, depth: int = 0) -> float:
    """Bytes a decode step reads: attention, the active neurons' FFN rows (bundles, or the dense layout's rows), the
    engine's predictors, lm_head; of matrices whose inputs are thinned (activation sparsity), the `kept` share of
    their rows; and the keys and values of `depth` cached positions in the engine's KV formats."""
    c, L0, selector = engine.config, engine.layers[0], engine.selector
    attn, ffn = L0.attn.nbytes(kept), L0.ffn.nbytes(active_neurons / c.d_ffn, kept)
    pred = sum(a.nbytes + b.nbytes for a, b in zip(selector.fc1, selector.fc2)) if selector.predicts else 0
    kv = depth * c.n_kv_heads * sum(FORMATS[name].row_bytes(c.head_dim) for name in engine.kv_types)
    return c.n_layers * (attn + ffn + kv) + pred + engine.lm_head.nbytes


def decode_tok_s(engine: Engine, tokens: int, seed: int = 0) -> float:
    """Decode tok/s of one run: `tokens` one-token steps after a one-token prompt."""
    cache = engine.new_cache(tokens + 1)
    engine.forward(Batch.single([1], cache), cache)
    t0 = time.perf_counter()
    for i in range(tokens):
        engine.forward(Batch.single([(7 * i + seed) % engine.config.vocab_size], cache), cache)
    return tokens / (time.perf_counter() - t0)


def time_decode(engine: Engine, tokens: int, runs: int) -> list[float]:
    """Decode tok/s of `runs` runs of `tokens` steps each, after one warm-up run."""
    decode_tok_s(engine, tokens)
    return [decode_tok_s(engine, tokens, r) for r in range(1, runs + 1)]


def overhead_per_token(cfg: ModelConfig, threads: int, tokens: int = 32) -> float:
    """Seconds per sparse decode step (predictors included) of the same depth with near-empty matrices: Python and
    kernel-dispatch overhead."""
    tiny = ModelConfig(**{**cfg.__dict__, "d_model": 16, "d_ffn": 16, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8,
                          "vocab_size": 16})
    e = random_engine(tiny, threads)
    e.selector = SyntheticSelector(synthetic_predictors(tiny, 16), tiny, 0.5)
    return 1.0 / np.median(time_decode(e, tokens, 5))
