import os

# GPU kernels run under numba's CUDA simulator unless a CUDA device is present; this must precede any numba import.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest

from tests.helpers import SHIPPED


@pytest.fixture(scope="session")
def shipped_model():
    import ref
    return ref.load_model(SHIPPED)


@pytest.fixture(scope="session")
def shipped_tokenizer():
    import ref
    return ref.load_tokenizer(SHIPPED)
