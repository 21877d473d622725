"""Running a variable-batch-size plan once, timed, and reading its peak from the allocator.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Sections III and IV: the DP predicts a plan's time (the profiled layer times summed over its
phases) and its memory (`Plan.peak_bytes`: the DP's accounting and the executor's copies, the
request included, `workbench.vbs.flow`). `run` executes a plan on the model and reports both
beside their predictions; `measure_peak` reads the peak from the allocator's own count
(`workbench.measure.AllocatorMeter`: c10's events on CPU, `max_memory_allocated` on CUDA), which
shares nothing with the plan's accounting.

Everything `run` does counts against the plan, the request included as the caller hands it over
(a tensor the caller keeps is held for the whole call, `Plan.request` "kept"; a list of samples is
freed sample by sample, "pieces"): the shapes are read with fake tensors (nothing allocated), the
executions stay within the plan's predicted peak and the first-batch check within the budget the
plan was made for (`RunResult.predicted_call_bytes` predicts the whole call), or `run` refuses
before it allocates anything (`UnexecutablePlan`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ..measure import AllocatorMeter
from .executor import Executor, _nbytes
from .schedule import Plan

__all__ = ["RunResult", "measure_peak", "run"]


@dataclass
class RunResult:
    """Outputs of one executed plan, its wall time and its measured peak memory."""

    outputs: torch.Tensor
    seconds: float
    peak_bytes: int
    input_bytes: int
    predicted_seconds: float
    predicted_peak_bytes: int  # the plan's: its execution, the request included
    checked: bool = False  # outputs were compared with the model's forward, sample by sample
    predicted_call_bytes: int = 0  # the whole call's, the first-batch check included (within the plan's budget)

    @property
    def time_ratio(self) -> float:
        """Executed / predicted time (above 1: per-phase overhead the profile does not see)."""
        return self.seconds / self.predicted_seconds if self.predicted_seconds > 0 else float("nan")

    @property
    def memory_ratio(self) -> float:
        """Measured peak (the request included) / the plan's predicted peak: at most 1."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")


def measure_peak(executor: Executor, inputs: torch.Tensor) -> int:
    """Peak bytes the device's allocator hands out (`AllocatorMeter`) while a copy of the request
    `inputs` is made and executed as `executor.plan` counts its request: one copy per sample, each
    handed over and freed once consumed ("pieces", OPT[1, n, b, mem]), or one copy held whole
    ("kept"). Comparable with `executor.plan.peak_bytes`."""
    with torch.no_grad(), AllocatorMeter(inputs.device) as meter:
        if executor.plan.request == "pieces":
            executor.execute([inputs[k:k + 1].clone() for k in range(inputs.shape[0])])
        else:
            executor.execute(inputs.clone())
    return meter.peak_bytes


def run(model: nn.Module, plan: Plan, inputs: torch.Tensor | list[torch.Tensor], *, measure_memory: bool = True,
        check: bool = True, rtol: float | None = None, atol: float | None = None,
        check_memory: bool = True) -> RunResult:
    """Execute `plan` on `model` for `inputs`; outputs equal `model(inputs)`.

    `inputs` is one tensor, which the caller keeps (counted whole for the whole call: plan with
    `request="kept"`), or a list of per-sample tensors of batch 1 handed over (emptied, each sample
    freed once consumed: the paper's accounting, `request="pieces"`). Before anything is allocated,
    the executor follows the plan with these inputs' sizes and refuses (`UnexecutablePlan`) where
    the execution or the check would need more than the plan's predicted peak, unless
    `check_memory=False`.

    With `measure_memory` (a tensor only: a list is consumed by its one execution) a first execution
    runs under the allocator's meter: `peak_bytes` is its peak plus the request, which was allocated
    before and is held throughout. `seconds` is the next execution, timed (after the measured one,
    which warms it), whose outputs are returned. With `check` (the default) those outputs are
    compared with the model's forward on every sample (`Executor.verify`), outside the timing; a
    mismatch raises `ExecutionMismatch` naming the stage. Both are for the device `inputs` live on.
    """
    if not isinstance(measure_memory, bool):
        raise TypeError(f"measure_memory must be True or False, got {measure_memory!r}")
    if not isinstance(inputs, (torch.Tensor, list)) or (
            isinstance(inputs, list) and not all(isinstance(x, torch.Tensor) for x in inputs)):
        raise TypeError(f"inputs must be a tensor or a list of per-sample tensors, got {type(inputs).__name__}")
    ex = Executor(model, plan, check=check, rtol=rtol, atol=atol, check_memory=check_memory)
    kept = isinstance(inputs, torch.Tensor)
    if measure_memory and not kept:
        raise ValueError("measure_memory needs a second execution, and a list of samples is consumed by its first: "
                         "pass measure_memory=False, or measure with vbs.measure_peak")
    ex.prepare(inputs)
    first = inputs if kept else inputs[0]
    nbytes, device = _nbytes(first[:1]) * plan.batch, first.device
    del first  # a handed-over sample held here would not be freed when the plan consumes it
    peak = 0
    if measure_memory:
        with torch.no_grad(), AllocatorMeter(device) as meter:
            ex.execute(inputs)  # its outputs are dropped at once
        peak = meter.peak_bytes + nbytes
    references = ex.references(inputs) if check else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync()
    start = time.perf_counter()
    outputs = ex.execute(inputs)
    sync()
    seconds = time.perf_counter() - start
    if check:
        ex.verify(outputs, references, inputs if kept else None)
    return RunResult(outputs, seconds, peak, nbytes, plan.time_per_sample * plan.batch, plan.peak_bytes, ex.checked,
                     ex.predicted_peak)
