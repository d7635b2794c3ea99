import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is ~10x faster than two contending."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
