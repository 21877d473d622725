"""Where sequential checkpoints go: the cost model and the planner (``plan_checkpoints``).

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-B-2 (sequential-checkpoint training: keep a few intermediate
outputs, recompute the rest from the previous checkpoint in the backward pass) and Sec. IV /
Fig 11 (the recommendation: the best checkpoint sits at the smallest layer).

:func:`plan_checkpoints` chooses the boundaries over a model's checkpoint units from a per-unit
profile measured once (``workbench.checkpoint.profile``):

* ``uniform``: equal segments, as ``torch.utils.checkpoint.checkpoint_sequential``;
* ``smallest``: boundaries at the smallest unit outputs (the paper's Fig 11 recommendation);
* ``optimal``: an exact Pareto dynamic program over (kept bytes, peak, recompute time) that
  minimises recompute time under a byte budget (the class of Chen et al. 2016 / rotor). Its
  search space contains every ``uniform`` and ``smallest`` plan and all three are scored by the
  same cost model, so at the same budget it is never slower than either.

The cost model (:func:`evaluate_plan`) replays one training step over the profile: the forward
(what each segment keeps, plus the running unit's input, output and scratch), the loss, and the
backward segment by segment (the recomputation with the output gradient already live, then each
unit's saved tensors, gradients and backward scratch). The sample batch is not counted.

The module wrapper that runs a plan, ``sc(model)``, is in ``workbench.checkpoint.sequential``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .profile import Key, LayerProfile, profile_layers

__all__ = ["STRATEGIES", "CheckpointPlan", "evaluate_plan", "plan_checkpoints"]

STRATEGIES = ("uniform", "smallest", "optimal")
Segment = tuple[int, int, bool]  # (start, end, checkpointed): units[start:end]


@dataclass
class CheckpointPlan:
    """Which unit outputs are kept, and the predicted peak and recompute time."""

    strategy: str
    segments: list[Segment]
    predicted_peak_bytes: int | None
    predicted_recompute_s: float | None
    memory_budget: int | None = None

    @property
    def kept(self) -> list[int]:
        """Indices of units whose outputs are stored (the checkpoints)."""
        return [end - 1 for _, end, _ in self.segments[:-1]]

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def _bytes(keys: dict[Key, int], minus: frozenset[Key] = frozenset()) -> int:
    return sum(v for k, v in keys.items() if k not in minus)


@dataclass(frozen=True)
class _SegmentCost:
    forward: int  # peak during the segment's forward, above what earlier segments keep
    backward: int  # peak during its recomputation and backward, above the same
    kept: int  # bytes it adds to what is kept until the backward
    kept_keys: frozenset[Key]
    recompute_s: float


class _CostModel:
    """Segment costs under the profile, cached; see the module docstring for what is counted."""

    def __init__(self, profile: LayerProfile) -> None:
        self.p = profile
        self.n = len(profile)
        self._cache: dict[tuple[int, bool, frozenset[Key]], list[_SegmentCost]] = {}

    def segment(self, a: int, b: int, ckpt: bool, carried: frozenset[Key]) -> _SegmentCost:
        """Costs of units[a:b]; ``carried`` holds the input storages earlier segments keep."""
        key = (a, ckpt, carried)
        if key not in self._cache:
            self._cache[key] = self._segments_from(a, ckpt, carried)
        return self._cache[key][b - a - 1]

    def _segments_from(self, a: int, ckpt: bool, carried: frozenset[Key]) -> list[_SegmentCost]:
        """Costs of units[a:b] for every b > a, in one pass (each term depends on a prefix)."""
        p = self.p
        inp = p.input_keys(a)
        inp_keys = frozenset(inp)
        fwd = bwd = rec_prefix = 0
        saved: dict[Key, int] = {}
        recomputed = 0  # bytes of the fresh copies the recomputation saves
        seconds = 0.0
        out: list[_SegmentCost] = []
        for i in range(a, self.n):
            unit_in = p.input_keys(i)
            if ckpt:
                # first forward: the kept input and the running unit's input
                fwd = max(fwd, _bytes({**inp, **unit_in}, carried) + p.forward_bytes[i])
                # recomputation: fresh copies of what the segment saves, its input shared
                fresh_in = _bytes(unit_in, inp_keys) if i > a else 0
                rec_prefix = max(rec_prefix, recomputed + fresh_in + p.forward_bytes[i])
                recomputed += _bytes({k: v for k, v in p.saved[i].items() if k not in saved}, inp_keys)
            else:
                fwd = max(fwd, _bytes({**saved, **unit_in}, carried) + p.forward_bytes[i])
            saved.update(p.saved[i])
            held = {**saved, **inp} if ckpt else saved
            bwd = max(bwd, _bytes(held, carried) + p.grad_bytes[i] + p.backward_bytes[i] + p.loss_held_bytes)
            seconds += p.time_s[i]
            if ckpt:
                b_cost = max(bwd, _bytes(inp, carried) + p.grad_bytes[i] + rec_prefix + p.loss_held_bytes)
                out.append(_SegmentCost(fwd, b_cost, _bytes(inp, carried), inp_keys, seconds))
            else:
                keys = frozenset(saved)
                out.append(_SegmentCost(fwd, bwd, _bytes(saved, carried), keys, 0.0))
        return out

    def carried_after(self, b: int, carried: frozenset[Key], kept_keys: frozenset[Key]) -> frozenset[Key]:
        return frozenset(k for k in self.p.out_keys[b - 1] if k in carried or k in kept_keys)

    def final(self, kept: int, carried: frozenset[Key]) -> int:
        """Peak at the loss: everything kept, the output, the loss's own bytes."""
        return kept + _bytes(self.p.out_keys[self.n - 1], carried) + self.p.loss_bytes


def evaluate_plan(profile: LayerProfile, segments: Sequence[Segment]) -> tuple[int, float]:
    """Predicted (peak bytes, recompute seconds) of a plan under the profile's cost model."""
    _check_segments(len(profile), segments)
    return _evaluate(_CostModel(profile), segments)


def _evaluate(model: _CostModel, segments: Sequence[Segment]) -> tuple[int, float]:
    kept, peak, recompute = 0, 0, 0.0
    carried: frozenset[Key] = frozenset()
    for a, b, ckpt in segments:
        cost = model.segment(a, b, bool(ckpt), carried)
        peak = max(peak, kept + cost.forward, kept + cost.backward)
        kept += cost.kept
        recompute += cost.recompute_s
        carried = model.carried_after(b, carried, cost.kept_keys)
    return max(peak, model.final(kept, carried)), recompute


def _check_segments(n: int, segments: Sequence[Segment]) -> None:
    pos = 0
    for a, b, _ in segments:
        if a != pos or b <= a:
            raise ValueError(f"segments must tile range(0, {n}) in order, got {list(segments)}")
        pos = b
    if pos != n:
        raise ValueError(f"segments must end at layer {n}, got {list(segments)}")


def _from_boundaries(n: int, ends: Sequence[int]) -> list[Segment]:
    """Segments ending at ``ends`` (sorted, last == n); all but the last are checkpointed."""
    starts = [0, *ends[:-1]]
    return [(a, b, b != n) for a, b in zip(starts, ends, strict=True)]


def uniform_segments(inplace: Sequence[bool], k: int) -> list[Segment]:
    """Equal segments by layer count, as torch's checkpoint_sequential."""
    n = len(inplace)
    size = max(n // k, 1)
    ends = set()
    for i in range(k - 1):
        e = size * (i + 1)
        # NOTE: a segment must not start with an in-place layer (ReLU(inplace=True)): it would
        # overwrite the stored input that the recomputation needs. Such boundaries move on.
        while e < n and inplace[e]:
            e += 1
        ends.add(e)
    return _from_boundaries(n, sorted({e for e in ends if 0 < e < n} | {n}))


def _uniform(profile: LayerProfile, k: int) -> list[Segment]:
    return uniform_segments(profile.inplace, k)


def _smallest(profile: LayerProfile, k: int) -> list[Segment]:
    """k segments whose boundaries sit at the smallest output inside each of k-1 windows
    centred on the uniform positions (so boundaries cannot all crowd at the tiny head)."""
    n = len(profile)
    ends: set[int] = {n}
    for j in range(1, k):
        lo = max(1, round((j - 0.5) * n / k))
        hi = min(n - 1, max(lo, round((j + 0.5) * n / k) - 1))
        window = [e for e in range(lo, hi + 1) if not profile.inplace[e]]
        if window:
            ends.add(min(window, key=lambda e: (profile.out_bytes[e - 1], e)))
    return _from_boundaries(n, sorted(ends))


Plan = tuple[int, float, list]  # (kept bytes or peak, second objective, segments)


def _dp(model: _CostModel, budget: float | None) -> list[tuple[int, float, tuple]]:
    """Plans of every unit, as (peak, recompute seconds, segment chain: see :func:`_unroll`).

    With a budget: per (position, kept input storages), the front of (kept bytes, recompute)
    over plans whose peak so far fits; without one, the front of (kept bytes, peak).
    # NOTE: two objectives per state instead of three keep the fronts small (a three-way front
    # over the units of a ResNet grows into the thousands); the budgeted search is exact for
    # its budget, and the minimum peak is found first, then searched at that budget. A state's
    # segments are a linked chain (earlier chain, last segment), unrolled only for finished
    # plans: copying a list per state was a third of the search.
    """
    p, n = model.p, model.n
    states: list[dict[frozenset[Key], list[tuple[int, int, float, tuple]]]] = [{} for _ in range(n + 1)]
    states[0][frozenset()] = [(0, 0, 0.0, ())]  # (kept, peak, recompute, segment chain)
    done: list[tuple[int, int, float, tuple]] = []
    second = 2 if budget is not None else 1
    for a in range(n):
        if a > 0 and p.inplace[a]:
            continue
        for carried, plans in states[a].items():
            for b in range(a + 1, n + 1):
                for ckpt in ((True, False) if b < n else (False,)):
                    cost = model.segment(a, b, ckpt, carried)
                    after = model.carried_after(b, carried, cost.kept_keys)
                    for kept, peak, rec, segs in plans:
                        new_peak = max(peak, kept + cost.forward, kept + cost.backward)
                        new_kept = kept + cost.kept
                        if b == n:
                            new_peak = max(new_peak, model.final(new_kept, after))
                        if budget is not None and new_peak > budget:
                            continue
                        state = (new_kept, new_peak, rec + cost.recompute_s, (segs, (a, b, ckpt)))
                        (done if b == n else states[b].setdefault(after, [])).append(state)
        for b in range(a + 1, n):  # prune dominated states once per source position
            for carried, plans in states[b].items():
                states[b][carried] = _front(plans, second)
        states[a] = {}
    return [(peak, rec, segs) for _, peak, rec, segs in done]


def _unroll(chain: tuple) -> list[Segment]:
    segments: list[Segment] = []
    while chain:
        chain, last = chain
        segments.append(last)
    return segments[::-1]


def _front(plans: list[tuple[int, int, float, tuple]], second: int) -> list[tuple[int, int, float, tuple]]:
    """Plans not dominated in (kept, plans[second]); ties keep the lower other objective."""
    other = 1 if second == 2 else 2
    front: list[tuple[int, int, float, tuple]] = []
    best = math.inf
    for s in sorted(plans, key=lambda s: (s[0], s[second], s[other])):
        if s[second] < best:
            front.append(s)
            best = s[second]
    return front


def _min_peak(model: _CostModel) -> int:
    return min(peak for peak, _, _ in _dp(model, None))


def _best_under(model: _CostModel, budget: float) -> tuple[int, float, list] | None:
    plans = _dp(model, budget)
    if not plans:
        return None
    peak, rec, chain = min(plans, key=lambda s: (s[1], s[0]))
    return peak, rec, _unroll(chain)


def check_count(name: str, value: object, n: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int in [1, {n}], got {value!r}")
    if not 1 <= value <= n:
        raise ValueError(f"{name} must be in [1, {n}], got {value}")


def check_budget(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"memory_budget must be a number of bytes > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory_budget must be a finite number of bytes > 0, got {value!r}")


def check_strategy(strategy: object) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def plan_checkpoints(
    layers: nn.Module | Sequence[nn.Module] | LayerProfile,
    sample: torch.Tensor | None = None,
    *,
    memory_budget: int | None = None,
    segments: int | None = None,
    strategy: str = "uniform",
    split_blocks: bool = True,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> CheckpointPlan:
    """Choose checkpoint boundaries over a model's units (see :func:`units_of`).

    Give ``segments`` (a count) or ``memory_budget`` (bytes, peak of one training step under
    the profile's cost model, the sample batch excluded), not both. Without either:
    ``uniform``/``smallest`` use round(sqrt(n)) segments and ``optimal`` returns the plan with
    the smallest peak. ``optimal`` with ``segments`` uses the budget of the ``uniform`` plan with
    that many segments. A budget below the minimum achievable peak raises ValueError naming it.
    ``split_blocks`` and ``loss_fn`` go to :func:`profile_layers` when a model is given.
    """
    check_strategy(strategy)
    if segments is not None and memory_budget is not None:
        raise ValueError("give segments or memory_budget, not both")
    if memory_budget is not None:
        check_budget(memory_budget)
    if isinstance(layers, LayerProfile):
        profile = layers
    else:
        if sample is None:
            raise ValueError("plan_checkpoints needs a sample batch to profile the layers")
        profile = profile_layers(layers, sample, split_blocks=split_blocks, loss_fn=loss_fn)
    n = len(profile)
    if segments is not None:
        check_count("segments", segments, n)
    model = _CostModel(profile)

    def done(segs: list[Segment], budget: int | None = memory_budget) -> CheckpointPlan:
        _check_segments(n, segs)
        peak, rec = _evaluate(model, segs)
        return CheckpointPlan(strategy, segs, peak, rec, budget)

    def min_peak() -> int:
        return _min_peak(model)

    if strategy in ("uniform", "smallest"):
        build: Callable[[LayerProfile, int], list[Segment]] = (
            _uniform if strategy == "uniform" else _smallest)
        if memory_budget is None:
            return done(build(profile, segments or max(1, round(math.sqrt(n)))))
        candidates = {tuple(build(profile, k)) for k in range(1, n + 1)}
        scored = [(_evaluate(model, s), list(s)) for s in sorted(candidates)]
        feasible = [(rec, peak, s) for (peak, rec), s in scored if peak <= memory_budget]
        if not feasible:
            best = min(p for (p, _), _ in scored)
            raise ValueError(
                f"memory_budget {memory_budget} B is below what {strategy!r} plans reach "
                f"(best {best} B; minimum achievable peak {min_peak()} B with any plan)")
        return done(min(feasible, key=lambda f: (f[0], f[1]))[2])

    budget = memory_budget
    if segments is not None:
        budget = _evaluate(model, _uniform(profile, segments))[0]
    best = _best_under(model, budget if budget is not None else min_peak())
    if best is None:
        raise ValueError(
            f"memory_budget {budget} B is below the minimum achievable peak {min_peak()} B")
    return done(best[2], budget)
