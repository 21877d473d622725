"""Checkpointing a model that is not a layer sequence through its repeated blocks (a ViT's or a GPT's
transformer blocks, a DenseNet's dense layers): each chosen block's forward runs under
`torch.utils.checkpoint` (non-reentrant), so backward recomputes it from its inputs.

The blocks are the instances of the module class that repeats most often among the model's non-container
submodules and whose instances together hold at least half of its parameters (ties: the class holding
more). A layer sequence (`nn.Sequential`, `.as_sequential()`) is checkpointed by OpTorch's `sc` instead
(`configs`); this is the fallback for every other model.

Plans use the layer-plan format `(start, end, checkpointed)` over block indices, each checkpointed segment one
block. One real forward of the fp32 model at a small batch (`profile_blocks`) measures each block's time
and the bytes autograd saves inside it: `uniform` checkpoints every block (the usual gradient
checkpointing of transformer libraries); `optimal` the fewest blocks, cheapest to recompute per byte
freed first, whose activations fit the budget; the chosen plan is then traced by CalcGraph like any other
candidate, so its predicted peak is CalcGraph's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint

from workbench.checkpoint import preserved_state

from .steptime import pooled, time_parts

__all__ = ["BlockCheckpoints", "checkpoint_blocks", "find_blocks", "profile_blocks"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in forward order (module order), or [] where no class repeats."""
    total = sum(p.numel() for p in model.parameters()) or 1
    by_class: dict[type, list[nn.Module]] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, _CONTAINERS) and any(True for _ in module.children()):
            by_class.setdefault(type(module), []).append(module)
    best, key = [], (1, 0)
    for instances in by_class.values():
        held = sum(p.numel() for m in instances for p in m.parameters())
        if len(instances) >= 2 and held >= total / 2 and (len(instances), held) > key:
            best, key = instances, (len(instances), held)
    return best


def _checkpointed(module: nn.Module, forward: Callable, *args, **kwargs):
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    # NOTE: the recomputation runs on the arguments as they were now: containers rebuilt (a DenseNet layer's
    # list of features grows after the call, and a recomputation on the grown list saw 57 channels, not 55)
    args, kwargs = tree_unflatten(*tree_flatten((args, kwargs)))
    # NOTE: the recomputation must not advance BatchNorm's running statistics a second time
    return checkpoint(forward, *args, use_reentrant=False, **kwargs,
                      context_fn=lambda: (contextlib.nullcontext(), preserved_state([module])))


def checkpoint_blocks(model: nn.Module, segments: Sequence[tuple[int, int, bool]] | None = None) -> nn.Module:
    """`model` with the blocks of the checkpointed segments (default: every block) run under checkpoint."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint")
    chosen = range(len(blocks)) if segments is None else [i for a, b, ckpt in segments if ckpt for i in range(a, b)]
    for i in chosen:
        block = blocks[i]
        block.forward = functools.partial(_checkpointed, block, block.forward)
    return model


@dataclass
class BlockCheckpoints:
    """Per-block forward seconds, bytes saved for backward and bytes of the block's input, one fp32 forward at
    a small batch; plans over the blocks in the layer-plan format (see the module docstring)."""

    time_s: list[float]
    forward_s: float
    saved: list[int]
    inputs: list[int]
    others: int  # bytes saved outside the blocks (stem, head)

    def __len__(self) -> int:
        return len(self.time_s)

    @property
    def uniform(self) -> list[tuple[int, int, bool]]:
        return [(i, i + 1, True) for i in range(len(self))]

    @property
    def unchecked_peak(self) -> int:
        return self.others + sum(self.saved)

    def recompute_share(self, segments: Sequence[tuple[int, int, bool]]) -> float:
        """The share of one forward pass the plan recomputes in backward."""
        return sum(self.time_s[i] for a, b, c in segments if c for i in range(a, b)) / max(self.forward_s, 1e-12)

    def activations(self, chosen: Sequence[int]) -> int:
        """Bytes of activations at their peak with `chosen` blocks checkpointed: the end of the forward (each
        chosen block keeps only its input), or backward recomputing a chosen block (the blocks after it freed
        already, its own tensors back)."""
        kept = [self.inputs[i] if i in chosen else self.saved[i] for i in range(len(self))]
        recomputing = [self.others + sum(kept[:i]) + self.saved[i] for i in chosen]
        return max([self.others + sum(kept), *recomputing])

    def optimal(self, budget: float) -> list[tuple[int, int, bool]]:
        """The fewest-seconds plan whose activations fit `budget` (greedy, most bytes freed per second
        recomputed first); every block where nothing fits."""
        order = sorted(range(len(self)), key=lambda i: -(self.saved[i] - self.inputs[i]) / max(self.time_s[i], 1e-12))
        chosen: list[int] = []
        while self.activations(chosen) > budget and len(chosen) < len(self):
            chosen.append(order[len(chosen)])
        plan, start = [], 0
        for i in sorted(chosen):
            if i > start:
                plan.append((start, i, False))
            plan.append((i, i + 1, True))
            start = i + 1
        if start < len(self) or not plan:
            plan.append((start, len(self), False))
        return plan


def profile_blocks(model: nn.Module, inputs: torch.Tensor, timed: torch.Tensor | None = None) -> BlockCheckpoints:
    """Counts the storages autograd saves inside each block and outside them (parameters and the inputs left
    out) in one real forward of `model` on `inputs` (train mode, grad on, buffers restored), and times each
    block and the whole forward on `timed` (default `inputs`) in passes the machine did not stall
    (`steptime.time_parts`)."""
    blocks = find_blocks(model)
    index = {id(b): i for i, b in enumerate(blocks)}
    times = [0.0 for _ in blocks]
    saved: list[dict[int, int]] = [{} for _ in blocks]
    outside: dict[int, int] = {}
    entered: list[int] = [0 for _ in blocks]
    stack: list[tuple[int, float]] = []
    params = {p.untyped_storage()._cdata for p in [*model.parameters(), *model.buffers()]}
    sync = torch.cuda.synchronize if inputs.device.type == "cuda" else (lambda: None)

    def before(module, args):
        i = index[id(module)]
        entered[i] = sum(t.untyped_storage().nbytes() for t in _tensors(args))
        sync()
        stack.append((i, time.perf_counter()))

    def after(module, args, out):
        sync()
        i, start = stack.pop()
        times[i] = time.perf_counter() - start

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            (saved[stack[-1][0]] if stack else outside)[key] = t.untyped_storage().nbytes()
        return t

    def forward(x: torch.Tensor) -> list[float]:
        sync()
        start = time.perf_counter()
        model(x)
        sync()
        return [*times, time.perf_counter() - start]

    handles = [b.register_forward_pre_hook(before) for b in blocks] + [b.register_forward_hook(after)
                                                                        for b in blocks]
    try:
        with preserved_state([model]), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(inputs)
            inside = {k for s in saved for k in s}
            counted = ([sum(s.values()) for s in saved], list(entered),
                       sum(v for k, v in outside.items() if k not in inside))
            parts, _ = time_parts(lambda: forward(inputs if timed is None else timed))
    finally:
        for handle in handles:
            handle.remove()
    # the same block class with the same parameter shapes on inputs of the same bytes does the same work
    keys = [(type(b), tuple(tuple(p.shape) for p in b.parameters()), entered[i]) for i, b in enumerate(blocks)]
    return BlockCheckpoints(pooled(parts[:-1], keys), parts[-1], *counted)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
