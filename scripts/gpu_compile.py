"""Every GPU kernel of fast.gpu compiled for real devices, without one: numba-cuda's NVVM to PTX for each compute
capability, then NVIDIA's ptxas for the registers, local-memory spills and shared memory per kernel (the `gpu`
extra brings both from PyPI). The simulator runs kernels as Python and accepts what the real compiler rejects; this
does not. Prints one row per (kernel, weight or KV format, capability); exits 1 on a compile error, a spill or shared
memory above the device's static limit.

    python scripts/gpu_compile.py --cc 8.0,9.0
"""

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import click

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # the simulator has no compiler: this needs the real numba.cuda
    sys.exit("scripts/gpu_compile.py: unset NUMBA_ENABLE_CUDASIM (the simulator compiles nothing)")

from numba import types  # noqa: E402

SHARED_LIMIT = 48 * 1024  # static shared memory per block on sm_80 and sm_90 (more only opt-in, dynamically)
f32, i32, i64 = types.float32, types.int32, types.int64
# The weights' element type per format, as gpu.weight() hands them to the kernels (f16 and bf16 bits as uint16,
# q8_0 quants int8, q4_0 nibble bytes uint8).
WEIGHTS = {"f32": types.float32, "f16": types.uint16, "bf16": types.uint16, "q8_0": types.int8, "q4_0": types.uint8}
# A KV slot's element type per format (fast.gpu.KV_DTYPES).
KV = {"f32": types.float32, "f16": types.float16, "bf16": types.uint16, "q8_0": types.uint8}


def a(dtype, ndim):
    return types.Array(dtype, ndim, "C")


def signatures(fmt: str = "-") -> dict:
    """Each kernel's argument types as fast.gpu launches it with weights, or a KV cache, in format `fmt` (kernels
    that read neither ignore it; "-": float32)."""
    w, kv = a(WEIGHTS.get(fmt, f32), 2), a(KV.get(fmt, f32), 3)
    return {
        "_quantize_rows": (a(f32, 2), a(f32, 2)),
        "_rmsnorm": (a(f32, 2), a(f32, 2), a(f32, 1), f32),
        "_layernorm": (a(f32, 2), a(f32, 2), a(f32, 1), a(f32, 1), f32),
        "_copy": (a(f32, 2), a(f32, 2)),
        "_add_bias": (a(f32, 2), a(f32, 1)),
        "_rows_dot": (a(f32, 2), a(f32, 2), w, a(f32, 2), i64, types.boolean),
        "_rope": (a(f32, 3), a(f32, 3), a(f32, 2), a(f32, 2), i64),
        "_attention": (a(f32, 3), a(f32, 3), kv, kv, i64, i64, i64, a(f32, 2)),
        "_ffn_gate_up": (a(f32, 1), a(f32, 1), w, a(f32, 2), i64, i64, a(f32, 1), a(i32, 1), i64, f32),
        "_ffn_down": (a(f32, 2), a(f32, 1), w, a(f32, 2), i64, i64, a(i32, 1), i64),
        "_sum_rows": (a(f32, 1), a(f32, 2)),
        "_copy_cols": (a(f32, 2), a(f32, 2), i64),
        "_store_kv": (kv, a(f32, 3), i64, i64),
        "_thin": (a(f32, 2), a(f32, 2), a(f32, 1), f32),
        "_thin_activations": (a(f32, 2), a(f32, 2), a(f32, 1), i64, f32, a(f32, 1), f32),
        "_union": (a(i32, 1), a(i32, 1), a(f32, 2)),
        "_sparse_rows": (a(f32, 3), a(f32, 2), w, a(f32, 2), i64, a(i32, 1), i64),
        "_add": (a(f32, 2), a(f32, 2)),
    }


def formats_of(name: str):
    """The formats a kernel compiles once each for: the weight formats for one that reads weights, the KV formats for
    one that reads or writes a KV cache, else one ("-")."""
    def sig(fmt):
        return signatures(fmt)[name]
    return list(WEIGHTS) if sig("q4_0") != sig("-") else list(KV) if sig("q8_0") != sig("-") else ["-"]


def kernels() -> dict:
    """fast.gpu's kernels (its @cuda.jit functions that are not device functions), by name."""
    from numba.cuda.dispatcher import CUDADispatcher

    from fast import gpu
    return {n: k for n, k in vars(gpu).items()
            if isinstance(k, CUDADispatcher) and not k.targetoptions.get("device")}


def ptxas_report(ptx: str, cc: tuple) -> dict:
    """ptxas -v on the PTX: registers, spill stores and loads (bytes), stack frame and static shared memory (bytes)."""
    from cuda.pathfinder import find_nvidia_binary_utility
    ptxas = find_nvidia_binary_utility("ptxas")
    if ptxas is None:
        raise click.ClickException("ptxas not found: pip install -e '.[gpu]'")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", "-o", str(Path(tmp) / "k.cubin"), str(src)],
                           capture_output=True, text=True)
    if r.returncode:  # its error lines, the mangled kernel name left out
        errors = [re.sub(r"'_Z\w+'", "the kernel", line) for line in r.stderr.splitlines() if "error" in line]
        raise RuntimeError("; ".join(errors) or r.stderr.strip())

    def number(pattern):
        m = re.search(pattern, r.stderr)
        return int(m.group(1)) if m else 0
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": number(r"(\d+) bytes smem")}


def compile_one(name: str, fmt: str, cc: tuple) -> tuple[dict | None, list]:
    """(row, problems) of one kernel in one weight format for one capability."""
    from numba import cuda
    row = {"kernel": name, "format": fmt, "cc": f"{cc[0]}.{cc[1]}"}
    where = f"{name} ({fmt}, sm_{cc[0]}{cc[1]})"
    try:
        ptx, _ = cuda.compile_ptx(kernels()[name].py_func, signatures(fmt)[name], cc=cc)
        row.update(ptxas_report(ptx, cc), ptx_lines=len(ptx.splitlines()))
    except Exception as e:  # noqa: BLE001 - every failure is reported with its kernel, then exit 1
        text = str(e).strip()
        return None, [f"{where}: {type(e).__name__}: {text.splitlines()[0] if text else ''}"]
    problems = [f"{where}: spills {row['spill_stores']} bytes"] if row["spill_stores"] or row["spill_loads"] else []
    if row["shared"] > SHARED_LIMIT:
        problems.append(f"{where}: {row['shared']} bytes of shared memory")
    return row, problems


def compile_all(ccs: list, jobs: int = 1) -> tuple[list, list]:
    """(rows, problems): a row per kernel, weight format and capability (compiled by `jobs` processes); a problem
    per failure."""
    found, table = kernels(), signatures()
    problems = [f"{n}: a fast.gpu kernel without a signature in scripts/gpu_compile.py" for n in sorted(set(found) - set(table))]
    problems += [f"{n}: in the signature table, not in fast.gpu" for n in sorted(set(table) - set(found))]
    work = [(name, fmt, cc) for name in sorted(set(table) & set(found))
            for fmt in formats_of(name) for cc in ccs]
    with ProcessPoolExecutor(jobs) as pool:
        done = list(pool.map(compile_one, *zip(*work)))
    rows = [row for row, _ in done if row is not None]
    return rows, problems + [p for _, found_ in done for p in found_]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cc", default="8.0,9.0", show_default=True, help="Compute capabilities, comma-separated.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="the cores",
              help="Compiling processes.")
def main(cc, jobs):
    """Compile every fast.gpu kernel to PTX and run ptxas on it; print registers, spills, shared memory."""
    try:
        ccs = [tuple(int(p) for p in c.strip().split(".")) for c in cc.split(",")]
        if any(len(c) != 2 for c in ccs):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"expected major.minor values such as 8.0,9.0, got '{cc}'", param_hint="--cc")
    try:
        from numba.cuda.cudadrv import nvvm
        nvvm.NVVM()
    except Exception as e:  # noqa: BLE001 - no NVVM: say how to get it
        raise click.ClickException(f"NVVM not found ({type(e).__name__}): pip install -e '.[gpu]'")
    rows, problems = compile_all(ccs, jobs)
    click.echo("| kernel | format | cc | registers | spills (bytes) | stack | shared (bytes) | PTX lines |")
    click.echo("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        click.echo(f"| {r['kernel']} | {r['format']} | {r['cc']} | {r['registers']} | "
                   f"{r['spill_stores'] + r['spill_loads']} | {r['stack']} | {r['shared']} | {r['ptx_lines']} |")
    for p in problems:
        click.echo(p, err=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
