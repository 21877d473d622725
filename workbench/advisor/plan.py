"""One candidate's memory in the advisor (`Plans`): its program's CalcGraph plan, calibrated where its precision was,
and the optimizer state it holds beyond that program's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.calcgraph import CompiledGraph

__all__ = ["CATEGORIES", "Plan"]

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "workspace")
_KINDS = {"parameter": "weights", "buffer": "weights", "gradient": "gradients", "state": "optimizer_state",
          "input": "activations", "activation": "activations"}


@dataclass
class Plan:
    """One candidate's memory: its program's plan (calibrated where its precision was) and the state bytes it
    holds beyond that program's."""

    graph: CompiledGraph
    offset: int = 0
    # NOTE: the program's peak per batch, shared by every candidate that runs it (`Plans.plan`): the table's
    # largest-batch search asks each of 48 candidates ~20 batches, and a ResNet-50 timeline takes ~10 ms
    memo: dict = field(default_factory=dict, repr=False)

    def _program_peak(self, batch_size: int) -> int:
        key = (id(self.graph), batch_size)  # graphs live as long as their `Plans`; cleared where recalibrated
        if key not in self.memo:
            self.memo[key] = self.graph.required_bytes(batch_size)
        return self.memo[key]

    def peak(self, batch_size: int) -> int:
        return self._program_peak(batch_size) + self.offset

    def fits(self, batch_size: int, cap: float) -> bool:
        return self.peak(batch_size) <= cap

    def held_bytes(self, batch_size: int) -> int:
        """The most bytes of weights, gradients and optimizer state live at one moment of the program (the state
        this candidate holds beyond its program's included): none of them depends on the batch, and each program
        holds them at the same moments of its steps, so no batch's peak is below this."""
        key = (id(self.graph), batch_size, "held")
        if key not in self.memo:
            frame = self.graph.variables(batch_size)
            kept = frame[frame["kind"].isin(("parameter", "buffer", "gradient", "state"))]
            change = np.zeros(int(frame["died"].to_numpy().max(initial=0)) + 2, dtype=np.int64)
            np.add.at(change, kept["born"].to_numpy().clip(0), kept["bytes"].to_numpy())
            np.add.at(change, kept["died"].to_numpy(), -kept["bytes"].to_numpy())
            self.memo[key] = int(np.cumsum(change).max(initial=0))
        return self.memo[key] + self.offset

    def categories(self, batch_size: int) -> dict[str, int]:
        """Bytes live at the predicted peak by category: a checkpoint's recomputed tensors (the graph's
        `recomputed` allocation ids) are activations, the calibrated scratch workspace."""
        key = (id(self.graph), batch_size, "categories")  # shared by the candidates that run the program
        if key not in self.memo:
            frame = self.graph.variables(batch_size)
            tensors, live = self.graph.timeline(batch_size), self.graph.live_bytes(batch_size)
            at = int(live.argmax()) if len(live) else 0
            alive = frame[(frame["born"] <= at) & (frame["died"] > at)]
            again = alive.index.isin(list(_recomputed(self.graph))) & (alive["kind"] == "temporary")
            self.memo[key] = dict.fromkeys(CATEGORIES, 0)
            for kind, nbytes in alive["bytes"].groupby(alive["kind"].where(~again, "activation")).sum().items():
                self.memo[key][_KINDS.get(kind, "workspace")] += int(nbytes)
            self.memo[key]["workspace"] += int(live[at] - tensors[at]) if len(live) else 0  # the kernel's scratch
        out = dict(self.memo[key])
        out["optimizer_state"] += self.offset
        return out


def _recomputed(graph: CompiledGraph) -> set[int]:
    """Ids of the allocations `graph`'s traces tag `recomputed` (a checkpoint's recomputation: `workload`)."""
    return {i for trace in graph._exact.values() for i, info in enumerate(trace.info) if info.get("recomputed")}
