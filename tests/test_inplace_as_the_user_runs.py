"""Under a tensor-counting dispatch mode the program is the user's (`workbench/inplace.py`): under any dispatch
mode torch sums a tensor's gradients and adds `linear`'s bias out of place, and every counting mode (MemoryMeter's
tracker, CalcGraph's tracer, its budget guard) runs them in place where the plain program does. Judged by the
allocator: the same allocations and frees, in the same order, with or without the meter."""

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

from tests.test_measure_allocator import counted_and_allocated, family_step
from workbench.calcgraph import BudgetGuard
from workbench.measure import MemoryMeter, allocator_events

USERS_MODELS = ["mha self-attention", "sdpa self-attention", "encoder layer", "residual mlp", "tied lm"]


def _allocations(step, mode=None) -> list[int]:
    """The allocator's events of one `step` (bytes, + allocated, - freed, in time order), above 8 bytes.

    # NOTE: 8-byte events are Python numbers wrapped into tensors by C++: a Python dispatch mode hands an op's
    # wrapped number to Python as a float and the op wraps it again, one more 8-byte tensor per such op (the
    # mode's own cost, freed at once, never an extra tensor of the user's)."""
    gc.collect()
    with allocator_events("test") as profiler, mode if mode is not None else contextlib.nullcontext():
        step()
    events = [e for e in profiler.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    return [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()) if abs(e.nbytes()) > 8]


@pytest.mark.parametrize("family", USERS_MODELS)
def test_the_metered_step_allocates_what_the_plain_step_allocates(family, one_thread):
    step = family_step(family)
    plain = _allocations(step)
    metered = _allocations(step, MemoryMeter("cpu"))
    assert metered == plain, (f"{len(metered)} allocations and frees under the meter ({sum(max(n, 0) for n in metered)}"
                              f" bytes allocated), {len(plain)} plain ({sum(max(n, 0) for n in plain)} bytes)")


def test_the_budget_guard_counts_the_users_program(one_thread):
    """CalcGraph's guard shares the counting mode: its peak is the meter's, below the allocator's peak of the plain
    step by the Python numbers neither sees (tests/test_measure_allocator.py)."""
    step = family_step("mha self-attention")
    counted, allocated = counted_and_allocated(step)
    guard = BudgetGuard(2**40)
    try:
        gc.collect()
        with guard:
            step()
    finally:
        guard.close()
    assert guard.peak_bytes == counted
    assert 0 < allocated - guard.peak_bytes <= 16, (guard.peak_bytes, allocated)


@contextlib.contextmanager
def _two_meters():
    with MemoryMeter("cpu") as outer, MemoryMeter("cpu") as inner:
        yield outer, inner


def test_torch_is_restored_after_the_block_even_on_error():
    backward, grad, linear = torch.autograd.backward, torch.autograd.grad, F.linear
    with MemoryMeter("cpu"):
        assert torch.autograd.backward is not backward and F.linear is not linear  # followed inside
    with pytest.raises(ValueError, match="inside"), MemoryMeter("cpu"):
        raise ValueError("raised inside")
    assert (torch.autograd.backward, torch.autograd.grad, F.linear) == (backward, grad, linear)


def test_nested_meters_run_the_users_program_and_agree(one_thread):
    """The innermost mode decides each add; the outer one sees the op it chose."""
    step = family_step("mha self-attention")
    plain = _allocations(step)
    meters = _two_meters()
    assert _allocations(step, meters) == plain
    gc.collect()
    with MemoryMeter("cpu") as alone:
        step()
    with _two_meters() as (outer, inner):
        step()
    assert outer.peak_bytes == inner.peak_bytes == alone.peak_bytes
