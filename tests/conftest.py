import os
import sys

from tests.helpers import HAS_GPU, SHIPPED

# GPU kernels run under numba's CUDA simulator unless a CUDA device is present; this must precede any numba import
# (tests.helpers imports only numpy and ref.common, which leave numba alone).
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # The simulator runs each CUDA thread as a Python thread and polls them from a loop that holds the GIL, so every
    # hand-over waited for the interpreter's switch interval (5 ms): a family's 2-token GPU run took 36 s, 4.7 s at
    # 0.1 ms.
    sys.setswitchinterval(1e-4)
    from tests.simulator import lock_shared_arrays
    lock_shared_arrays()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shipped_model():
    import ref
    return ref.load_model(SHIPPED)


@pytest.fixture(scope="session")
def shipped_tokenizer():
    import ref
    return ref.load_tokenizer(SHIPPED)


@pytest.fixture(autouse=True, scope="session")
def one_default_thread():
    """The default -t is the number of cores other processes leave idle (fast.engine.free_cores), which moves with
    the suite's other process; an engine's sums split in chunks per thread, so two engines loaded a moment apart
    could differ in their last bits. Tests that want threads ask for them."""
    if "fast.engine" not in sys.modules:
        yield
        return
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys.modules["fast.engine"], "free_cores", lambda *a, **k: 1)
        yield
