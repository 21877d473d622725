"""The nested schedule that needs the least memory, and the smallest budgets of the baselines.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section III: the DP's table OPT[i, j, b, mem] is finite exactly when `mem` is at least the
smallest *peak* of a nested schedule of b samples through L_i..L_j, because more memory never
makes a schedule infeasible. That smallest peak follows the DP's recurrences with the maximum of
the parts' peaks in place of the sum of their times and no memory axis:

- exact(i, j, b) = min over k of max(opt(i, k-1, b), need(k, b), opt(k+1, j, b))      (1)
- opt(i, j, b)   = min over b1 of max(in(i, b-b1) + exact(i, j, b1), out(j, b1) + opt(i, j, b-b1))  (2)
- need(k, b)     = in + ws + out of layer k at batch b                                   (3)

and for a special layer, the group's input and output plus the largest of its branches' peaks.
So the smallest peak of the DP's accounting is found exactly in any unit, even bytes, where the
DP's own tables (one column per memory unit) would be far too large. `least_memory_plan` is a
schedule with that peak (the DP's space, method "vbs"; not the fastest one, which needs the full
DP), accounted for execution (`workbench.vbs.flow`): the executor's copies may add to it.

`baseline_floor` is the least memory a baseline serves the request in, as executed: for FBS its
smallest executed peak over batch sizes; for Greedy-VBS the smallest budget in which it succeeds,
found by bisection from the largest over layers of the smallest peak that layer can run at (a
lower bound). `workbench.vbs.dynamic_program.smallest_budget` builds on these.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .baselines import _greedy_layer, fbs_peak, greedy_vbs
from .flow import account, check_units, table_sizes
from .layers import LayerProfile
from .request import checked_request, lift, planned, without_request
from .schedule import Plan, Step, check_request

__all__ = ["baseline_floor", "least_memory_plan", "METHOD_NAMES"]

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

    def plan(self, batch: int) -> Plan:
        """The least-memory schedule, accounted for execution; `memory` is its executed peak."""
        steps = self._opt(self.main, None, 0, self.main.n - 1, batch, 0)
        p, _ = account(Plan("vbs", 0, int(batch), self.layers.unit_bytes, list(self.layers.names), steps,
                            check=check_units(self.layers)), table_sizes(self.layers))
        p.memory = p.peak
        return p

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


def _greedy_fits(layers: LayerProfile, batch: int, memory: int) -> bool:
    try:
        greedy_vbs(layers, memory=memory, batch=batch)
    except ValueError:
        return False
    return True


def _greedy_floor(layers: LayerProfile, batch: int) -> int:
    """Bisection between a lower bound (each layer alone, without copies) and a budget that fits."""
    lo = max(min(max(s.reserved + s.used for s in _greedy_layer(layers, i, g, batch)) for g in range(1, batch + 1))
             for i in range(layers.n_layers)) - 1
    hi = max(lo + 1, 1)
    while not _greedy_fits(layers, batch, hi):
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _greedy_fits(layers, batch, mid) else (mid, hi)
    return hi


def baseline_floor(layers: LayerProfile, *, batch: int, method: str) -> int:
    """The least memory (in `layers`' units) in which "fbs" or "greedy" serves a request of `batch`,
    as executed: FBS's smallest executed peak over batch sizes; Greedy-VBS's by bisection."""
    if method == "fbs":
        return min(fbs_peak(layers, batch=batch, size=q) for q in range(1, batch + 1))
    if method == "greedy":
        return _greedy_floor(layers, batch)
    raise ValueError(f"method must be 'fbs' or 'greedy', got {method!r}")


def least_memory_plan(layers: LayerProfile, *, batch: int, memory: int | None = None,
                      request: str = "pieces") -> Plan:
    """The nested schedule (method "vbs") of least memory in the DP's accounting (among equally
    small peaks, the largest first phases), accounted for execution, for the request handed over
    ("pieces") or kept by the caller ("kept"). Raises ValueError if `memory` is given and below its
    executed peak. `Plan.memory` is `memory`, else that peak."""
    check_request(layers, memory, batch)
    if memory is not None:
        return planned(lambda t, m: _least(t, batch, m), layers, memory, batch, request)
    if checked_request(request) == "pieces":
        return _least(layers, batch, None)
    p = lift(_least(without_request(layers), batch, None), layers, 0)
    return replace(p, memory=p.peak)


def _least(layers: LayerProfile, batch: int, memory: int | None) -> Plan:
    p = _LeastMemory(layers).plan(batch)
    if memory is not None and memory < p.peak:
        raise ValueError(f"memory={memory} units is below the executed peak of the least-memory nested schedule, "
                         f"{p.peak} units")
    if memory is not None:
        p.memory = int(memory)
    return p
