"""The model tests use tiny models: one intra-op thread is fastest for them and immune to
OpenMP barrier stalls when the machine is busy (a 2-thread bf16 matmul can then take ~10 ms)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
