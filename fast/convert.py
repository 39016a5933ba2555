"""`python -m fast.convert MODEL_DIR -o OUT.gguf --type f16|q8_0|q4_0 [--predictors FILE]`: an HF checkpoint as a
PowerInfer-layout GGUF (magic PWRI: predictors embedded, the down matrix transposed as ffn_down_t, the sparse
threshold, the tokenizer), which PowerInfer's C++ loads and fast.run memory-maps; `--dense` writes llama.cpp's
layout instead (magic GGUF, ffn_down, no predictors). One tensor at a time: memory holds one tensor in two formats."""

from ref.common.errors import UserError, ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import sys
import time
from pathlib import Path

import click

from ref.common.artifacts import Predictors
from ref.common.cli import check_model_dir, output_file, user_errors
from ref.common.config import ModelConfig
from ref.common.formats import FORMATS, Format, format_of
from ref.common.gguf_io import Planned, is_gguf, model_kv, rope_rows, tokenizer_kv, write_gguf, THRESHOLD_KEY
from ref.common.names import GGUF_NAMES, expected_shapes, gguf_name
from ref.common.progress import Progress
from ref.common.safetensors import upcast
from ref.common.weights import Weights
from ref.quant import predictor_format, quantize

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def plan(w: Weights, fmt: Format, predictors: Predictors | None) -> list[Planned]:
    """The file's tensors in order, each computed when written: norms f32; matrices in fmt (attn_q / attn_k rows in
    llama.cpp's order; the down matrix transposed when predictors come along); predictors in the format that goes
    with fmt where their rows are whole blocks of it, else f16 (ref.quant.predictor_format)."""
    cfg, out = w.config, []
    for name, shape in expected_shapes(cfg).items():
        gname = gguf_name(cfg, name)
        if len(shape) == 1:
            out.append(Planned(gname, shape, FORMATS["f32"], lambda n=name: upcast(w[n])))
        elif name.endswith((".wq", ".wk")):
            rows = rope_rows(shape[0] // cfg.head_dim, cfg.head_dim, to_gguf=True)
            out.append(Planned(gname, shape, fmt, lambda n=name, r=rows: quantize(upcast(w[n])[r], fmt, n)))
        elif name.endswith(".wd") and predictors is not None:
            out.append(Planned(gname.replace("ffn_down.", "ffn_down_t."), shape[::-1], fmt,
                               lambda n=name: quantize(upcast(w[n]).T, fmt, n)))
        else:
            out.append(Planned(gname, shape, fmt, lambda n=name: quantize(upcast(w[n]), fmt, n)))
    for l, (a, b) in enumerate(zip(predictors.fc1, predictors.fc2) if predictors is not None else ()):
        for part, t in (("fc1", a), ("fc2", b)):
            f = predictor_format(fmt, t.shape[-1])
            out.append(Planned(f"blk.{l}.{part}.weight", tuple(t.shape), f, lambda t=t, f=f: quantize(upcast(t), f)))
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="The .gguf file to write.")
@click.option("--type", "type_", default="f16", show_default=True, help=f"Weight format: {', '.join(TYPES)}.")
@click.option("--predictors", type=click.Path(path_type=Path), default=None,
              help="[default: MODEL_DIR/predictors.safetensors]")
@click.option("--dense", is_flag=True, help="llama.cpp's layout: no predictors, ffn_down, magic GGUF.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@user_errors
def main(model_dir, out, type_, predictors, dense, force):
    """Write MODEL_DIR (an HF folder) as a PowerInfer GGUF file."""
    t0 = time.perf_counter()
    fmt = format_of(type_)
    if dense and predictors is not None:
        raise UserError("--dense and --predictors contradict each other")
    out = output_file(out, force, "-o")
    if model_dir.is_file() and is_gguf(model_dir):
        raise UserError(f"MODEL_DIR {model_dir}: a GGUF file already (fast.run and ref run it as it is); fast.convert "
                        "reads a Hugging Face folder")
    check_model_dir(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    if cfg.family not in GGUF_NAMES:
        raise UserError(f"{model_dir}: GGUF conversion writes the LLaMA family; this is a {cfg.architecture} "
                        f"({cfg.family}), which runs from its HF folder")
    unwritten = [what for what, has in (("q/k/v biases", cfg.qkv_bias), ("q/k norms", cfg.qk_norm),
                                        (f"{(cfg.rope_scaling or ('',))[0]} RoPE scaling", cfg.rope_scaling)) if has]
    if unwritten:  # llama.cpp's llama architecture has no place for them: the file would be another model
        raise UserError(f"{model_dir}: GGUF conversion of a {cfg.architecture} with {unwritten[0]} is not written yet; "
                        "it runs from its HF folder")
    w = Weights.load(model_dir, cfg)
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{tok_file}: missing (the GGUF file carries the tokenizer)")
    pred = None
    if not dense:
        predictors = predictors or model_dir / "predictors.safetensors"
        if not predictors.is_file():
            raise UserError(f"--predictors {predictors}: not found (a PowerInfer file carries predictors; "
                            "--dense writes llama.cpp's layout without them)")
        pred = Predictors.load(predictors, cfg)
    kind = "gguf" if dense else "powerinfer"
    kv = model_kv(cfg, "llama", fmt, model_dir.resolve().name) + tokenizer_kv(tok_file.read_text(encoding="utf-8"), cfg)
    if pred is not None:
        kv.append(("add_float32", THRESHOLD_KEY, pred.threshold))
    planned = plan(w, fmt, pred)
    total = sum(p.fmt.nbytes(p.shape) for p in planned)
    progress = Progress(f"writing {out.name}", total / 2**20, unit="MiB")
    def written(i, n, nbytes):  # each source tensor is read once: drop its pages (resident memory stays one tensor)
        w.release()
        progress.update(nbytes / 2**20)

    size = write_gguf(out, kind, "llama", kv, planned, written)
    progress.close()
    shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    click.echo(f"wrote {out}: {'PowerInfer' if pred is not None else 'llama.cpp'} GGUF, {fmt.name}, {len(planned)} "
               f"tensors, {shown} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
