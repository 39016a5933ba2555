import pytest

from fast import blas, cpu, gpu
from tests.fast.kernels import CASES, DEVICE_SHAPES, SHAPES, case_id, check_kernel


@pytest.mark.parametrize("name, shape, sim", SHAPES, ids=[case_id(*c) for c in SHAPES])
def test_cpu_kernel(name, shape, sim):
    check_kernel(cpu, name, shape)


BLAS_SHAPES = [c for c in SHAPES if hasattr(blas, c[0])]


@pytest.mark.parametrize("name, shape, sim", BLAS_SHAPES, ids=[case_id(*c) for c in BLAS_SHAPES])
def test_blas_kernel(name, shape, sim):
    """The prompt-chunk kernels (numpy's BLAS on decoded rows) against ref, as fast.cpu's."""
    check_kernel(blas, name, shape)


def test_every_kernel_a_table_names_exists():
    """Runs on the CPU: the device table must name only kernels fast.gpu has, or a real device fails where the
    simulator run did not look."""
    assert {n for n in CASES if not hasattr(cpu, n)} == set()
    assert {n for n, _, _ in DEVICE_SHAPES if not hasattr(gpu, n)} == set()


def test_a_kernels_cache_is_stale_when_any_kernel_source_changes(tmp_path, monkeypatch):
    """numba checks a cached function against its own file only; fast's kernels are stamped by their own file and
    fast.quant's (whose row operations compile into them) together, and only fast's files are located so."""
    from fast import kernel_cache
    for name in ("engine.py", *kernel_cache.SOURCES):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(kernel_cache, "HERE", str(tmp_path))
    kernel_cache.stamp.cache_clear()
    own = str(tmp_path / "engine.py")
    before = kernel_cache.stamp(own)
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.stamp(own) == before  # nothing changed: the cache is fresh
    (tmp_path / "quant" / "blocks.py").write_text("# blocks.py, edited\n")
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.stamp(own) != before
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.InTree.from_function(len, str(tmp_path.parent / "elsewhere.py")) is None
    assert type(cpu.matmul._cache._impl.locator).__mro__[1] is kernel_cache.KernelSources
    # the user's NUMBA_CACHE_DIR too: with it set, the old drop_stale_cache stepped aside and numba kept running q8_0
    # input rounding compiled before its fix (27f6468: the 1-in-1000 failure of the q8_0 batch FFN case)
    from numba.core import caching
    assert caching.CacheImpl._locator_classes[:3] == [kernel_cache.UserProvided, kernel_cache.InTree,
                                                      kernel_cache.UserWide]
    assert all(issubclass(c, kernel_cache.KernelSources) for c in caching.CacheImpl._locator_classes[:3])


LOADED_OR_COMPILED = """
import sys
import numpy as np
from fast import cpu
from ref.quant import blocks, quantize
rng = np.random.default_rng(0)
H, K, E, S = 8, 4, 32, 400
x = rng.standard_normal((64, 2048)).astype(np.float32)
out = [np.empty_like(x)]
cpu.rmsnorm(out[0], x, rng.standard_normal(2048).astype(np.float32), 1e-5)
for T, pos0 in [(1, 0), (60, 0), (96, 100), (7, 300)]:
    kv = [blocks(quantize(rng.standard_normal((K * S, E)).astype(np.float32), "q8_0")).reshape(K, S, -1) for _ in "kv"]
    out.append(np.empty((T, H, E), np.float32))
    cpu.attention(out[-1], rng.standard_normal((T, H, E)).astype(np.float32), *kv, pos0)
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
"""


def test_a_kernel_loaded_from_numbas_cache_gives_the_bits_it_compiled_to(tmp_path):
    """The norms and attention, compiled in one process and loaded from numba's cache in the next, give the same bits
    (with 'fast' flags a q8_0 attention differed in 4 % of its outputs by an ulp: LLVM had vectorised the softmax's
    sum one way in the kernel as compiled and another in the one the cache held)."""
    import os
    import subprocess
    import sys

    import numpy as np

    from tests.helpers import ROOT
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    for run in ("compiled", "loaded"):
        subprocess.run([sys.executable, "-c", LOADED_OR_COMPILED, str(tmp_path / run)], cwd=ROOT, env=env,
                       check=True, timeout=600)
    assert np.array_equal(np.load(tmp_path / "compiled.npy"), np.load(tmp_path / "loaded.npy"))


def test_a_run_that_compiles_says_so_once():
    """first_compile calls back once when a kernel of fast/ compiles (not for numba's own helpers or other code,
    nor for a kernel loaded from the cache)."""
    import numpy as np
    from numba import njit

    from fast import kernel_cache
    said = []
    with kernel_cache.first_compile(lambda: said.append(1)):
        njit(lambda x: x + 1)(1)  # not fast's
        assert said == []
        fresh = njit(cpu.relu_.py_func)  # fast's code, a dispatcher with no cache: it compiles
        fresh(np.ones(3, np.float32))
        fresh(np.ones(3))
    assert said == [1]


def test_small_layouts_land_on_huge_page_arenas():
    """for_matmul and for_sparse copy what numpy leaves on 4 KiB pages (under 4 MiB) into 2 MiB-aligned arenas
    (fast.pages) with the same bytes, each array on its own cache lines; a large array and an empty one stay as they
    are; an arena full for the next array starts a new chunk."""
    import numpy as np

    from fast import pages, quant
    from ref.quant import blocks, quantize
    b = blocks(quantize(np.random.default_rng(11).standard_normal((16, 64)).astype(np.float32), "q4_0"))
    floats = np.arange(32, dtype=np.float32).reshape(4, 8)
    for laid in (quant.for_matmul(b), quant.for_sparse(b.reshape(8, 2, 2)), quant.for_matmul(floats)):
        assert np.shares_memory(laid, pages.ARENA.chunk) and laid.ctypes.data % pages.ALIGN == 0
    assert quant.plain(quant.for_matmul(b)).tobytes() == b.tobytes()
    assert quant.for_matmul(floats).tobytes() == floats.tobytes()
    large, empty = np.zeros(pages.NUMPY_ADVISES, np.uint8), np.zeros((0, 4), np.float32)
    assert pages.on_huge_pages(large) is large and pages.on_huge_pages(empty) is empty
    arena = pages.Arena()
    x, y = arena.take(100), arena.take(1)
    assert y.ctypes.data - x.ctypes.data == 128 and x.ctypes.data % pages.HUGE == 0
    z = arena.take(pages.CHUNK)
    assert z.size == pages.CHUNK and z.ctypes.data % pages.HUGE == 0 and not np.shares_memory(z, x)


def test_exp_le0_is_exp_to_an_ulp():
    """attend's vectorisable exponential against numpy's in float64, over softmax's range x <= 0 (and at the clamp)."""
    import numpy as np
    from numba import njit

    @njit(fastmath=cpu.FASTMATH)
    def exps(out, x):
        for i in range(x.size):
            out[i] = cpu.exp_le0(x[i])

    x = -np.concatenate([np.linspace(0, 87, 100_001), np.random.default_rng(0).exponential(5, 10_000)]).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -1e-30, -87.0])])
    out = np.empty_like(x)
    exps(out, x)
    want = np.exp(x.astype(np.float64))
    kept = x >= -87
    assert np.max(np.abs(out[kept] - want[kept]) / want[kept]) < 1.2e-7
    deep = np.float32([-88.0, -100.0, -np.inf])
    exps(out[:3], deep)
    assert np.all(out[:3] == out[-1]) and 0 < out[-1] < 1e-37  # exp(-87): nothing beside a softmax's 1


def test_input_rounding_is_exact_inside_fastmath_kernels():
    """The kernels are compiled with fastmath, whose pass marks every unflagged float instruction 'fast': the Q8_0
    rounding of their input (quantize_input's q8_0_block) must still be ref.quant.quantize_q8_0's to the byte, on
    values whose q = roundf(v / d) sits within ulps of a half (arcp's 1/d or a fused multiply-add flips them)."""
    import numpy as np
    from numba import njit

    from fast import quant
    from fast.cpu import FASTMATH
    from ref.quant import blocks, quantize, quantize_q8_0
    rng = np.random.default_rng(12)
    x = rng.standard_normal((64, 32)).astype(np.float32)  # [blocks, 32]
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    half = (rng.integers(0, 126, size=x.shape) + np.float32(0.5)).astype(np.float32)
    near = (half * d * np.where(rng.random(x.shape) < 0.5, 1, -1)).astype(np.float32)
    near = (near.view(np.int32) + rng.integers(-3, 4, size=x.shape, dtype=np.int32)).view(np.float32)  # +-3 ulps
    amax = np.abs(x).argmax(axis=1)
    near[np.arange(64), amax] = x[np.arange(64), amax]  # each block keeps its scale
    near = near.reshape(8, 256)  # 8 tokens of 8 blocks

    @njit(fastmath=FASTMATH)
    def quants(x, w):
        return quant.quantize_input(x, w)[0]

    want = quantize_q8_0(near.reshape(-1, 32))[:, 2:].view(np.int8).reshape(8, 256)
    w = blocks(quantize(np.zeros((1, 256), np.float32), "q8_0"))[0]
    assert np.array_equal(quants(near, w), want)


def test_every_compiled_function_names_the_flags_it_would_inherit():
    """Every numba function and overload of fast/ that compiles on its own (not inlined into its caller) names its
    fastmath flag and error model: numba compiles one that names none with its first caller's (a prange body's
    callees numpy's error model), once per process, so a kernel's arithmetic would depend on which kernel compiled
    first, in which process (and whose cache it loads)."""
    import importlib
    import pkgutil
    import sys

    from numba.core.registry import CPUDispatcher
    from numba.core.typing.templates import builtin_registry

    import fast
    for m in pkgutil.walk_packages(fast.__path__, "fast."):
        if m.name != "fast.__main__":
            importlib.import_module(m.name)
    named = {"fastmath", "error_model"}
    unnamed = [f"{d.py_func.__module__}.{d.__name__}" for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("fast.") for d in vars(m).values()
               if isinstance(d, CPUDispatcher) and d.py_func.__module__ == m.__name__
               and not named <= set(d.targetoptions) and d.targetoptions.get("inline") != "always"]
    overloads = [t for t in builtin_registry.functions if getattr(t, "_overload_func", None) is not None
                 and (t._overload_func.__module__ or "").startswith("fast.")]
    unnamed += [f"{t._overload_func.__module__}.{t._overload_func.__name__}" for t in overloads
                if not named <= set(t._jit_options) and not t._inline.is_always_inline]
    assert len(overloads) >= 20 and not unnamed, unnamed


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_a_tokens_product_is_the_same_bits_beside_any_others(fmt):
    """cpu.matmul's row for a token, with 1 to 9 tokens in the call (one at a time, four-token tiles, the tokens left
    over) and rows left over from the streams: the same bits as the token alone, so that a token's result does not
    depend on its neighbours in a step."""
    import numpy as np

    from fast.quant import for_matmul
    from ref.quant import blocks, quantize
    rng = np.random.default_rng()
    N, K = 203, 100 if fmt in ("f32", "f16", "bf16") else 96  # a float row's vector tail; whole blocks
    w = for_matmul(blocks(quantize(rng.standard_normal((N, K)).astype(np.float32), fmt)))
    x = rng.standard_normal((9, K)).astype(np.float32)
    alone = np.empty((9, N), np.float32)
    for t in range(9):
        cpu.matmul(alone[t:t + 1], x[t:t + 1], w)
    for T in range(2, 10):
        out = np.empty((T, N), np.float32)
        cpu.matmul(out, x[:T], w)
        np.testing.assert_array_equal(out, alone[:T], err_msg=f"{T} tokens")


BESIDE = [("f32", True, False), ("f16", True, False), ("bf16", True, False), ("f16", False, False),
          ("q8_0", True, False), ("q8_0", True, True), ("q4_0", True, True), ("q4_0", False, False)]


@pytest.mark.parametrize("fmt, gated, runs", BESIDE)
@pytest.mark.parametrize("sizes", [(0.7, 1.0), (0.0, 0.3)], ids=["dense-sets", "sparse-sets"])
def test_a_tokens_ffn_is_the_same_bits_beside_any_others(fmt, gated, runs, sizes):
    """sparse_ffn_batch's row for a token, with 2 to 9 tokens over their sets' union (tiles or a neuron at a time),
    and sparse_ffn of the token alone over its own set: the same bits, so that a token's FFN does not depend on its
    neighbours in a step."""
    import numpy as np

    from fast.cpu import KINDS
    from tests.fast.kernels import ffn_weights, randn
    rng = np.random.default_rng()
    D = 256 if runs else 40 if fmt in ("f32", "f16", "bf16") else 64  # runs: whole runs of blocks; floats: a tail
    T, F, C, kind, thr = 9, 61, 3, KINDS["relu"], np.float32(0.1)
    bundle, bu, _ = ffn_weights(rng, F, D, fmt, gated, runs)
    x = randn(rng, T, D)
    sets = [np.sort(rng.choice(F, rng.integers(int(sizes[0] * F), int(sizes[1] * F) + 1), replace=False))
            .astype(np.int32) for _ in range(T)]
    sets[1] = np.empty(0, np.int32)
    alone = np.empty((T, D), np.float32)
    for t in range(T):
        cpu.sparse_ffn(alone[t], np.empty((C, D), np.float32), x[t], bundle, bu, sets[t], len(sets[t]), kind, thr)
    for n in range(2, T + 1):
        union = np.unique(np.concatenate(sets[:n])).astype(np.int32)
        mask = np.zeros((n, F), np.uint8)
        for t in range(n):
            mask[t, np.searchsorted(union, sets[t])] = 1
        out = np.empty((n, D), np.float32)
        cpu.sparse_ffn_batch(out, np.empty((C, n, D), np.float32), x[:n], bundle, bu, union, len(union), mask, kind,
                             thr)
        np.testing.assert_array_equal(out, alone[:n], err_msg=f"{n} tokens")


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_a_tokens_rows_product_is_the_same_bits_beside_any_others(fmt):
    """sparse_rows (activation sparsity's product, the dense layout's down half: dense_down) for a token over its own
    inputs alone and over the union of 2 to 9 tokens' inputs: the same bits."""
    import numpy as np

    from ref.quant import blocks, quantize
    rng = np.random.default_rng()
    T, K, N, C = 9, 57, 40 if fmt in ("f32", "f16", "bf16") else 64, 3
    wt = blocks(quantize(rng.standard_normal((K, N)).astype(np.float32), fmt))
    x = rng.standard_normal((T, K)).astype(np.float32) * (rng.random((T, K)) < 0.4)
    x[2] = 0
    alone = np.empty((T, N), np.float32)
    for t in range(T):
        ids = np.flatnonzero(x[t]).astype(np.int32)
        cpu.sparse_rows(alone[t:t + 1], np.empty((C, 1, N), np.float32), x[t:t + 1], wt, ids, len(ids))
    for n in range(2, T + 1):
        ids = np.flatnonzero(x[:n].any(0)).astype(np.int32)
        out = np.empty((n, N), np.float32)
        cpu.sparse_rows(out, np.empty((C, n, N), np.float32), x[:n], wt, ids, len(ids))
        np.testing.assert_array_equal(out, alone[:n], err_msg=f"{n} tokens")
