"""Per-unit profile of a flat layer sequence, for checkpoint planning.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-B-2 and Sec. IV / Fig 11: where a sequential checkpoint should go
depends on each layer's output size and on what it keeps for backward. This module cuts a model
into checkpoint *units* and measures them once on a sample batch: time, the storages each unit
outputs and saves for backward, the bytes its forward and its backward allocate, and the loss.

Units are the model's children, except that a residual block (``workbench.models.resnet``'s
``BasicBlock``/``Bottleneck``) is opened into ``fork``, one unit per layer of its body, and
``merge`` (shortcut, add, ReLU): inside a block the state between units is the pair (skip input,
body activation), so a checkpoint there keeps both. Checkpoints at block boundaries only leave
a whole block's activations to be stored or recomputed at once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from workbench.measure import MemoryMeter, time_callable
from workbench.models.resnet import BasicBlock

__all__ = ["LayerProfile", "State", "layers_of", "preserved_state", "profile_layers", "units_of"]

# NOTE: the state between units is whatever a layer returns: a tensor, a tuple, or any nest of containers
# (a dict of hidden states and token ids); only its tensors are counted, detached and cloned (torch's pytree)
State = torch.Tensor | tuple[torch.Tensor, ...] | Any
Key = tuple[str, int]


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The flat layer sequence of an nn.Sequential, a model with ``.as_sequential()`` or a list."""
    if isinstance(model, nn.Sequential):
        layers = list(model.children())
    elif hasattr(model, "as_sequential"):
        layers = list(model.as_sequential().children())
    elif isinstance(model, Sequence) and not isinstance(model, (str, bytes)) and all(
            isinstance(m, nn.Module) for m in model):
        layers = list(model)
    else:
        raise TypeError(
            f"expected an nn.Sequential, a model with .as_sequential() or a list of modules, "
            f"got {type(model).__name__}")
    if not layers:
        raise ValueError("cannot checkpoint an empty layer sequence: the model has no children")
    return layers


class _Fork(nn.Module):
    """x -> (x, x): the skip input and the body's running activation."""

    inplace = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class _Body(nn.Module):
    """(skip, h) -> (skip, layer(h)): one layer of a residual block's body."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.inplace = bool(getattr(layer, "inplace", False))

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        skip, h = state
        return skip, self.layer(h)


class _Merge(nn.Module):
    """(skip, h) -> relu(h + shortcut(skip)): the end of a residual block, as its forward."""

    inplace = False

    def __init__(self, block: BasicBlock) -> None:
        super().__init__()
        self.shortcut, self.relu = block.shortcut, block.relu

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        skip, h = state
        return self.relu(h + self.shortcut(skip))


def units_of(model: nn.Module | Sequence[nn.Module], *, split_blocks: bool = True) -> list[nn.Module]:
    """The checkpoint units of a model: its layers, residual blocks opened when ``split_blocks``.

    Units share the model's modules (nothing is copied); running them in order computes what the
    model computes, operation for operation.
    """
    units: list[nn.Module] = []
    for layer in layers_of(model):
        # NOTE: only blocks whose forward is known (relu(body(x) + shortcut(x))) are opened; any
        # other module stays one unit.
        if split_blocks and isinstance(layer, BasicBlock) and isinstance(layer.body, nn.Sequential):
            units += [_Fork(), *(_Body(m) for m in layer.body), _Merge(layer)]
        else:
            units.append(layer)
    return units


def _tensors(state: State) -> list[torch.Tensor]:
    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> Key:
    return (str(t.device), t.untyped_storage().data_ptr())


def _keys(state: State) -> dict[Key, int]:
    return {_storage_key(t): t.untyped_storage().nbytes() for t in _tensors(state)}


@contextlib.contextmanager
def preserved_state(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Run code that must leave no trace: buffers (BatchNorm statistics) and the RNG restored."""
    buffers = list({id(b): b for m in layers for b in m.buffers()}.values())
    saved = [b.detach().clone() for b in buffers]
    devices = sorted({b.device.index for b in buffers if b.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved, strict=True):
                    b.copy_(s)


@dataclass
class LayerProfile:
    """Per-unit costs measured once on a sample batch (training mode, autograd on).

    ``out_keys[i]``/``saved[i]``: storages (key -> bytes) unit i outputs / saves for backward;
    ``forward_bytes[i]``: peak bytes its forward allocates (outputs, saved tensors, scratch);
    ``backward_bytes[i]``: peak bytes its backward allocates given its output gradients;
    ``grad_bytes[i]``: bytes of the gradients of its outputs; ``loss_bytes``: peak of the loss's
    forward and backward on the last output; ``loss_held_bytes``: the loss and its seed gradient,
    which stay live through the backward. The sample batch itself is never counted.
    """

    names: list[str]
    time_s: list[float]
    out_keys: list[dict[Key, int]]
    saved: list[dict[Key, int]] = field(repr=False)
    inplace: list[bool] = field(repr=False)
    forward_bytes: list[int] = field(repr=False)
    backward_bytes: list[int] = field(repr=False)
    grad_bytes: list[int] = field(repr=False)
    loss_bytes: int = 0
    loss_held_bytes: int = 0  # the loss and its seed gradient, live through the whole backward

    def __len__(self) -> int:
        return len(self.names)

    @property
    def out_bytes(self) -> list[int]:
        """Bytes a boundary after each unit keeps (its output storages)."""
        return [sum(k.values()) for k in self.out_keys]

    def saved_bytes(self, i: int) -> int:
        return sum(self.saved[i].values())

    def input_keys(self, i: int) -> dict[Key, int]:
        """Storages of unit i's input (empty for the sample, which is not counted)."""
        return self.out_keys[i - 1] if i > 0 else {}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "unit": range(len(self)), "name": self.names, "time_s": self.time_s,
            "out_bytes": self.out_bytes,
            "saved_bytes": [self.saved_bytes(i) for i in range(len(self))],
            "forward_bytes": self.forward_bytes, "backward_bytes": self.backward_bytes,
            "grad_bytes": self.grad_bytes,
        })


def _default_loss(out: torch.Tensor) -> torch.Tensor:
    # NOTE: a loss whose backward materialises the output gradient, as cross-entropy does.
    return out.float().square().mean()


def profile_layers(
    model: nn.Module | Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 3,
    split_blocks: bool = True, loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LayerProfile:
    """Measure per-unit forward time, storages out and saved, forward/backward bytes, and the loss.

    ``loss_fn(output) -> scalar`` is the training loss (default: mean square of the output).
    The model's buffers (BatchNorm statistics) and the RNG are restored afterwards.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"sample must be a torch.Tensor batch, got {type(sample).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output) -> scalar loss, got {loss_fn!r}")
    units = units_of(model, split_blocks=split_blocks)
    loss_fn = loss_fn or _default_loss
    exclude = {_storage_key(t) for m in units for t in list(m.parameters()) + list(m.buffers())}
    exclude |= set(_keys(sample))
    saved: list[dict[Key, int]] = [{} for _ in units]
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude:
            saved[current[0]][key] = t.untyped_storage().nbytes()
        return t

    names = [type(m).__name__ if not isinstance(m, _Body) else f"{type(m.layer).__name__} (in block)"
             for m in units]
    names = [n if not isinstance(m, (_Fork, _Merge)) else ("block fork" if isinstance(m, _Fork) else "block merge")
             for n, m in zip(names, units, strict=True)]
    outs: list[State] = []
    inputs: list[State] = []
    forward_bytes: list[int] = []
    device = sample.device
    with preserved_state(units), torch.enable_grad():
        x: State = sample
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for i, unit in enumerate(units):
                current[0] = i
                inputs.append(x)
                with MemoryMeter(device) as meter:
                    x = _forward(unit, i, names[i], x, sample)
                forward_bytes.append(meter.peak_bytes)
                outs.append(x)
        out_keys = [{k: v for k, v in _keys(o).items() if k not in exclude} for o in outs]
        final = x
        detached = [_detach(inp) for inp in inputs]
        for unit, inp in zip(units, detached, strict=True):  # warm-up: first calls pay one-off costs
            unit(_clone_if_inplace(unit, inp))
        # each unit is timed on its own recorded input
        times = [time_callable(functools.partial(_call, unit, inp), warmup=1, repeats=repeats,
                               device=device).median_s
                 for unit, inp in zip(units, detached, strict=True)]
        backward, grads = [], []
        for i, (unit, inp) in enumerate(zip(units, detached, strict=True)):
            b, g = _backward_bytes(unit, inp, needs_input_grad=i > 0 or sample.requires_grad)
            backward.append(b)
            grads.append(g)
        leaf = _leaf(final, True)
        if not any(t.requires_grad for t in _tensors(leaf)):
            raise TypeError(f"the model's last unit must return a floating tensor (or a container of them), "
                            f"got {type(final).__name__}")
        with MemoryMeter(device) as meter:
            loss = loss_fn(leaf)
            loss.backward()
        loss_bytes = meter.peak_bytes
        loss_held = 2 * loss.untyped_storage().nbytes()
    return LayerProfile(
        names=names, time_s=times, out_keys=out_keys, saved=saved,
        inplace=[bool(getattr(m, "inplace", False)) for m in units], forward_bytes=forward_bytes,
        backward_bytes=backward, grad_bytes=grads, loss_bytes=loss_bytes, loss_held_bytes=loss_held,
    )


def _forward(unit: nn.Module, i: int, name: str, x: State, sample: torch.Tensor) -> State:
    """`unit(x)`; torch's shape errors come back naming the unit and the sample's shape."""
    try:
        return unit(x)
    except RuntimeError as exc:
        shapes = tuple(x.shape) if isinstance(x, torch.Tensor) else [tuple(t.shape) for t in _tensors(x)]
        raise ValueError(f"unit {i} ({name}) refused its input of shape {shapes} (sample shape "
                         f"{tuple(sample.shape)}): {exc}") from exc


def _detach(state: State) -> State:
    return tree_map_only(torch.Tensor, torch.Tensor.detach, state)


def _leaf(state: State, requires_grad: bool) -> State:
    """The state detached, its floating tensors leaves that require grad when `requires_grad` (token ids
    and other integer tensors cannot)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point()),
                         state)


def _clone_if_inplace(unit: nn.Module, state: State) -> State:
    if not getattr(unit, "inplace", False):
        return state
    return tree_map_only(torch.Tensor, torch.Tensor.clone, state)


def _call(unit: nn.Module, state: State) -> State:
    return unit(_clone_if_inplace(unit, state))


def _backward_bytes(unit: nn.Module, inp: State, *, needs_input_grad: bool) -> tuple[int, int]:
    """(peak bytes the unit's backward allocates, bytes of its output gradients), gradients
    preallocated as in training after the first step, measured with MemoryMeter."""
    params = [p for p in unit.parameters() if p.requires_grad]
    old = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        leaf = _leaf(inp, needs_input_grad)
        # in-place layers may not touch a leaf
        x = tree_map_only(torch.Tensor, torch.Tensor.clone, leaf) if needs_input_grad else leaf
        outs = [o for o in _tensors(unit(x)) if o.requires_grad]
        if not outs:
            return 0, 0
        grads = [torch.ones_like(o) for o in outs]
        with MemoryMeter(_tensors(inp)[0].device) as meter:
            torch.autograd.backward(outs, grads)
        return meter.peak_bytes, sum(g.untyped_storage().nbytes() for g in grads)
    finally:
        for p, g in zip(params, old, strict=True):
            p.grad = g
