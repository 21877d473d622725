"""The budget guard (support for Sections 4.3 and 4.5 of "CalcGraph: taming the high costs of deep
learning using models", 2022): a budget that fails like a real out-of-memory error."""

import pytest
import torch

from workbench.calcgraph import BudgetGuard


def test_guard_raises_an_out_of_memory_error_that_peers_recognise():
    guard = BudgetGuard(1000)
    with pytest.raises(torch.OutOfMemoryError, match="DefaultCPUAllocator: can't allocate memory"):
        with guard:
            torch.zeros(100)  # 400 bytes fit
            torch.zeros(1000)  # 4000 bytes do not
    assert guard.refusals == 1
    with pytest.raises(ValueError, match="budget_bytes"):
        BudgetGuard(0)
    accelerate = pytest.importorskip("accelerate.utils.memory")
    try:
        with BudgetGuard(10):
            torch.zeros(10)
    except torch.OutOfMemoryError as err:
        assert accelerate.should_reduce_batch_size(err)
