import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# A CUDA-only test is marked `cuda`: `pytest -m cuda` selects exactly them on a GPU machine (the GPU run's
# `run.sh tests`), and without CUDA each is skipped with the reason below.
requires_cuda = pytest.mark.cuda


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny tensors and convolutions run several times faster on a
    shared 2-core machine without threads spin-waiting on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
