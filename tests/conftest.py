import gc
import importlib.util

import pytest
import torch

# The GPU machine's image has no Dask, and its CUDA run (`pytest -m cuda tests`) collects every file: the Dask
# runner's tests (none of them CUDA tests) are left out there instead of failing to import. `[dev]` installs it.
collect_ignore = [] if importlib.util.find_spec("distributed") else ["report/test_dask.py"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# A CUDA-only test is marked `cuda`: `pytest -m cuda` selects exactly them on a GPU machine (the GPU run's
# `run.sh tests`), and without CUDA each is skipped with the reason below.
requires_cuda = pytest.mark.cuda


def pytest_configure(config):
    """One intra-op thread for the whole run: the tests' tensors are tiny, and at torch's default (a thread per
    core) each op pays OpenMP's fork, join and spin-wait. On the 2-core machine at load 5, 96 tests of
    checkpoint, models, calcgraph calibration and two experiments took 97 s (76 s CPU) at 2 threads and 20 s
    (18 s CPU) at 1. A test that needs several threads sets them itself (tests/optim/test_cpu_kernel.py)."""
    # NOTE: torch's setting only, not OMP_NUM_THREADS: processes the tests start (ranks, Dask workers, kernels)
    # keep their own defaults, which some tests check; the notebook build sets it for its kernels itself.
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Freeze what collection made (modules, functions, parameters: alive for the whole run) out of the cyclic
    garbage collector's reach: the measuring code's `gc.collect()` (before each meter, calibration run and
    allocator peak) then walks only what the tests made since, 0.3-0.6 s less per call here."""
    # NOTE: frozen objects are never collected, so only what lives as long as the session is frozen: a cycle
    # that dies later is still freed, since everything made after this point stays in the collector's reach.
    import torch._dynamo  # noqa: F401  (60 k objects; the first step of a torch.optim optimizer imports it)

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the last collection sees everything again (else nanobind reports triton's objects leaked)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, whatever the session's setting (`pytest_configure`): tiny tensors and
    convolutions run several times faster on a shared 2-core machine without threads spin-waiting on each
    other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
