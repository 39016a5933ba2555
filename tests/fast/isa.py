"""fast.quant generating its code for another instruction set or vector width, in one test only."""

import pytest


def with_isa(monkeypatch, request, isa):
    """fast.quant generating its integer products for `isa` (read when the intrinsics generate code: callers compiled
    afterwards use it): "vnni512" is vnni with 16-lane vpdpbusd (fast.quant.target.WIDE: interleaved groups and rows
    in runs two by two); skips where this CPU cannot run it."""
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    runs = {"vnni512": feats.get("avx512vnni") and feats.get("avx512bw"),
            "vnni": feats.get("avxvnni") or feats.get("avx512vnni"), "avx2": feats.get("avx2"), "generic": True}
    if not runs[isa]:
        pytest.skip(f"this CPU cannot run {isa}")
    return generating(monkeypatch, request, ISA="vnni" if isa == "vnni512" else isa, WIDE=isa == "vnni512")


def generating(monkeypatch, request, **settings):
    """fast.quant with `settings` of fast.quant.target in force for the code its intrinsics generate from now on, in
    this test only: their cached code is forgotten now and again at teardown, so that nothing compiled later keeps
    it."""
    from fast import quant
    from fast.quant import target
    for name, value in settings.items():
        monkeypatch.setattr(target, name, value)
    forget_intrinsic_code(quant)
    request.addfinalizer(lambda: forget_intrinsic_code(quant))
    return quant


def forget_intrinsic_code(module):
    """Drop numba's typing caches of the module's intrinsics and overloads (the row operations), which keep each
    one's codegen or compiled implementation per argument types for the process: without it every ISA or vector
    width after the first reused the first one's code."""
    from numba.core import types
    from numba.core.registry import cpu_target

    context = cpu_target.typing_context
    context.refresh()
    for obj in vars(module).values():
        if not callable(obj):
            continue
        try:
            typ = context.resolve_value_type(obj)
        except ValueError:  # a plain Python function: nothing compiled
            continue
        for template in typ.templates if isinstance(typ, types.Function) else ():
            template._impl_cache.clear()
            getattr(template, "_overload_cache", {}).clear()
