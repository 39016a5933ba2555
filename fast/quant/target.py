"""What fast.quant generates its code for: the host's integer dot product and vector widths. Read when an intrinsic
generates code, so that tests can set another (tests/fast/isa.py)."""

import llvmlite.binding as llvm
from numba.core import config as numba_config


def isa() -> str:
    """The integer dot product this machine has: 'vnni' (vpdpbusd), 'avx2' (vpmaddubsw) or 'generic' IR. Numba
    compiles for the host unless NUMBA_CPU_NAME names another CPU, and keys its cache by CPU and features."""
    if numba_config.CPU_NAME and numba_config.CPU_NAME != "host":
        return "generic"
    feats = llvm.get_host_cpu_features()
    if feats.get("avxvnni") or (feats.get("avx512vnni") and feats.get("avx512vl")):
        return "vnni"
    return "avx2" if feats.get("avx2") else "generic"


ISA = isa()


def wide() -> bool:
    """Whether vpdpbusd runs on 16 lanes here (AVX512-VNNI; AVX-VNNI stops at 8): interleaved groups and rows in runs
    then go two by two (_dot8_codegen): one token against [32000, 2048] q8_0 in cache 1.67 -> 1.23 ms. Decided as
    isa() is, for the host."""
    if ISA != "vnni":
        return False
    feats = llvm.get_host_cpu_features()
    return bool(feats.get("avx512vnni") and feats.get("avx512bw"))


WIDE = wide()


def float_lanes() -> int:
    """Lanes of the float tiles' vectors (_float_tile): 16 where the CPU has AVX-512's 32 zmm registers, 8 elsewhere
    (AVX2's 16 ymm registers would spill 16 accumulators of 16 lanes)."""
    if numba_config.CPU_NAME and numba_config.CPU_NAME != "host":
        return 8
    return 16 if llvm.get_host_cpu_features().get("avx512f") else 8


FLOAT_LANES = float_lanes()


# Every function numba compiles on its own (not inlined into its caller) names the two flags it would otherwise take
# from its first caller (numba.core.cpu's inherit_if_not_set): fast-math, and the error model (a prange body's
# callees get numpy's, a serial caller's python's, whose zero-division checks change how LLVM vectorises and so
# reassociates). A callee compiles once per process and numba's cache records neither, so a kernel's arithmetic would
# depend on which kernel compiled a callee first, in which process.
FASTMATH = True  # vectorised dot products reorder sums; well inside the 1e-4 tolerance (tests check)
# The fast-math flags that change no finite result (no NaNs or infinities assumed, zeros' signs ignored; nothing
# reassociated, fused or approximated): a function compiled with them rounds as its source says in whatever kernel
# LLVM inlines it into, and alike in code numba compiled in this process and in code its cache loaded (with 'fast'
# the two can differ: a softmax's sum vectorised one way or the other). The norms and attention, whose results a
# token's prefill and decode kernels must share to the bit, use them.
EXACT_MATH = {"nnan", "ninf", "nsz"}
ERROR_MODEL = "numpy"  # division by zero gives inf or nan, as in numpy, with no check in the loops
JIT_OPTIONS = {"fastmath": FASTMATH, "error_model": ERROR_MODEL}  # the row operations' overloads (jit_options)
