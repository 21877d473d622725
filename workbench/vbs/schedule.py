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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from .layers import LayerProfile

__all__ = ["Step", "Plan", "uniform_step", "check_request"]


@dataclass(frozen=True)
class Step:
    """One phase at one layer: `batch` samples through layer `layer`.

    `reserved` is memory held by other activations meanwhile (pending inputs, finished outputs,
    and for branch steps the group's input and output); `used` is this step's in + ws + out;
    `seconds` the predicted time of the step (branch steps included for a special layer).
    """

    layer: int
    batch: int
    reserved: int
    used: int
    seconds: float
    branches: tuple[tuple[Step, ...], ...] = ()

    @property
    def peak(self) -> int:
        inner = [s.peak for br in self.branches for s in br]
        return max([self.reserved + self.used, *inner])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["branches"] = [[s.to_dict() for s in br] for br in self.branches]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Step:
        return cls(int(d["layer"]), int(d["batch"]), int(d["reserved"]), int(d["used"]), float(d["seconds"]),
                   tuple(tuple(cls.from_dict(s) for s in br) for br in d.get("branches", [])))


@dataclass
class Plan:
    """A schedule of phases for a request of `batch` samples within `memory` units.

    `method` names the planner that made it: "vbs" (the paper's DP), "fbs" or "greedy".
    `steps` run in order; each takes the first `batch` samples waiting at its layer and appends
    its outputs to the next layer's queue. Save with `to_json`, reuse with `Plan.from_json`.
    """

    method: str
    memory: int
    batch: int
    unit_bytes: int
    names: list[str]
    steps: list[Step]

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
                           "steps": [s.to_dict() for s in self.steps]})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        return cls(d["method"], int(d["memory"]), int(d["batch"]), int(d["unit_bytes"]), list(d["names"]),
                   [Step.from_dict(s) for s in d["steps"]])

    def __repr__(self) -> str:
        return (f"Plan({self.method}, batch={self.batch}, memory={self.memory} units, peak={self.peak}, "
                f"{self.time_per_sample:.4g} s/sample, {len(self.steps)} steps)")


def check_request(layers: LayerProfile, memory: int | None, batch: int) -> None:
    """Raise early for tables that are not a LayerProfile, a batch outside 1..B or a negative budget."""
    if not isinstance(layers, LayerProfile):
        raise TypeError(f"layers must be a workbench.vbs.LayerProfile, got {type(layers).__name__}")
    if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= layers.max_batch:
        raise ValueError(f"batch must be an int in 1..{layers.max_batch} (the tables' B), got {batch!r}")
    if memory is not None and (not isinstance(memory, (int, np.integer)) or memory < 0):
        raise ValueError(f"memory must be an int >= 0 (units of {layers.unit_bytes} bytes), got {memory!r}")


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
