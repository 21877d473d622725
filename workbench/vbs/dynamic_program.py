"""The dynamic program of "Variable batch size across layers for efficient prediction on CNNs"
(Choudhury et al.), Section III: OPT and OPTExact, recurrences (1)-(3), Algorithm 1, and the
"Generalization to branched models".

For layers L_i..L_j, a batch of b samples and `mem` units of memory:

- OPTExact[i, j, b, mem] (1): some layer L_k runs the whole batch b at once; L_i..L_{k-1} and
  L_{k+1}..L_j run it in batches of at most b: OPT[i, k-1, b, mem] + OPTExact[k, k, b, mem]
  + OPT[k+1, j, b, mem], minimised over k.
- OPT[i, j, b, mem] (2): a first phase of b1 samples runs through L_i..L_j exactly at b1 while
  the other b - b1 inputs wait at L_i (`in(i, b - b1)` reserved); then the rest runs while the
  b1 finished outputs wait at L_j (`out(j, b1)` reserved); minimised over b1, per sample.
- OPTExact[i, i, b, mem] (3) = time(i, b) if in + ws + out <= mem, else infinity.

A special layer (branch group between L_x and L_y) gets OPTExact[s, s, b, mem] from the branch
tables: with mem' = mem - in(x, b) - out(y, b), the sum over branches of OPT_a[1, n_a, b, mem']
(the paper's formula, whose inner minimum over b' is recurrence (2) itself), plus the measured
merge overhead. Branches run one after another, each in its own phases.

`dp` is the DP alone (the paper's VBS); `plan` returns the fastest of the DP and both baselines.

Executed memory. A plan's predicted peak is what the executor allocates (`workbench.vbs.flow`):
the DP's accounting plus the copies a PyTorch executor makes to gather a phase from several
tensors or to free the consumed part of one. Where those copies do not fit the budget, the DP's
plan for a smaller budget is taken (the largest one whose execution fits), down to the
least-memory nested schedule; so a plan never needs more than its budget as executed.

# NOTE: the DP is optimal only among the paper's *nested* schedules: every phase of recurrence (2)
# carries its samples through L_i..L_j before the next phase starts. Schedules outside that space
# exist: Greedy-VBS runs a layer in several phases over the whole request before the next layer.
# An exhaustive search over all phase orders finds a faster schedule than the DP in 28 of 200
# small random linear instances (2-3 layers, requests of 2-4, the tests' generator), and
# Greedy-VBS beats the DP at a few (instance, budget) points. So `plan` takes the best of the
# three; FBS is inside the DP's space, so it only ties.

# NOTE: the tables are vectorised with NumPy over the layer offset i, the batch split b1 and the
# memory axis; only the span d = j - i, the split point k (1) and the batch b (2) are Python
# loops, so 60 layers x 16 batch sizes x 64 memory units plan in well under a second.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .baselines import fbs, fixed_batch_plan, greedy_vbs
from .floor import METHOD_NAMES, baseline_floor, least_memory_plan, need, padded, reserves
from .flow import account, check_units, table_sizes
from .layers import LayerProfile
from .request import checked_request, held, lift, without_request
from .schedule import Plan, Step, check_request

__all__ = ["Planner", "dp", "plan", "smallest_budget", "MAX_TABLE_CELLS", "DEFAULT_RESOLUTION"]

MAX_TABLE_CELLS = 15_000_000
DEFAULT_RESOLUTION = 256


# ---------------------------------------------------------------------------------------------
# The tables


def _shift(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """a[..., m - s] along the memory axis, infinity where m - s < 0; `s` has shape a.shape[:-1]."""
    lead, m1 = a.shape[:-1], a.shape[-1]
    top = int(s.max()) if s.size else 0
    if top <= 0:
        return a
    top = min(top, m1)
    pad = np.full((*lead, m1 + top), np.inf)
    pad[..., top:] = a
    # NOTE: a window view over the padded memory axis turns the per-row shift into indexing on
    # the leading axes, which copies whole rows (much faster than an element-wise gather).
    win = np.lib.stride_tricks.sliding_window_view(pad, m1, axis=-1)
    grids = np.indices(lead, sparse=True)
    return win[(*grids, top - np.minimum(s, top))]


class _Chain:
    """OPT / OPTExact tables of one linear chain, for batch 0..B and memory 0..M."""

    def __init__(self, base: np.ndarray, in_res: np.ndarray, out_res: np.ndarray) -> None:
        n, B1, M1 = base.shape
        self.n, self.base, self.in_res, self.out_res = n, base, in_res, out_res
        self.opt: list[np.ndarray] = []
        self.exact: list[np.ndarray] = []
        for d in range(n):
            rows = n - d
            # recurrence (1): the layer k = i + t running the whole batch
            exact = np.full((rows, B1, M1), np.inf)
            for t in range(d + 1):
                cand = base[t:t + rows]
                if t >= 1:
                    cand = cand + self.opt[t - 1][:rows]
                if t < d:
                    cand = cand + self.opt[d - t - 1][t + 1:t + 1 + rows]
                np.minimum(exact, cand, out=exact)
            # recurrence (2): a first phase of b1 samples, then the remaining b - b1
            opt = np.zeros((rows, B1, M1))
            in_i, out_j = in_res[:rows], out_res[d:d + rows]
            for b in range(1, B1):
                b1 = np.arange(1, b + 1)
                total = _shift(exact[:, 1:b + 1], in_i[:, b - b1]) * b1[None, :, None]
                if b > 1:
                    r = b1[:-1]
                    total[:, :-1] += _shift(opt[:, b - r], out_j[:, r]) * (b - r)[None, :, None]
                opt[:, b] = total.min(axis=1) / b
            self.opt.append(opt)
            self.exact.append(exact)

    # NOTE: the arg-min tables of Algorithm 1 (aux1) are not stored: the reconstruction recomputes
    # the few candidates it needs from the value tables, which halves memory and time.
    def _opt_at(self, i: int, j: int, b: int, m: int) -> float:
        return 0.0 if i > j or b == 0 else (np.inf if m < 0 else float(self.opt[j - i][i, b, m]))

    def best_k(self, base: np.ndarray, i: int, j: int, b: int, m: int) -> int:
        vals = [self._opt_at(i, k - 1, b, m) + float(base[k, b, m]) + self._opt_at(k + 1, j, b, m)
                for k in range(i, j + 1)]
        return i + int(np.argmin(vals))

    def best_b1(self, i: int, j: int, b: int, m: int) -> int:
        vals = []
        for b1 in range(1, b + 1):
            m1 = m - int(self.in_res[i, b - b1])
            first = b1 * float(self.exact[j - i][i, b1, m1]) if m1 >= 0 else np.inf
            rest = 0.0 if b1 == b else (b - b1) * self._opt_at(i, j, b - b1, m - int(self.out_res[j, b1]))
            vals.append(first + rest)
        return 1 + int(np.argmin(vals))

    def value(self, b: int, m: int) -> float:
        return float(self.opt[self.n - 1][0, b, m]) if self.n else 0.0


class Planner:
    """Solves the DP of `layers` once for memory 0..`memory` units and batch 1..B.

    `plan(memory=m, batch=b)` then reads the DP's plan for any m <= memory and b <= B without
    solving again, and `curve(batch)` gives the DP's time per sample at every budget (Fig 7's VBS
    line). These are the DP alone, optimal among nested schedules (see the module docstring).
    `request="kept"` plans for a request the caller keeps (`workbench.vbs.request`): the tables
    without it, every budget less it.
    """

    def __init__(self, layers: LayerProfile, *, memory: int, request: str = "pieces") -> None:
        check_request(layers, memory, 1, budget=True)
        self.request, self.tables = checked_request(request), layers
        if self.request == "kept":
            layers = without_request(layers)
        n, B, M = layers.n_layers, layers.max_batch, int(memory)
        cells = n * (n + 1) // 2 * (B + 1) * (M + 1)
        if cells > MAX_TABLE_CELLS:
            raise ValueError(f"DP table of {cells:,} cells (layers {n}, batch {B}, memory {M} units) exceeds "
                             f"{MAX_TABLE_CELLS:,}; use plan(), which picks its unit (`resolution`), or a "
                             f"coarser unit (LayerProfile.coarsen)")
        self.layers, self.memory = layers, M
        mem = np.arange(M + 1)
        self.need = need(layers)
        base = np.where(self.need[:, :, None] <= mem, padded(layers.time)[:, :, None], np.inf)
        base[:, 0] = np.inf
        self.branch_chains: dict[int, list[_Chain]] = {}
        self.branch_need: dict[int, list[np.ndarray]] = {}
        for s, parts in layers.branches.items():
            group = padded(layers.inp[s] + layers.out[s][None])[0]
            chains, needs, total = [], [], np.zeros((B + 1, M + 1))
            for p in parts:
                n_p = need(p, first_in=False)
                b_base = np.where(n_p[:, :, None] <= mem, padded(p.time)[:, :, None], np.inf)
                chain = _Chain(b_base, *reserves(p, branch=True))  # first in / last out: the group's
                chains.append(chain)
                needs.append(n_p)
                if p.n_layers:
                    total = total + chain.opt[p.n_layers - 1][0]
            shifted = _shift(total, group)
            merge = padded(layers.time[s][None])[0]
            base[s] = shifted + merge[:, None]
            base[s, 0] = np.inf
            self.branch_chains[s], self.branch_need[s] = chains, needs
        self.base = base
        self.main = _Chain(base, padded(layers.inp), padded(layers.out))
        self._nested: dict[int, list[Plan]] = {}

    def curve(self, batch: int) -> np.ndarray:
        """The DP's seconds per sample for budgets 0..memory in its own accounting (inf where
        infeasible), before the executor's copies (see `plan`)."""
        self._check_batch(batch)
        curve = self.main.opt[self.main.n - 1][0, batch]
        h = min(self._held(batch), curve.size)  # a kept request: the same times, each budget higher by it
        return np.concatenate([np.full(h, np.inf), curve[:curve.size - h]])

    def _held(self, batch: int) -> int:
        return held(self.tables, batch) if self.request == "kept" else 0

    def smallest_feasible(self, batch: int) -> int | None:
        """The least budget in 0..memory in which `plan` finds a plan (as executed), or None."""
        finite = np.flatnonzero(np.isfinite(self.curve(batch)))
        for m in range(int(finite[0]) if finite.size else self.memory + 1, self.memory + 1):
            if self.executable(m, batch) is not None:
                return m
        return None

    def _check_batch(self, batch: int) -> None:
        if (isinstance(batch, bool) or not isinstance(batch, (int, np.integer))
                or not 1 <= batch <= self.layers.max_batch):
            raise ValueError(f"batch must be an int in 1..{self.layers.max_batch} (the tables' B), got {batch!r}")

    def plan(self, *, memory: int | None = None, batch: int) -> Plan:
        """The DP's plan (method "vbs") for `batch` samples in `memory` units (default: all)."""
        self._check_batch(batch)
        m = self.memory if memory is None else memory
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 0 <= m <= self.memory:
            raise ValueError(f"memory must be an int in 0..{self.memory} for this Planner, got {m!r}")
        found = self.executable(int(m), int(batch))
        if found is None:
            raise ValueError(_infeasible(self.tables, int(m), batch, "the DP", smallest_budget(
                self.tables, batch=batch, method="dp", request=self.request), self.request))
        return found

    def executable(self, memory: int, batch: int) -> Plan | None:
        """The plan `plan` returns for `memory` units, or None where none fits."""
        h = self._held(batch)
        found = self._executable(memory - h, batch) if memory >= h else None
        return lift(found, self.tables, memory) if found is not None and self.request == "kept" else found

    def _executable(self, memory: int, batch: int) -> Plan | None:
        """The fastest nested schedule found that executes within `memory`: the DP's plan at the
        largest budget <= `memory` whose executed peak fits, FBS's schedule (a nested one too, so
        the DP is never slower than FBS) or the least-memory schedule; None if none fits."""
        sizes, budget = table_sizes(self.layers), memory
        if batch not in self._nested:  # FBS's schedules at every size, and the least-memory one
            self._nested[batch] = [*(fixed_batch_plan(self.layers, batch=batch, size=q) for q in range(1, batch + 1)),
                                   least_memory_plan(self.layers, batch=batch)]
        found = [p for p in self._nested[batch] if p.peak <= memory]
        while budget >= 0 and np.isfinite(self.main.value(batch, budget)):
            steps = self._opt(self.main, None, 0, self.main.n - 1, batch, budget, budget)
            p, _ = account(Plan("vbs", memory, batch, self.layers.unit_bytes, list(self.layers.names), steps,
                                check=check_units(self.layers)), sizes)
            peak = p.peak  # the DP's accounting or the executor's, the higher
            if peak <= memory:
                found.insert(0, p)
                break
            budget -= peak - memory  # the copies' excess: the DP plans again with that much less
        if not found:
            return None
        best = min(found, key=lambda p: p.time_per_sample)  # the first of equals: the DP's own
        return replace(best, method="vbs", memory=memory)

    # reconstruction (Algorithm 1, "keep track of the optimal choice at each step")
    def _opt(self, chain: _Chain, where, i: int, j: int, b: int, m: int, total: int) -> list[Step]:
        if i > j or b == 0:
            return []
        b1 = chain.best_b1(i, j, b, m)
        steps = self._exact(chain, where, i, j, b1, m - int(chain.in_res[i, b - b1]), total)
        return steps + self._opt(chain, where, i, j, b - b1, m - int(chain.out_res[j, b1]), total)

    def _exact(self, chain: _Chain, where, i: int, j: int, b: int, m: int, total: int) -> list[Step]:
        k = chain.best_k(chain.base, i, j, b, m)
        left = self._opt(chain, where, i, k - 1, b, m, total)
        right = self._opt(chain, where, k + 1, j, b, m, total)
        return left + [self._leaf(where, k, b, m, total)] + right

    def _leaf(self, where, k: int, b: int, m: int, total: int) -> Step:
        p = self.layers
        if where is not None:  # a layer inside branch `where = (s, a)`
            s, a = where
            part = p.branches[s][a]
            return Step(k, b, total - m, int(self.branch_need[s][a][k, b]), b * float(part.time[k, b - 1]))
        if k not in p.branches:
            return Step(k, b, total - m, int(self.need[k, b]), b * float(p.time[k, b - 1]))
        group = int(p.inp[k, b - 1] + p.out[k, b - 1])
        inner = m - group
        branches = tuple(tuple(self._opt(chain, (k, a), 0, chain.n - 1, b, inner, total))
                         for a, chain in enumerate(self.branch_chains[k]))
        seconds = b * float(p.time[k, b - 1]) + sum(x.seconds for br in branches for x in br)
        return Step(k, b, total - m, group, seconds, branches)


def _infeasible(layers: LayerProfile, memory: int, batch: int, what: str, smallest: int,
                request: str = "pieces") -> str:
    kept = " kept by the caller" if request == "kept" else ""
    return (f"memory={memory} units ({memory * layers.unit_bytes} bytes) is infeasible for {what} with a "
            f"request of {batch}{kept}; the smallest feasible budget is {smallest} units "
            f"({smallest * layers.unit_bytes} bytes)")


def smallest_budget(layers: LayerProfile, *, batch: int, method: str = "any", request: str = "pieces") -> int:
    """The smallest memory (in `layers`' units) in which `method` serves a request of `batch`, as
    executed: "dp" (the DP, `dp`), "fbs", "greedy" (`greedy_vbs`) or "any" (the least of the
    three, the smallest budget `plan` accepts); for a request the caller keeps (`request="kept"`),
    the same for the tables without it, plus the request.

    Every budget from it up is served. FBS's and Greedy-VBS's are exact (`baseline_floor`). The
    DP's is bounded without the memory axis (the least-memory nested schedule or FBS's, as
    executed, the lower) and found exactly below that bound with the DP's tables, where they fit
    in `MAX_TABLE_CELLS` (in bytes they do not: then the bound is named)."""
    check_request(layers, None, batch)
    if method not in METHOD_NAMES:
        raise ValueError(f"method must be one of {METHOD_NAMES}, got {method!r}")
    if checked_request(request) == "kept":
        return smallest_budget(without_request(layers), batch=batch, method=method) + held(layers, batch)
    found = {}
    if method in ("fbs", "dp", "any"):  # FBS's schedules are nested ones: the DP's too
        found["fbs"] = baseline_floor(layers, batch=batch, method="fbs")
    if method in ("dp", "any"):
        bound = min(least_memory_plan(layers, batch=batch).peak, found["fbs"])
        n, B = layers.n_layers, layers.max_batch
        if n * (n + 1) // 2 * (B + 1) * (bound + 1) <= MAX_TABLE_CELLS:
            bound = Planner(layers, memory=bound).smallest_feasible(batch)
        found["dp"] = bound
    if method in ("greedy", "any"):
        found["greedy"] = baseline_floor(layers, batch=batch, method="greedy")
    return found[method] if method != "any" else min(found.values())


def dp(layers: LayerProfile, *, memory: int, batch: int, request: str = "pieces") -> Plan:
    """The paper's DP alone (method "vbs"): the fastest nested schedule for `batch` samples in
    `memory` units, exact in `layers`' unit (`plan` picks a coarser one for large budgets), for the
    request handed over ("pieces") or kept by the caller ("kept"). Raises ValueError naming the
    DP's smallest feasible budget when none fits."""
    return Planner(layers, memory=memory, request=request).plan(memory=memory, batch=batch)


def _factor(layers: LayerProfile, memory: int, resolution: int | None) -> int:
    """How many of `layers`' units make one planning unit, for about `resolution` units in `memory`."""
    if resolution is None:
        n, B = layers.n_layers, layers.max_batch
        fits = MAX_TABLE_CELLS // (n * (n + 1) // 2 * (B + 1)) - 1  # the largest table allowed
        resolution = max(1, min(DEFAULT_RESOLUTION, fits))
    elif not isinstance(resolution, (int, np.integer)) or resolution < 1:
        raise ValueError(f"resolution must be an int >= 1 (memory units across the budget), got {resolution!r}")
    return max(1, -(-int(memory) // int(resolution)))


def plan(layers: LayerProfile, *, memory: int, batch: int, resolution: int | None = None,
         request: str = "pieces") -> Plan:
    """The fastest feasible plan for `batch` samples in `memory` units (of `layers.unit_bytes`
    bytes): the best predicted time per sample of the DP (`dp`), FBS (`fbs`) and Greedy-VBS
    (`greedy_vbs`); `Plan.method` says which one ("vbs", "fbs" or "greedy"; on a tie the DP,
    then FBS).

    The unit is chosen here: the DP works in units of k x `layers.unit_bytes`, k the smallest
    whole number giving at most `resolution` units across `memory` (default `DEFAULT_RESOLUTION`,
    fewer when the DP's table would exceed `MAX_TABLE_CELLS`), so a profile in bytes needs no
    `coarsen`. Its tables are rounded up to that unit and the budget down, so its plan also fits
    in `memory`; the plan is in that unit (`Plan.unit_bytes`, `Plan.memory`), `peak_bytes` in
    bytes. FBS and Greedy-VBS run on `layers` as given. Where the rounding leaves the DP no room
    although a nested schedule fits, the DP's plan is the nested schedule of least memory
    (`least_memory_plan`); so every budget from the smallest feasible one up gets a plan.

    The DP is optimal only among the paper's nested schedules; Greedy-VBS's layer-by-layer
    schedules lie outside them and are sometimes faster. Raises ValueError naming the smallest
    budget in which any of the three fits (`smallest_budget(..., method="any")`) when none does.

    `request` is how the request will be handed over: "pieces" (sample by sample, each freed once
    consumed: the paper's accounting, `Executor` with a list of samples) or "kept" (a tensor the
    caller keeps for the whole call, as `vbs.run(model, plan, x)` does).
    """
    check_request(layers, memory, batch, budget=True)
    checked_request(request)
    k = _factor(layers, memory, resolution)
    coarse = layers.coarsen(layers.unit_bytes * k) if k > 1 else layers
    candidates = []
    found = Planner(coarse, memory=memory // k, request=request).executable(memory // k, batch)
    if found is not None:
        candidates.append(found)
    elif k > 1:  # the rounded tables leave the DP no room: the least-memory schedule, unrounded
        try:
            candidates.append(least_memory_plan(layers, batch=batch, memory=memory, request=request))
        except ValueError:
            pass
    for method in (fbs, greedy_vbs):
        try:
            candidates.append(method(layers, memory=memory, batch=batch, request=request))
        except ValueError:
            continue
    if not candidates:
        raise ValueError(_infeasible(layers, memory, batch, "plan() (the DP, FBS and Greedy-VBS)",
                                     smallest_budget(layers, batch=batch, method="any", request=request), request))
    return min(candidates, key=lambda p: p.time_per_sample)  # the first of equals: DP, FBS, greedy
