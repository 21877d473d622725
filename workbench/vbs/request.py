"""Planning for a request the caller keeps, and the memory a plan's first-batch check needs.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section III. The DP's OPT[1, n, b, mem] reserves in(1, b - b1) for the samples of the request that
wait at the first layer: it assumes the request is handed over sample by sample and every sample is
freed once the first layer consumed it (`Plan.request` "pieces", what `Executor` does with a list of
per-sample tensors). A caller who passes one tensor (`vbs.run(model, plan, x)`) keeps it alive for
the whole call: all of in(1, b) is held at every step and the first layer reads views of it
(request "kept"). Nothing else changes, so a kept request is planned exactly by the same planners on
tables whose first input is free (`without_request`: the views cost nothing) in a budget smaller by
the request, and the schedule found is lifted back (`lift`): every step holds the request, the
first layer's steps count their own samples inside it. FBS and Greedy-VBS are planned the same way.

# NOTE: the request is a constant on top of every step, so the shift is exact: a budget m serves a
# kept request exactly when m - in(1, b) serves the tables without it; `smallest_budget` adds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .flow import account, check_units, table_sizes
from .layers import LayerProfile
from .schedule import REQUESTS, Plan, Step

__all__ = ["checked_request", "held", "lift", "planned", "without_request"]


def checked_request(request: str) -> str:
    if request not in REQUESTS:
        raise ValueError(f"request must be one of {list(REQUESTS)} (handed over sample by sample, or a tensor the "
                         f"caller keeps), got {request!r}")
    return request


def held(layers: LayerProfile, batch: int) -> int:
    """Units a kept request of `batch` samples holds: in(1, batch)."""
    return int(layers.inp[0, batch - 1])


def without_request(layers: LayerProfile) -> LayerProfile:
    """`layers` with the first layer's input free (read as views of a request the caller keeps)."""
    inp = layers.inp.copy()
    inp[0] = 0
    return LayerProfile(layers.time, inp, layers.out, layers.ws, layers.names, layers.branches, layers.unit_bytes,
                        dict(layers.merge))


def _lift(step: Step, layers: LayerProfile, request: int, first: bool) -> Step:
    """`step`, planned without the request, holding it: the first layer's own samples count inside it."""
    mine = int(layers.inp[0, step.batch - 1]) if first and step.layer == 0 else 0
    inner = tuple(tuple(_lift(s, layers, request, False) for s in br) for br in step.branches)
    return replace(step, reserved=step.reserved + request - mine, used=step.used + mine, branches=inner, executed=0)


def lift(plan: Plan, layers: LayerProfile, memory: int) -> Plan:
    """`plan`, made on `without_request(layers)`, for a request kept by the caller: the same
    schedule on `layers` within `memory`, accounted for execution (`Plan.request` "kept")."""
    request = held(layers, plan.batch)
    steps = [_lift(s, layers, request, True) for s in plan.steps]
    kept = replace(plan, steps=steps, memory=int(memory), request="kept", check=check_units(layers))
    return account(kept, table_sizes(layers), request="kept")[0]


def planned(make: Callable[[LayerProfile, int], Plan], layers: LayerProfile, memory: int, batch: int,
            request: str) -> Plan:
    """`make(tables, memory)` for the request as handed over: as given for "pieces"; for "kept",
    on the tables without the request in `memory` less the request, lifted back."""
    if checked_request(request) == "pieces":
        return make(layers, memory)
    need = held(layers, batch)
    if memory < need:
        raise ValueError(f"memory={memory} units ({memory * layers.unit_bytes} bytes) is below the request the "
                         f"caller keeps: {batch} samples hold {need} units ({need * layers.unit_bytes} bytes)")
    try:
        inner = make(without_request(layers), memory - need)
    except ValueError as exc:
        raise ValueError(f"{exc} [for a request the caller keeps: these figures leave out its {need} units "
                         f"({need * layers.unit_bytes} bytes), which it holds on top of them]") from None
    return lift(inner, layers, memory)
