"""Sequential checkpoints (S-C): ``scmodel = sc(model)``, the module wrapper that runs a plan.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-B-2 (sequential-checkpoint training) and the one-call
``scmodel = sc(model)`` API of Sec. III.

``sc(model)`` runs a model's checkpoint units (its children, residual blocks opened into their
layers: ``workbench.checkpoint.profile.units_of``) in segments; every segment but the last keeps
only its input and is recomputed in the backward pass by
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Where the boundaries go is chosen by
``plan_checkpoints`` (``workbench.checkpoint.planner``: uniform, smallest, optimal) from a
per-unit profile measured once.

Two traps: recomputing a segment that holds BatchNorm would update the running statistics twice,
so the recomputation runs inside a context that restores them (``num_batches_tracked`` advances
once); dropout stays identical because checkpoint stashes and restores the RNG state
(``preserve_rng_state=True``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .planner import CheckpointPlan, check_budget, check_count, check_strategy, plan_checkpoints, uniform_segments
from .profile import State, layers_of, units_of

__all__ = ["CheckpointedSequential", "sc"]


@contextlib.contextmanager
def _restore_batchnorm(bns: Sequence[nn.Module]) -> Iterator[None]:
    saved = [[b.detach().clone() for b in m.buffers()] for m in bns]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, values in zip(bns, saved, strict=True):
                for b, v in zip(m.buffers(), values, strict=True):
                    b.copy_(v)


class CheckpointedSequential(nn.Sequential):
    """The same layers (shared, not copied) run in checkpointed segments of units.

    Children, parameters and state_dict keys are those of the wrapped model, so training the
    result trains the original model; in training mode the forward runs ``units`` (the
    children, residual blocks opened) segment by segment, in eval mode the children as they are.
    """

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        plan: CheckpointPlan | None,
        *,
        planner: Callable[[torch.Tensor], CheckpointPlan] | None = None,
        preserve_rng_state: bool = True,
        units: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__(layers)
        self.plan = plan
        self._planner = planner
        self._lazy: CheckpointPlan | None = None  # the plan made here from a batch, and that batch's size
        self._lazy_numel = 0
        self.preserve_rng_state = preserve_rng_state
        # NOTE: a plain list, not registered: the units wrap the children, and registering them
        # would list every parameter twice in the state_dict.
        self.units: list[nn.Module] = list(units) if units is not None else list(self.children())

    def _run(self, a: int, b: int, state: State) -> State:
        for unit in self.units[a:b]:
            state = unit(state)
        return state

    def _needs_plan(self, x: torch.Tensor) -> bool:
        """Plan on `x` when no plan was given (nor set): on the first non-empty batch, and again on a batch
        with more elements than the one the plan was made on.

        # NOTE: a plan under a memory budget made on a small batch (an empty one plans no checkpoints at
        # all) exceeds the budget on a larger one; a plan made on the largest batch so far holds for the
        # smaller ones, so planning again is needed only when a batch grows.
        """
        lazy = self.plan is None or self.plan is self._lazy
        return lazy and self._planner is not None and x.numel() > self._lazy_numel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(x)
        if self._needs_plan(x):
            assert self._planner is not None
            self.plan = self._lazy = self._planner(x.detach())
            self._lazy_numel = x.numel()
        if self.plan is None:  # an empty batch before any plan: nothing to keep, nothing to plan on
            return self._run(0, len(self.units), x)
        if self.plan.segments[-1][1] != len(self.units):
            raise ValueError(f"the plan covers {self.plan.segments[-1][1]} units, the model has {len(self.units)}")
        state: State = x
        for a, b, ckpt in self.plan.segments:
            if not ckpt:
                state = self._run(a, b, state)
                continue
            bns = [m for unit in self.units[a:b] for m in unit.modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

            def contexts(bns=bns):
                return contextlib.nullcontext(), _restore_batchnorm(bns)
            # the state as its leaves (a tensor, a tuple, a dict of hidden states and token ids), rebuilt inside
            args, spec = tree_flatten(state)

            def run(*args: torch.Tensor, a: int = a, b: int = b, spec=spec) -> State:
                return self._run(a, b, tree_unflatten(list(args), spec))
            state = checkpoint(run, *args, use_reentrant=False, context_fn=contexts,
                               preserve_rng_state=self.preserve_rng_state)
        return state


def sc(
    model: nn.Module,
    segments: int | None = None,
    *,
    memory_budget: int | None = None,
    strategy: str = "uniform",
    sample: torch.Tensor | None = None,
    preserve_rng_state: bool = True,
    split_blocks: bool = True,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> CheckpointedSequential:
    """OpTorch's one-call sequential checkpoints: ``scmodel = sc(model)``.

    The result shares ``model``'s layers and gives the same outputs, gradients and BatchNorm
    running statistics. Checkpoints may fall inside residual blocks (``split_blocks``; see
    :func:`units_of`). ``uniform`` without a budget needs no profile; other choices profile the
    units on ``sample`` now, or, when ``sample`` is None, on the first non-empty training batch and
    again on any later batch with more elements than the one planned on.
    """
    check_strategy(strategy)
    layers = layers_of(model)
    units = units_of(layers, split_blocks=split_blocks)
    if segments is not None:
        check_count("segments", segments, len(units))
    if memory_budget is not None:
        check_budget(memory_budget)
        if segments is not None:
            raise ValueError("give segments or memory_budget, not both")
    named = (OrderedDict(model.named_children()) if isinstance(model, nn.Module)
             else OrderedDict((str(i), m) for i, m in enumerate(layers)))
    if isinstance(model, nn.Module) and len(named) != len(layers):
        named = OrderedDict((str(i), m) for i, m in enumerate(layers))

    def planner(x: torch.Tensor) -> CheckpointPlan:
        return plan_checkpoints(layers, x, memory_budget=memory_budget, segments=segments,
                                strategy=strategy, split_blocks=split_blocks, loss_fn=loss_fn)

    plan = None
    if sample is not None:
        plan = planner(sample)
    elif strategy == "uniform" and memory_budget is None:
        k = segments or max(1, round(math.sqrt(len(units))))
        inplace = [bool(getattr(m, "inplace", False)) for m in units]
        plan = CheckpointPlan("uniform", uniform_segments(inplace, k), None, None)  # not profiled
    return CheckpointedSequential(named, plan, planner=planner, preserve_rng_state=preserve_rng_state,
                                  units=units)
