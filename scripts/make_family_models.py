"""Write the tiny test checkpoints of the other families and LLaMA's variants (OPT, Falcon; Llama-3's RoPE scaling,
Mistral's window, Qwen2, Qwen3), one per variant, with golden logits.

Each is a randomly initialised transformers model saved exactly as transformers saves it (`save_pretrained`:
config.json, generation_config.json, model.safetensors), the shipped model's tokenizer beside it, and
golden.safetensors: the logits transformers computes in float64 for fixed prompts (`prompts.{j}.ids`,
`prompts.{j}.logits`), the oracle tests/ref/test_families.py holds ref and fast to. Needs the `train` extra
(torch, transformers); nothing else imports them.

With `--llama-cpp DIR` (a llama.cpp source tree), each LLaMA-family variant also gets llama.cpp.gguf and
llama.cpp-q8_0.gguf: the folder as llama.cpp's own convert_hf_to_gguf.py writes it (f32, q8_0), which is what users
download. Its pre-tokenizer is named by
ref.common.tokenizer's table: the converter's list of tokenizer hashes does not know the shipped tokenizer.

    python scripts/make_family_models.py -o tests/families --llama-cpp ~/llama.cpp
"""

import json
import os
import shutil
import sys
from pathlib import Path

# Run as a file, this folder comes first on sys.path, and its profile.py would stand in for the standard library's
# `profile`, which torch imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "tiny-relu-llama"
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time", "a"]

COMMON = dict(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# variant -> (transformers config class, its fields): every block layout and q/k/v layout the loaders know.
VARIANTS = {
    "opt-pre-ln": ("OPTConfig", dict(ffn_dim=128, do_layer_norm_before=True)),
    "opt-post-ln": ("OPTConfig", dict(ffn_dim=128, do_layer_norm_before=False, word_embed_proj_dim=16)),
    "falcon-gqa": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=True,
                                        ffn_hidden_size=128, activation="relu")),
    "falcon-multi-query": ("FalconConfig", dict(multi_query=True, parallel_attn=True, bias=False, ffn_hidden_size=128,
                                                activation="relu")),
    "falcon-interleaved": ("FalconConfig", dict(multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=128,
                                                activation="relu")),
    # Llama-3's RoPE: with head_dim 8 and theta 100 the wavelengths are 6.3, 20, 63 and 199 positions, so that an
    # original context of 32 with factors 4 (high) and 1 (low) keeps one frequency, smooths one and divides two
    "llama3-rope": ("LlamaConfig", dict(intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 32})),
    "llama-linear-rope": ("LlamaConfig", dict(intermediate_size=128, num_key_value_heads=2,
                                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                               "factor": 4.0})),
    "mistral-window": ("MistralConfig", dict(intermediate_size=128, num_key_value_heads=2, sliding_window=32)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, num_key_value_heads=2, head_dim=16)),
}
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "pad_token": "<unk>"}
# The variants llama.cpp's converter writes as architectures our GGUF reader knows (llama, qwen2, qwen3).
GGUF_VARIANTS = tuple(name for name, (cls, _) in VARIANTS.items()
                      if cls in ("LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config"))


def make(name: str, out: Path, seed: int) -> None:
    import torch
    import transformers
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    cls, fields = VARIANTS[name]
    cfg = getattr(transformers, cls)(**COMMON, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # weights large enough that every layer matters; biases and norms not at their init
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif p.ndim == 1:
                p.copy_(1 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(SHIPPED / "tokenizer.json", out / "tokenizer.json")
    # its special tokens named, or transformers' Qwen2 tokenizer would add its own <|endoftext|> past the vocabulary
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    gold = {}
    model = model.double()
    for j, prompt in enumerate(PROMPTS):
        ids = [cfg.bos_token_id, *tok.encode(prompt, add_special_tokens=False).ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        gold[f"prompts.{j}.ids"] = np.asarray(ids, dtype=np.int64)
        gold[f"prompts.{j}.logits"] = logits.float().numpy()
    tmp = out / "golden.safetensors.tmp"
    save_file(gold, str(tmp))
    os.replace(tmp, out / "golden.safetensors")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=ROOT / "tests" / "families",
              show_default=True, help="Folder to write one model folder per variant into.")
@click.option("--variant", "variants", multiple=True, type=click.Choice(list(VARIANTS)),
              help="Only these variants [default: all].")
@click.option("--seed", default=0, show_default=True)
@click.option("--llama-cpp", "llama_cpp", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A llama.cpp source tree: also write each LLaMA-family variant with its convert_hf_to_gguf.py.")
def main(out_dir: Path, variants, seed: int, llama_cpp: Path | None) -> None:
    """Write the tiny test checkpoints with golden logits."""
    for name in variants or VARIANTS:
        make(name, out_dir / name, seed)
        if llama_cpp is not None and name in GGUF_VARIANTS:
            for outtype, file in (("f32", "llama.cpp.gguf"), ("q8_0", "llama.cpp-q8_0.gguf")):
                llama_cpp_gguf(llama_cpp, out_dir / name, out_dir / name / file, outtype)
        click.echo(f"{out_dir / name}: written")


def llama_cpp_gguf(llama_cpp: Path, folder: Path, out: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `folder`, in this process, its matrices in `outtype` (f32, q8_0)."""
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py"), str(ROOT)]
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from ref.common.tokenizer import pre_tokenizer_name
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer_name(
        json.loads((self.dir_model / "tokenizer.json").read_text(encoding="utf-8")))
    argv, sys.argv = sys.argv, ["convert_hf_to_gguf.py", str(folder), "--outtype", outtype, "--outfile", str(out)]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


if __name__ == "__main__":
    main()
