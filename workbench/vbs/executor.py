"""Executing a variable-batch-size plan on the real model.

From "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section II (phases of smaller batches with buffered activations, Figs 3 and 4) and Section III:
every `Step` of a `Plan` takes the first `batch` samples waiting at its layer, runs the layer on
them and appends the outputs to the next layer's queue. Queues hold chunks (one tensor per
finished phase); a phase that needs samples from several chunks concatenates them, one that
needs part of a chunk takes a view. Samples keep their order, so the result equals
`model(inputs)` (tests check it with `assert_close`).

A special layer (branch group) pre-allocates its output for the step's samples; each branch
runs its own phases on views of the group's input and copies (concatenation) or adds (residual
sum) its finished outputs into that buffer, then the group's `post` module runs on it in place.
The per-sample shapes of the branch outputs come from one single-sample pass done before any
measurement.

`run` returns the outputs with the wall time of one execution and the peak memory of another
(under `MemoryMeter`, whose CPU dispatch tracker slows execution). Differences from the DP's
accounting, reported rather than hidden: the request's inputs are held by the caller for the
whole run (the DP frees them as they are consumed), a chunk only partly consumed stays
allocated until all of it is, and concatenating chunks holds both copies for a moment.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from ..measure import MemoryMeter
from .graph import Stage, stages_of
from .schedule import Plan, Step

__all__ = ["Executor", "RunResult", "run"]


def _take(queue: deque, b: int) -> torch.Tensor:
    parts, n = [], 0
    while n < b:
        if not queue:
            raise RuntimeError(f"plan asks for {b} samples but only {n} are waiting at this layer")
        chunk = queue.popleft()
        need = b - n
        if chunk.shape[0] > need:
            queue.appendleft(chunk[need:])
            chunk = chunk[:need]
        parts.append(chunk)
        n += chunk.shape[0]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _write(dst: torch.Tensor, src: torch.Tensor, merge: str) -> None:
    if merge == "add":
        dst.add_(src)
    else:
        dst.copy_(src)


class Executor:
    """Runs `plan` on `model` (eval mode, no grad): `Executor(model, plan)(inputs) -> outputs`."""

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a workbench.vbs.Plan, got {type(plan).__name__}")
        self.model = model.eval()
        self.stages: list[Stage] = stages_of(model)
        names = [s.name for s in self.stages]
        if names != plan.names:
            raise ValueError(f"plan was made for layers {plan.names[:4]}... ({len(plan.names)}), "
                             f"the model has {names[:4]}... ({len(names)})")
        self.plan = plan
        self._shapes: dict[int, list[tuple[int, ...]]] | None = None

    @torch.no_grad()
    def prepare(self, sample: torch.Tensor) -> None:
        """Per-sample output shapes of every branch (one single-sample pass)."""
        shapes: dict[int, list[tuple[int, ...]]] = {}
        x = sample[:1]
        for i, stage in enumerate(self.stages):
            if stage.is_branch:
                shapes[i] = []
                for branch in stage.branches:
                    y = x
                    for _, layer in branch:
                        y = layer(y)
                    shapes[i].append(tuple(y.shape[1:]))
            x = stage(x)
        self._shapes = shapes

    def _group(self, i: int, step: Step, x: torch.Tensor) -> torch.Tensor:
        stage, shapes = self.stages[i], self._shapes[i]
        b = x.shape[0]
        if stage.merge == "cat":
            channels = sum(s[0] for s in shapes)
            buf = x.new_empty((b, channels, *shapes[0][1:]))
        else:
            buf = x.new_zeros((b, *shapes[0]))
        offset = 0
        for a, (branch, steps) in enumerate(zip(stage.branches, step.branches, strict=True)):
            width = shapes[a][0]
            target = buf[:, offset:offset + width] if stage.merge == "cat" else buf
            if not branch:  # identity branch
                _write(target, x, stage.merge)
            queues = [deque([x])] + [deque() for _ in branch]
            row = 0
            for s in steps:
                y = branch[s.layer][1](_take(queues[s.layer], s.batch))
                if s.layer == len(branch) - 1:
                    _write(target[row:row + s.batch], y, stage.merge)
                    row += s.batch
                else:
                    queues[s.layer + 1].append(y)
                del y
            if branch and row != b:
                raise RuntimeError(f"branch {a} of {stage.name!r} produced {row} of {b} samples")
            offset += width if stage.merge == "cat" else 0
        return stage.post(buf) if stage.post is not None else buf

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.shape[0] != self.plan.batch:
            raise ValueError(f"plan is for a request of {self.plan.batch} samples, got {inputs.shape[0]}")
        if self._shapes is None:
            self.prepare(inputs)
        queues = [deque([inputs])] + [deque() for _ in self.stages]
        for step in self.plan.steps:
            x = _take(queues[step.layer], step.batch)
            stage = self.stages[step.layer]
            y = self._group(step.layer, step, x) if stage.is_branch else stage.module(x)
            del x
            queues[step.layer + 1].append(y)
            del y
        out = list(queues[-1])
        if sum(t.shape[0] for t in out) != self.plan.batch or any(queues[:-1]):
            raise RuntimeError("plan did not carry every sample through every layer")
        return out[0] if len(out) == 1 else torch.cat(out)


@dataclass
class RunResult:
    """Outputs of one executed plan, its wall time and its measured peak memory."""

    outputs: torch.Tensor
    seconds: float
    peak_bytes: int
    input_bytes: int
    predicted_seconds: float
    predicted_peak_bytes: int

    @property
    def time_ratio(self) -> float:
        """Executed / predicted time (above 1: per-phase overhead the profile does not see)."""
        return self.seconds / self.predicted_seconds if self.predicted_seconds > 0 else float("nan")

    @property
    def memory_ratio(self) -> float:
        """Measured peak (incl. the caller's inputs) / the DP's predicted peak."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")


def run(model: nn.Module, plan: Plan, inputs: torch.Tensor, *, measure_memory: bool = True) -> RunResult:
    """Execute `plan` on `model` for `inputs`; outputs equal `model(inputs)`.

    `seconds` is one timed execution (after the shape pass); `peak_bytes` is the peak of tensors
    allocated during a second execution under `MemoryMeter`, plus the inputs' bytes (held by the
    caller throughout). Both are for the device `inputs` live on.
    """
    ex = Executor(model, plan)
    ex.prepare(inputs)
    device = inputs.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync()
    start = time.perf_counter()
    outputs = ex(inputs)
    sync()
    seconds = time.perf_counter() - start
    peak = 0
    if measure_memory:
        with MemoryMeter(device) as meter:
            again = ex(inputs)
        del again
        peak = meter.peak_bytes
    nbytes = inputs.numel() * inputs.element_size()
    return RunResult(outputs, seconds, peak + nbytes, nbytes, plan.time_per_sample * plan.batch, plan.peak_bytes)
