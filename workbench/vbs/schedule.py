"""Schedules of phases and their memory accounting, shared by the dynamic program and the baselines.

From "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Sections II and III: a request of b samples runs as a sequence of *phases*; each phase takes
some samples waiting at one layer and runs that layer on them (Figs 3 and 4). A `Step` is one
phase with the memory it uses and the memory other activations hold meanwhile; a `Plan` is the
whole schedule, whichever planner made it (`method`: "vbs" for the paper's DP, "fbs" or
"greedy" for the baselines of Section IV).

The accounting is the DP's (recurrences (1)-(3)): a step at layer L_i with batch q uses
in(i, q) + ws(i, q) + out(i, q); pending inputs and finished outputs are `reserved`; a special
layer (branch group) holds its group input and output while its branches run, each branch step
counted on top of them (`uniform_step` builds one such step for the baselines).

The request. The paper's OPT[1, n, b, mem] reserves in(1, b - b1) for the request's pending
samples: a request handed over sample by sample, each freed once consumed (`Plan.request` =
"pieces"). A request the caller keeps (one tensor, alive for the whole call) holds in(1, b) at every
step, the first layer reading views of it ("kept", `workbench.vbs.request`). Either way a step's
`used` is in + ws + out, the first layer's input included.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from .layers import LayerProfile

__all__ = ["METHODS", "REQUESTS", "Step", "Plan", "uniform_step", "check_request"]

METHODS = ("vbs", "fbs", "greedy")  # the planners that make plans: the DP and the two baselines
REQUESTS = ("pieces", "kept")  # how a plan's request is handed over: sample by sample, or kept by the caller


@dataclass(frozen=True)
class Step:
    """One phase at one layer: `batch` samples through layer `layer`.

    `reserved` is memory held by other activations meanwhile (pending inputs, finished outputs,
    and for branch steps the group's input and output); `used` is this step's in + ws + out;
    `seconds` the predicted time of the step (branch steps included for a special layer).
    `executed` is the executor's live memory at its highest during the step, its copies included
    (`workbench.vbs.flow`; 0 where the plan was not accounted for execution).
    """

    layer: int
    batch: int
    reserved: int
    used: int
    seconds: float
    branches: tuple[tuple[Step, ...], ...] = ()
    executed: int = 0

    @property
    def peak(self) -> int:
        """The DP's accounting (reserved + used) or the executor's, whichever is higher."""
        inner = [s.peak for br in self.branches for s in br]
        return max([self.reserved + self.used, self.executed, *inner])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["branches"] = [[s.to_dict() for s in br] for br in self.branches]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Step:
        return cls(int(d["layer"]), int(d["batch"]), int(d["reserved"]), int(d["used"]), float(d["seconds"]),
                   tuple(tuple(cls.from_dict(s) for s in br) for br in d.get("branches", [])),
                   int(d.get("executed", 0)))


@dataclass
class Plan:
    """A schedule of phases for a request of `batch` samples within `memory` units.

    `method` names the planner that made it: "vbs" (the paper's DP), "fbs" or "greedy".
    `steps` run in order; each takes the first `batch` samples waiting at its layer and appends
    its outputs to the next layer's queue. `request` is how the plan counts its request: "pieces"
    (handed over sample by sample, each freed once consumed: the paper's accounting) or "kept" (a
    tensor the caller keeps for the whole call). `check` is the memory of one sample through the
    model in the same unit (in + ws + out of its hungriest layer at batch 1, every branch output of
    a group held as the model's own forward holds them): what the executor's first-batch check
    adds; 0 where unknown. Save with `to_json`, reuse with `Plan.from_json`.
    """

    method: str
    memory: int
    batch: int
    unit_bytes: int
    names: list[str]
    steps: list[Step]
    request: str = "pieces"
    check: int = 0

    @property
    def time_per_sample(self) -> float:
        """Predicted seconds per sample (profile times summed over the schedule)."""
        return sum(s.seconds for s in self.steps) / self.batch

    @property
    def peak(self) -> int:
        """Predicted peak memory in units (the DP's accounting; never above `memory`)."""
        return max(s.peak for s in self.steps)

    @property
    def peak_bytes(self) -> int:
        return self.peak * self.unit_bytes

    @property
    def layer_batches(self) -> dict[str, list[int]]:
        """For each main-path layer, the batch sizes of its phases, in order."""
        out: dict[str, list[int]] = {name: [] for name in self.names}
        for s in self.steps:
            out[self.names[s.layer]].append(s.batch)
        return out

    @property
    def max_batch_used(self) -> int:
        return max(s.batch for s in self.steps)

    def to_frame(self) -> pd.DataFrame:
        """Per main-path layer: phases, batch sizes, predicted peak and unused memory, time."""
        rows = []
        for i, name in enumerate(self.names):
            steps = [s for s in self.steps if s.layer == i]
            peak = max(s.peak for s in steps)
            rows.append({"layer": i, "name": name, "phases": len(steps), "batches": [s.batch for s in steps],
                         "peak_units": peak, "unused_units": self.memory - peak,
                         "peak_bytes": peak * self.unit_bytes,
                         "unused_bytes": (self.memory - peak) * self.unit_bytes,
                         "seconds": sum(s.seconds for s in steps),
                         "seconds_per_sample": sum(s.seconds for s in steps) / self.batch})
        return pd.DataFrame(rows)

    def to_json(self) -> str:
        return json.dumps({"method": self.method, "memory": self.memory, "batch": self.batch,
                           "unit_bytes": self.unit_bytes, "names": self.names,
                           "steps": [s.to_dict() for s in self.steps], "request": self.request, "check": self.check})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan `to_json` wrote; ValueError naming the field and value of anything else.

        Checked: every key present (and no other; `request` and `check` may be absent, in a plan
        saved before they were: "pieces" and 0), `method` a planner's name, `memory` >= 0,
        `unit_bytes` and `batch` >= 1, every step at a layer of the model with a batch in 1..`batch`,
        and every layer (and branch layer) given all the samples of its request exactly once.
        """
        try:
            d = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
            raise ValueError(f"Plan.from_json needs the text Plan.to_json writes: {exc}") from None
        _keys(d, ("method", "memory", "batch", "unit_bytes", "names", "steps")
              + tuple(k for k in ("request", "check") if isinstance(d, dict) and k in d), "plan")
        if d["method"] not in METHODS:
            raise ValueError(f"plan 'method' must be one of {list(METHODS)}, got {d['method']!r}")
        memory, batch = _count(d["memory"], "plan 'memory'", 0), _count(d["batch"], "plan 'batch'", 1)
        unit_bytes = _count(d["unit_bytes"], "plan 'unit_bytes'", 1)
        names = d["names"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"plan 'names' must be a non-empty list of layer names, got {str(names)[:80]}")
        if not isinstance(d["steps"], list) or not d["steps"]:
            raise ValueError(f"plan 'steps' must be a non-empty list, got {str(d['steps'])[:80]}")
        steps = [_step(s, f"steps[{k}]", len(names), batch) for k, s in enumerate(d["steps"])]
        _conserved(steps, range(len(names)), batch, "plan", names)
        request = d.get("request", "pieces")
        if request not in REQUESTS:
            raise ValueError(f"plan 'request' must be one of {list(REQUESTS)}, got {request!r}")
        return cls(d["method"], memory, batch, unit_bytes, list(names), steps, request,
                   _count(d.get("check", 0), "plan 'check'", 0))

    def __repr__(self) -> str:
        kept = ", request kept" if self.request == "kept" else ""
        return (f"Plan({self.method}, batch={self.batch}{kept}, memory={self.memory} units, peak={self.peak}, "
                f"{self.time_per_sample:.4g} s/sample, {len(self.steps)} steps)")


def _keys(d, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object with keys {list(keys)}, got {type(d).__name__}")
    missing, extra = [k for k in keys if k not in d], sorted(set(d) - set(keys))
    if missing or extra:
        raise ValueError(f"{where} must have the keys {list(keys)}; missing {missing}, unknown {extra}")


def _count(value, what: str, least: int) -> int:
    if type(value) is not int or value < least:
        raise ValueError(f"{what} must be an int >= {least}, got {value!r}")
    return value


def _step(d, where: str, n_layers: int, batch: int, layers: str = "the plan's layers") -> Step:
    """One step of a plan's JSON, its layer in 0..n_layers-1 and its batch in 1..batch."""
    keys = ("layer", "batch", "reserved", "used", "seconds") + tuple(k for k in ("branches", "executed") if k in d)
    _keys(d, keys, where)
    layer = _count(d["layer"], f"{where} 'layer'", 0)
    if layer >= n_layers:
        raise ValueError(f"{where} 'layer' must be in 0..{n_layers - 1} ({layers}), got {layer}")
    q = _count(d["batch"], f"{where} 'batch'", 1)
    if q > batch:
        raise ValueError(f"{where} 'batch' must be in 1..{batch} (the request), got {q}")
    seconds = d["seconds"]
    if type(seconds) not in (int, float) or not 0 <= seconds < float("inf"):
        raise ValueError(f"{where} 'seconds' must be a finite number >= 0, got {seconds!r}")
    branches = d.get("branches", [])
    if not isinstance(branches, list) or not all(isinstance(br, list) for br in branches):
        raise ValueError(f"{where} 'branches' must be a list of lists of steps, got {str(branches)[:80]}")
    parts = []
    for j, br in enumerate(branches):
        inner = [_step(s, f"{where} branch {j} step {k}", len(br), q, f"a branch of {len(br)} steps")
                 for k, s in enumerate(br)]
        _conserved(inner, range(max((s.layer for s in inner), default=-1) + 1), q, f"{where} branch {j}")
        parts.append(tuple(inner))
    return Step(layer, q, _count(d["reserved"], f"{where} 'reserved'", 0), _count(d["used"], f"{where} 'used'", 0),
                float(seconds), tuple(parts), _count(d.get("executed", 0), f"{where} 'executed'", 0))


def _conserved(steps: list[Step], layers: range, batch: int, where: str, names: list[str] | None = None) -> None:
    """Every layer's phases take the request's `batch` samples exactly: no sample lost or run twice."""
    for i in layers:
        total = sum(s.batch for s in steps if s.layer == i)
        if total != batch:
            name = f" ({names[i]!r})" if names else ""
            raise ValueError(f"{where}: layer {i}{name} runs {total} samples in its steps, the request has {batch}")


def check_request(layers: LayerProfile, memory: int | None, batch: int, *, budget: bool = False) -> None:
    """Raise early for tables that are not a LayerProfile, a batch outside 1..B or a negative budget (or none,
    where `budget` says the planner needs one)."""
    if not isinstance(layers, LayerProfile):
        raise TypeError(f"layers must be a workbench.vbs.LayerProfile, got {type(layers).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= layers.max_batch:
        raise ValueError(f"batch must be an int in 1..{layers.max_batch} (the tables' B), got {batch!r}")
    if memory is None and budget:
        raise ValueError(f"memory must be an int >= 0 (units of {layers.unit_bytes} bytes), got None")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, np.integer)) or memory < 0):
        raise ValueError(f"memory must be an int >= 0 (units of {layers.unit_bytes} bytes), got {memory!r}")
    if memory is not None and memory * layers.unit_bytes > 2**63 - 1:  # numpy's int64 tables hold no more
        raise ValueError(f"memory must be at most 2**63-1 bytes ({(2**63 - 1) // layers.unit_bytes} units of "
                         f"{layers.unit_bytes} bytes), got {memory!r}")


def uniform_step(layers: LayerProfile, layer: int, q: int, reserved: int) -> Step:
    """Layer `layer` at batch `q` in one phase (branches too, each at `q`), `reserved` held meanwhile."""
    b = q - 1
    if layer not in layers.branches:
        used = int(layers.inp[layer, b] + layers.ws[layer, b] + layers.out[layer, b])
        return Step(layer, q, reserved, used, q * float(layers.time[layer, b]))
    group = int(layers.inp[layer, b] + layers.out[layer, b])
    branches = []
    for part in layers.branches[layer]:
        steps = []
        for k in range(part.n_layers):
            inp = 0 if k == 0 else int(part.inp[k, b])
            steps.append(Step(k, q, reserved + group, inp + int(part.ws[k, b] + part.out[k, b]),
                              q * float(part.time[k, b])))
        branches.append(tuple(steps))
    seconds = q * float(layers.time[layer, b]) + sum(s.seconds for br in branches for s in br)
    return Step(layer, q, reserved, group, seconds, tuple(branches))
