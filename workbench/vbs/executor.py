"""Executing a variable-batch-size plan on the real model.

From "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section II (phases of smaller batches with buffered activations, Figs 3 and 4) and Section III:
every `Step` of a `Plan` takes the first `batch` samples waiting at its layer, runs the layer on
them and appends the outputs to the next layer's queue. Queues hold chunks (one tensor per
finished phase); a phase that needs samples from several chunks concatenates them, one that
needs part of a chunk takes a view. Samples keep their order, so the result equals
`model(inputs)`.

Never silently wrong: the first call checks the executed outputs against the model's own forward
on that batch (`assert_close` with the dtype's tolerances, `tolerances`) and raises
`ExecutionMismatch` naming the stage that differs: a decomposition that does not follow the
forward, or a layer whose output for a sample depends on the other samples of its phase. The
check costs one extra forward pass of the first batch; it is skipped only with `check=False`.

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
from .graph import Stage, decompose
from .schedule import Plan, Step
from .tracing import node_values

__all__ = ["ExecutionMismatch", "Executor", "RunResult", "run", "tolerances"]


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


# torch.testing.assert_close's default (rtol, atol) per dtype
_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
               torch.bfloat16: (1.6e-2, 1e-5)}


def tolerances(reference: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) of the first-batch check for outputs like `reference`.

    rtol is `torch.testing.assert_close`'s default for the dtype; float32 on CUDA with TF32 allowed
    (cuDNN's default) computes with float16's 10-bit mantissa and gets float16's rtol. atol is the
    dtype's default, raised to rtol x the largest |reference|: phases run the layers at other batch
    sizes, whose kernels sum in other orders, and that rounding scales with the output, not 1e-5.
    """
    rtol, atol = _TOLERANCES.get(reference.dtype, (0.0, 0.0))
    if reference.device.type == "cuda" and reference.dtype == torch.float32 and (
            torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32):
        rtol = max(rtol, _TOLERANCES[torch.float16][0])
    scale = float(reference.detach().abs().max()) if reference.numel() and reference.is_floating_point() else 0.0
    return rtol, max(atol, rtol * scale)


class ExecutionMismatch(RuntimeError):
    """An executed plan did not reproduce `model(x)`; the message names the stage that differs."""


class Executor:
    """Runs `plan` on `model` (eval mode, no grad): `Executor(model, plan)(inputs) -> outputs`.

    The first call checks its outputs against the model's own forward (`model(inputs)`) and raises
    `ExecutionMismatch`, naming the stage that differs, instead of returning wrong outputs. It
    costs one extra forward pass of the whole request and a copy of the inputs, on the first call
    only (later calls reuse the checked stages); `check=False` skips it. `rtol`/`atol` default to
    `tolerances` (the dtype's `torch.testing` tolerances, see there). `execute` runs the plan
    without any check.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, check: bool = True, rtol: float | None = None,
                 atol: float | None = None) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a workbench.vbs.Plan, got {type(plan).__name__}")
        self.model = model.eval()
        found = decompose(model)
        self.stages: list[Stage] = found.stages
        self.traced = found.traced
        names = [s.name for s in self.stages]
        if names != plan.names:
            raise ValueError(f"plan was made for layers {plan.names[:4]}... ({len(plan.names)}), "
                             f"the model has {names[:4]}... ({len(names)})")
        self.plan = plan
        self.check, self.rtol, self.atol = bool(check), rtol, atol
        self.checked = False
        self._shapes: dict[int, list[tuple[int, ...]]] | None = None

    @torch.no_grad()
    def prepare(self, sample: torch.Tensor) -> None:
        """Per-sample output shapes of every branch (one single-sample pass)."""
        shapes: dict[int, list[tuple[int, ...]]] = {}
        x = sample[:1]
        try:
            self._shape_pass(x, shapes)
        except RuntimeError as exc:  # torch's shape errors, named here with the inputs' shape
            raise ValueError(f"the model refused inputs of shape {tuple(sample.shape)} (one sample: "
                             f"{tuple(x.shape)}): {exc}") from exc
        self._shapes = shapes

    def _shape_pass(self, x: torch.Tensor, shapes: dict[int, list[tuple[int, ...]]]) -> None:
        for i, stage in enumerate(self.stages):
            if stage.is_branch:
                shapes[i] = []
                for branch in stage.branches:
                    y = x
                    for _, layer in branch:
                        y = layer(y)
                    shapes[i].append(tuple(y.shape[1:]))
                rest = {s[1:] if stage.merge == "cat" else s for s in shapes[i]}
                if len(rest) != 1:
                    raise ValueError(f"stage {stage.name!r}: branch outputs of per-sample shapes {shapes[i]} "
                                     f"cannot be merged by {stage.merge!r} without broadcasting")
            x = stage(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"stage {stage.name!r} returns {type(x).__name__}, not a tensor")

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
        """The plan's outputs for `inputs`; the first call is checked against `model(inputs)`."""
        if not self.check or self.checked:
            return self.execute(inputs)
        pristine = inputs.clone()  # the plan's layers may work in place on their inputs
        outputs = self.execute(inputs)
        self.verify(pristine, outputs)
        return outputs

    @torch.no_grad()
    def execute(self, inputs: torch.Tensor) -> torch.Tensor:
        """Run the plan's phases on `inputs` (no check)."""
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

    # -- the first-batch check ---------------------------------------------------------------
    def _mismatch(self, actual: torch.Tensor, expected: torch.Tensor) -> str:
        """'' when `actual` matches `expected` within the tolerances, else assert_close's report."""
        rtol, atol = tolerances(expected)
        rtol, atol = self.rtol if self.rtol is not None else rtol, self.atol if self.atol is not None else atol
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as err:
            return " ".join(str(err).split())
        return ""

    @torch.no_grad()
    def verify(self, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        """Compare `outputs` (the plan's, for `inputs`) with `model(inputs)`: ExecutionMismatch,
        naming the stage that differs, if they do not match. Costs one forward of the model."""
        want = self.model(inputs.clone())
        detail = self._mismatch(outputs, want)
        if detail:
            where = self._diagnose(inputs, want)
            raise ExecutionMismatch(
                f"workbench.vbs: executing the plan on {type(self.model).__name__} does not reproduce model(x) "
                f"on the first batch: {where}. No outputs are returned. ({detail})")
        self.checked = True

    @torch.no_grad()
    def _diagnose(self, x: torch.Tensor, want: torch.Tensor) -> str:
        """Which stage differs: from the forward (decomposition), or from itself in phases."""
        acts = [x]
        for stage in self.stages:
            acts.append(stage(acts[-1].clone()))
        if self._mismatch(acts[-1], want):
            model = type(self.model).__name__
            if self.traced is None:
                return f"{model}'s forward gives different results on the same batch (is it deterministic?)"
            traced, ref = node_values(self.traced, x.clone(), [s.node for s in self.stages])
            if self._mismatch(traced, want):
                return (f"torch.fx's trace of {model} does not compute what its forward computes now (Python "
                        f"values the forward reads, such as attributes or globals, were fixed when it was traced, "
                        f"or the forward is not deterministic)")
            for i, stage in enumerate(self.stages):
                if stage.node in ref and self._mismatch(acts[i + 1], ref[stage.node]):
                    return f"stage {i} {stage.name!r} does not reproduce its part of {model}'s forward"
            return f"the stages of {model}, run on the whole batch, do not reproduce its forward"
        for i, stage in enumerate(self.stages):
            steps = [s for s in self.plan.steps if s.layer == i]
            parts, row = [], 0
            for s in steps:
                chunk = acts[i][row:row + s.batch].clone()
                row += s.batch
                parts.append(self._group(i, s, chunk) if stage.is_branch else stage.module(chunk))
            if self._mismatch(torch.cat(parts), acts[i + 1]):
                return (f"stage {i} {stage.name!r} gives other outputs in phases of {[s.batch for s in steps]} "
                        f"samples than on the whole batch of {self.plan.batch} (an output depends on other "
                        f"samples of its phase, or a layer keeps state between calls)")
        return "no stage differs on its own; their phases together do (a layer keeps state between calls?)"


@dataclass
class RunResult:
    """Outputs of one executed plan, its wall time and its measured peak memory."""

    outputs: torch.Tensor
    seconds: float
    peak_bytes: int
    input_bytes: int
    predicted_seconds: float
    predicted_peak_bytes: int
    checked: bool = False  # outputs were compared with model(inputs)

    @property
    def time_ratio(self) -> float:
        """Executed / predicted time (above 1: per-phase overhead the profile does not see)."""
        return self.seconds / self.predicted_seconds if self.predicted_seconds > 0 else float("nan")

    @property
    def memory_ratio(self) -> float:
        """Measured peak (incl. the caller's inputs) / the DP's predicted peak."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")


def run(model: nn.Module, plan: Plan, inputs: torch.Tensor, *, measure_memory: bool = True,
        check: bool = True, rtol: float | None = None, atol: float | None = None) -> RunResult:
    """Execute `plan` on `model` for `inputs`; outputs equal `model(inputs)`.

    `seconds` is one timed execution (after the shape pass); `peak_bytes` is the peak of tensors
    allocated during a second execution under `MemoryMeter`, plus the inputs' bytes (held by the
    caller throughout). Both are for the device `inputs` live on.

    With `check` (the default) the timed execution's outputs are compared with `model(inputs)`
    (`Executor.verify`: one extra forward pass and a copy of the inputs, outside the timing and the
    memory measurement); a mismatch raises `ExecutionMismatch` naming the stage. `check=False`
    skips it.
    """
    ex = Executor(model, plan, check=check, rtol=rtol, atol=atol)
    ex.prepare(inputs)
    pristine = inputs.clone() if check else None
    device = inputs.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync()
    start = time.perf_counter()
    outputs = ex.execute(inputs)
    sync()
    seconds = time.perf_counter() - start
    if pristine is not None:
        ex.verify(pristine, outputs)
        del pristine
    peak = 0
    if measure_memory:
        with MemoryMeter(device) as meter:
            again = ex.execute(inputs)
        del again
        peak = meter.peak_bytes
    nbytes = inputs.numel() * inputs.element_size()
    return RunResult(outputs, seconds, peak + nbytes, nbytes, plan.time_per_sample * plan.batch, plan.peak_bytes,
                     ex.checked)
