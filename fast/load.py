"""The facade one floor up: `load_engine` composes what fast.run's flags ask for, in order: load the checkpoint
(`Engine.load`, its weights laid out in the format asked for), apply the predictors (`apply_predictors`),
on a GPU let `placement` decide and apply its decision (`to_hybrid`, in the weights' format), then compile the
kernels. Nothing here is written to disk: a placement solved at load lives in memory
(`python -m placement -o FILE` writes one to reuse with `placement=FILE`)."""

from pathlib import Path

from fast import cpu
from fast.engine import Decoder, Engine, apply_predictors, dense_ffn, stored_format
from fast.hybrid import device_identity, require_gpu, to_hybrid
from fast.quant import base_format
from placement.budget import GiB, hardware_for, whole_layers
from placement.place import place, request
from ref.common.artifacts import load_placement
from ref.common.checkpoint import load_checkpoint
from ref.common.errors import UserError
from ref.common.formats import Format, format_of
from ref.common.names import expected_shapes
from ref.quant import predictors_beside
from ref.sparse import resolve_predictors

def kernels_cached() -> bool:
    """Whether numba's on-disk cache holds fast.cpu's kernels (its index files beside the module): if not, the
    first load compiles them, which takes about 20 s."""
    return any((Path(cpu.__file__).parent / "__pycache__").glob("cpu.*.nbi"))


DEVICES = ("cpu", "gpu", "hybrid")
POLICIES = ("hybrid", "layers")  # PowerInfer's neuron split; llama.cpp-style whole layers on the GPU
GROUP = 64  # neurons per ILP group


EMBEDDED = "embedded"  # predictors=EMBEDDED: the checkpoint's own where it has them, else dense


def default_predictors(path: Path, predictors, dense: bool):
    """The predictors a CLI runs: those given; with none given and not --dense, a folder's predictors.safetensors,
    else the checkpoint's own (EMBEDDED: PowerInfer's GGUF files and TurboSparse's folders carry them, others run
    dense); None for dense."""
    if predictors is not None or dense:
        return predictors
    if path.is_dir() and (path / "predictors.safetensors").is_file():
        return path / "predictors.safetensors"
    return EMBEDDED


def load_engine(path, device: str = "cpu", predictors=None, placement=None, vram_budget: float | None = None,
                threads: int | None = None, predictor_threshold: float | None = None, policy: str = "hybrid",
                type_: str | None = None, predictor_type: str | None = None) -> Decoder:
    """The engine fast.run runs: weights as stored or in the format `type_` names, dense, or predictor-sparse with
    `predictors` (a file, loaded Predictors, or EMBEDDED; stored in `predictor_type` if given, else a file's own as
    they are and others in the format that goes with the weights, ref.quant.predictor_format); on `gpu`/`hybrid`,
    placed on the card (a placement file, or one solved for `vram_budget` GiB from MODEL_DIR/activations.safetensors).
    Refuses what does not fit in memory before laying anything out. Compiles (or loads the cached) kernels with one
    warm-up token, timed as `compile_seconds`."""
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
    if predictors == EMBEDDED and w.predictors is None:
        predictors = None
    check_memory(path, w.config, fmt or stored)
    engine = Engine.load(w, threads, fmt)
    if predictors is not None:
        source = engine.file_predictors if predictors == EMBEDDED else predictors
        if predictor_type or predictors == EMBEDDED:  # in the format asked for, or a file's own as stored
            apply_predictors(engine, source, predictor_threshold,
                             format_of(predictor_type, "--predictor-type") if predictor_type else None)
        else:  # in the formats that go with the weights
            pred, threshold = resolve_predictors(engine.config, source, predictor_threshold)
            apply_predictors(engine, predictors_beside(pred, engine.format), threshold)
    if device != "cpu":
        engine = place_on_gpu(engine, Path(path), device, placement, vram_budget, policy)
    elif predictors is None:
        dense_ffn(engine)
    engine.warm_up()
    return engine


def elements(b) -> int:
    """Elements of rows of blocks (their count times the format's block; an interleaved group's ROWS rows too)."""
    fmt = base_format(b.dtype)
    return b.nbytes // fmt.block_bytes * fmt.block


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


def check_memory(path, cfg, fmt: Format) -> None:
    """Refuse, before loading, a model whose laid-out weights and KV cache exceed the memory available (instead of
    the kernel killing the process half-way): the bytes it needs and the bytes there are."""
    weights = sum(fmt.nbytes(s) if len(s) == 2 else 4 * s[0] for s in expected_shapes(cfg).values())
    kv = 2 * cfg.n_layers * cfg.max_seq_len * cfg.n_kv_heads * cfg.head_dim * 4
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
        params = [elements(a) + elements(b) for a, b in zip(sel.fc1, sel.fc2)] if sel.predicts else []
        solved, _, meta = place(c, model_dir / "activations.safetensors", req, hw, params)
        neurons, dense = solved.gpu_neurons, meta["dense_on_gpu"]
    return to_hybrid(engine, neurons, dense)
