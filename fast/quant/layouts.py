"""How a matrix's rows are laid out for the kernels: plain rows of a format's items (ref.common.formats' dtype),
q8_0 and q4_0 rows interleaved in groups (INTERLEAVED, for matmul), a row's blocks in runs (RUNS, for the sparse FFN);
the transforms between them, and what a numba array type holds. fast.quant.reference reads each layout from its
definition.

An array's item type is its format and layout at once: numba compiles a kernel per item type, so that is how a
`Format` reaches a kernel. `LAYOUTS` is the one table that says which (format, layout) each item type is, for
numpy dtypes and numba types alike; nothing else decodes a dtype.
"""

from dataclasses import dataclass

from numba import njit
from numba.extending import overload
from numba.np.numpy_support import from_dtype
import numpy as np

from fast import kernel_cache
from fast.pages import on_huge_pages
from fast.quant.target import ERROR_MODEL, JIT_OPTIONS
from ref.common.formats import FORMATS, Format

kernel_cache.install()  # before the kernels below are defined

BLOCK = 32
QUANTIZED = ("q8_0", "q4_0")

# A matrix of q8_0 or q4_0 rows as fast.cpu.matmul reads it fastest: rows in groups of ROWS, each group block by
# block, a block of the group being its rows' ROWS fp16 scales, then their quants 4 bytes of each row in turn (a q4_0
# byte holds elements j and j + 16; q8_0's quants stored plus 128, i.e. unsigned). One vpdpbusd then multiplies 4
# quants of each of the 8 rows by the same 4 of the token: lanes are rows, a block's scales apply lane by lane, the
# token's block is read once for 8 rows, and no horizontal sum is left but the last. llama.cpp repacks Q4_0 for AVX2
# likewise (its q4_0_8x8): a [45056, 2048] q4_0 matmul of one token 2.2 -> 1.2 ms.
ROWS = 8
INTERLEAVED = {n: np.dtype([("d", "<u2", (ROWS,)), ("qs", "u1", (ROWS * (FORMATS[n].block_bytes - 2),))])
               for n in QUANTIZED}
# A q8_0 or q4_0 row as the sparse kernels read it, one neuron's rows at a time: its blocks in runs of RUN, a run
# laid out as a group block with blocks for rows (the RUN blocks' fp16 scales, then word i of each block in turn, for
# each word i; q8_0's quants stored plus 128), and the token's blocks likewise (quantize_input). One vpdpbusd then
# multiplies word i of 8 blocks of the row by word i of the token's 8: lanes are blocks, the scales apply lane by lane,
# a sum across lanes is left once per row. Row by row, blocks one by one took 6.3 cycles a block and groups 1.9
# ([1, 2048] x [1024, 2048] q4_0 in cache, 2 threads); a neuron's rows cannot be grouped with its neighbours', whom
# the predictor does not pick with it.
RUN = 8
# What the interleaved layouts xor into a block's quant bytes: q8_0's stored unsigned (q + 128), q4_0's as they are.
FLIP = {"q8_0": 0x80, "q4_0": 0}
RUNS = {n: np.dtype([("d", "<u2", (RUN,)), ("qw", "u1", (RUN * (FORMATS[n].block_bytes - 2),))]) for n in QUANTIZED}


@dataclass(frozen=True)
class Layout:
    """What one item of a kernel array is: `elements` values of each of `rows` rows in `format`, laid out as `name`
    ("rows": a block of one row, "groups": a block of each of ROWS rows, "runs": RUN blocks of one row)."""

    format: Format
    name: str
    rows: int = 1
    elements: int = 0

    def __post_init__(self):
        object.__setattr__(self, "elements", self.format.block * (RUN if self.name == "runs" else 1))


LAYOUTS = {**{f.dtype: Layout(f, "rows") for f in FORMATS.values()},
           **{dt: Layout(FORMATS[n], "groups", ROWS) for n, dt in INTERLEAVED.items()},
           **{dt: Layout(FORMATS[n], "runs") for n, dt in RUNS.items()}}
TYPES = {from_dtype(dt): lay for dt, lay in LAYOUTS.items()}  # the same, keyed by the numba type kernels see


def layout_of(w: np.ndarray) -> Layout:
    """The format and layout of an array of rows (its item type's entry in LAYOUTS)."""
    try:
        return LAYOUTS[w.dtype]
    except KeyError:
        raise ValueError(f"no weight format or layout has items of {w.dtype}") from None


def formats_in(layout: str) -> dict:
    """{numba item type: Format} of the quantized formats in one layout, for the overloads of that layout."""
    return {t: lay.format for t, lay in TYPES.items() if lay.name == layout and lay.format.quantized}


BLOCK_FORMATS, INTERLEAVED_FORMATS, RUN_FORMATS = formats_in("rows"), formats_in("groups"), formats_in("runs")


def is_float(row) -> bool:
    return float_kind(row.dtype) is not None


def in_runs(row) -> bool:
    """Whether the numba array type `row` holds a row's blocks in runs (RUNS)."""
    return row.dtype in RUN_FORMATS


def float_kind(dtype) -> str | None:
    """'f32', 'f16' or 'bf16' for a numba dtype of a float format's row elements, else None."""
    lay = TYPES.get(dtype)
    return None if lay is None or lay.format.quantized else lay.format.name


def chosen(typer):
    """Marks a row operation of a layout's class (fast.quant.floats.Floats, ...) as a typer: called with the numba
    types of the arguments, it returns the implementation for them (as a numba overload does), where one
    implementation does not serve every format of the layout."""
    typer.chooses = True
    return typer


# -------------------------------------------------------------------------------------------------- interleaved matrices

def interleaved(w) -> bool:
    """Whether the numba array type w holds groups of interleaved rows (INTERLEAVED)."""
    return w.dtype in INTERLEAVED_FORMATS


def n_rows(w) -> int:
    """Rows of a matrix (an interleaved one's groups times ROWS), in Python and in kernels."""
    return w.shape[0] * layout_of(w).rows


@overload(n_rows, jit_options=JIT_OPTIONS)
def _n_rows(w):
    per = ROWS if interleaved(w) else 1
    return lambda w: w.shape[0] * per


def interleave(*parts: np.ndarray) -> np.ndarray:
    """Matrices [N_i, B] of q8_0 or q4_0 blocks, stacked, as groups of ROWS rows [sum N_i / ROWS, B] (INTERLEAVED;
    each N_i % ROWS == 0): each part written into its groups, no stacked copy first."""
    name = layout_of(parts[0]).format.name
    B, size = parts[0].shape[1], FORMATS[name].block_bytes
    out = np.empty((sum(p.shape[0] for p in parts) // ROWS, B), INTERLEAVED[name])
    at = 0
    for p in parts:
        interleave_bytes(out[at:at + p.shape[0] // ROWS].view(np.uint8).reshape(-1, B, ROWS * size),
                         np.ascontiguousarray(p).view(np.uint8).reshape(-1, B, size),
                         np.uint8(FLIP[name]))
        at += p.shape[0] // ROWS
    return out


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def interleave_bytes(out, src, flip):
    """out [G, B, ROWS * S] <- src [G ROWS, B, S] (S bytes a block: a 2-byte scale, then quants): per group and
    block, the ROWS scales, then each 4-byte word k of the rows in turn (quants ^ flip). A loop over bytes: numpy's
    transposes of the same moved 0.1 s a 7B layer's matrix, 13 s an 8B model at load."""
    G, B, S = src.shape[0] // ROWS, src.shape[1], src.shape[2]
    for g in range(G):
        for b in range(B):
            for r in range(ROWS):
                row = src[g * ROWS + r, b]
                out[g, b, 2 * r] = row[0]
                out[g, b, 2 * r + 1] = row[1]
                for k in range((S - 2) // 4):
                    at = 2 * ROWS + (k * ROWS + r) * 4
                    for j in range(4):
                        out[g, b, at + j] = row[2 + 4 * k + j] ^ flip


def to_runs(w: np.ndarray) -> np.ndarray:
    """Rows [..., B] of q8_0 or q4_0 blocks in runs [..., B / RUN] (RUNS); B % RUN == 0."""
    name, lead, B = layout_of(w).format.name, w.shape[:-1], w.shape[-1]
    words = (FORMATS[name].block_bytes - 2) // 4
    r = np.ascontiguousarray(w).reshape(-1, B // RUN, RUN)  # [N, run, block j]
    out = np.empty(r.shape[:2], RUNS[name])
    out["d"] = r["d"]
    qs = r["qs"].view(np.uint8).reshape(*r.shape, words, 4)  # [N, run, j, word, byte]
    out["qw"] = (qs.transpose(0, 1, 3, 2, 4).reshape(*r.shape[:2], RUN * 4 * words)
                 ^ np.uint8(FLIP[name]))
    return out.reshape(*lead, B // RUN)


def for_sparse(bundle: np.ndarray) -> np.ndarray:
    """Neuron bundles [F, P, B] as fast.cpu.sparse_ffn reads them fastest: q8_0 and q4_0 rows in runs (RUNS) where B
    divides by RUN and the bundle has rows to take dot products with (P > 1; the dense layout's down rows alone read
    faster as blocks); other formats and shapes as they are. Runs also read the down rows (y += a down_i), at 1.2x
    (q4_0) to 1.8x (q8_0) the cost of blocks, that the neuron's rows stay one bundle. On huge pages (fast.pages)."""
    lay = layout_of(bundle)
    fast = (lay.name == "rows" and lay.format.quantized and bundle.ndim == 3 and bundle.shape[1] > 1
            and bundle.shape[-1] % RUN == 0)
    return on_huge_pages(to_runs(bundle) if fast else bundle)


def plain(w: np.ndarray) -> np.ndarray:
    """Rows of blocks [..., B]: an interleaved matrix's rows back in their own order, rows in runs back in blocks,
    others as they are."""
    lay = layout_of(w)
    fmt = lay.format
    if lay.name == "runs":
        name, lead, n = fmt.name, w.shape[:-1], w.shape[-1]
        words = (fmt.block_bytes - 2) // 4
        r = np.ascontiguousarray(w).reshape(-1, n)  # [N, run]
        out = np.empty((r.shape[0], n, RUN), fmt.dtype)
        out["d"] = r["d"]
        qw = (r["qw"] ^ np.uint8(FLIP[name])).reshape(*r.shape, words, RUN, 4)  # [N, run, word, j, byte]
        out["qs"] = qw.transpose(0, 1, 3, 2, 4).reshape(*r.shape, RUN, 4 * words).view(out["qs"].dtype)
        return out.reshape(*lead, n * RUN)
    if lay.name == "rows":
        return w
    name = fmt.name
    (G, B), words = w.shape, (FORMATS[name].block_bytes - 2) // 4
    out = np.empty((G, ROWS, B), FORMATS[name].dtype)
    out["d"] = w["d"].transpose(0, 2, 1)
    qs = (w["qs"] ^ np.uint8(FLIP[name])).reshape(G, B, words, ROWS, 4)  # [G, B, word, r, byte]
    out["qs"] = qs.transpose(0, 3, 1, 2, 4).reshape(G, ROWS, B, 4 * words).view(out["qs"].dtype)
    return out.reshape(G * ROWS, B)


def for_matmul(*parts: np.ndarray) -> np.ndarray:
    """A matrix [N, B] (or matrices stacked: [q | k | v], [gate | up]) as fast.cpu.matmul reads it fastest: q8_0
    and q4_0 rows interleaved in groups (INTERLEAVED) where N divides by ROWS, part by part where each part's does;
    other formats and shapes as they are; on huge pages (fast.pages)."""
    quantized = all(layout_of(w).name == "rows" and layout_of(w).format.quantized and w.ndim == 2 for w in parts)
    if quantized and all(w.shape[0] % ROWS == 0 for w in parts):
        return on_huge_pages(interleave(*parts))
    w = parts[0] if len(parts) == 1 else np.concatenate(parts)  # groups across the parts: stacked first
    return on_huge_pages(interleave(w) if quantized and w.shape[0] % ROWS == 0 else w)
