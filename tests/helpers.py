"""Shared test helpers: the one comparison helper and random HF-layout model folders."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from ref.common.safetensors import write_safetensors
from ref.common.sampling import Processor

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "tiny-relu-llama"
SHIPPED_SILU = ROOT / "data" / "tiny-silu-llama"  # its SwiGLU twin (activation sparsity's accuracy)
# The tiny OPT and Falcon checkpoints (scripts/make_family_models.py), one per variant, with golden logits.
FAMILIES = ROOT / "tests" / "families"
VARIANTS = ["opt-pre-ln", "opt-post-ln", "falcon-gqa", "falcon-multi-query", "falcon-interleaved"]  # ReLU FFNs
# LLaMA-family variants (SwiGLU: dense only): Llama-3's and linear RoPE scaling, Mistral's window, Qwen2, Qwen3
DENSE_VARIANTS = ["llama3-rope", "llama-linear-rope", "mistral-window", "qwen2", "qwen3"]
HAS_GPU = os.path.exists("/dev/nvidiactl")  # decided before numba is imported (tests/conftest.py)

SMALL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "relu",
    "hidden_size": 32, "intermediate_size": 100, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "vocab_size": 50, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float16",
}


def load_script(name: str):
    """scripts/NAME.py as a module (its click command is `.main`)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_close(actual, expected, rtol=1e-4, atol=0.0, name="value"):
    """Shape, dtype-agnostic ‖a−b‖/‖b‖ ≤ rtol (plus atol); prints max abs diff and first values on failure."""
    a, b = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    if a.size == 0:
        return
    err = np.linalg.norm(a - b)
    ref = np.linalg.norm(b)
    assert err <= rtol * ref + atol, (
        f"{name}: ‖a−b‖/‖b‖ = {err / max(ref, 1e-300):.3e} > {rtol:.1e}; max |a−b| = {np.abs(a - b).max():.3e}\n"
        f"  actual   {a.ravel()[:6]}\n  expected {b.ravel()[:6]}")


def random_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights for a LLaMA config, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, K = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    E = cfg.get("head_dim") or D // H
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = mat(V, D)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = mat(H * E, D)
        t[p + "self_attn.k_proj.weight"] = mat(K * E, D)
        t[p + "self_attn.v_proj.weight"] = mat(K * E, D)
        t[p + "self_attn.o_proj.weight"] = mat(D, H * E)
        t[p + "mlp.gate_proj.weight"] = mat(F, D)
        t[p + "mlp.up_proj.weight"] = mat(F, D)
        t[p + "mlp.down_proj.weight"] = mat(D, F)
    return t


def write_model(folder: Path, overrides: dict | None = None, dtype: str = "F16", shards: int = 1, seed: int = 0,
                tensors: dict | None = None) -> Path:
    """A random model folder in HF layout (config.json plus one file or `shards` shards with an index)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**SMALL_CONFIG, **(overrides or {})}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = random_tensors(cfg, seed) if tensors is None else tensors
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, dtype=dtype)
        return folder
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(folder / fname, part, dtype=dtype)
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def variant_copy(folder: Path, variant: str, config: dict | None = None, rename=None, drop=(), add=None) -> Path:
    """A copy of a family test checkpoint with its config.json changed (keys mapped to None are removed) and its
    tensors renamed (`rename(name) -> name`), dropped or added."""
    from safetensors.numpy import load_file, save_file
    src = FAMILIES / variant
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    for k, v in (config or {}).items():
        raw.pop(k, None) if v is None else raw.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(raw))
    tensors = {(rename or (lambda n: n))(n): t for n, t in load_file(src / "model.safetensors").items() if n not in drop}
    save_file({**tensors, **(add or {})}, str(folder / "model.safetensors"))
    return folder


def turbosparse(folder, drop_layer=None):
    """A Bamboo checkpoint that carries its predictors (mlp.predictor.fc1 / fc2, as TurboSparse's files do), and
    TurboSparse's stop token in tokenizer_config.json only."""
    cfg = {**SMALL_CONFIG, "architectures": ["BambooForCausalLM"], "model_type": "bamboo"}
    t = random_tensors(cfg, seed=2)
    rng = np.random.default_rng(3)
    for l in range(cfg["num_hidden_layers"]):
        if l != drop_layer:
            t[f"model.layers.{l}.mlp.predictor.fc1.weight"] = rng.standard_normal((6, 32)).astype(np.float32)
        t[f"model.layers.{l}.mlp.predictor.fc2.weight"] = rng.standard_normal((100, 6)).astype(np.float32)
    write_model(folder, cfg, tensors=t)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return folder


def write_gguf(path, arch="llama", tensors=(), magic=b"GGUF", **kv):
    """A GGUF file of `tensors` (name, data, raw dtype) and metadata `kv` (GGUFWriter.add_KEY(value)); another
    magic written over GGUF's when asked."""
    import gguf
    w = gguf.GGUFWriter(path, arch)
    for k, v in kv.items():
        getattr(w, f"add_{k}")(v)
    for name, data, raw in tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if magic != b"GGUF":
        with open(path, "r+b") as f:
            f.write(magic)
    return path


def serve_requests(sched, requests, timeout: float = 120) -> list[list]:
    """Submit `requests` to a started scheduler at once, wait for each one's last event: each one's events."""
    import threading
    assert sched.ready.wait(timeout)
    done, events = threading.Event(), {id(r): [] for r in requests}
    for r in requests:
        def emit(ev, r=r):
            events[id(r)].append(ev)
            if all(e and e[-1][0] in ("done", "error") for e in events.values()):
                done.set()
        r.emit = emit
        sched.submit(r)
    assert done.wait(timeout)
    return [events[id(r)] for r in requests]


class Ban(Processor):
    """A logits processor with state: `token` never drawn, and `seen` every token it is told was taken."""

    def __init__(self, token: int):
        self.token, self.seen = token, []

    def __call__(self, z, prompt, out):
        z = z.copy()
        z[self.token] = -np.inf
        return z

    def accept(self, token):
        self.seen.append(token)
