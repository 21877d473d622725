"""The two baselines of "Variable batch size across layers for efficient prediction on CNNs"
(Choudhury et al.), Section IV: Fixed Batch Size (FBS) and Greedy-VBS.

- FBS: every layer uses one batch size, the largest for which the whole request fits.
- Greedy-VBS: layer i starts only when layer i-1 has processed all r samples; each layer
  processes the r samples with the largest batch it can afford while the inputs and outputs of
  all r samples are resident at that layer (infeasible when they alone do not fit).

# NOTE: both are scored with exactly the DP's memory accounting (`workbench.vbs.schedule`):
# pending inputs of the request and finished outputs stay resident, chunk by chunk, and a branch
# group holds its input and output while its branches run; and, like the DP's plans, with the
# executor's copies (`workbench.vbs.flow`): a plan's peak is what the executor allocates. FBS is a
# schedule the DP also considers, so the DP is never slower than FBS (a test checks it);
# Greedy-VBS processes a layer in phases smaller than the request without passing them on,
# which is outside the DP's space of nested schedules, so Greedy-VBS is sometimes faster.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .flow import Flow, account, check_units, table_sizes
from .layers import LayerProfile
from .request import planned
from .schedule import Plan, Step, check_request, uniform_step

__all__ = ["fbs", "greedy_vbs", "fbs_peak", "fixed_batch_plan"]


def fixed_batch_plan(layers: LayerProfile, *, batch: int, size: int, memory: int | None = None) -> Plan:
    """All layers at batch `size` (phases of `size`, the last one the remainder), not checked
    against a budget; its `peak` is the memory it needs (the DP's accounting, executed)."""
    check_request(layers, memory, batch)
    if not isinstance(size, (int, np.integer)) or not 1 <= size <= batch:
        raise ValueError(f"size must be an int in 1..{batch} (the request), got {size!r}")
    n, last = layers.n_layers, layers.n_layers - 1
    steps, done, finished = [], 0, 0
    while done < batch:
        q = min(size, batch - done)
        pending = batch - done - q
        reserved = (int(layers.inp[0, pending - 1]) if pending else 0) + finished
        steps.extend(uniform_step(layers, i, q, reserved) for i in range(n))
        finished += int(layers.out[last, q - 1])
        done += q
    bare = Plan("fbs", 0, int(batch), layers.unit_bytes, list(layers.names), steps, check=check_units(layers))
    plan, _ = account(bare, table_sizes(layers))
    plan.memory = int(memory) if memory is not None else plan.peak
    return plan


def fbs_peak(layers: LayerProfile, *, batch: int, size: int) -> int:
    """Memory units FBS needs for a request of `batch` at fixed batch `size`."""
    return fixed_batch_plan(layers, batch=batch, size=size).peak


def fbs(layers: LayerProfile, *, memory: int, batch: int, request: str = "pieces") -> Plan:
    """Fixed batch size: the largest batch size whose schedule fits in `memory` units, for the
    request handed over sample by sample ("pieces") or kept by the caller ("kept", `vbs.request`)."""
    check_request(layers, memory, batch, budget=True)
    return planned(lambda t, m: _fbs(t, m, batch), layers, memory, batch, request)


def _fbs(layers: LayerProfile, memory: int, batch: int) -> Plan:
    for size in range(batch, 0, -1):
        p = fixed_batch_plan(layers, batch=batch, size=size, memory=memory)
        if p.peak <= memory:
            return p
    need = fbs_peak(layers, batch=batch, size=1)
    raise ValueError(f"FBS is infeasible: memory={memory} units ({memory * layers.unit_bytes} bytes) for a "
                     f"request of {batch}; batch size 1 needs {need} units ({need * layers.unit_bytes} bytes)")


def _greedy_layer(layers: LayerProfile, i: int, g: int, batch: int) -> list[Step]:
    """Layer `i` over all `batch` samples in phases of `g`, the inputs and outputs of all resident."""
    steps, done, finished = [], 0, 0
    while done < batch:
        q = min(g, batch - done)
        pending = batch - done - q
        reserved = (int(layers.inp[i, pending - 1]) if pending else 0) + finished
        steps.append(uniform_step(layers, i, q, reserved))
        finished += int(layers.out[i, q - 1])
        done += q
    return steps


def greedy_vbs(layers: LayerProfile, *, memory: int, batch: int, request: str = "pieces") -> Plan:
    """Greedy-VBS: layer by layer over all `batch` samples, each with its largest feasible batch;
    `request` as in `fbs`."""
    check_request(layers, memory, batch, budget=True)
    return planned(lambda t, m: _greedy(t, m, batch), layers, memory, batch, request)


def _greedy(layers: LayerProfile, memory: int, batch: int) -> Plan:
    steps: list[Step] = []
    flow = Flow(table_sizes(layers), batch)
    last = layers.n_layers - 1
    for i in range(layers.n_layers):
        for g in range(batch, 0, -1):
            trial = flow.copy()  # the layer's phases follow the previous layer's chunks
            done = [trial.run(s) for s in _greedy_layer(layers, i, g, batch)]
            if max(max(s.peak for s in done), trial.finish(layers.n_layers) if i == last else 0) <= memory:
                flow = trial
                steps.extend(done)
                break
        else:
            hold = int(layers.inp[i, batch - 1] + layers.out[i, batch - 1])
            raise ValueError(f"Greedy-VBS is infeasible: memory={memory} units ({memory * layers.unit_bytes} "
                             f"bytes) for a request of {batch}; layer {layers.names[i]!r} holds {hold} units of "
                             f"inputs and outputs for all {batch} samples and fits at no batch size (the "
                             f"executor's copies counted)")
    steps[-1] = replace(steps[-1], executed=max(steps[-1].executed, flow.finish(layers.n_layers)))
    return Plan("greedy", int(memory), int(batch), layers.unit_bytes, list(layers.names), steps,
                check=check_units(layers))
