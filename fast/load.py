"""The facade one floor up: `load_engine` composes what fast.run's flags ask for, in order: load the checkpoint
(`Engine.load`, its weights laid out in the format asked for), apply the predictors (`apply_predictors`),
on a GPU let `placement` decide and apply its decision (`to_hybrid`, in the weights' format), then compile the
kernels. Nothing here is written to disk: a placement solved at load lives in memory
(`python -m placement -o FILE` writes one to reuse with `placement=FILE`)."""

from pathlib import Path

import click

from fast.engine import Decoder, Engine, apply_predictors, apply_activation_sparsity, dense_ffn, stored_format
from fast.hybrid import device_identity, require_gpu, to_hybrid
from placement.budget import GiB, hardware_for, whole_layers
from placement.place import place, request
from ref.common.artifacts import EMBEDDED, load_placement
from ref.common.checkpoint import load_checkpoint
from ref.common.errors import UserError
from ref.common.batch import KV_DEFAULT, kv_format
from ref.common.formats import FORMATS, Format, format_of
from ref.common.names import expected_shapes
from ref.activation_sparsity import sparsity_to_run
from ref.sparse import predictors_to_run


def say_compiling(engine) -> None:
    """The CLIs' notice, on stderr, that kernels for this engine's combination of formats compile now (cached after:
    the first run compiles most of them, about a minute on a quiet 2-core machine; another combination adds 20 to
    40 s)."""
    sel = engine.selector
    what = [f"{engine.format.name} weights"]
    if sel.predicts:
        what.append(f"{'/'.join(f.name for f in sel.formats)} predictors")
    what.append(f"a {'/'.join(engine.kv_types)} KV cache")
    click.echo(f"compiling kernels for {', '.join(what)} (once per combination of formats: up to a minute on 2 quiet "
               "cores, more on busy ones)...", err=True)


DEVICES = ("cpu", "gpu", "hybrid")
POLICIES = ("hybrid", "layers")  # PowerInfer's neuron split; llama.cpp-style whole layers on the GPU
GROUP = 64  # neurons per ILP group


def load_engine(path, device: str = "cpu", predictors=None, placement=None, vram_budget: float | None = None,
                threads: int | None = None, predictor_threshold: float | None = None, policy: str = "hybrid",
                type_: str | None = None, predictor_type: str | None = None, notice=None, sparsity: float | None = None,
                sparsity_method: str = "teal", sparsity_file: Path | None = None,
                cache_types: tuple = (KV_DEFAULT, KV_DEFAULT), sequences: int = 1) -> Decoder:
    """The engine fast.run runs: weights as stored or in the format `type_` names, dense, or predictor-sparse with
    `predictors` (a file, loaded Predictors, or EMBEDDED; stored as ref.sparse.predictors_to_run says), with
    activation sparsity where `sparsity` asks (the model's calibration: ref.activation_sparsity); on `gpu`/`hybrid`,
    placed on the card (a placement file, or one solved for `vram_budget` GiB from MODEL_DIR/activations.safetensors);
    its caches store keys and values in `cache_types` (-ctk, -ctv). Refuses what does not fit in memory before
    laying anything out. Compiles (or loads the cached) kernels with one warm-up token (and a step of two where
    `sequences` will decode together), timed as `compile_seconds`, calling notice(engine) first where they must
    compile."""
    if device not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got '{device}'")
    if policy not in POLICIES:
        raise UserError(f"--policy must be one of {', '.join(POLICIES)}, got '{policy}'")
    fmt = format_of(type_) if type_ is not None else None
    w = load_checkpoint(path)  # memory-mapped: the checks below read no weights
    stored = stored_format(w)
    if fmt is not None and stored.quantized and fmt != stored:
        raise UserError(f"--type {fmt.name}: {path} is quantized to {stored.name} already; quantizing it again loses "
                        f"accuracy twice (convert the original checkpoint instead)")
    ffn = predictors is None or (predictors == EMBEDDED and w.predictors is None)  # no predictors keep the FFN
    cut = sparsity_to_run(w, path, sparsity, sparsity_method, sparsity_file, ffn=ffn)
    kv = tuple(kv_format(name, flag, w.config.head_dim) for name, flag in zip(cache_types, ("-ctk", "-ctv")))
    check_memory(path, w.config, fmt or stored, kv)
    engine = Engine.load(w, threads, fmt)
    run = None if predictors is None else predictors_to_run(engine.config, predictors, engine.file_predictors,
                                                            engine.format, predictor_threshold, predictor_type)
    if run is not None:
        apply_predictors(engine, *run)
    if cut is not None:
        apply_activation_sparsity(engine, sparsity_method, cut, ffn=run is None)
    if device != "cpu":
        engine = place_on_gpu(engine, Path(path), device, placement, vram_budget, policy)
    elif run is None and cut is None:
        dense_ffn(engine)
    engine.kv_types = tuple(f.name for f in kv)
    engine.warm_up(notice, sequences)
    return engine


def memory_available() -> int:
    """Bytes the kernel can give this process without swapping (MemAvailable; page cache counts as available)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_memory(path, cfg, fmt: Format, kv_formats: tuple = (FORMATS["f32"], FORMATS["f32"])) -> None:
    """Refuse, before loading, a model whose laid-out weights and KV cache (a full context, in `kv_formats`) exceed
    the memory available (instead of the kernel killing the process half-way): the bytes it needs and the bytes
    there are."""
    shapes = expected_shapes(cfg)
    weights = sum(fmt.nbytes(s) if len(s) == 2 else 4 * s[0] for s in shapes.values())
    weights += fmt.nbytes(shapes["embed"]) if cfg.tie_word_embeddings and fmt.quantized else 0  # engine.tied_head
    kv = cfg.n_layers * cfg.max_seq_len * cfg.n_kv_heads * sum(f.row_bytes(cfg.head_dim) for f in kv_formats)
    need, have = weights + kv, memory_available()
    if need > have:
        raise UserError(f"{path}: needs {need / GiB:.1f} GiB of memory ({fmt.name} weights {weights / GiB:.1f} GiB, "
                        f"KV cache {kv / GiB:.1f} GiB), {have / GiB:.1f} GiB available")


def place_on_gpu(engine: Engine, model_dir: Path, device: str, placement=None, vram_budget: float | None = None,
                 policy: str = "hybrid"):
    """Budget the card, take the placement (a file, llama.cpp's whole layers, or PowerInfer's ILP) and apply it."""
    require_gpu(f"--device {device}")
    c, sel = engine.config, engine.selector
    hw = hardware_for(*device_identity())
    if vram_budget is not None and vram_budget * GiB > hw.vram_bytes:
        raise UserError(f"--vram-budget {vram_budget:g} GiB is larger than the GPU's {hw.vram_bytes / GiB:.1f} GiB")
    budget = int(vram_budget * GiB) if vram_budget is not None else int(0.9 * hw.vram_bytes)
    if device == "gpu" or policy == "layers":
        neurons, dense = whole_layers(c, engine.format, c.max_seq_len, budget)
        on_gpu = sum(name.startswith("attention.") for name in dense)
        if device == "gpu" and on_gpu < c.n_layers:
            raise UserError(f"--device gpu: the model does not fit --vram-budget {budget / GiB:.2f} GiB "
                            f"({on_gpu} of {c.n_layers} layers do); use --device hybrid")
    elif placement is not None:
        neurons, meta = load_placement(placement, c.n_layers, c.d_ffn)
        dense = meta.get("dense_on_gpu", [])
    else:
        req = request(c, model_dir / "activations.safetensors", budget / GiB, hw, engine.format, c.max_seq_len, GROUP,
                      "auto")
        params = list(sel.params)
        solved, _, meta = place(c, model_dir / "activations.safetensors", req, hw, params)
        neurons, dense = solved.gpu_neurons, meta["dense_on_gpu"]
    return to_hybrid(engine, neurons, dense)
