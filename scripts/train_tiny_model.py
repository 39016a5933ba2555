"""Train a shipped tiny LLaMA on TinyStories and write it in plain HF layout: the ReLU one (ReGLU FFN,
data/tiny-relu-llama) or its SwiGLU twin (--act silu, data/tiny-silu-llama), same corpus, tokenizer and recipe.

Needs the optional `train` extra (PyTorch). Everything here is self-contained on purpose: the model
below is an independent implementation of the LLaMA forward pass, so the golden logits it writes
are a check on `ref/`, not a copy of it.

Dimensions: B batch, T tokens, D d_model, H/K query/kv heads, E head dim, F FFN neurons, V vocab.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

try:
    import torch
    import torch.nn.functional as nnf
except ImportError:
    sys.exit("train_tiny_model.py: PyTorch is missing; install the extra: pip install -e '.[train]'")

from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

STORY_SEP = "<|endoftext|>"
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in LLaMA
GOLDEN_PROMPTS = [
    "once upon a time, there was a little girl named lily.",
    "the dog ran to the park and",
    "tom and his mom went to the store. they wanted to buy",
    "one day, a big red ball",
]


def read_stories(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [s.strip() for s in text.split(STORY_SEP) if s.strip()]


def train_tokenizer(stories: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stories, trainer=trainer)
    tok.normalizer = normalizers.Lowercase()  # the corpus is lowercase: a prompt is read as the model was trained
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def token_stream(tok: Tokenizer, stories: list[str]) -> np.ndarray:
    """Every story as <s> story </s>, concatenated."""
    out = []
    for enc in tok.encode_batch(stories, add_special_tokens=False):
        out.extend([1, *enc.ids, 2])
    return np.asarray(out, dtype=np.int64)


ACTS = {"relu": torch.relu, "silu": nnf.silu}  # the FFN gate's activation, HF's hidden_act names


class TinyLlama(torch.nn.Module):
    """LLaMA with a gated FFN act(gate) * up (ReGLU or SwiGLU), parameter names as in HF's LlamaForCausalLM."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        E = D // H
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.embed_tokens = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg["num_hidden_layers"]):
            layer = torch.nn.Module()
            layer.input_layernorm = torch.nn.Parameter(torch.ones(D))
            layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj = lin(D, H * E), lin(D, K * E), lin(D, K * E), lin(H * E, D)
            layer.post_attention_layernorm = torch.nn.Parameter(torch.ones(D))
            layer.gate_proj, layer.up_proj, layer.down_proj = lin(D, F), lin(D, F), lin(F, D)
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(D))
        self.lm_head = lin(D, V)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)

    def rmsnorm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * w

    def rope(self, x, pos):  # x: [B, h, T, E]; HF rotate-half convention
        E = x.shape[-1]
        inv_freq = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, E, 2, dtype=torch.float64) / E))
        ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, E/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
        x1, x2 = x[..., : E // 2], x[..., E // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids):  # ids: [B, T] -> logits [B, T, V]
        cfg = self.cfg
        B, T = ids.shape
        H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        pos = torch.arange(T)
        x = self.embed_tokens(ids)  # [B, T, D]
        for L in self.layers:
            h = self.rmsnorm(x, L.input_layernorm)
            q = L.q_proj(h).view(B, T, H, -1).transpose(1, 2)  # [B, H, T, E]
            k = L.k_proj(h).view(B, T, K, -1).transpose(1, 2)  # [B, K, T, E]
            v = L.v_proj(h).view(B, T, K, -1).transpose(1, 2)
            q, k = self.rope(q, pos), self.rope(k, pos)
            k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
            att = nnf.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, E]
            x = x + L.o_proj(att.transpose(1, 2).reshape(B, T, -1))
            h = self.rmsnorm(x, L.post_attention_layernorm)
            x = x + L.down_proj(ACTS[cfg["hidden_act"]](L.gate_proj(h)) * L.up_proj(h))
        return self.lm_head(self.rmsnorm(x, self.norm))

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm,
               "lm_head.weight": self.lm_head.weight}
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = L.input_layernorm
            out[p + "post_attention_layernorm.weight"] = L.post_attention_layernorm
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{n}.weight"] = getattr(L, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{n}.weight"] = getattr(L, n).weight
        return {k: v.detach().cpu().numpy() for k, v in out.items()}

    def load_hf_state_dict(self, sd: dict[str, np.ndarray]):
        own = self.hf_state_dict()
        assert own.keys() == sd.keys()
        with torch.no_grad():
            named = dict(self.named_parameters())
            mapping = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm", "lm_head.weight": "lm_head.weight"}
            for i in range(len(self.layers)):
                p = f"model.layers.{i}."
                mapping[p + "input_layernorm.weight"] = f"layers.{i}.input_layernorm"
                mapping[p + "post_attention_layernorm.weight"] = f"layers.{i}.post_attention_layernorm"
                for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    mapping[p + f"self_attn.{n}.weight"] = f"layers.{i}.{n}.weight"
                for n in ("gate_proj", "up_proj", "down_proj"):
                    mapping[p + f"mlp.{n}.weight"] = f"layers.{i}.{n}.weight"
            for hf_name, own_name in mapping.items():
                named[own_name].copy_(torch.from_numpy(sd[hf_name].astype(np.float32)))


@torch.no_grad()
def evaluate(model: TinyLlama, stream: np.ndarray, seq: int, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy over non-overlapping windows of `seq` tokens."""
    model.eval()
    n = (len(stream) - 1) // seq
    n = n if max_windows is None else min(n, max_windows)
    total, count = 0.0, 0
    for s in range(0, n, 8):
        idx = np.arange(s, min(n, s + 8))[:, None] * seq + np.arange(seq + 1)[None, :]
        batch = torch.from_numpy(stream[idx])
        logits = model(batch[:, :-1])
        loss = nnf.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def activation_stats(model: TinyLlama, stream: np.ndarray, seq: int, windows: int) -> list[dict]:
    """Per layer: mean fraction of FFN neurons firing per token, and the fraction of neurons covering 80% of firings."""
    F = model.cfg["intermediate_size"]
    counts = [torch.zeros(F, dtype=torch.float64) for _ in model.layers]
    fired = [0.0 for _ in model.layers]
    tokens = 0
    hooks = []
    for i, L in enumerate(model.layers):
        def hook(mod, inp, out, i=i):
            on = (out > 0).reshape(-1, F)
            counts[i] += on.sum(0).double()
            fired[i] += on.sum().item()
        hooks.append(L.gate_proj.register_forward_hook(hook))
    n = min((len(stream) - 1) // seq, windows)
    for s in range(n):
        model(torch.from_numpy(stream[None, s * seq:(s + 1) * seq]))
        tokens += seq
    for h in hooks:
        h.remove()
    stats = []
    for i in range(len(model.layers)):
        c = torch.sort(counts[i], descending=True).values
        cover = int(torch.searchsorted(torch.cumsum(c, 0) / c.sum(), torch.tensor([0.8], dtype=torch.float64)).item()) + 1
        stats.append({"layer": i, "fired_fraction": fired[i] / tokens / F, "neurons_for_80pct": cover / F})
    return stats


def golden(model_dir: Path, cfg: dict, tok: Tokenizer) -> dict[str, np.ndarray]:
    """Logits for fixed prompts from the stored fp16 weights, computed here in float64."""
    from safetensors.numpy import load_file
    model = TinyLlama(cfg).double()
    sd = load_file(model_dir / "model.safetensors")
    model.load_hf_state_dict(sd)
    model.double()
    out = {}
    for j, prompt in enumerate(GOLDEN_PROMPTS):
        ids = [1, *tok.encode(prompt, add_special_tokens=False).ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        out[f"prompts.{j}.ids"] = np.asarray(ids, dtype=np.int64)
        out[f"prompts.{j}.logits"] = logits.float().numpy()
    return out


def atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--corpus", type=click.Path(path_type=Path), default=None, help="Corpus folder with train.txt and val.txt [default: data/corpus].")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Model folder to write.")
@click.option("--force", is_flag=True, help="Write into OUT even if it holds files (the shipped model's folder, say).")
@click.option("--layers", default=6, show_default=True)
@click.option("--d-model", default=256, show_default=True)
@click.option("--ffn", default=1024, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=4, show_default=True)
@click.option("--ctx", default=512, show_default=True)
@click.option("--vocab", default=4096, show_default=True)
@click.option("--batch", default=16, show_default=True)
@click.option("--steps", default=1200, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--eval-every", default=100, show_default=True)
@click.option("--seed", default=1234, show_default=True)
@click.option("--threads", default=os.cpu_count(), show_default=True)
@click.option("--act", type=click.Choice(sorted(ACTS)), default="relu", show_default=True,
              help="The FFN's gate activation: relu (ReGLU, the shipped tiny-relu-llama) or silu (SwiGLU, its twin).")
def main(corpus, out_dir, force, layers, d_model, ffn, heads, kv_heads, ctx, vocab, batch, steps, lr, eval_every, seed,
         threads, act):
    """Train the tiny LLaMA and write config.json, model.safetensors (fp16), tokenizer.json, golden.safetensors."""
    settings = dict(layers=layers, d_model=d_model, ffn=ffn, heads=heads, kv_heads=kv_heads, ctx=ctx, vocab=vocab,
                    batch=batch, steps=steps, lr=lr, seed=seed, threads=threads, act=act)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise click.UsageError(f"-o/--out {out_dir} holds files: pass --force to write over them")
    if corpus is None:
        corpus = Path(__file__).resolve().parents[1] / "data" / "corpus"
    for name in ("train.txt", "val.txt"):
        if not (corpus / name).is_file():
            raise click.UsageError(f"--corpus: {corpus / name} not found")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    train_stories, val_stories = read_stories(corpus / "train.txt"), read_stories(corpus / "val.txt")
    tok = train_tokenizer(train_stories, vocab)
    train, val = token_stream(tok, train_stories), token_stream(tok, val_stories)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, train {len(train):,} tokens, val {len(val):,} tokens ({time.time() - t0:.1f} s)")

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": act,
        "hidden_size": d_model, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d_model // heads,
        "max_position_embeddings": ctx, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "vocab_size": tok.get_vocab_size(), "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
    }
    model = TinyLlama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))

    history = []
    t_train = time.time()
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(train) - ctx - 1, size=batch)
        chunk = torch.from_numpy(train[starts[:, None] + np.arange(ctx + 1)[None, :]])
        logits = model(chunk[:, :-1])
        loss = nnf.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0:
            el = time.time() - t_train
            print(f"step {step}/{steps} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{step * batch * ctx / el:,.0f} tok/s", flush=True)
        if step % eval_every == 0 or step == steps:
            vl = evaluate(model, val, ctx, max_windows=None if step == steps else 48)
            history.append({"step": step, "tokens": step * batch * ctx, "val_loss": vl, "seconds": time.time() - t_train})
            print(f"  eval step {step}: val loss {vl:.4f}", flush=True)
    train_seconds = time.time() - t_train

    sd = {k: v.astype(np.float16) for k, v in model.hf_state_dict().items()}
    # Score the model exactly as shipped: fp16 weights, upcast.
    model.load_hf_state_dict(sd)
    val_loss = evaluate(model, val, ctx)
    stats = activation_stats(model, val, ctx, windows=64)

    atomic_write(out_dir / "model.safetensors", lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
    atomic_write(out_dir / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    atomic_write(out_dir / "generation_config.json",
                 lambda p: p.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_length": ctx}, indent=2) + "\n"))
    atomic_write(out_dir / "tokenizer.json", lambda p: tok.save(str(p)))
    gold = golden(out_dir, cfg, tok)
    atomic_write(out_dir / "golden.safetensors",
                 lambda p: save_file(gold, str(p), metadata={"prompts": json.dumps(GOLDEN_PROMPTS)}))
    report = {"settings": settings, "parameters": n_params, "train_seconds": train_seconds,
              "tokens_seen": steps * batch * ctx, "train_tokens": len(train), "val_tokens": len(val),
              "val_loss": val_loss, "history": history, "activation_stats": stats, "torch": torch.__version__}
    atomic_write(out_dir / "training.json", lambda p: p.write_text(json.dumps(report, indent=2) + "\n"))

    print(f"\ntrained {steps} steps, {steps * batch * ctx:,} tokens in {train_seconds / 60:.1f} min; val loss (fp16 weights) {val_loss:.4f}")
    print("layer | fired per token | neurons for 80% of firings")
    for s in stats:
        print(f"{s['layer']:5d} | {s['fired_fraction']:15.1%} | {s['neurons_for_80pct']:.1%}")


if __name__ == "__main__":
    main()
