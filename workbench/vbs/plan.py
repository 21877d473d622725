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

# NOTE: the tables are vectorised with NumPy over the layer offset i, the batch split b1 and the
# memory axis; only the span d = j - i, the split point k (1) and the batch b (2) are Python
# loops, so 60 layers x 16 batch sizes x 64 memory units plan in well under a second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from .profile import Profile

__all__ = ["Step", "Plan", "Planner", "plan", "MAX_TABLE_CELLS"]

MAX_TABLE_CELLS = 15_000_000


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


def _padded(t: np.ndarray) -> np.ndarray:
    """Prepend a zero column so that index b means batch size b (0 = nothing)."""
    return np.concatenate([np.zeros((t.shape[0], 1), dtype=t.dtype), t], axis=1)


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


def _need(p: Profile, *, first_in: bool = True) -> np.ndarray:
    inp = p.inp.copy()
    if not first_in and p.n_layers:
        inp[0] = 0
    return _padded(inp + p.ws + p.out)


class Planner:
    """Solves the DP of `profile` once for memory 0..`memory` units and batch 1..B.

    `plan(memory=m, batch=b)` then reads any m <= memory and b <= B without solving again, and
    `curve(batch)` gives the optimal time per sample at every budget (Fig 7's VBS line).
    """

    def __init__(self, profile: Profile, *, memory: int) -> None:
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a workbench.vbs.Profile, got {type(profile).__name__}")
        if not isinstance(memory, (int, np.integer)) or memory < 0:
            raise ValueError(f"memory must be an int >= 0 (units of {profile.unit_bytes} bytes), got {memory!r}")
        n, B, M = profile.n_layers, profile.max_batch, int(memory)
        cells = n * (n + 1) // 2 * (B + 1) * (M + 1)
        if cells > MAX_TABLE_CELLS:
            raise ValueError(f"DP table of {cells:,} cells (layers {n}, batch {B}, memory {M} units) exceeds "
                             f"{MAX_TABLE_CELLS:,}; use a coarser unit (Profile.coarsen)")
        self.profile, self.memory = profile, M
        mem = np.arange(M + 1)
        self.need = _need(profile)
        base = np.where(self.need[:, :, None] <= mem, _padded(profile.time)[:, :, None], np.inf)
        base[:, 0] = np.inf
        self.branch_chains: dict[int, list[_Chain]] = {}
        self.branch_need: dict[int, list[np.ndarray]] = {}
        for s, parts in profile.branches.items():
            group = _padded(profile.inp[s] + profile.out[s][None])[0]
            chains, needs, total = [], [], np.zeros((B + 1, M + 1))
            for p in parts:
                need = _need(p, first_in=False)
                in_res, out_res = _padded(p.inp), _padded(p.out)
                if p.n_layers:
                    in_res[0], out_res[-1] = 0, 0  # held by the group's input / output
                b_base = np.where(need[:, :, None] <= mem, _padded(p.time)[:, :, None], np.inf)
                chain = _Chain(b_base, in_res, out_res)
                chains.append(chain)
                needs.append(need)
                if p.n_layers:
                    total = total + chain.opt[p.n_layers - 1][0]
            shifted = _shift(total, group)
            merge = _padded(profile.time[s][None])[0]
            base[s] = shifted + merge[:, None]
            base[s, 0] = np.inf
            self.branch_chains[s], self.branch_need[s] = chains, needs
        self.base = base
        self.main = _Chain(base, _padded(profile.inp), _padded(profile.out))

    def curve(self, batch: int) -> np.ndarray:
        """Optimal seconds per sample for budgets 0..memory (inf where infeasible)."""
        self._check_batch(batch)
        return self.main.opt[self.main.n - 1][0, batch].copy()

    def smallest_feasible(self, batch: int) -> int | None:
        finite = np.flatnonzero(np.isfinite(self.curve(batch)))
        return int(finite[0]) if finite.size else None

    def _check_batch(self, batch: int) -> None:
        if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= self.profile.max_batch:
            raise ValueError(f"batch must be an int in 1..{self.profile.max_batch} (the profile's B), got {batch!r}")

    def plan(self, *, memory: int | None = None, batch: int) -> Plan:
        self._check_batch(batch)
        m = self.memory if memory is None else memory
        if not isinstance(m, (int, np.integer)) or not 0 <= m <= self.memory:
            raise ValueError(f"memory must be an int in 0..{self.memory} for this Planner, got {m!r}")
        if not np.isfinite(self.main.value(batch, m)):
            raise ValueError(_infeasible(self.profile, int(m), batch, "the DP"))
        steps = self._opt(self.main, None, 0, self.main.n - 1, batch, int(m), int(m))
        return Plan("vbs", int(m), int(batch), self.profile.unit_bytes, list(self.profile.names), steps)

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
        p = self.profile
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


def _infeasible(profile: Profile, memory: int, batch: int, what: str) -> str:
    from .baselines import fbs_peak

    upper = fbs_peak(profile, batch=batch, size=1)
    smallest = None
    try:
        smallest = Planner(profile, memory=upper).smallest_feasible(batch)
    except ValueError:  # table too large to search exactly: give the single-sample schedule's need
        pass
    hint = (f"the smallest feasible budget is {smallest} units" if smallest is not None
            else f"a feasible budget is {upper} units (one sample at a time)")
    return (f"memory={memory} units ({memory * profile.unit_bytes} bytes) is infeasible for {what} with a "
            f"request of {batch}; {hint} ({(smallest or upper) * profile.unit_bytes} bytes)")


def plan(profile: Profile, *, memory: int, batch: int) -> Plan:
    """The optimal variable-batch-size plan (the paper's DP) for `batch` samples in `memory` units.

    Raises ValueError naming the smallest feasible budget when no schedule fits.
    """
    return Planner(profile, memory=memory).plan(memory=memory, batch=batch)
