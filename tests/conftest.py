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
