"""Shared fixtures of the CalcGraph library tests: the paper's MLP planned for a heap, and plain
PyTorch training to compare heap-bound training against."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.calcgraph import make_optimizer, plan_training, training_program
from workbench.measure import AllocatorMeter
from workbench.models import MLP


def pytest_configure(config):
    config.addinivalue_line("markers", "large_batch: a zoo case at a large batch (deselect with -m 'not large_batch')")


@pytest.fixture(scope="module")
def one_thread_module():
    """One intra-op thread for plans, calibration and measurement alike (the allocator's scratch depends on
    the thread count, and tiny kernels run faster on a shared machine without spinning threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _allocator_peak(build, shape, batch_size, **options) -> int:
    with AllocatorMeter("cpu") as meter:
        training_program(build, shape, batch_size, **options)
    return meter.peak_bytes


@pytest.fixture
def allocator_peak():
    """(build, shape, batch_size, **training_program options) -> the allocator's peak (`AllocatorMeter`) over a
    real run of `training_program`: the measure a plan is judged against, sharing no counting rule with it."""
    return _allocator_peak


@pytest.fixture(scope="module")
def mlp_heap_graph():
    return plan_training(MLP, (1, 28, 28), persistent_grads=True)


def plain_training(seed: int, x: torch.Tensor, y: torch.Tensor, steps: int) -> nn.Module:
    """An MLP built under `seed` and trained `steps` Adam steps by plain PyTorch."""
    torch.manual_seed(seed)
    model = MLP()
    opt = make_optimizer("adam", model.parameters())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.fixture
def plain():
    return plain_training


@pytest.fixture
def same():
    return assert_same
