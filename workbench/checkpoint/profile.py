"""Per-layer profile of a flat layer sequence, for checkpoint planning.

Paper: Ahmed & Naveed, "OpTorch" (arXiv 2105.00619), Sec. II-B-2 and Sec. IV / Fig 11: where a
sequential checkpoint should go depends on each layer's output size and on what it keeps for
backward. This module measures those once on a sample batch (time, output bytes, storages saved
for backward, backward working bytes) and holds the cost model ``workbench.checkpoint``'s
planners share.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from workbench.measure import MemoryMeter, time_callable

__all__ = ["LayerProfile", "layers_of", "preserved_state", "profile_layers"]


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The flat layer sequence of an nn.Sequential, a model with ``.as_sequential()`` or a list."""
    if isinstance(model, nn.Sequential):
        return list(model.children())
    if hasattr(model, "as_sequential"):
        return list(model.as_sequential().children())
    if isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise TypeError(
        f"expected an nn.Sequential, a model with .as_sequential() or a list of modules, "
        f"got {type(model).__name__}"
    )


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


@contextlib.contextmanager
def preserved_state(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Run code that must leave no trace: buffers (BatchNorm statistics) and the RNG restored."""
    buffers = [b for m in layers for b in m.buffers()]
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
    """Per-layer costs measured once on a sample batch (training mode, autograd on)."""

    names: list[str]
    time_s: list[float]
    out_bytes: list[int]
    out_keys: list[tuple[str, int]]
    saved: list[dict[tuple[str, int], int]] = field(repr=False)
    inplace: list[bool] = field(repr=False)
    backward_bytes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def saved_bytes(self, i: int) -> int:
        return sum(self.saved[i].values())

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "layer": range(len(self)), "name": self.names, "time_s": self.time_s,
            "out_bytes": self.out_bytes,
            "saved_bytes": [self.saved_bytes(i) for i in range(len(self))],
            "backward_bytes": self.backward_bytes or [float("nan")] * len(self),
        })

    # --- cost model -------------------------------------------------------------------------
    def inner_bytes(self, a: int, b: int) -> int:
        """Bytes saved for backward by layers[a:b], excluding its input and output tensors."""
        keys: dict[tuple[str, int], int] = {}
        for i in range(a, b):
            keys.update(self.saved[i])
        keys.pop(self.out_keys[b - 1], None)
        if a > 0:
            keys.pop(self.out_keys[a - 1], None)
        return sum(keys.values())

    def backward_peak(self, a: int, b: int) -> int:
        """Peak while back-propagating layers[a:b] with all their saved tensors live, input
        excluded: max over layer i of saved(a..i) + grad of its output + its backward's own
        allocations (layers after i have freed what they saved)."""
        keys: dict[tuple[str, int], int] = {}
        peak = 0
        for i in range(a, b):
            keys.update(self.saved[i])
            if a > 0:
                keys.pop(self.out_keys[a - 1], None)
            work = self.backward_bytes[i] if self.backward_bytes else self.out_bytes[i]
            peak = max(peak, sum(keys.values()) + self.out_bytes[i] + work)
        return peak


def profile_layers(
    model: nn.Module | Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 3
) -> LayerProfile:
    """Measure per-layer forward time, output bytes and bytes saved for backward.

    The model's buffers (BatchNorm statistics) and the RNG are restored afterwards.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    layers = layers_of(model)
    exclude = {_storage_key(p) for m in layers for p in list(m.parameters()) + list(m.buffers())}
    saved: list[dict[tuple[str, int], int]] = [{} for _ in layers]
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude:
            saved[current[0]][key] = t.untyped_storage().nbytes()
        return t

    names = [type(m).__name__ for m in layers]
    outs: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    device = sample.device
    with preserved_state(layers), torch.enable_grad():
        x = sample
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for i, layer in enumerate(layers):
                current[0] = i
                inputs.append(x.detach())
                x = layer(x)
                outs.append(x)
        for layer, inp in zip(layers, inputs, strict=True):  # warm-up: first calls pay one-off costs
            layer(inp)
        # each layer is timed on its own recorded input
        times = [time_callable(functools.partial(layer, inp), warmup=1, repeats=repeats,
                               device=device).median_s
                 for layer, inp in zip(layers, inputs, strict=True)]
        backward = [_backward_bytes(layer, inp, needs_input_grad=i > 0 or sample.requires_grad)
                    for i, (layer, inp) in enumerate(zip(layers, inputs, strict=True))]
    return LayerProfile(
        names=names, time_s=times,
        out_bytes=[o.untyped_storage().nbytes() for o in outs],
        out_keys=[_storage_key(o) for o in outs], saved=saved,
        inplace=[bool(getattr(m, "inplace", False)) for m in layers], backward_bytes=backward,
    )


def _backward_bytes(layer: nn.Module, inp: torch.Tensor, *, needs_input_grad: bool) -> int:
    """Peak bytes a layer's backward allocates (gradients preallocated, as in training after
    the first step), measured with workbench.measure.MemoryMeter."""
    params = [p for p in layer.parameters() if p.requires_grad]
    old = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        leaf = inp.detach().requires_grad_(needs_input_grad)
        x = leaf.clone() if needs_input_grad else leaf  # in-place layers may not touch a leaf
        out = layer(x)
        if not out.requires_grad:
            return 0
        grad = torch.ones_like(out)
        with MemoryMeter(inp.device) as meter:
            torch.autograd.backward(out, grad)
        return meter.peak_bytes
    finally:
        for p, g in zip(params, old, strict=True):
            p.grad = g
