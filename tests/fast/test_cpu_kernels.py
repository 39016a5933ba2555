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
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(kernel_cache, "HERE", str(tmp_path))
    kernel_cache.stamp.cache_clear()
    own = str(tmp_path / "engine.py")
    before = kernel_cache.stamp(own)
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.stamp(own) == before  # nothing changed: the cache is fresh
    (tmp_path / "quant.py").write_text("# quant.py, edited\n")
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.stamp(own) != before
    kernel_cache.stamp.cache_clear()
    assert kernel_cache.InTree.from_function(len, str(tmp_path.parent / "elsewhere.py")) is None
    assert type(cpu.matmul._cache._impl.locator).__mro__[1] is kernel_cache.KernelSources


def with_isa(monkeypatch, request, isa):
    """fast.quant generating its integer products for `isa` (read when the intrinsics generate code: callers compiled
    afterwards use it): "vnni512" is vnni with 16-lane vpdpbusd (fast.quant.WIDE: interleaved groups and rows in
    runs two by two); skips where this CPU cannot run it."""
    import llvmlite.binding as llvm

    from fast import quant
    feats = llvm.get_host_cpu_features()
    runs = {"vnni512": feats.get("avx512vnni") and feats.get("avx512bw"),
            "vnni": feats.get("avxvnni") or feats.get("avx512vnni"), "avx2": feats.get("avx2"), "generic": True}
    if not runs[isa]:
        pytest.skip(f"this CPU cannot run {isa}")
    return generating(monkeypatch, request, quant, ISA="vnni" if isa == "vnni512" else isa, WIDE=isa == "vnni512")


def generating(monkeypatch, request, module, **settings):
    """The module with `settings` in force for the code its intrinsics generate from now on, in this test only:
    their cached code is forgotten now and again at teardown, so that nothing compiled later keeps it."""
    for name, value in settings.items():
        monkeypatch.setattr(module, name, value)
    forget_intrinsic_code(module)
    request.addfinalizer(lambda: forget_intrinsic_code(module))
    return module


def forget_intrinsic_code(module):
    """Drop numba's typing cache of the module's intrinsics, which keeps each one's codegen per argument types for the
    process: without it every ISA after the first reused the first one's code."""
    from numba.core.extending import _Intrinsic
    from numba.core.registry import cpu_target

    context = cpu_target.typing_context
    context.refresh()
    for obj in vars(module).values():
        if isinstance(obj, _Intrinsic):
            for template in context.resolve_value_type(obj).templates:
                template._impl_cache.clear()
                template._overload_cache.clear()


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("K", [48, 37, 5])
def test_float_tiles_in_every_width(monkeypatch, request, lanes, fmt, K):
    """fast.quant.dot4x4 in 16-lane vectors (AVX-512) and 8-lane ones (other CPUs), steps and a tail, a tail alone,
    against ref's values: lane 4 i + j = w_i . x_j."""
    import numpy as np
    from numba import njit

    from fast import quant
    from ref.quant import blocks, quantize, values
    generating(monkeypatch, request, quant, FLOAT_LANES=lanes)

    @njit
    def tile(w, x):
        return quant.dot4x4(w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], w[1], w[2], w[3], w[0])

    rng = np.random.default_rng(11)
    w = blocks(quantize(rng.standard_normal((4, K)).astype(np.float32), fmt))
    x = rng.standard_normal((4, K)).astype(np.float32)
    want = values(w).astype(np.float64) @ x.astype(np.float64).T  # [4 rows, 4 tokens]
    np.testing.assert_allclose(np.array(tile(w, x)), want.ravel(), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("isa", ["vnni512", "vnni", "avx2", "generic"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_block_dot_products_in_every_isa(monkeypatch, request, isa, fmt):
    """The block dot products' IR for each instruction set this machine can run (the kernels use the best one; a
    machine without VNNI or without AVX2 runs the others): one token and four tokens against ref's values."""
    import numpy as np
    from numba import njit

    from ref.quant import blocks, input_values, quantize, values
    quant = with_isa(monkeypatch, request, isa)

    @njit
    def one(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot(w, xq[0], xd[0], xs[0], np.int64(w.shape[0]))

    @njit
    def four(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot4t(w, xq, xd, xs, np.int64(4), np.int64(0), np.int64(2), np.int64(1))

    rng = np.random.default_rng(7)
    t = quantize(rng.standard_normal((1, 32 * 7)).astype(np.float32), fmt)  # 7 blocks: GROUP's tail too
    w = blocks(t)[0]
    x = rng.standard_normal((5, 32 * 7)).astype(np.float32) * 3
    want = input_values(x, t).astype(np.float64) @ values(w).astype(np.float64)  # [5]
    np.testing.assert_allclose(one(w, x[:1]), want[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(four(w, x), want[[4, 0, 2, 1]], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["vnni512", "vnni", "avx2", "generic"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_interleaved_dot_products_in_every_isa(monkeypatch, request, isa, fmt):
    """The interleaved groups' dot products (vpdpbusd, or its plain-IR form without VNNI): one group, four groups at
    once, one group against four tokens and two groups against four tokens, against ref's values."""
    import numpy as np
    from numba import njit

    from ref.quant import blocks, input_values, quantize, values
    quant = with_isa(monkeypatch, request, isa)

    @njit
    def one(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot8(w[1], xq[0], xd[0], xs[0], np.int64(w.shape[1]))

    @njit
    def four(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot8x4(w[3], w[0], w[2], w[1], xq[0], xd[0], xs[0], np.int64(w.shape[1]))

    @njit
    def tokens(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot8_4t(w[2], xq, xd, xs, np.int64(w.shape[1]), np.int64(4), np.int64(0), np.int64(2),
                                   np.int64(1))

    @njit
    def pair(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        return quant.block_dot8x2_4t(w[3], w[1], xq, xd, xs, np.int64(w.shape[1]), np.int64(4), np.int64(0),
                                     np.int64(2), np.int64(1))

    rng = np.random.default_rng(8)
    t = quantize(rng.standard_normal((32, 32 * 7)).astype(np.float32), fmt)  # 4 groups of 8 rows, 7 blocks
    w = quant.interleave(blocks(t))
    x = rng.standard_normal((5, 32 * 7)).astype(np.float32) * 3
    want = values(blocks(t)).astype(np.float64) @ input_values(x, t).astype(np.float64).T  # [32, 5]
    np.testing.assert_allclose(one(w, x[:1]), want[8:16, 0], rtol=1e-5, atol=1e-4)
    order = np.concatenate([np.arange(8) + 8 * g for g in (3, 0, 2, 1)])
    np.testing.assert_allclose(four(w, x[:1]), want[order, 0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(tokens(w, x), want[16:24][:, [4, 0, 2, 1]].T.ravel(), rtol=1e-5, atol=1e-4)
    pairs = np.concatenate([want[g * 8:g * 8 + 8][:, [4, 0, 2, 1]].T.ravel() for g in (3, 1)])
    np.testing.assert_allclose(pair(w, x), pairs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["vnni512", "vnni", "avx2", "generic"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_run_dot_products_in_every_isa(monkeypatch, request, isa, fmt):
    """Rows in runs (fast.quant.RUNS: lanes are blocks): one row, four rows at once (also hinting four others on the
    way), one row against four and two tokens, against ref's values; the token laid out by quantize_input as the runs
    read it."""
    import numpy as np
    from numba import njit

    from ref.quant import blocks, input_values, quantize, values
    quant = with_isa(monkeypatch, request, isa)

    @njit
    def products(w, x):
        xq, xd, xs = quant.quantize_input(x, w)
        reach = np.int64(w.shape[1])
        one = quant.run_dot(w[1], xq[0], xd[0], xs[0], reach)
        four = quant.run_dot4(w[3], w[0], w[2], w[1], xq[0], xd[0], xs[0], reach)
        tokens = quant.run_dot4t(w[2], xq, xd, xs, reach, np.int64(4), np.int64(0), np.int64(2), np.int64(1))
        two = quant.run_dot2t(w[0], xq, xd, xs, reach, np.int64(3), np.int64(0))
        ahead = quant.run_dot4_ahead(w[3], w[0], w[2], w[1], w[0], w[0], w[1], w[2], xq[0], xd[0], xs[0], reach)
        return one, four, tokens, two, ahead

    rng = np.random.default_rng(9)
    t = quantize(rng.standard_normal((4, 32 * 24)).astype(np.float32), fmt)  # 4 rows of 3 runs
    w = quant.to_runs(blocks(t))
    x = rng.standard_normal((5, 32 * 24)).astype(np.float32) * 3
    want = values(blocks(t)).astype(np.float64) @ input_values(x, t).astype(np.float64).T  # [4, 5]
    one, four, tokens, two, ahead = products(w, x)
    np.testing.assert_allclose(one, want[1, 0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(four, want[[3, 0, 2, 1], 0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(tokens, want[2, [4, 0, 2, 1]], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(two, want[0, [3, 0]], rtol=1e-5, atol=1e-4)
    assert ahead == four  # the same products; the hints change no result


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_runs_are_blocks_rearranged(fmt):
    """plain undoes to_runs byte for byte, and the row operations read runs as the blocks they hold: each axpy as
    on the blocks (the same products; LLVM may fuse them into FMAs differently, hence to a few ulps)."""
    import numpy as np
    from numba import njit

    from fast import quant
    from ref.quant import blocks, quantize
    rng = np.random.default_rng(10)
    b = blocks(quantize(rng.standard_normal((4, 32 * 16)).astype(np.float32), fmt))  # 4 rows of 2 runs
    r = quant.to_runs(b)
    assert r.shape == (4, 2) and r.nbytes == b.nbytes
    assert quant.plain(r).tobytes() == b.tobytes()
    assert quant.for_sparse(b.reshape(2, 2, 16)).dtype == r.dtype and quant.for_sparse(b[:, :12]).dtype == b.dtype

    @njit
    def axpys(w, n):
        y = np.zeros((3, n), np.float32)
        a = np.float32(0.7)
        quant.axpy(y[0], a, w[0])
        quant.axpy4(y[1], a, np.float32(-1.5), np.float32(2.0), a, w[0], w[1], w[2], w[3])
        quant.axpy4t(y, np.int64(2), np.int64(0), np.int64(1), np.int64(2), a, a, np.float32(3.0), np.float32(-2.0), w[3])
        quant.axpy2t(y, np.int64(0), np.int64(1), np.float32(0.25), a, w[2])
        return y

    np.testing.assert_allclose(axpys(r, 512), axpys(b, 512), rtol=1e-6, atol=1e-6)


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
