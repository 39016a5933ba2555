"""`python -m fast.convert MODEL -o OUT.gguf [--type f16|q8_0|q4_0] [--predictors FILE]`: an HF checkpoint, or a GGUF
file (llama.cpp's or ours, as llama-quantize takes one), as a PowerInfer-layout GGUF (magic PWRI: predictors
embedded, the down matrix transposed as ffn_down_t, the sparse threshold, the tokenizer), which PowerInfer's C++
loads and fast.run memory-maps; `--dense` writes llama.cpp's layout instead (magic GGUF, ffn_down, no predictors).
One tensor at a time: memory holds one tensor in two formats; a tensor already in the format and layout wanted is
copied as it is."""

from ref.common.errors import UserError, ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import sys
import time
from pathlib import Path

import click
import numpy as np

from ref.common.artifacts import DEFAULT_SPARSITY_FILE, Predictors, Thresholds
from ref.common.cli import check_model_dir, output_file, user_errors
from ref.common.config import ModelConfig
from ref.common.formats import FORMATS, Format, format_of
from ref.common.gguf_io import (PERMUTED, SPARSITY_PREFIX, THRESHOLD_KEY, Metadata, Planned, copied_kv, is_gguf,
                                model_kv, read_gguf, rope_freqs, rope_rows, write_gguf)
from ref.common.names import GGUF_NAMES, expected_shapes, gguf_architecture, gguf_name
from ref.common.progress import Progress
from ref.common.safetensors import upcast
from ref.common.weights import Weights
from ref.common.tokenizer import load_tokenizer, tokenizer_kv
from ref.quant import Transposed, predictors_beside, quantize, stored_format, tensor_format

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def plan(w: Weights, fmt: Format, predictors: Predictors | None, sparsity: Thresholds | None = None) -> list[Planned]:
    """The file's tensors in order, each computed when written: norms and biases f32; matrices in fmt (attn_q /
    attn_k rows in llama.cpp's order where its architecture permutes them; the down matrix transposed when predictors
    come along); rope_freqs where the frequencies are scaled per frequency; predictors in the format that goes with
    fmt, every layer alike (ref.quant.predictors_beside); an activation-sparsity
    calibration's tensors f32 under `sparsity.`."""
    cfg, out = w.config, rope_freqs(w.config)
    permuted = gguf_architecture(cfg) in PERMUTED
    for name, shape in expected_shapes(cfg).items():
        gname, f = gguf_name(cfg, name), fmt if len(shape) == 2 else FORMATS["f32"]
        if permuted and name.endswith((".wq", ".wk", ".wq.bias", ".wk.bias")):
            rows = rope_rows(shape[0] // cfg.head_dim, cfg.head_dim, to_gguf=True)
            out.append(Planned(gname, shape, f, lambda n=name, r=rows, f=f: in_format(w[n][r], f, n)))
        elif name.endswith(".wd") and predictors is not None:
            out.append(Planned(gname.replace("ffn_down.", "ffn_down_t."), shape[::-1], fmt,
                               lambda n=name: in_format(transposed(w[n]), fmt, n)))
        else:
            out.append(Planned(gname, shape, f, lambda n=name, f=f: in_format(w[n], f, n)))
    stored = predictors_beside(predictors, fmt) if predictors is not None else None
    for l, (a, b) in enumerate(zip(stored.fc1, stored.fc2) if stored is not None else ()):
        for part, t in (("fc1", a), ("fc2", b)):
            out.append(Planned(f"blk.{l}.{part}.weight", tuple(t.shape), tensor_format(t), lambda t=t: t))
    for key, t in (sparsity.tensors() if sparsity is not None else {}).items():
        out.append(Planned(SPARSITY_PREFIX + key, t.shape, FORMATS["f32"], lambda t=t: t.astype(np.float32)))
    return out


def in_format(t, fmt: Format, name: str):
    """A stored tensor in `fmt`: as it is when it is in it already (no second rounding), else converted."""
    return t if not isinstance(t, Transposed) and tensor_format(t) == fmt else quantize(upcast(t), fmt, name)


def transposed(t):
    """The stored transpose of a matrix: a PowerInfer file's ffn_down_t as it is, else computed (in float32)."""
    return t.T if isinstance(t, Transposed) else upcast(t).T


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="The .gguf file to write.")
@click.option("--type", "type_", default=None,
              help=f"Weight format: {', '.join(TYPES)}. [default: f16 from a folder, a GGUF file's own]")
@click.option("--predictors", type=click.Path(path_type=Path), default=None,
              help="[default: MODEL/predictors.safetensors of a folder, a PowerInfer file's own]")
@click.option("--dense", is_flag=True, help="llama.cpp's layout: no predictors, ffn_down, magic GGUF.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@user_errors
def main(model, out, type_, predictors, dense, force):
    """Write MODEL (an HF folder or a GGUF file) as a PowerInfer GGUF file."""
    t0 = time.perf_counter()
    if dense and predictors is not None:
        raise UserError("--dense and --predictors contradict each other")
    out = output_file(out, force, "-o")
    from_gguf = model.is_file() and is_gguf(model)
    meta = None
    if from_gguf:
        ck = read_gguf(model)
        w, meta = Weights(ck.config, ck.tensors, ck.predictors, model, ck.sparsity), ck.meta
        if model.resolve() == out.resolve():
            raise UserError(f"-o {out}: the file being read; write another")
    else:
        check_model_dir(model)
        cfg = ModelConfig.from_hf(model)
        if cfg.family not in GGUF_NAMES:
            raise UserError(f"{model}: GGUF conversion writes the LLaMA family; this is a {cfg.architecture} "
                            f"({cfg.family}), which runs from its HF folder")
        w = Weights.load(model, cfg)
    cfg = w.config
    fmt = format_of(type_) if type_ is not None else stored_format(w) if from_gguf else FORMATS["f16"]
    beside = None if from_gguf else model / DEFAULT_SPARSITY_FILE
    # a PowerInfer file carries the model's activation-sparsity calibration (llama.cpp refuses unknown tensors)
    sparsity = None if dense else Thresholds.load(beside) if beside is not None and beside.is_file() else w.sparsity
    if sparsity is not None and sparsity is not w.sparsity:  # a file beside the folder: this model's calibration?
        sparsity.check(w, None, beside)
    pred = None
    if not dense:
        own = w.predictors if from_gguf else model / "predictors.safetensors"
        if predictors is None and (own is None or not from_gguf and not own.is_file()) and sparsity is None:
            raise UserError(f"{model}: no predictors and no activation-sparsity thresholds to carry; --predictors "
                            "FILE adds predictors (--dense writes llama.cpp's layout without them)")
        if predictors is not None and not predictors.is_file():
            raise UserError(f"--predictors {predictors}: not found (a PowerInfer file carries predictors; "
                            "--dense writes llama.cpp's layout without them)")
        if predictors is not None or not from_gguf and own.is_file():
            pred = Predictors.load(predictors or own, cfg)
        elif from_gguf:
            pred = w.predictors
    kind = "gguf" if dense else "powerinfer"
    name = model.stem if from_gguf else model.resolve().name
    kv = model_kv(cfg, fmt, name) + tokenizer_of(model, meta, cfg)
    if pred is not None:
        kv.append(("add_float32", THRESHOLD_KEY, pred.threshold))
    planned = plan(w, fmt, pred, sparsity)
    total = sum(p.fmt.nbytes(p.shape) for p in planned)
    progress = Progress(f"writing {out.name}", total / 2**20, unit="MiB")
    def written(i, n, nbytes):  # each source tensor is read once: drop its pages (resident memory stays one tensor)
        w.release()
        progress.update(nbytes / 2**20)

    size = write_gguf(out, kind, gguf_architecture(cfg), kv, planned, written)
    progress.close()
    shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    click.echo(f"wrote {out}: {'PowerInfer' if kind == 'powerinfer' else 'llama.cpp'} GGUF, {fmt.name}, {len(planned)} "
               f"tensors, {shown} in {time.perf_counter() - t0:.1f} s")


def tokenizer_of(model: Path, meta: Metadata | None, cfg: ModelConfig) -> list:
    """The tokenizer's metadata: a GGUF file's own tokenizer.* keys as they are (`meta`, its metadata), or a
    folder's tokenizer.json with the BOS and EOS ids its loader uses."""
    if meta is not None:
        return copied_kv(meta, "tokenizer.")
    tok_file = model / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{tok_file}: missing (the GGUF file carries the tokenizer)")
    tok = load_tokenizer(model)
    return tokenizer_kv(tok_file.read_text(encoding="utf-8"), tok.bos_id, tok.eos_ids, cfg.vocab_size)


if __name__ == "__main__":
    sys.exit(main())
