"""A memory budget that fails like a real out-of-memory error, on CPU and on CUDA.

Support for "CalcGraph: taming the high costs of deep learning using models (2022)",
Sections 4.3 and 4.5: the paper's baselines find their memory limit by running until they
fail. A host with tens of GiB never runs out of memory for a small model, so on CPU a budget
is made real by `BudgetGuard`, a dispatch mode that counts the live bytes of every storage
created while it is active (the rule of `workbench.measure.MemoryMeter`) and raises
`torch.OutOfMemoryError` as soon as they exceed the budget. On CUDA `cuda_memory_budget`
caps the caching allocator with `torch.cuda.set_per_process_memory_fraction`.

# NOTE: the guard checks after an op has produced its output (its size is not known before),
# then raises; the refused tensor is dropped as the exception unwinds. The message contains
# the CPU allocator's own wording, "DefaultCPUAllocator: can't allocate memory", because
# trial-based batch finders (accelerate, Lightning) recognise an out-of-memory error by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from workbench.measure import LiveStorageMode

__all__ = ["BudgetGuard", "cuda_memory_budget"]


class BudgetGuard(LiveStorageMode):
    """Raise `torch.OutOfMemoryError` when live tensor bytes created inside exceed a budget.

    `baseline` counts bytes already resident that belong to the job (e.g. a model built before
    entry). The same guard may be entered many times; tensors it saw stay counted until freed.
    `peak_bytes` (highest count, baseline included) and `refusals` are kept across entries.

    Example::

        with BudgetGuard(64 * 2**20):
            train_step(batch_size=512)   # raises torch.OutOfMemoryError past 64 MiB
    """

    def __init__(self, budget_bytes: float, *, baseline: int = 0, pause_on_refusal: bool = False) -> None:
        super().__init__()
        if not budget_bytes > 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        if baseline < 0:
            raise ValueError(f"baseline must be >= 0 bytes, got {baseline}")
        self.budget_bytes = float(budget_bytes)
        self.baseline = int(baseline)
        self.current = self.baseline
        self.peak_bytes = self.baseline
        self.refusals = 0
        # NOTE: `active = False` lets a framework's own bookkeeping (e.g. a trainer restoring a
        # checkpoint between trials) run untouched while the mode stays on the stack; frees of
        # counted tensors are still followed. `pause_on_refusal` sets it after each refusal.
        self.active = True
        self.pause_on_refusal = pause_on_refusal
        self._reserved = 0

    def reserve(self, nbytes: int) -> None:
        """Count `nbytes` held outside the guard's sight (e.g. a batch collated before entry),
        replacing the previous reservation."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.current += int(nbytes) - self._reserved
        self._reserved = int(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.current)

    def _watching(self) -> bool:
        return self.active

    def _released(self, key: int, nbytes: int) -> None:
        self.current -= nbytes

    def _allocated(self, key: int, nbytes: int, old_nbytes: int | None, op: str) -> None:
        self.current += nbytes - (old_nbytes or 0)
        if self.current > self.budget_bytes:
            self.refusals += 1
            wanted = self.current
            self._forget(key)  # the refused tensor is about to be dropped
            self.active = not self.pause_on_refusal
            raise torch.OutOfMemoryError(
                f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {nbytes} bytes; "
                f"budget guard: live tensor bytes would be {wanted} > budget {self.budget_bytes:.0f} "
                f"(op {op})"
            )
        self.peak_bytes = max(self.peak_bytes, self.current)


@contextlib.contextmanager
def cuda_memory_budget(budget_bytes: float, device: torch.device | str = "cuda") -> Iterator[float]:
    """Cap this process's CUDA allocations at `budget_bytes` beyond what is allocated now.

    Sets `torch.cuda.set_per_process_memory_fraction` for the duration (the cache is emptied
    first so that reserved-but-free blocks do not count) and restores a fraction of 1.0 after.
    Yields the fraction used.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_memory_budget needs CUDA, which is not available here")
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    device = torch.device(device)
    if device.index is None:  # set_per_process_memory_fraction needs an index: "cuda" is the current device
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = (torch.cuda.memory_allocated(device) + float(budget_bytes)) / total
    if not 0 < fraction <= 1:
        raise ValueError(f"budget {budget_bytes:.0f} bytes exceeds the device's {total} bytes")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield fraction
    finally:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
