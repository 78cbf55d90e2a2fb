import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster, and on a shared 2-core machine two threads spin-wait
    on each other (100x slower under load, measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
