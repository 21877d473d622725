"""CalcHeap: pre-allocated zones for parameters, gradients and optimizer state; model switching.

Implements Sections 3.1 and 3.3 of "CalcGraph: taming the high costs of deep learning using
models (2022)". A `Heap` allocates, once, one contiguous buffer per zone laid out from a
compiled plan (`CompiledGraph.spec`): the forward zone's parameters and buffers, the gradient
zone and the optimizer zone, each variable at a fixed, aligned offset. `bind(model, optimizer)`
moves a model's parameters, buffers, gradients and its optimizer's state into views of those
buffers, so training allocates nothing new for them; activations and temporaries stay with
PyTorch's allocator (eager PyTorch gives no hook to place them).

A model switch (Section 3.3, Fig 8) is `save()` (one copy per zone to host storage) and
`load(snapshot)` (one copy per zone back, the gradient zone re-initialised with one memset);
`reinit(seed)` re-initialises the bound model in place, the heap's replacement for building a
fresh model and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from .plan import CompiledGraph

__all__ = ["Heap", "HeapSnapshot"]

_ALIGN = 64  # bytes; every variable starts on a cache-line boundary
# NOTE: these optimizers create their state as zeros (SGD's momentum buffer is a copy of the
# first gradient, which equals 0 * momentum + gradient when dampening is 0), so an unstepped
# optimizer can be bound to a zeroed optimizer zone without changing a single bit of training.
_ZERO_STATE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_HYPER_SKIP = ("params",)


@dataclass
class HeapSnapshot:
    """A switched-out model: one host copy per zone, plus the optimizer's hyperparameters."""

    zones: dict[str, torch.Tensor]
    hyper: list[dict] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.zones.values())


class Heap:
    """Contiguous zones for one model's parameters, buffers, gradients and optimizer state."""

    def __init__(self, graph: CompiledGraph, *, device: torch.device | str | None = None) -> None:
        if not isinstance(graph, CompiledGraph):
            raise TypeError(f"Heap needs a CompiledGraph from calcgraph.plan_training, got {type(graph).__name__}")
        self.device = torch.device(device) if device is not None else graph.device
        spec = graph.spec
        host = torch.device("cpu")
        slots: list[dict] = []
        ends: dict[str, int] = {}

        def place(zone: str, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
            start = -(-ends.get(zone, 0) // _ALIGN) * _ALIGN
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            slots.append({"zone": zone, "name": name, "offset": start, "bytes": nbytes, "shape": shape,
                          "dtype": dtype, "device": device})
            ends[zone] = start + nbytes

        for name, shape, dtype in spec["parameters"]:
            place("forward", name, shape, dtype, self.device)
        for name, shape, dtype in spec["buffers"]:
            place("forward", name, shape, dtype, self.device)
        for name, shape, dtype in spec["parameters"]:
            place("gradient", name + ".grad", shape, dtype, self.device)
        self._state_slots: list[list[int]] = []
        for (pname, _, _), state in zip(spec["parameters"], spec["state"], strict=True):
            self._state_slots.append(list(range(len(slots), len(slots) + len(state))))
            for key, shape, dtype, dev_type in state:
                # NOTE: optimizer scalars that torch keeps on the host (Adam's `step` on CUDA) get
                # their own host zone, so the device zone stays one contiguous device buffer.
                on_host = dev_type == "cpu" and self.device.type != "cpu"
                place("optimizer_host" if on_host else "optimizer", f"{pname}.{key}", shape, dtype,
                      host if on_host else self.device)
        self._slots = slots
        self.layout = pd.DataFrame(slots)
        self.zones: dict[str, torch.Tensor] = {
            zone: torch.zeros(-(-end // _ALIGN) * _ALIGN, dtype=torch.uint8,
                              device=host if zone == "optimizer_host" else self.device)
            for zone, end in ends.items()
        }
        self._views = [self._view(s) for s in slots]
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._n_params = len(spec["parameters"])
        self._n_buffers = len(spec["buffers"])

    def _view(self, slot: dict) -> torch.Tensor:
        raw = self.zones[slot["zone"]][slot["offset"]:slot["offset"] + slot["bytes"]]
        return raw.view(slot["dtype"]).view(slot["shape"])

    @property
    def nbytes(self) -> int:
        return sum(z.numel() for z in self.zones.values())

    def zone_bytes(self) -> pd.DataFrame:
        """Bytes per zone: allocated (with alignment padding) and used by variables."""
        used = self.layout.groupby("zone")["bytes"].sum()
        return pd.DataFrame([{"zone": z, "allocated_bytes": t.numel(), "variable_bytes": int(used[z]),
                              "variables": int((self.layout["zone"] == z).sum())} for z, t in self.zones.items()])

    # binding -------------------------------------------------------------------------------
    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Heap:
        """Move parameters, buffers, gradients and optimizer state into the heap's views.

        Values are copied in (an existing gradient or optimizer state included); afterwards
        `p.data`, `p.grad` and `optimizer.state[p]` are views of the zones.
        """
        params = list(model.parameters())
        buffers = list(model.buffers())
        if len(params) != self._n_params or len(buffers) != self._n_buffers:
            raise ValueError(
                f"model has {len(params)} parameters and {len(buffers)} buffers; the plan has "
                f"{self._n_params} and {self._n_buffers}"
            )
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if {id(p) for p in opt_params} != {id(p) for p in params}:
            raise ValueError("optimizer must own exactly the model's parameters")
        if any(len(optimizer.state.get(p, {})) == 0 for p in params) and not isinstance(optimizer, _ZERO_STATE):
            raise TypeError(
                f"{type(optimizer).__name__} has no state yet and is not one of "
                f"{[c.__name__ for c in _ZERO_STATE]} (zero-initialised state); take one step before binding"
            )
        if isinstance(optimizer, torch.optim.SGD) and any(g.get("dampening", 0) for g in optimizer.param_groups):
            raise ValueError("SGD with dampening != 0 does not start from a zero momentum buffer")
        views = iter(self._views)
        slots = iter(self._slots)
        with torch.no_grad():
            for t in [*params, *buffers]:
                view, slot = next(views), next(slots)
                self._check(slot, t)
                view.copy_(t)
                t.data = view
            for p in params:
                view, slot = next(views), next(slots)
                view.zero_() if p.grad is None else view.copy_(p.grad)
                p.grad = view
            for p, indices in zip(params, self._state_slots, strict=True):
                state = optimizer.state.get(p, {})
                new = {}
                for i in indices:
                    view, slot = self._views[i], self._slots[i]
                    key = slot["name"].rsplit(".", 1)[1]
                    if key in state:
                        self._check(slot, state[key])
                        view.copy_(state[key])
                    else:
                        view.zero_()
                    new[key] = view
                optimizer.state[p] = new
        self.model, self.optimizer = model, optimizer
        return self

    @staticmethod
    def _check(slot: dict, t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(slot["shape"]) or t.dtype != slot["dtype"]:
            raise ValueError(
                f"{slot['name']}: tensor {tuple(t.shape)} {t.dtype} does not match the plan's "
                f"{tuple(slot['shape'])} {slot['dtype']}"
            )

    def _require_bound(self) -> None:
        if self.model is None:
            raise RuntimeError("bind(model, optimizer) first")

    # in-place operations ---------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every gradient with one memset of the gradient zone."""
        self.zones["gradient"].zero_()

    def save(self, *, gradients: bool = False) -> HeapSnapshot:
        """Copy the zones to host storage (one copy per zone). Gradients are skipped by default:
        after an optimizer step they are not needed (Section 3.3)."""
        self._require_bound()
        zones = {z: t.to("cpu", copy=True) for z, t in self.zones.items() if gradients or z != "gradient"}
        hyper = [{k: v for k, v in g.items() if k not in _HYPER_SKIP} for g in self.optimizer.param_groups]
        return HeapSnapshot(zones, hyper)

    def load(self, snapshot: HeapSnapshot) -> None:
        """Switch a saved model in: one copy per zone; a zone it lacks is zeroed (memset)."""
        self._require_bound()
        for zone, buffer in self.zones.items():
            saved = snapshot.zones.get(zone)
            if saved is None:
                buffer.zero_()
            elif saved.shape != buffer.shape:
                raise ValueError(f"snapshot zone {zone!r} has {saved.numel()} bytes, the heap {buffer.numel()}")
            else:
                buffer.copy_(saved)
        for group, hyper in zip(self.optimizer.param_groups, snapshot.hyper, strict=True):
            group.update(hyper)

    def reinit(self, seed: int | None = None, **hyper) -> None:
        """Re-initialise the bound model in place: zones zeroed, `reset_parameters()` of every
        submodule in construction order (under `seed`), optimizer hyperparameters updated.

        With the same seed this gives the bit-identical initial weights of a freshly built model
        whose modules initialise themselves in `reset_parameters` (torch's layers do).
        """
        self._require_bound()
        for buffer in self.zones.values():
            buffer.zero_()
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            for module in self.model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        for group in self.optimizer.param_groups:
            group.update(hyper)
