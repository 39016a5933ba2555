import os

from tests.helpers import HAS_GPU, SHIPPED

# GPU kernels run under numba's CUDA simulator unless a CUDA device is present; this must precede any numba import
# (tests.helpers imports only numpy and ref.common, which leave numba alone).
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shipped_model():
    import ref
    return ref.load_model(SHIPPED)


@pytest.fixture(scope="session")
def shipped_tokenizer():
    import ref
    return ref.load_tokenizer(SHIPPED)
