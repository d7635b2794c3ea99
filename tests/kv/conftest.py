import pytest


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here runs torch on one thread (``one_torch_thread``, tests/conftest.py)."""
