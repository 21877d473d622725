"""Executing a variable-batch-size plan on the real model.

From "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section II (phases of smaller batches with buffered activations, Figs 3 and 4) and Section III:
every `Step` of a `Plan` takes the first `batch` samples waiting at its layer, runs the layer on
them and appends the outputs to the next layer's queue. Samples keep their order, so the result
equals `model(inputs)`.

Every sample is in one place between steps, as in the DP's accounting: queues hold chunks (one
tensor per finished phase); a phase that needs samples from several chunks concatenates them and
drops the sources before the layer runs; one that needs the first samples of a larger chunk reads
a view, and right after the layer the rest is copied out and the chunk dropped, so no consumed
sample stays allocated. The request is handed over as one tensor per sample (`execute` with a
list, which it empties) and each sample is freed once consumed, as OPT[1, n, b, mem] counts it;
a tensor the caller keeps is read through views instead. What the copies cost is in the plan's
prediction (`workbench.vbs.flow`): before running, the executor follows the plan with the real
tensors' sizes and refuses it (`UnexecutablePlan`) if it would need more than the plan predicts,
e.g. a plan made for smaller inputs, or one saved before its copies were accounted.

Never silently wrong: the first call checks the executed outputs against the model's own forward
on that batch (`assert_close` with the dtype's tolerances, `tolerances`) and raises
`ExecutionMismatch` naming the stage that differs: a decomposition that does not follow the
forward, or a layer whose output for a sample depends on the other samples of its phase. The
check costs one extra forward pass of the first batch; it is skipped only with `check=False`.

A special layer (branch group) pre-allocates its output for the step's samples; each branch
runs its own phases on views of the group's input and copies (concatenation) or adds (residual
sum) its finished outputs into that buffer, then the group's `post` module runs on it in place.
The per-sample shapes come from one single-sample pass done before any measurement.

`run` returns the outputs with the wall time of one execution and the peak memory of another,
request included (`AllocatorMeter`: the allocator's own count, which shares nothing with the
plan's accounting).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from ..measure import AllocatorMeter
from .flow import account, byte_sizes
from .graph import Stage, decompose
from .schedule import Plan, Step
from .tracing import node_values

__all__ = ["ExecutionMismatch", "Executor", "RunResult", "UnexecutablePlan", "measure_peak", "run", "tolerances"]


def _take(queue: deque, b: int) -> tuple[torch.Tensor, bool]:
    """The first `b` samples waiting in `queue` as one tensor, and whether a chunk was left partly
    consumed (its rest stays at the front of `queue` as a view until `_compact`)."""
    parts, n, split = [], 0, False
    while n < b:
        if not queue:
            raise RuntimeError(f"plan asks for {b} samples but only {n} are waiting at this layer")
        chunk = queue.popleft()
        need = b - n
        if chunk.shape[0] > need:
            queue.appendleft(chunk[need:])
            chunk, split = chunk[:need], True
        parts.append(chunk)
        n += chunk.shape[0]
    del chunk
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), split


def _compact(queue: deque) -> None:
    """Copy the rest of a partly consumed chunk out, so that the chunk (and its consumed samples) is freed."""
    queue[0] = queue[0].clone()


def _per_sample(t: torch.Tensor) -> int:
    return t[:1].numel() * t.element_size()


def _request(inputs, batch: int):
    """The request as one tensor, or as the list of its samples (each of batch 1), checked."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() < 1 or inputs.shape[0] != batch:
            raise ValueError(f"plan is for a request of {batch} samples, got {inputs.shape[0] if inputs.dim() else 0}")
        return inputs
    if not isinstance(inputs, list) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(f"inputs must be a tensor or a list of tensors (the request's samples), got "
                        f"{type(inputs).__name__}")
    if len(inputs) != batch or any(t.dim() < 1 or t.shape[0] != 1 for t in inputs):
        raise ValueError(f"plan is for a request of {batch} samples: a list of {batch} tensors of batch 1 each, "
                         f"got {len(inputs)} of batches {[t.shape[0] if t.dim() else 0 for t in inputs][:6]}")
    return list(inputs)


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


class UnexecutablePlan(ValueError):
    """A plan the executor cannot run within its predicted peak; the message says where and by how much."""


class Executor:
    """Runs `plan` on `model` (eval mode, no grad): `Executor(model, plan)(inputs) -> outputs`.

    `inputs` is the request: a list of its samples, one tensor of batch 1 each, which the executor
    takes over (it empties the list and frees every sample once consumed: the memory the plan
    predicts), or one tensor the caller keeps (read through views; its memory is the caller's).
    Before the first run the plan is followed with the real tensors' sizes (`workbench.vbs.flow`)
    and refused with `UnexecutablePlan` if it would need more than its predicted peak;
    `check_memory=False` skips that (to run schedules made from other tables, e.g. in tests).

    The first call checks its outputs against the model's own forward (`model(inputs)`) and raises
    `ExecutionMismatch`, naming the stage that differs, instead of returning wrong outputs. It
    costs one extra forward pass of the whole request and a copy of the inputs, on the first call
    only (later calls reuse the checked stages); `check=False` skips it. `rtol`/`atol` default to
    `tolerances` (the dtype's `torch.testing` tolerances, see there). `execute` runs the plan
    without the outputs check.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, check: bool = True, rtol: float | None = None,
                 atol: float | None = None, check_memory: bool = True) -> None:
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
        self.check, self.rtol, self.atol, self.check_memory = bool(check), rtol, atol, bool(check_memory)
        self.checked = False
        self._shapes: dict[int, list[tuple[int, ...]]] | None = None
        self.executed_peak: int | None = None  # bytes the executor will allocate, request included

    @torch.no_grad()
    def prepare(self, sample: torch.Tensor) -> None:
        """Per-sample shapes of every branch (one single-sample pass), then the memory check."""
        shapes: dict[int, list[tuple[int, ...]]] = {}
        main, inner, posts = [_per_sample(sample)], {}, set()
        x = sample[:1]
        try:
            self._shape_pass(x, shapes, main, inner, posts)
        except RuntimeError as exc:  # torch's shape errors, named here with the inputs' shape
            raise ValueError(f"the model refused inputs of shape {tuple(sample.shape)} (one sample: "
                             f"{tuple(x.shape)}): {exc}") from exc
        self._shapes = shapes
        unit = self.plan.unit_bytes
        _, peak = account(self.plan, byte_sizes(main, inner, unit), posts=frozenset(posts))
        self.executed_peak = peak * unit
        if self.check_memory and peak > self.plan.peak:
            raise UnexecutablePlan(
                f"workbench.vbs: executing this {self.plan.method} plan on inputs of shape (1, "
                f"{', '.join(map(str, sample.shape[1:]))}) needs {peak * unit:,} bytes (request included, the "
                f"executor's copies counted), above the plan's predicted peak of {self.plan.peak_bytes:,} bytes: "
                f"plan again with vbs.plan or vbs.dp on tables of these inputs (a plan made for other inputs, or "
                f"saved without its copies accounted, cannot hold its prediction). Not run.")

    def _shape_pass(self, x: torch.Tensor, shapes: dict[int, list[tuple[int, ...]]], main: list[int],
                    inner: dict[int, list[list[int]]], posts: set[int]) -> None:
        """Per-sample shapes and bytes of every stage and branch layer, and the branch groups whose
        `post` writes a new tensor instead of working in place on the group's output."""
        for i, stage in enumerate(self.stages):
            if stage.is_branch:
                shapes[i], inner[i] = [], []
                for branch in stage.branches:
                    y, sizes = x, []
                    for _, layer in branch:
                        y = layer(y)
                        sizes.append(_per_sample(y))
                    shapes[i].append(tuple(y.shape[1:]))
                    inner[i].append(sizes)
                rest = {s[1:] if stage.merge == "cat" else s for s in shapes[i]}
                if len(rest) != 1:
                    raise ValueError(f"stage {stage.name!r}: branch outputs of per-sample shapes {shapes[i]} "
                                     f"cannot be merged by {stage.merge!r} without broadcasting")
                if stage.post is not None:
                    merged = shapes[i][0] if stage.merge == "add" else (sum(s[0] for s in shapes[i]), *rest.pop())
                    probe = x.new_zeros((1, *merged))
                    if stage.post(probe).untyped_storage().data_ptr() != probe.untyped_storage().data_ptr():
                        posts.add(i)
            x = stage(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"stage {stage.name!r} returns {type(x).__name__}, not a tensor")
            main.append(_per_sample(x))

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
            queues = [deque([x])] + [deque() for _ in branch]  # the first: views of x, which the group holds
            row = 0
            for s in steps:
                xs, split = _take(queues[s.layer], s.batch)
                y = branch[s.layer][1](xs)
                del xs
                if split and s.layer > 0:
                    _compact(queues[s.layer])
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
    def __call__(self, inputs: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The plan's outputs for `inputs`; the first call is checked against `model(inputs)`."""
        if not self.check or self.checked:
            return self.execute(inputs)
        request = _request(inputs, self.plan.batch)
        pristine = (request if isinstance(request, torch.Tensor) else torch.cat(request)).clone()
        outputs = self.execute(inputs)  # the plan's layers may work in place on their inputs
        self.verify(pristine, outputs)
        return outputs

    @torch.no_grad()
    def execute(self, inputs: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Run the plan's phases on `inputs` (no outputs check); a list of samples is emptied."""
        request = _request(inputs, self.plan.batch)
        if self._shapes is None:
            self.prepare(request if isinstance(request, torch.Tensor) else request[0])
        owned = isinstance(inputs, list)
        queues = [deque(request if owned else [request])] + [deque() for _ in self.stages]
        if owned:
            inputs.clear()  # the executor holds the request's samples now, and frees each one consumed
        del request
        for step in self.plan.steps:
            x, split = _take(queues[step.layer], step.batch)
            stage = self.stages[step.layer]
            y = self._group(step.layer, step, x) if stage.is_branch else stage.module(x)
            del x
            if split and (owned or step.layer > 0):
                _compact(queues[step.layer])
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
        """Measured peak (the request included) / the plan's predicted peak: at most 1."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")


def measure_peak(executor: Executor, inputs: torch.Tensor) -> int:
    """Peak bytes the device's allocator hands out (`AllocatorMeter`) while the request `inputs`
    is handed over to `executor` as one copy per sample and executed: the request is counted as
    OPT[1, n, b, mem] counts it, each sample until it is consumed. Comparable with
    `executor.plan.peak_bytes`."""
    with torch.no_grad(), AllocatorMeter(inputs.device) as meter:
        samples = [inputs[k:k + 1].clone() for k in range(inputs.shape[0])]
        executor.execute(samples)
    return meter.peak_bytes


def run(model: nn.Module, plan: Plan, inputs: torch.Tensor, *, measure_memory: bool = True,
        check: bool = True, rtol: float | None = None, atol: float | None = None,
        check_memory: bool = True) -> RunResult:
    """Execute `plan` on `model` for `inputs`; outputs equal `model(inputs)`.

    `seconds` is one timed execution (after the shape pass); `peak_bytes` is the allocator's peak
    during a second execution to which the request is handed over sample by sample (`measure_peak`),
    the request included. Both are for the device `inputs` live on. A plan that cannot run within
    its predicted peak is refused (`UnexecutablePlan`) unless `check_memory=False`.

    With `check` (the default) the timed execution's outputs are compared with `model(inputs)`
    (`Executor.verify`: one extra forward pass and a copy of the inputs, outside the timing and the
    memory measurement); a mismatch raises `ExecutionMismatch` naming the stage. `check=False`
    skips it.
    """
    ex = Executor(model, plan, check=check, rtol=rtol, atol=atol, check_memory=check_memory)
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
    peak = measure_peak(ex, inputs) if measure_memory else 0
    nbytes = inputs.numel() * inputs.element_size()
    return RunResult(outputs, seconds, peak, nbytes, plan.time_per_sample * plan.batch, plan.peak_bytes, ex.checked)
