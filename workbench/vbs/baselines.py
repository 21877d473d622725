"""The two baselines of "Variable batch size across layers for efficient prediction on CNNs"
(Choudhury et al.), Section IV: Fixed Batch Size (FBS) and Greedy-VBS.

- FBS: every layer uses one batch size, the largest for which the whole request fits.
- Greedy-VBS: layer i starts only when layer i-1 has processed all r samples; each layer
  processes the r samples with the largest batch it can afford while the inputs and outputs of
  all r samples are resident at that layer (infeasible when they alone do not fit).

# NOTE: both are scored with exactly the DP's memory accounting (`workbench.vbs.plan`): pending
# inputs of the request and finished outputs stay resident, chunk by chunk, and a branch group
# holds its input and output while its branches run. FBS is therefore a schedule the DP also
# considers, so the DP is never slower than FBS (a test checks it); Greedy-VBS processes a layer
# in phases smaller than the request without passing them on, which is outside the DP's space.
"""

from __future__ import annotations

import numpy as np

from .plan import Plan, Step
from .profile import Profile

__all__ = ["fbs", "greedy_vbs", "fbs_peak", "fixed_batch_plan", "uniform_step"]


def _check(profile: Profile, memory: int | None, batch: int) -> None:
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a workbench.vbs.Profile, got {type(profile).__name__}")
    if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= profile.max_batch:
        raise ValueError(f"batch must be an int in 1..{profile.max_batch} (the profile's B), got {batch!r}")
    if memory is not None and (not isinstance(memory, (int, np.integer)) or memory < 0):
        raise ValueError(f"memory must be an int >= 0 (units of {profile.unit_bytes} bytes), got {memory!r}")


def uniform_step(profile: Profile, layer: int, q: int, reserved: int) -> Step:
    """Layer `layer` at batch `q` in one phase (branches too, each at `q`)."""
    b = q - 1
    if layer not in profile.branches:
        used = int(profile.inp[layer, b] + profile.ws[layer, b] + profile.out[layer, b])
        return Step(layer, q, reserved, used, q * float(profile.time[layer, b]))
    group = int(profile.inp[layer, b] + profile.out[layer, b])
    branches = []
    for part in profile.branches[layer]:
        steps = []
        for k in range(part.n_layers):
            inp = 0 if k == 0 else int(part.inp[k, b])
            steps.append(Step(k, q, reserved + group, inp + int(part.ws[k, b] + part.out[k, b]),
                              q * float(part.time[k, b])))
        branches.append(tuple(steps))
    seconds = q * float(profile.time[layer, b]) + sum(s.seconds for br in branches for s in br)
    return Step(layer, q, reserved, group, seconds, tuple(branches))


def fixed_batch_plan(profile: Profile, *, batch: int, size: int, memory: int | None = None) -> Plan:
    """All layers at batch `size` (phases of `size`, the last one the remainder), not checked
    against a budget; its `peak` is the memory it needs under the DP's accounting."""
    _check(profile, memory, batch)
    if not isinstance(size, (int, np.integer)) or not 1 <= size <= batch:
        raise ValueError(f"size must be an int in 1..{batch} (the request), got {size!r}")
    n, last = profile.n_layers, profile.n_layers - 1
    steps, done, finished = [], 0, 0
    while done < batch:
        q = min(size, batch - done)
        pending = batch - done - q
        reserved = (int(profile.inp[0, pending - 1]) if pending else 0) + finished
        steps.extend(uniform_step(profile, i, q, reserved) for i in range(n))
        finished += int(profile.out[last, q - 1])
        done += q
    plan = Plan("fbs", 0, int(batch), profile.unit_bytes, list(profile.names), steps)
    plan.memory = int(memory) if memory is not None else plan.peak
    return plan


def fbs_peak(profile: Profile, *, batch: int, size: int) -> int:
    """Memory units FBS needs for a request of `batch` at fixed batch `size`."""
    return fixed_batch_plan(profile, batch=batch, size=size).peak


def fbs(profile: Profile, *, memory: int, batch: int) -> Plan:
    """Fixed batch size: the largest batch size whose schedule fits in `memory` units."""
    _check(profile, memory, batch)
    for size in range(batch, 0, -1):
        p = fixed_batch_plan(profile, batch=batch, size=size, memory=memory)
        if p.peak <= memory:
            return p
    need = fbs_peak(profile, batch=batch, size=1)
    raise ValueError(f"FBS is infeasible: memory={memory} units ({memory * profile.unit_bytes} bytes) for a "
                     f"request of {batch}; batch size 1 needs {need} units ({need * profile.unit_bytes} bytes)")


def greedy_vbs(profile: Profile, *, memory: int, batch: int) -> Plan:
    """Greedy-VBS: layer by layer over all `batch` samples, each with its largest feasible batch."""
    _check(profile, memory, batch)
    steps: list[Step] = []
    for i in range(profile.n_layers):
        chosen = None
        for g in range(batch, 0, -1):
            trial, done, finished = [], 0, 0
            while done < batch:
                q = min(g, batch - done)
                pending = batch - done - q
                reserved = (int(profile.inp[i, pending - 1]) if pending else 0) + finished
                trial.append(uniform_step(profile, i, q, reserved))
                finished += int(profile.out[i, q - 1])
                done += q
            if max(s.peak for s in trial) <= memory:
                chosen = trial
                break
        if chosen is None:
            hold = int(profile.inp[i, batch - 1] + profile.out[i, batch - 1])
            raise ValueError(f"Greedy-VBS is infeasible: memory={memory} units ({memory * profile.unit_bytes} "
                             f"bytes) for a request of {batch}; layer {profile.names[i]!r} holds {hold} units of "
                             f"inputs and outputs for all {batch} samples and cannot run even one sample")
        steps.extend(chosen)
    return Plan("greedy", int(memory), int(batch), profile.unit_bytes, list(profile.names), steps)
