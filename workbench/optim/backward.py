"""Run the optimizer step inside the backward pass, one parameter at a time, never silently.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.2
("Fusing backward pass and optimizer step") and 4.1 (limitations: gradient accumulation, clipping
and loss scaling through hooks, closures).

``step_in_backward(model, optimizer)`` registers a ``register_post_accumulate_grad_hook`` on every
trainable parameter: as soon as a parameter's gradient is complete, the hook applies the optimizer
update to that parameter alone and frees the gradient, so at most a few gradients are alive at once
instead of all of them. Works with the packed optimizers (``step_param``) and with ordinary
``torch.optim`` optimizers (the step runs with the parameter's group narrowed to that parameter).

What an ordinary loop does between backward and ``optimizer.step()`` moves into the hook (4.1):

* ``clip_value``: clamp each gradient to [-clip_value, clip_value], as ``clip_grad_value_`` would
  (in the gradient's dtype; with a loss scale, on the unscaled gradient, in fp32 for the packed
  optimizers). Global-norm clipping needs every gradient at once and is refused (``max_norm``).
* ``grad_scale``: the loss scale the gradients carry, divided out before the update. A float is a
  static scale; a ``torch.amp.GradScaler`` is dynamic: each gradient is checked for inf/NaN, the
  scaler records what it found, and ``scaler.update()`` after backward backs off or grows the scale
  with torch's own constants and kernel. On an inf/NaN the remaining updates of that step are
  skipped; parameters whose gradients completed earlier in the same backward were already updated
  (their finite gradients are exact: the step cannot wait for the rest without keeping them).
  ``handle.skipped`` counts the skipped parameter updates.
* ``accumulate=N``: gradients are kept over N micro-batches (one forward of ``model`` with gradients
  enabled each; evaluations under ``torch.no_grad`` do not count) and the update runs in the N-th
  backward, so gradient memory is back to that of an ordinary step for those N micro-batches
  (``workbench.experiments.packed_bit_optimizers.accumulation_memory``).

Parameters that become trainable after registration (unfrozen, or a layer added to the model and to the
optimizer with ``add_param_group``) are hooked at the model's next forward and updated from then on, as an
ordinary ``step()`` would update them; a trainable parameter the optimizer does not manage is refused there.

Refused with an error naming the fix, instead of changing training silently: a second backward that
would update a parameter again before the model's next forward, a clip (or any read) of a gradient
already applied (``p.grad`` is an :class:`~workbench.optim.applied.AppliedGradient` until the next
forward), zeroing gradients between accumulated micro-batches, a gradient held before the hooks
exist, and ``optimizer.step()`` while the hooks are active.

Distributed: under FSDP2 (``fully_shard``) the hooks run after the gradient's reduce-scatter, so each
rank updates its shard with the synchronised gradient (``p.grad`` is then None, not a marker: a
DTensor gradient cannot hold one; a GradScaler is refused, as its inf check would differ between
ranks). Under DDP the hooks fire before the all-reduce: refused (``distributed.DDP_REASON``).

``optimizer.step`` itself is left in place (a step pre-hook refuses outside calls), so LR
schedulers created before or after work as usual. A packed optimizer built with ``compile=True``
(or ``fused=True``) runs each per-parameter update as one compiled kernel (dynamic shapes).
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.utils._pytree import tree_leaves

from workbench.optim.applied import SECOND_BACKWARD_FIX, AppliedGradient
from workbench.optim.distributed import is_sharded, refuse_ddp, refuse_under_ddp
from workbench.optim.packed import PackedOptimizer

__all__ = ["StepInBackwardHandle", "step_in_backward"]


def _step_one(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
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


def _backward_id() -> int:
    # NOTE: the autograd engine numbers each backward call (its "graph task"); -1 outside backward.
    # Hooks of one backward see one id, so a second backward is told apart from more hooks of the
    # first; a forward inside backward is an activation-checkpoint recomputation, not a micro-batch.
    return torch._C._current_graph_task_id()


class StepInBackwardHandle:
    """Returned by :func:`step_in_backward`; ``remove()`` restores ordinary stepping.

    ``steps``: parameter updates applied; ``skipped``: parameter updates skipped for an inf/NaN
    gradient (dynamic loss scaling); ``forwards``: forwards of the model seen with gradients enabled.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *,
                 clip_value: float | None, grad_scale: float | torch.amp.GradScaler | None,
                 accumulate: int) -> None:
        self.optimizer, self.accumulate = optimizer, accumulate
        self.clip_value, self.grad_scale = clip_value, grad_scale
        self.hooks: list[Any] = []
        self.steps = self.skipped = self.forwards = 0
        self._params = params
        self._hooked = {id(p) for p in params}
        self._packed = isinstance(optimizer, PackedOptimizer)
        self._inside = False
        self._marked: list[torch.Tensor] = []
        self._task: int | None = None            # the backward that updates, in this forward's micro-batch
        self._held: dict[int, weakref.ref] = {}  # id(p) -> its gradient after the previous micro-batch
        self._step_at = -1                       # forward count of the optimizer step under way
        self._scale: float | None = None
        self._found: dict[torch.device, torch.Tensor] | None = None

    # ------------------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self._clear_marks()

    @property
    def active(self) -> bool:
        return bool(self.hooks)

    def __enter__(self) -> StepInBackwardHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _clear_marks(self) -> None:
        for p in self._marked:
            if type(p.grad) is AppliedGradient:
                p.grad = None
        self._marked.clear()

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        # a micro-batch is a forward with gradients on (an evaluation under no_grad is not one)
        if _backward_id() == -1 and torch.is_grad_enabled():
            self._adopt(module)
            refuse_under_ddp(self._params)
            self.forwards += 1
            self._task = None
            self._clear_marks()

    def _adopt(self, model: nn.Module) -> None:
        """Hook the parameters that became trainable since registration (unfrozen, or a layer added with
        ``optimizer.add_param_group``), as an ordinary ``step()`` would update them; refuse those not in the
        optimizer (their gradients would pile up with no step to use them)."""
        hooked = self._hooked
        new = [p for p in model.parameters() if p.requires_grad and id(p) not in hooked]
        if not new:
            return
        _check_params(self.optimizer, new, self.grad_scale, names=dict(
            (id(p), name) for name, p in model.named_parameters()), later=True)
        for p in new:
            self.hooks.append(p.register_post_accumulate_grad_hook(self._hook))
            hooked.add(id(p))
        self._params.extend(new)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # a hook on each output fires as a backward enters the model, before any parameter's update
        if _backward_id() == -1 and torch.is_grad_enabled() and self._stepping():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._check_one_backward()

    def _check_one_backward(self) -> None:
        if self._task is not None and self._task != _backward_id():
            raise RuntimeError(
                "a second backward before the model's next forward would update the parameters again (the "
                f"first one already ran the optimizer step inside backward). Fix: {SECOND_BACKWARD_FIX}")

    def _refuse_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._inside:
            raise RuntimeError(
                "optimizer.step() called while step_in_backward is active: the update already ran inside "
                "backward and the gradients were freed. For gradient accumulation use "
                "step_in_backward(..., accumulate=N) and do not call step(); clip with clip_value=; or call "
                "handle.remove() to step normally")

    # ------------------------------------------------------------------------------ the hook
    def _stepping(self) -> bool:
        n = self.accumulate
        return n == 1 or (self.forwards > 0 and self.forwards % n == 0)

    def _hook(self, p: torch.Tensor) -> None:
        key, grad = id(p), p.grad
        if self.accumulate > 1:
            held = self._held.get(key)
            # NOTE: autograd adds each micro-batch's gradient into the same .grad tensor in place (grad
            # mode off, dense gradients), so a different tensor means the sum was dropped in between.
            if held is not None and held() is not grad and not torch.is_grad_enabled() and not grad.is_sparse:
                raise RuntimeError(
                    f"the gradient accumulated over earlier micro-batches was replaced (zero_grad() between "
                    f"micro-batches?): with accumulate={self.accumulate}, step_in_backward updates and frees the "
                    "gradients in the backward of every N-th forward; do not zero them yourself")
            if not self._stepping():
                self._held[key] = weakref.ref(grad)
                return
            self._held.pop(key, None)
        self._check_one_backward()
        self._task = _backward_id()
        if self._step_at != self.forwards:
            self._begin_step()
        if self._overflowed(grad):
            self.skipped += 1
        else:
            self._update(p, grad)
            self.steps += 1
        # NOTE: under fake tensors (CalcGraph's plan of a step in backward) no marker: it cannot wrap a
        # fake tensor, and it views a shared scalar, so the plan loses no byte without it
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        p.grad = None if fake or is_sharded(p) else AppliedGradient.like(p)
        self._marked.append(p)

    def _begin_step(self) -> None:
        """First update of an optimizer step: read the loss scale once, register the inf check."""
        self._step_at = self.forwards
        gs, self._found = self.grad_scale, None
        if not isinstance(gs, torch.amp.GradScaler):
            self._scale = None if gs is None else float(gs)
            return
        # NOTE: the dynamic case reuses torch.amp.GradScaler rather than a copy of it: its scale,
        # growth tracker, constants and update kernel are torch's own. What scaler.step() would record
        # (the inf checks, stage STEPPED) is recorded here, in its per-optimizer state, so that
        # scaler.update() after backward works unchanged; torch 2.13's private layout, pinned.
        if gs._scale is None:
            raise RuntimeError("grad_scale is a GradScaler but the loss was not scaled: call "
                               "scaler.scale(loss).backward() (the gradients would be unscaled wrongly)")
        state = gs._per_optimizer_states[id(self.optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("scaler.update() was not called after the previous backward that stepped: call "
                               "it after every backward that updates (every accumulate-th), as after scaler.step()")
        state["stage"] = OptState.STEPPED
        self._scale = gs.get_scale()
        self._found = {}

    def _overflowed(self, grad: torch.Tensor) -> bool:
        """Dynamic scaling: True if this gradient, or one before it in this step, holds inf/NaN."""
        if self._found is None:
            return False
        if any(float(f) != 0 for f in self._found.values()):
            return True
        found = self._found.get(grad.device)
        if found is None:
            found = self._found[grad.device] = torch.zeros((), dtype=torch.float32, device=grad.device)
            self.grad_scale._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"][grad.device] = found
        # NOTE: torch's fused inf check; torch optimizers (fp32 gradients) are unscaled by it in place,
        # as GradScaler.unscale_ does; packed ones are only checked (x 1, exact) and unscale in fp32.
        inv = 1.0 if self._packed else 1.0 / self._scale
        torch._amp_foreach_non_finite_check_and_unscale_(
            [grad], found, torch.full((), inv, dtype=torch.float32, device=grad.device))
        return float(found) != 0

    def _update(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        clip = self.clip_value
        if self._packed:
            if clip is not None:
                clip = float(torch.tensor(clip, dtype=grad.dtype))  # the bound clip_grad_value_ would use
            self.optimizer.step_param(p, grad_scale=self._scale, clip_value=clip)
            return
        if self._scale is not None and self._found is None:  # a static scale (dynamic: unscaled above)
            grad.mul_(torch.tensor(1.0 / self._scale, dtype=torch.float32))
        if clip is not None:
            grad.clamp_(-clip, clip)
        self._inside = True
        try:
            _step_one(self.optimizer, p)
        finally:
            self._inside = False


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: allowed finite numbers > 0 (or None)")


def _check_params(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grad_scale: Any, *,
                  names: dict[int, Any], later: bool = False) -> None:
    """Raise for trainable parameters step_in_backward cannot update (``later``: found at a forward after
    registration, named by their names in the model)."""
    when = " (trainable since step_in_backward was registered)" if later else ""
    managed = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [names.get(id(p)) for p in params if id(p) not in managed]
    if missing:
        raise ValueError(f"parameters {missing[:5]} of the model{when} are not in the optimizer: their gradients "
                         "would pile up with no step to use them; add them with optimizer.add_param_group("
                         "{'params': [...]}) before the forward, or freeze them (requires_grad_(False))")
    low = [p for p in params if p.dtype != torch.float32]
    if grad_scale is not None and low and not isinstance(optimizer, PackedOptimizer):
        raise ValueError(
            f"grad_scale with {type(optimizer).__name__} on {low[0].dtype} parameters (e.g. parameter "
            f"{names.get(id(low[0]))}): unscaling 16-bit gradients in place loses them (torch.amp.GradScaler refuses "
            "too); use a packed optimizer (PackedAdamW, PackedSGD), which unscales in fp32 inside its step, or fp32 "
            "parameters")
    if isinstance(grad_scale, torch.amp.GradScaler) and any(is_sharded(p) for p in params):
        raise ValueError("grad_scale is a GradScaler but the model's parameters are DTensors (FSDP2): each rank "
                         "would check only its shard for inf/NaN and ranks could disagree on skipping the step; "
                         "use a static float grad_scale, or an ordinary optimizer.step() with the GradScaler")
    held = [names.get(id(p)) for p in params if p.grad is not None]
    if held:
        raise RuntimeError(
            f"parameters {held[:5]}{when} already hold a .grad: step_in_backward would update with only the new "
            "gradient and silently drop the accumulated one; call optimizer.zero_grad(set_to_none=True) first "
            "(to accumulate, use step_in_backward(..., accumulate=N))")


# each parameter's step_in_backward handle, by id, both held weakly (a tensor cannot key a WeakKeyDictionary: its
# == is elementwise; the hooks keep an active handle alive)
_REGISTERED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _registered(p: torch.Tensor) -> bool:
    entry = _REGISTERED.get(id(p))
    if entry is None or entry[0]() is not p:
        return False
    handle = entry[1]()
    return handle is not None and handle.active


def step_in_backward(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clip_value: float | None = None,
    grad_scale: float | torch.amp.GradScaler | None = None,
    accumulate: int = 1,
    max_norm: float | None = None,
) -> StepInBackwardHandle:
    """Apply ``optimizer``'s update to each parameter of ``model`` as its gradient becomes ready.

    After ``loss.backward()`` every parameter is updated and its ``.grad`` is an
    :class:`AppliedGradient` (no memory; None again at the model's next forward); do not call
    ``optimizer.step()`` (it raises while the hooks are active). ``clip_value`` clamps each gradient
    by value, ``grad_scale`` (a float or a ``torch.amp.GradScaler``; call ``scaler.update()`` after
    each backward that steps) divides out the loss scale, ``accumulate=N`` steps in the backward of
    every N-th forward of ``model``; see the module docstring (paper 4.1).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"step_in_backward(model, optimizer): model must be an nn.Module (its forward marks the "
                        f"steps), got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward(model, optimizer): optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if max_norm is not None:
        raise ValueError(
            f"max_norm={max_norm}: global-norm clipping needs every gradient at once, but step_in_backward "
            "frees each gradient as soon as it is used; use clip_value= (clip by value, inside the hook) or "
            "an ordinary optimizer.step()")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate={accumulate!r}: allowed integers >= 1 (micro-batches per optimizer step)")
    if clip_value is not None:
        _check_number("clip_value", clip_value)
    if isinstance(grad_scale, torch.amp.GradScaler):
        grad_scale = grad_scale if grad_scale.is_enabled() else None
    elif grad_scale is not None:
        _check_number("grad_scale", grad_scale)
    refuse_ddp(model)
    params = [p for p in model.parameters() if p.requires_grad]
    _check_params(optimizer, params, grad_scale, names={id(p): i for i, p in enumerate(params)})
    held = [i for i, p in enumerate(params) if _registered(p)]
    if held:
        raise ValueError(f"step_in_backward is already registered on {len(held)} of this model's parameters (first: "
                         f"parameter {held[0]}): each would be updated twice per backward; remove() the earlier "
                         f"handle first")
    handle = StepInBackwardHandle(optimizer, params, clip_value=clip_value, grad_scale=grad_scale,
                                  accumulate=accumulate)
    for key in [k for k, (ref, h) in _REGISTERED.items() if ref() is None or h() is None or not h().active]:
        del _REGISTERED[key]  # parameters gone, handles gone or removed
    for p in params:
        _REGISTERED[id(p)] = weakref.ref(p), weakref.ref(handle)
    # NOTE: a step pre-hook refuses outside calls instead of replacing ``optimizer.step``: an LR
    # scheduler created later wraps the bound method ``step`` and would break on a plain function.
    handle.hooks.append(optimizer.register_step_pre_hook(handle._refuse_step))
    handle.hooks.append(model.register_forward_pre_hook(handle._on_forward))
    handle.hooks.append(model.register_forward_hook(handle._after_forward))
    for p in params:
        handle.hooks.append(p.register_post_accumulate_grad_hook(handle._hook))
    return handle
