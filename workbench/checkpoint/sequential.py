"""Sequential checkpoints (S-C) with planned placement.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (arXiv 2105.00619), Sec. II-B-2 (sequential-checkpoint training, the one-call
``scmodel = sc(model)`` API of Sec. III) and Sec. IV / Fig 11 (the best checkpoint sits at the
smallest layer).

``sc(model)`` runs a flat layer sequence (an ``nn.Sequential`` or the ResNets of
``workbench.models``) in segments; every segment but the last keeps only its input and is
recomputed in the backward pass by ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
Where the boundaries go is chosen by :func:`plan_checkpoints` from a per-layer profile measured
once (time, output bytes, bytes saved for backward):

* ``uniform``: equal segments, as ``torch.utils.checkpoint.checkpoint_sequential``;
* ``smallest``: boundaries at the smallest layer outputs (the paper's Fig 11 recommendation);
* ``optimal``: an exact Pareto dynamic program over (stored bytes, peak, recompute time) that
  minimises recompute time under a byte budget (the class of Chen et al. 2016 / rotor). Its
  search space contains every ``uniform`` and ``smallest`` plan and all three are scored by the
  same cost model, so at the same budget it is never slower than either.

Two traps (../shared/papers/README.md): recomputing a segment that holds BatchNorm would update
the running statistics twice, so the recomputation runs inside a context that restores them
(``num_batches_tracked`` advances once); dropout stays identical because checkpoint stashes and
restores the RNG state (``preserve_rng_state=True``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .profile import LayerProfile, layers_of, profile_layers

__all__ = [
    "STRATEGIES",
    "CheckpointPlan",
    "CheckpointedSequential",
    "evaluate_plan",
    "plan_checkpoints",
    "sc",
]

STRATEGIES = ("uniform", "smallest", "optimal")
Segment = tuple[int, int, bool]  # (start, end, checkpointed): layers[start:end]


@dataclass
class CheckpointPlan:
    """Which layer outputs are kept, and the predicted peak and recompute time."""

    strategy: str
    segments: list[Segment]
    predicted_peak_bytes: int | None
    predicted_recompute_s: float | None
    memory_budget: int | None = None

    @property
    def kept(self) -> list[int]:
        """Indices of layers whose outputs are stored (the checkpoints)."""
        return [end - 1 for _, end, _ in self.segments[:-1]]

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def evaluate_plan(profile: LayerProfile, segments: Sequence[Segment]) -> tuple[int, float]:
    """Predicted (peak bytes, recompute seconds) of a plan under the profile's cost model.

    Backward through segment j holds everything stored before it (boundary outputs, saved
    tensors of plain segments) plus its own saved tensors, recomputed or stored, and the
    working gradients (``LayerProfile.backward_peak``).
    """
    stored, peak, recompute = 0, 0, 0.0
    for a, b, ckpt in segments:
        inner = profile.inner_bytes(a, b)
        peak = max(peak, stored + profile.backward_peak(a, b))
        stored += profile.out_bytes[b - 1] + (0 if ckpt else inner)
        if ckpt:
            recompute += sum(profile.time_s[a:b])
    return peak, recompute


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


def _uniform_ends(inplace: Sequence[bool], k: int) -> list[Segment]:
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
    return _uniform_ends(profile.inplace, k)


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


def _pareto_dp(profile: LayerProfile, budget: float | None) -> list[tuple[int, int, float, list]]:
    """All non-dominated (stored, peak, recompute, segments) plans covering every layer."""
    n = len(profile)
    states: list[list[tuple[int, int, float, list]]] = [[] for _ in range(n + 1)]
    states[0] = [(0, 0, 0.0, [])]
    for a in range(n):
        if not states[a] or (a > 0 and profile.inplace[a]):
            continue
        for b in range(a + 1, n + 1):
            inner = profile.inner_bytes(a, b)
            during_base = profile.backward_peak(a, b)
            seg_time = sum(profile.time_s[a:b])
            for stored, peak, rec, segs in states[a]:
                during = stored + during_base
                if budget is not None and during > budget:
                    continue
                for ckpt in ((True, False) if b < n else (False,)):
                    new = (stored + profile.out_bytes[b - 1] + (0 if ckpt else inner),
                           max(peak, during), rec + (seg_time if ckpt else 0.0),
                           [*segs, (a, b, ckpt)])
                    states[b].append(new)
        for b in range(a + 1, n + 1):  # prune dominated states once per source position
            front: list[tuple[int, int, float, list]] = []
            for s in sorted(states[b], key=lambda s: (s[2], s[1], s[0])):
                if not any(f[0] <= s[0] and f[1] <= s[1] and f[2] <= s[2] for f in front):
                    front.append(s)
            states[b] = front
    return states[n]


def plan_checkpoints(
    layers: nn.Module | Sequence[nn.Module] | LayerProfile,
    sample: torch.Tensor | None = None,
    *,
    memory_budget: int | None = None,
    segments: int | None = None,
    strategy: str = "uniform",
) -> CheckpointPlan:
    """Choose checkpoint boundaries for a flat layer sequence.

    Give ``segments`` (a count) or ``memory_budget`` (bytes, peak of one training step under
    the profile's cost model), not both. Without either: ``uniform``/``smallest`` use
    round(sqrt(n)) segments and ``optimal`` returns the plan with the smallest peak. ``optimal``
    with ``segments`` uses the budget of the ``uniform`` plan with that many segments.
    A budget below the minimum achievable peak raises ValueError naming that minimum.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if segments is not None and memory_budget is not None:
        raise ValueError("give segments or memory_budget, not both")
    if isinstance(layers, LayerProfile):
        profile = layers
    else:
        if sample is None:
            raise ValueError("plan_checkpoints needs a sample batch to profile the layers")
        profile = profile_layers(layers, sample)
    n = len(profile)
    if segments is not None and not 1 <= segments <= n:
        raise ValueError(f"segments must be in [1, {n}], got {segments}")
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget}")

    def done(segs: list[Segment], budget: int | None = memory_budget) -> CheckpointPlan:
        _check_segments(n, segs)
        peak, rec = evaluate_plan(profile, segs)
        return CheckpointPlan(strategy, segs, peak, rec, budget)

    def min_peak() -> int:
        return min(s[1] for s in _pareto_dp(profile, None))

    if strategy in ("uniform", "smallest"):
        build: Callable[[LayerProfile, int], list[Segment]] = (
            _uniform if strategy == "uniform" else _smallest)
        if memory_budget is None:
            return done(build(profile, segments or max(1, round(math.sqrt(n)))))
        candidates = [build(profile, k) for k in range(1, n + 1)]
        scored = [(evaluate_plan(profile, s), s) for s in candidates]
        feasible = [(rec, peak, s) for (peak, rec), s in scored if peak <= memory_budget]
        if not feasible:
            best = min(p for (p, _), _ in scored)
            raise ValueError(
                f"memory_budget {memory_budget} B is below what {strategy!r} plans reach "
                f"(best {best} B; minimum achievable peak {min_peak()} B with any plan)")
        return done(min(feasible, key=lambda f: (f[0], f[1]))[2])

    budget = memory_budget
    if segments is not None:
        budget = evaluate_plan(profile, _uniform(profile, segments))[0]
    front = _pareto_dp(profile, budget)
    if not front:
        raise ValueError(
            f"memory_budget {budget} B is below the minimum achievable peak {min_peak()} B")
    if budget is None:
        best = min(front, key=lambda s: (s[1], s[2]))
    else:
        best = min(front, key=lambda s: (s[2], s[1]))
    return done(best[3], budget)


@contextlib.contextmanager
def _restore_batchnorm(bns: Sequence[nn.Module]) -> Iterator[None]:
    saved = [[b.detach().clone() for b in m.buffers()] for m in bns]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, values in zip(bns, saved, strict=True):
                for b, v in zip(m.buffers(), values, strict=True):
                    b.copy_(v)


class CheckpointedSequential(nn.Sequential):
    """The same layers (shared, not copied) run in checkpointed segments.

    Parameters and state_dict keys are those of the wrapped sequence, so training the result
    trains the original model.
    """

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        plan: CheckpointPlan | None,
        *,
        planner: Callable[[torch.Tensor], CheckpointPlan] | None = None,
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__(layers)
        self.plan = plan
        self._planner = planner
        self.preserve_rng_state = preserve_rng_state

    def _run(self, a: int, b: int) -> Callable[[torch.Tensor], torch.Tensor]:
        mods = list(self.children())[a:b]

        def run(x: torch.Tensor) -> torch.Tensor:
            for m in mods:
                x = m(x)
            return x
        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(x)
        if self.plan is None:
            assert self._planner is not None
            self.plan = self._planner(x.detach())
        mods = list(self.children())
        for a, b, ckpt in self.plan.segments:
            if not ckpt:
                x = self._run(a, b)(x)
                continue
            bns = [m for layer in mods[a:b] for m in layer.modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

            def contexts(bns=bns):
                return contextlib.nullcontext(), _restore_batchnorm(bns)
            x = checkpoint(self._run(a, b), x, use_reentrant=False, context_fn=contexts,
                           preserve_rng_state=self.preserve_rng_state)
        return x


def sc(
    model: nn.Module,
    segments: int | None = None,
    *,
    memory_budget: int | None = None,
    strategy: str = "uniform",
    sample: torch.Tensor | None = None,
    preserve_rng_state: bool = True,
) -> CheckpointedSequential:
    """OpTorch's one-call sequential checkpoints: ``scmodel = sc(model)``.

    The result shares ``model``'s layers and gives the same outputs, gradients and BatchNorm
    running statistics. ``uniform`` without a budget needs no profile; other choices profile the
    layers on ``sample`` now, or on the first training batch when ``sample`` is None.
    """
    layers = layers_of(model)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if segments is not None and not 1 <= segments <= len(layers):
        raise ValueError(f"segments must be in [1, {len(layers)}], got {segments}")
    named = (OrderedDict(model.named_children()) if isinstance(model, nn.Module)
             else OrderedDict((str(i), m) for i, m in enumerate(layers)))
    if isinstance(model, nn.Module) and len(named) != len(layers):
        named = OrderedDict((str(i), m) for i, m in enumerate(layers))

    def planner(x: torch.Tensor) -> CheckpointPlan:
        return plan_checkpoints(layers, x, memory_budget=memory_budget, segments=segments,
                                strategy=strategy)

    plan = None
    if sample is not None:
        plan = planner(sample)
    elif strategy == "uniform" and memory_budget is None:
        k = segments or max(1, round(math.sqrt(len(layers))))
        inplace = [bool(getattr(m, "inplace", False)) for m in layers]
        plan = CheckpointPlan("uniform", _uniform_ends(inplace, k), None, None)  # not profiled
    return CheckpointedSequential(named, plan, planner=planner,
                                  preserve_rng_state=preserve_rng_state)
