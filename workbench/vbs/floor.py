"""The smallest memory budget in which each planner can serve a request, and the nested schedule
that needs the least memory.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section III: the DP's table OPT[i, j, b, mem] is finite exactly when `mem` is at least the
smallest *peak* of a nested schedule of b samples through L_i..L_j, because more memory never
makes a schedule infeasible. That smallest peak follows the DP's recurrences with the maximum of
the parts' peaks in place of the sum of their times and no memory axis:

- exact(i, j, b) = min over k of max(opt(i, k-1, b), need(k, b), opt(k+1, j, b))      (1)
- opt(i, j, b)   = min over b1 of max(in(i, b-b1) + exact(i, j, b1), out(j, b1) + opt(i, j, b-b1))  (2)
- need(k, b)     = in + ws + out of layer k at batch b                                   (3)

and for a special layer, the group's input and output plus the largest of its branches' peaks.
So the DP's smallest feasible budget is found exactly in any unit, even bytes, where the DP's own
tables (one column per memory unit) would be far too large. `least_memory_plan` is a schedule
with that peak (the DP's space, method "vbs"; not the fastest one, which needs the full DP).
FBS's floor is its smallest peak over batch sizes, Greedy-VBS's the largest over layers of the
smallest peak that layer can run at; `smallest_budget(..., method="any")` is the least of the
three: the smallest budget `plan` accepts.
"""

from __future__ import annotations

import numpy as np

from .baselines import _greedy_layer, fbs_peak
from .layers import LayerProfile
from .schedule import Plan, Step, check_request

__all__ = ["smallest_budget", "least_memory_plan", "METHOD_NAMES"]

METHOD_NAMES = ("dp", "fbs", "greedy", "any")


def padded(t: np.ndarray) -> np.ndarray:
    """Prepend a zero column so that index b means batch size b (0 = nothing)."""
    return np.concatenate([np.zeros((t.shape[0], 1), dtype=t.dtype), t], axis=1)


def need(p: LayerProfile, *, first_in: bool = True) -> np.ndarray:
    """in + ws + out per layer and batch (padded); a branch's first input is the group's."""
    inp = p.inp.copy()
    if not first_in and p.n_layers:
        inp[0] = 0
    return padded(inp + p.ws + p.out)


def reserves(p: LayerProfile, *, branch: bool) -> tuple[np.ndarray, np.ndarray]:
    """Memory held by pending inputs and finished outputs (padded); a branch's first input and
    last output are held by its group."""
    in_res, out_res = padded(p.inp), padded(p.out)
    if branch and p.n_layers:
        in_res[0], out_res[-1] = 0, 0
    return in_res, out_res


class _PeakChain:
    """Smallest peaks of one linear chain, opt[d][i, b] and exact[d][i, b] for L_i..L_{i+d}."""

    def __init__(self, base: np.ndarray, in_res: np.ndarray, out_res: np.ndarray) -> None:
        n, B1 = base.shape
        self.n, self.base, self.in_res, self.out_res = n, base, in_res, out_res
        self.opt: list[np.ndarray] = []
        self.exact: list[np.ndarray] = []
        for d in range(n):
            rows = n - d
            exact = np.full((rows, B1), np.inf)
            for t in range(d + 1):  # (1): layer i + t runs the whole batch
                cand = base[t:t + rows]
                if t >= 1:
                    cand = np.maximum(cand, self.opt[t - 1][:rows])
                if t < d:
                    cand = np.maximum(cand, self.opt[d - t - 1][t + 1:t + 1 + rows])
                np.minimum(exact, cand, out=exact)
            opt = np.zeros((rows, B1))
            in_i, out_j = in_res[:rows], out_res[d:d + rows]
            for b in range(1, B1):  # (2): a first phase of b1, then the rest
                b1 = np.arange(1, b + 1)
                total = in_i[:, b - b1] + exact[:, 1:b + 1]
                if b > 1:
                    r = b1[:-1]
                    total[:, :-1] = np.maximum(total[:, :-1], out_j[:, r] + opt[:, b - r])
                opt[:, b] = total.min(axis=1)
            self.opt.append(opt)
            self.exact.append(exact)

    def at(self, i: int, j: int, b: int) -> float:
        return 0.0 if i > j or b == 0 else float(self.opt[j - i][i, b])

    def value(self, b: int) -> float:
        return self.at(0, self.n - 1, b)


class _LeastMemory:
    """The smallest-peak DP of `layers` for batch 1..B and its reconstruction."""

    def __init__(self, layers: LayerProfile) -> None:
        self.layers = layers
        self.need = need(layers).astype(np.float64)
        base = self.need.copy()
        self.branch: dict[int, list[tuple[_PeakChain, np.ndarray]]] = {}
        for s, parts in layers.branches.items():
            chains = []
            inner = np.zeros(layers.max_batch + 1)
            for p in parts:
                n_p = need(p, first_in=False)
                chain = _PeakChain(n_p.astype(np.float64), *reserves(p, branch=True))
                chains.append((chain, n_p))
                if p.n_layers:
                    inner = np.maximum(inner, chain.opt[p.n_layers - 1][0])
            base[s] = padded(layers.inp[s][None] + layers.out[s][None])[0] + inner
            self.branch[s] = chains
        base[:, 0] = np.inf
        self.main = _PeakChain(base, *reserves(layers, branch=False))

    def plan(self, batch: int, memory: int | None) -> Plan:
        steps = self._opt(self.main, None, 0, self.main.n - 1, batch, 0)
        peak = int(self.main.value(batch))
        return Plan("vbs", peak if memory is None else int(memory), int(batch), self.layers.unit_bytes,
                    list(self.layers.names), steps)

    # reconstruction: the choices of (2) and (1) that reach the smallest peak
    def _opt(self, c: _PeakChain, where, i: int, j: int, b: int, reserved: int) -> list[Step]:
        if i > j or b == 0:
            return []
        peaks = [max(c.in_res[i, b - b1] + c.exact[j - i][i, b1],
                     c.out_res[j, b1] + c.at(i, j, b - b1) if b1 < b else 0.0) for b1 in range(1, b + 1)]
        b1 = b - int(np.argmin(peaks[::-1]))  # the largest first phase among the best
        first = self._exact(c, where, i, j, b1, reserved + int(c.in_res[i, b - b1]))
        return first + self._opt(c, where, i, j, b - b1, reserved + int(c.out_res[j, b1]))

    def _exact(self, c: _PeakChain, where, i: int, j: int, b: int, reserved: int) -> list[Step]:
        peaks = [max(c.at(i, k - 1, b), c.base[k, b], c.at(k + 1, j, b)) for k in range(i, j + 1)]
        k = i + int(np.argmin(peaks))
        return (self._opt(c, where, i, k - 1, b, reserved) + [self._leaf(where, k, b, reserved)]
                + self._opt(c, where, k + 1, j, b, reserved))

    def _leaf(self, where, k: int, b: int, reserved: int) -> Step:
        p = self.layers
        if where is not None:  # layer k of branch a of special layer s
            s, a = where
            chain, n_p = self.branch[s][a]
            return Step(k, b, reserved, int(n_p[k, b]), b * float(p.branches[s][a].time[k, b - 1]))
        if k not in p.branches:
            return Step(k, b, reserved, int(self.need[k, b]), b * float(p.time[k, b - 1]))
        group = int(p.inp[k, b - 1] + p.out[k, b - 1])
        branches = tuple(tuple(self._opt(chain, (k, a), 0, chain.n - 1, b, reserved + group))
                         for a, (chain, _) in enumerate(self.branch[k]))
        seconds = b * float(p.time[k, b - 1]) + sum(x.seconds for br in branches for x in br)
        return Step(k, b, reserved, group, seconds, branches)


def _greedy_floor(layers: LayerProfile, batch: int) -> int:
    return max(min(max(s.peak for s in _greedy_layer(layers, i, g, batch)) for g in range(1, batch + 1))
               for i in range(layers.n_layers))


def smallest_budget(layers: LayerProfile, *, batch: int, method: str = "any") -> int:
    """The smallest memory (in `layers`' units) in which `method` serves a request of `batch`:
    "dp" (the DP, `dp`), "fbs", "greedy" (`greedy_vbs`) or "any" (the least of the three, the
    smallest budget `plan` accepts). Exact, computed without the DP's memory axis."""
    check_request(layers, None, batch)
    if method not in METHOD_NAMES:
        raise ValueError(f"method must be one of {METHOD_NAMES}, got {method!r}")
    found = {}
    if method in ("dp", "any"):
        found["dp"] = int(_LeastMemory(layers).main.value(batch))
    if method in ("fbs", "any"):
        found["fbs"] = min(fbs_peak(layers, batch=batch, size=q) for q in range(1, batch + 1))
    if method in ("greedy", "any"):
        found["greedy"] = _greedy_floor(layers, batch)
    return min(found.values())


def least_memory_plan(layers: LayerProfile, *, batch: int, memory: int | None = None) -> Plan:
    """A nested schedule (method "vbs") whose peak is the DP's smallest feasible budget; among
    equally small peaks it takes the largest first phases. Raises ValueError if `memory` is
    given and smaller than that peak. `Plan.memory` is `memory`, else the peak."""
    check_request(layers, memory, batch)
    solver = _LeastMemory(layers)
    peak = int(solver.main.value(batch))
    if memory is not None and memory < peak:
        raise ValueError(f"memory={memory} units is below the smallest peak of any nested schedule, {peak} units")
    return solver.plan(batch, memory)
