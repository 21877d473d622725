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
sample stays allocated. The request comes either as one tensor per sample (a list, which the
executor empties, freeing each sample once consumed: OPT[1, n, b, mem], `Plan.request` "pieces")
or as one tensor the caller keeps, read through views and held whole until the call returns
("kept"). What the copies and the request cost is in the plan's prediction (`workbench.vbs.flow`).

Within the prediction, or not at all. Before anything is allocated, `prepare` reads every layer's
per-sample shape from one pass of fake tensors (`FakeTensorMode`: shapes without memory), follows
the plan with those sizes and the request as it is handed over, and refuses (`UnexecutablePlan`,
naming the bytes) if the execution would exceed the plan's predicted peak (a plan made for other
inputs, one saved before its copies were accounted, a plan for a request handed over run on a
tensor the caller keeps), or if the first-batch check (`workbench.vbs.check`: one sample through
the model at a time, `Plan.check`, the outputs compared row by row, beside the request and the
outputs) would exceed the budget the plan was made for. `check_memory=False` skips the refusal.

A special layer (branch group) pre-allocates its output for the step's samples; each branch
runs its own phases on views of the group's input and copies (concatenation) or adds (residual
sum) its finished outputs into that buffer, then the group's `post` module runs on it in place.
`run` and `measure_peak` (`workbench.vbs.run_plan`) time an execution and read its peak from the
allocator.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode, UnsupportedOperatorException,
)

from .check import COMPARE_TEMPORARIES, ExecutionMismatch, diagnose, mismatch
from .flow import account, byte_sizes
from .graph import Stage, decompose
from .schedule import Plan, Step

__all__ = ["Executor", "UnexecutablePlan"]

_NOT_FAKEABLE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _request(inputs, batch: int):
    """The request as one tensor, or as the list of its samples (each of batch 1, each its own storage)."""
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
    for k, t in enumerate(inputs):
        if t.untyped_storage().nbytes() > _nbytes(t):
            raise ValueError(f"sample {k} of the request is a view of a larger tensor "
                             f"({t.untyped_storage().nbytes():,} bytes): freeing it frees nothing. Hand over "
                             f"samples of their own (x[k:k + 1].clone(), then drop x), or pass the tensor itself "
                             f"(a request the caller keeps)")
    return list(inputs)


def _hand_over(inputs) -> str:
    return "pieces" if isinstance(inputs, list) else "kept"


def _write(dst: torch.Tensor, src: torch.Tensor, merge: str) -> None:
    if merge == "add":
        dst.add_(src)
    else:
        dst.copy_(src)


class UnexecutablePlan(ValueError):
    """A plan the executor cannot run within its predicted peak; the message says where and by how much."""


class Executor:
    """Runs `plan` on `model` (eval mode, no grad): `Executor(model, plan)(inputs) -> outputs`.

    `inputs` is the request: a list of its samples, one tensor of batch 1 each, which the executor
    takes over (it empties the list and frees every sample once consumed), or one tensor the caller
    keeps (read through views, held whole). Before its first run for either hand-over, `prepare`
    follows the plan with the real per-sample sizes (fake tensors: nothing allocated) and refuses
    with `UnexecutablePlan` if the execution would need more than the plan's predicted peak, or the
    first-batch check more than the plan's budget; `check_memory=False` skips that (to run schedules
    made from other tables, e.g. in tests).

    The first call checks every sample's outputs against the model's own forward on that sample
    (`workbench.vbs.check`) and raises `ExecutionMismatch`, naming the stage that differs, instead of
    returning wrong outputs; `check=False` skips it. `rtol`/`atol` default to `tolerances` of each
    sample's reference. `execute` runs the plan without the check.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, check: bool = True, rtol: float | None = None,
                 atol: float | None = None, check_memory: bool = True) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a workbench.vbs.Plan, got {type(plan).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {model!r} ({type(model).__name__})")
        for name, flag in (("check", check), ("check_memory", check_memory)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        for name, tol in (("rtol", rtol), ("atol", atol)):
            if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                    or not 0 <= tol < math.inf):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {tol!r}")
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
        self._sizes: tuple | None = None  # (main, inner, posts): per-sample bytes, branch bytes, copying posts
        self.writes_input = False  # the model writes into its input (in place): references need a copy first
        self._ready: set[str] = set()
        self.executed_peak: int | None = None  # bytes the last prepared execution allocates, request included
        self.predicted_peak: int | None = None  # the same with the first-batch check, where it runs

    # -- shapes and memory, before anything is allocated ---------------------------------------
    @torch.no_grad()
    def prepare(self, inputs: torch.Tensor | list[torch.Tensor]) -> None:
        """Per-sample shapes (a pass of fake tensors) and the memory check for this hand-over of
        the request: `UnexecutablePlan` where the plan cannot hold its prediction."""
        request = _request(inputs, self.plan.batch)
        sample = request if isinstance(request, torch.Tensor) else request[0]
        if self._sizes is None:
            self._shape_pass(sample)
        phases = self.phases(_hand_over(inputs))
        self.executed_peak, self.predicted_peak = phases["execution"], max(phases.values())
        if self.check_memory:
            self._refuse(phases, _hand_over(inputs), tuple(sample.shape[1:]))
        self._ready.add(_hand_over(inputs))

    def _shape_pass(self, sample: torch.Tensor) -> None:
        shape = (1, *sample.shape[1:])
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level, quiet.level = quiet.level, logging.CRITICAL  # a shape error is reported below, not logged
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.empty(shape, dtype=sample.dtype, device=sample.device)
                version = x._version
                self._sizes = self._walk(x)
                self.writes_input = x._version != version
        except _NOT_FAKEABLE:  # an op fake tensors cannot run: one real sample, counted as the check's
            self._real_pass(sample, shape)
        except RuntimeError as exc:  # torch's shape errors, named here with the inputs' shape
            raise ValueError(f"the model refused inputs of shape {tuple(sample.shape)} (one sample: "
                             f"{shape}): {exc}") from exc
        finally:
            quiet.level = level

    def _real_pass(self, sample: torch.Tensor, shape: tuple[int, ...]) -> None:
        need = _nbytes(sample[:1]) * self.plan.batch + self.plan.check * self.plan.unit_bytes
        if self.check_memory and (not self.plan.check or need > self.plan.peak_bytes):
            raise UnexecutablePlan(
                f"workbench.vbs: the model's shapes cannot be read with fake tensors (an op depends on the values), "
                f"and one real sample through it needs {need:,} bytes beside the request"
                + ("" if self.plan.check else " (unknown: the plan does not carry Plan.check)")
                + f", above the plan's predicted peak of {self.plan.peak_bytes:,} bytes. Not run.")
        x = sample[:1].clone()
        version = x._version
        try:
            self._sizes = self._walk(x)
        except RuntimeError as exc:
            raise ValueError(f"the model refused inputs of shape {tuple(sample.shape)} (one sample: "
                             f"{shape}): {exc}") from exc
        self.writes_input = x._version != version

    def _walk(self, x: torch.Tensor) -> tuple[list[int], dict[int, list[list[int]]], frozenset[int]]:
        """Per-sample shapes and bytes of every stage and branch layer, and the branch groups whose
        `post` writes a new tensor instead of working in place on the group's output."""
        shapes: dict[int, list[tuple[int, ...]]] = {}
        main, inner, posts = [_nbytes(x)], {}, set()
        for i, stage in enumerate(self.stages):
            if stage.is_branch:
                shapes[i], inner[i] = [], []
                for branch in stage.branches:
                    y, sizes = x, []
                    for _, layer in branch:
                        y = layer(y)
                        sizes.append(_nbytes(y))
                    shapes[i].append(tuple(y.shape[1:]))
                    inner[i].append(sizes)
                rest = {s[1:] if stage.merge == "cat" else s for s in shapes[i]}
                if len(rest) != 1:
                    raise ValueError(f"stage {stage.name!r}: branch outputs of per-sample shapes {shapes[i]} "
                                     f"cannot be merged by {stage.merge!r} without broadcasting")
                if stage.post is not None:
                    merged = shapes[i][0] if stage.merge == "add" else (sum(s[0] for s in shapes[i]), *rest.pop())
                    probe = x.new_zeros((1, *merged))
                    if not torch._C._is_alias_of(stage.post(probe), probe):
                        posts.add(i)
            x = stage(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"stage {stage.name!r} returns {type(x).__name__}, not a tensor")
            main.append(_nbytes(x))
        self._shapes = shapes
        return main, inner, frozenset(posts)

    def _references_first(self, hand_over: str) -> bool:
        """Whether the check computes every reference before the plan runs (and holds them)."""
        return hand_over == "pieces" or self.writes_input

    def phases(self, hand_over: str) -> dict[str, int]:
        """Bytes at the highest point of each part of a call with the request handed over as
        `hand_over` ("pieces" or "kept"), the request included: "execution", and where the first
        call's check runs, "references" (computed first, then held while the plan runs) and
        "comparison"."""
        main, inner, posts = self._sizes
        unit, b = self.plan.unit_bytes, self.plan.batch
        _, peak = account(self.plan, byte_sizes(main, inner, unit), request=hand_over, posts=posts)
        execution, request, row = peak * unit, main[0] * b, main[-1]
        if not self.check or self.checked:
            return {"execution": execution}
        one, temps = self.plan.check * unit, COMPARE_TEMPORARIES * row  # one sample through the model
        held = request if hand_over == "kept" else 0  # after the plan ran
        if self._references_first(hand_over):  # all of the request waits, the references pile up
            return {"execution": execution, "references": request + (b - 1) * row + one,
                    "execution beside the references": execution + b * row, "comparison": held + 2 * b * row + temps}
        return {"execution": execution, "comparison": held + b * row + max(one, row + temps)}

    def _refuse(self, phases: dict[str, int], hand_over: str, shape: tuple[int, ...]) -> None:
        limit, plan = self.plan.peak_bytes, self.plan
        if phases["execution"] > limit and hand_over != plan.request:
            raise UnexecutablePlan(
                f"workbench.vbs: this {plan.method} plan counts its request as {_HAND_OVERS[plan.request]}, and was "
                f"given {_HAND_OVERS[hand_over]}: executed so, it needs {phases['execution']:,} bytes (the request and "
                f"the executor's copies counted), above the plan's predicted peak of {limit:,} bytes. Plan for the "
                f"request as you hand it over (vbs.plan(..., request={hand_over!r})), or hand it over as the plan "
                f"counts it. Not run.")
        if phases["execution"] > limit:
            raise UnexecutablePlan(
                f"workbench.vbs: executing this {plan.method} plan on inputs of shape "
                f"(1, {', '.join(map(str, shape))}) needs {phases['execution']:,} bytes (request included, the "
                f"executor's copies counted), above the plan's predicted peak of {limit:,} bytes: plan again with "
                f"vbs.plan or vbs.dp on tables of these inputs (a plan made for other inputs, or saved without its "
                f"copies accounted, cannot hold its prediction). Not run.")
        if self.check and not self.checked and not plan.check:
            raise UnexecutablePlan(
                "workbench.vbs: the first-batch check needs one sample through the model beside the request, which "
                "this plan does not count (Plan.check is 0: a plan made by hand or saved before it was counted): "
                "plan again, or run with check=False. Not run.")
        budget = max(plan.memory * plan.unit_bytes, limit)  # a plan made by hand may name no budget
        over = {k: v for k, v in phases.items() if k != "execution" and v > budget}
        if over:
            parts = ", ".join(f"{k} {v:,} bytes" for k, v in over.items())
            raise UnexecutablePlan(
                f"workbench.vbs: the first-batch check (every sample's outputs against model(sample), one sample at "
                f"a time, beside the request and the outputs) needs {parts}, above the budget the plan was made for "
                f"({budget:,} bytes; the plan itself {limit:,}): run with check=False (the plan alone fits), or plan "
                f"with that much memory. Not run.")

    # -- running ------------------------------------------------------------------------------
    def run_step(self, i: int, step: Step, x: torch.Tensor) -> torch.Tensor:
        """Stage `i` on `x`, a step's samples (a branch group runs its branches' phases)."""
        return self._group(i, step, x) if self.stages[i].is_branch else self.stages[i].module(x)

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
        """The plan's outputs for `inputs`; the first call is checked against the model, sample by sample."""
        if not self.check or self.checked:
            return self.execute(inputs)
        if _hand_over(inputs) not in self._ready:
            self.prepare(inputs)
        references = self.references(inputs)
        outputs = self.execute(inputs)
        self.verify(outputs, references, inputs if isinstance(inputs, torch.Tensor) else None)
        return outputs

    @torch.no_grad()
    def execute(self, inputs: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Run the plan's phases on `inputs` (no outputs check); a list of samples is emptied."""
        request = _request(inputs, self.plan.batch)
        if _hand_over(inputs) not in self._ready:
            self.prepare(inputs)
        owned = isinstance(inputs, list)
        queues = [deque(request if owned else [request])] + [deque() for _ in self.stages]
        if owned:
            inputs.clear()  # the executor holds the request's samples now, and frees each one consumed
        del request
        for step in self.plan.steps:
            x, split = _take(queues[step.layer], step.batch)
            y = self.run_step(step.layer, step, x)
            del x
            if split and (owned or step.layer > 0):
                _compact(queues[step.layer])
            queues[step.layer + 1].append(y)
            del y
        out = list(queues[-1])
        if sum(t.shape[0] for t in out) != self.plan.batch or any(queues[:-1]):
            raise RuntimeError("plan did not carry every sample through every layer")
        return out[0] if len(out) == 1 else torch.cat(out)

    # -- the first-batch check (workbench.vbs.check) -------------------------------------------
    @torch.no_grad()
    def references(self, inputs: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor] | None:
        """`model(sample)` for every sample, computed before the plan runs where the check needs
        that (a request handed over, which the plan consumes, or a model that writes into its
        input); None where `verify` computes each one after the plan, from the kept request."""
        if not self._references_first(_hand_over(inputs)):
            return None
        samples = inputs if isinstance(inputs, list) else [inputs[k:k + 1] for k in range(inputs.shape[0])]
        return [self.model(s.clone() if self.writes_input else s) for s in samples]

    @torch.no_grad()
    def verify(self, outputs: torch.Tensor, references: list[torch.Tensor] | None,
               inputs: torch.Tensor | None) -> None:
        """Compare `outputs` (the plan's) with every sample's reference (`references`, or
        `model(sample)` of the kept request `inputs`, one at a time): ExecutionMismatch, naming the
        stage that differs, if any sample does not match. Frees each reference once compared."""
        for k in range(self.plan.batch):
            if references is not None:
                want, references[k] = references[k], None
            else:
                want = self.model(inputs[k:k + 1])
            detail = mismatch(outputs[k:k + 1], want, self.rtol, self.atol)
            nan = detail and want.is_floating_point() and bool(want.isnan().any())
            del want
            if nan:  # NaN never compares close: the model's own output for this sample cannot be checked
                raise ValueError(
                    f"workbench.vbs: model(x) is NaN for sample {k} of the first batch (NaN or inf in the inputs?), "
                    f"and NaN outputs cannot be checked against the plan's: give finite inputs, or run with "
                    f"check=False. No outputs are returned.")
            if detail:
                where = (diagnose(self, inputs, self.rtol, self.atol) if inputs is not None else
                         "the request was handed over and consumed: run it as one tensor to find the stage")
                raise ExecutionMismatch(
                    f"workbench.vbs: executing the plan on {type(self.model).__name__} does not reproduce model(x) "
                    f"for sample {k} of the first batch: {where}. No outputs are returned. ({detail})")
        self.checked = True


_HAND_OVERS = {"pieces": "handed over sample by sample (a list, each sample freed once consumed)",
               "kept": "one tensor the caller keeps (held whole for the whole call)"}
