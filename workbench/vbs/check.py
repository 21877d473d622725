"""The executor's first-batch check: every sample's outputs against the model's own forward on it.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section II: a plan runs every layer in phases of other batch sizes than the request, which gives
the model's outputs only where a sample's outputs do not depend on the other samples of its batch
(eval mode), and only where the executor's stages follow the model's forward. Never silently
wrong: the first call of an `Executor` compares what it executed with `model(sample)` for every
sample of the request, and raises `ExecutionMismatch` naming the stage that differs.

Within the plan's memory. The reference is the model's forward on one sample at a time (the
memory `Plan.check` counts), compared row by row with a few temporaries of one sample's outputs
(`close`), never a forward of the whole request, which needs as much memory as running every layer
at the request's size. Where the request is a tensor the caller keeps and the model does not write
into its input, each sample's reference is computed after the plan ran, from views of the request;
otherwise (a request handed over sample by sample, consumed by the plan, or a model whose first
layers work in place on their input) every reference is computed first, on a copy of its sample,
and held while the plan runs. The executor counts either way (`Executor.prepare`).

# NOTE: a model that mixes samples (its output for a sample depends on the batch) fails the check
# against its single-sample forward even for a plan that runs every layer at the whole request:
# VBS needs sample independence, and `diagnose` names the stage that breaks it. The diagnosis, on
# the error path only, runs the stages on the whole request and is not bounded by the plan.
"""

from __future__ import annotations

import torch

from .tracing import node_values

__all__ = ["ExecutionMismatch", "close", "diagnose", "tolerances", "COMPARE_TEMPORARIES"]

# torch.testing.assert_close's default (rtol, atol) per dtype
_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
               torch.bfloat16: (1.6e-2, 1e-5)}
# `close` allocates at most this many tensors of one sample's outputs (two of the dtype, three of bool)
COMPARE_TEMPORARIES = 4


class ExecutionMismatch(RuntimeError):
    """An executed plan did not reproduce `model(x)`; the message names the stage that differs."""


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


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> bool:
    """Whether `actual` matches `expected` as `torch.testing.assert_close` would (equal infinities
    close, NaN never), with at most `COMPARE_TEMPORARIES` temporaries of their size."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype or actual.device != expected.device:
        return False
    if not expected.is_floating_point():
        return torch.equal(actual, expected)
    diff = torch.sub(actual, expected).abs_()
    bound = expected.abs().mul_(rtol).add_(atol)
    ok = diff.le(bound)
    del diff, bound
    ok |= actual.eq(expected)  # inf == inf, where the difference is NaN
    return bool(ok.all())


def mismatch(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None, atol: float | None) -> str:
    """'' when `actual` matches `expected` within the tolerances (`tolerances` where None), else
    assert_close's report."""
    default = tolerances(expected)
    rtol, atol = rtol if rtol is not None else default[0], atol if atol is not None else default[1]
    if close(actual, expected, rtol, atol):
        return ""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        return " ".join(str(err).split())
    return "outside the tolerances"


@torch.no_grad()
def diagnose(executor, x: torch.Tensor, rtol: float | None = None, atol: float | None = None) -> str:
    """Which stage of `executor` differs, on the request `x`: from the forward (decomposition), in
    the plan's phases, or for one sample alone (a stage that mixes samples)."""
    model, stages, plan = executor.model, executor.stages, executor.plan
    want = model(x.clone())
    acts = [x]
    for stage in stages:
        acts.append(stage(acts[-1].clone()))
    name = type(model).__name__
    if mismatch(acts[-1], want, rtol, atol):
        if executor.traced is None:
            return f"{name}'s forward gives different results on the same batch (is it deterministic?)"
        traced, ref = node_values(executor.traced, x.clone(), [s.node for s in stages])
        if mismatch(traced, want, rtol, atol):
            return (f"torch.fx's trace of {name} does not compute what its forward computes now (Python "
                    f"values the forward reads, such as attributes or globals, were fixed when it was traced, "
                    f"or the forward is not deterministic)")
        for i, stage in enumerate(stages):
            if stage.node in ref and mismatch(acts[i + 1], ref[stage.node], rtol, atol):
                return f"stage {i} {stage.name!r} does not reproduce its part of {name}'s forward"
        return f"the stages of {name}, run on the whole batch, do not reproduce its forward"
    for i, stage in enumerate(stages):
        steps = [s for s in plan.steps if s.layer == i]
        parts, row = [], 0
        for s in steps:
            chunk = acts[i][row:row + s.batch].clone()
            row += s.batch
            parts.append(executor.run_step(i, s, chunk))
        if mismatch(torch.cat(parts), acts[i + 1], rtol, atol):
            return (f"stage {i} {stage.name!r} gives other outputs in phases of {[s.batch for s in steps]} "
                    f"samples than on the whole batch of {plan.batch} (an output depends on other "
                    f"samples of its phase, or a layer keeps state between calls)")
    for i, stage in enumerate(stages):
        alone = torch.cat([stage(acts[i][k:k + 1].clone()) for k in range(plan.batch)])
        if mismatch(alone, acts[i + 1], rtol, atol):
            return (f"stage {i} {stage.name!r} gives other outputs for one sample alone than in the whole "
                    f"batch of {plan.batch} (an output depends on the other samples of its batch, which "
                    f"variable batch sizes cannot keep)")
    return "no stage differs on its own; their phases together do (a layer keeps state between calls?)"
