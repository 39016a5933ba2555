"""Peak memory of activation profiling and sample collection besides the weights, on a random model of a real shape.

Writes a random fp16 checkpoint of the shape (memory-mapped by ref, so its pages are file-backed), runs profiling
and sample collection over a short synthetic corpus, and samples this process's anonymous resident memory
(RssAnon: everything but the mapped weights) every 50 ms.
"""

import json
import tempfile
import threading
import time
from pathlib import Path

import click
import numpy as np

from ref.common.config import ARCHITECTURES, SHAPES, shape_config
from ref.common.names import expected_shapes, hf_name
from ref.common.safetensors import write_safetensors
from ref.model import Model
from ref.profile import Reservoir, collect_samples, profile_activations


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakMemory(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = rss_anon_bytes(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(0.05)


class Tiled:
    """A [rows, cols] fp16 tensor whose values repeat one random block: what the writer reads, never all in memory."""

    def __init__(self, block: np.ndarray, shape: tuple[int, ...]):
        self.block, self.shape, self.dtype = block, shape, block.dtype

    def __getitem__(self, rows: slice) -> np.ndarray:
        cols = int(np.prod(self.shape[1:], dtype=np.int64))
        start, stop, _ = rows.indices(self.shape[0])
        return self.block[np.arange(start * cols, stop * cols) % self.block.size].reshape((stop - start, *self.shape[1:]))


def write_random_fp16(folder: Path, cfg_dict: dict, cfg) -> None:
    """A random fp16 checkpoint in HF layout, streamed tensor by tensor (one 64 MiB random block, tiled)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    block = (np.random.default_rng(0).standard_normal(1 << 25) * 0.02).astype(np.float16)
    tensors = {hf_name(cfg, n): Tiled(block, s) for n, s in expected_shapes(cfg).items()}
    write_safetensors(folder / "model.safetensors", tensors)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", type=click.Choice([n for n, raw in SHAPES.items() if ARCHITECTURES[raw["architectures"][0]] == "llama"]),
              default="llama-7b", show_default=True, help="A LLaMA-family shape (the checkpoint it writes is LLaMA's).")
@click.option("--tokens", default=512, show_default=True, help="Corpus tokens to profile and sample.")
@click.option("--samples", default=7000, show_default=True, help="Reservoir capacity (tokens per layer).")
@click.option("--window", default=256, show_default=True)
def main(shape, tokens, samples, window):
    """Measure peak anonymous memory of profiling + sample collection for a real model shape."""
    cfg = shape_config(shape)
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_act": "relu", "hidden_size": cfg.d_model,
           "intermediate_size": cfg.d_ffn, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        write_random_fp16(Path(tmp), raw, cfg)
        click.echo(f"wrote a random {shape} fp16 checkpoint in {time.time() - t0:.0f} s")
        base = rss_anon_bytes()
        watch = PeakMemory()
        watch.start()
        model = Model.load(tmp)
        rng = np.random.default_rng(0)
        windows = lambda: ((rng.integers(0, cfg.vocab_size, window), (i + 1) * window / tokens)  # noqa: E731
                           for i in range(tokens // window))
        t0 = time.time()
        profile_activations(model, windows())
        res = collect_samples(model, windows(), samples, 0)
        watch.running = False
        watch.join()
        reservoir = res.h.nbytes + res.bits.nbytes
        click.echo(f"{shape}: {cfg.n_layers} x {cfg.d_ffn}, {tokens} tokens, reservoir {samples} tokens "
                   f"({Reservoir.bytes_per_sample(cfg.n_layers, cfg.d_model, cfg.d_ffn) * samples / 2**30:.2f} GiB), "
                   f"{time.time() - t0:.0f} s")
        click.echo(f"peak anonymous memory besides the weights: {(watch.peak - base) / 2**30:.2f} GiB "
                   f"(reservoir {reservoir / 2**30:.2f} GiB allocated)")


if __name__ == "__main__":
    main()
