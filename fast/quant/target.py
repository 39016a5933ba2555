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
