"""Run the optimizer step inside the backward pass, one parameter at a time.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.2
("Fusing backward pass and optimizer step") and 4.1 (limitations: gradient accumulation,
clipping through hooks, closures).

``step_in_backward(model, optimizer)`` registers a ``register_post_accumulate_grad_hook`` on every
trainable parameter: as soon as a parameter's gradient is accumulated, the hook (optionally) clips
it by value, applies the optimizer update to that parameter alone and frees the gradient, so at
most a few gradients are alive at once instead of all of them. Works with the packed optimizers
(``step_param``) and with ordinary ``torch.optim`` optimizers (the step runs with the parameter's
group temporarily narrowed to that one parameter).

Refused with an error, since they need every gradient at once: gradient accumulation
(``accumulation_steps > 1``, a parameter that already holds a ``.grad``, or calling
``optimizer.step()`` while the hooks are active) and global-norm clipping (``max_norm``).

``optimizer.step`` itself is left in place (a step pre-hook refuses outside calls), so LR
schedulers created before or after work as usual. A packed optimizer built with ``compile=True``
runs each per-parameter update as one compiled kernel (dynamic shapes: one compile per format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workbench.optim.packed import PackedOptimizer

__all__ = ["StepInBackwardHandle", "step_in_backward"]


def _step_one(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    if isinstance(optimizer, PackedOptimizer):
        optimizer.step_param(p)
        return
    # NOTE: torch optimizers have no per-parameter step; narrowing the groups to ``p`` for one
    # ordinary step() applies exactly its update (per-parameter state, its group's options). The
    # call goes through ``optimizer.step`` as it is now, so wrappers (LR schedulers) still see it.
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [q for q in g["params"] if q is p]
        optimizer.step()
    finally:
        for g, params in zip(optimizer.param_groups, saved, strict=True):
            g["params"] = params


@dataclass
class StepInBackwardHandle:
    """Returned by :func:`step_in_backward`; ``remove()`` restores ordinary stepping."""

    optimizer: torch.optim.Optimizer
    hooks: list[Any] = field(default_factory=list)
    steps: int = 0
    _inside: bool = False

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    @property
    def active(self) -> bool:
        return bool(self.hooks)

    def __enter__(self) -> StepInBackwardHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def step_in_backward(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clip_value: float | None = None,
    max_norm: float | None = None,
    accumulation_steps: int = 1,
) -> StepInBackwardHandle:
    """Apply ``optimizer``'s update to each parameter of ``model`` as its gradient becomes ready.

    After ``loss.backward()`` every parameter is updated and its ``.grad`` is None; do not call
    ``optimizer.step()`` (it raises while the hooks are active). ``clip_value`` clamps each
    gradient to [-clip_value, clip_value] before its update (the paper's hook-based clipping).
    """
    if max_norm is not None:
        raise ValueError(
            f"max_norm={max_norm}: global-norm clipping needs every gradient at once, but "
            "step_in_backward frees each gradient as soon as it is used; use clip_value= (clip "
            "by value, per parameter) or an ordinary optimizer.step()"
        )
    if accumulation_steps != 1:
        raise ValueError(
            f"accumulation_steps={accumulation_steps}: gradient accumulation is impossible when "
            "the step runs inside backward (paper 4.1); allowed value: 1 (use a larger batch)"
        )
    if clip_value is not None and not clip_value > 0:
        raise ValueError(f"clip_value={clip_value} must be > 0")
    managed = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = [p for p in model.parameters() if p.requires_grad]
    missing = [i for i, p in enumerate(params) if id(p) not in managed]
    if missing:
        raise ValueError(f"parameters {missing[:5]} of the model are not in the optimizer")
    held = [i for i, p in enumerate(params) if p.grad is not None]
    if held:
        raise RuntimeError(
            f"parameters {held[:5]} already hold a .grad: step_in_backward would update with only "
            "the new gradient and silently drop the accumulated one; call "
            "optimizer.zero_grad(set_to_none=True) first (gradient accumulation is not supported)"
        )
    handle = StepInBackwardHandle(optimizer)

    def hook(p: torch.Tensor) -> None:
        if clip_value is not None:
            p.grad.clamp_(-clip_value, clip_value)
        handle._inside = True
        try:
            _step_one(optimizer, p)
        finally:
            handle._inside = False
        p.grad = None
        handle.steps += 1

    def refuse(opt, args, kwargs) -> None:
        if not handle._inside:
            raise RuntimeError(
                "optimizer.step() called while step_in_backward hooks are active: the update already "
                "ran inside backward and gradients were freed (gradient accumulation and global-norm "
                "clipping are not supported); call handle.remove() to step normally"
            )

    # NOTE: a step pre-hook refuses outside calls instead of replacing ``optimizer.step``: an LR
    # scheduler created later wraps the bound method ``step`` and would break on a plain function.
    handle.hooks.append(optimizer.register_step_pre_hook(refuse))
    for p in params:
        handle.hooks.append(p.register_post_accumulate_grad_hook(hook))
    return handle
