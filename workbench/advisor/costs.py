"""The advisor's step-time cost model and the per-layer profile its checkpoint candidates are planned from.

Time (a cost model, derived from measurements in this process, all at the user's batch, or at the largest
the budget allows for fp32 with the forward and backward scaled linearly in the batch):

- one whole training step per precision (fp32, AMP, bf16 weights), run by the same `training_step` that
  `Advice.build()` returns (forward, loss, backward, optimizer step, gradients freed), of its first
  optimizer variant; this anchors the candidates of that precision;
- one optimizer step of each other optimizer variant (packed width k, state dtype) on the model's parameters:
  a candidate's step is its precision's whole step with the anchor's optimizer step swapped for its own;
- one whole step with the update inside backward, per optimizer family (torch's, the packed ones): what it
  costs beyond the plain step (per-parameter updates, hooks) is added to each candidate with step in backward;
- the forward (and loss) per precision, read off the same calls as its whole step, and one whole step with
  uniform checkpoints (of the precision whose whole step was fastest): a checkpoint plan adds the share of the
  forward it recomputes (profiled layer times) plus, per checkpointed segment, what the uniform step measured
  beyond its own recomputation (torch.utils.checkpoint's machinery).

Each is timed after a warm-up call, in blocks of calls (torch.utils.benchmark), or in single calls where one
lasts `min_run_time` (one call for a step of seconds: a 100M-parameter model's optimizer step). A step whose
difference from a plain one is a term (step in backward, uniform checkpoints) is timed together with that
plain step, in alternating samples (`steptime.time_steps`), where both fit the memory free now.

Checkpointing (models whose layers open): one per-layer profile (`workbench.checkpoint.profile_layers`,
real passes of each layer at a small batch) gives the share of the forward each plan recomputes, and the
`optimal` candidate's plan: the least recomputation whose activations fit what the budget leaves after the
same configuration's weights, gradients, state and workspace (OpTorch's planner, Ahmed & Naveed 2021,
Sec. II-B-2, an exact dynamic program over the profile). The profile's bytes are scaled to the candidate's
precision and batch by its un-checkpointed activations; the chosen plan is then traced like every other
candidate, so its predicted peak is CalcGraph's, not the profile's. Without a profile (checkpoint
candidates narrowed away) nothing is profiled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from workbench.calcgraph import search_max
from workbench.checkpoint import (
    CheckpointPlan, LayerProfile, evaluate_plan, plan_checkpoints, preserved_state, profile_layers, sc, units_of,
)
from workbench.optim import step_in_backward

from .blocks import BlockCheckpoints, profile_blocks
from .configs import SPLIT_BLOCKS, Config, checkpoint_kind, training_setup
from .steptime import StepTime, pooled, time_parts, time_step, time_steps
from .workload import Workload

__all__ = ["Checkpoints", "measure_time", "predict_seconds", "profile_checkpoints", "time_terms",
           "timing_batches", "training_step"]


def training_step(work: Workload, cfg: Config, segments: Sequence | None = None, *,
                  forward_clock: list[float] | None = None
                  ) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`step(batch) -> loss`: one training step of `cfg` (model, optimizer, precision, step in backward,
    checkpoints) built now on the workload's device, with `step.model`, `step.optimizer`, `step.config`.
    Given `forward_clock`, each step appends the seconds of its forward and loss to it."""
    setup = training_setup(cfg, work.build, optimizer=work.optimizer, lr=work.lr, segments=segments)
    with work.device:
        model = work.shard(setup["build"]()).train()
    opt = setup["optimizer"](model.parameters())
    hooks = step_in_backward(model, opt) if setup["in_backward"] else None
    cast = setup["autocast"]

    sync = torch.cuda.synchronize if work.device.type == "cuda" and forward_clock is not None else (lambda: None)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(work.device) for t in batch)
        if cfg.precision == "bf16" and x.is_floating_point():
            x = x.to(torch.bfloat16)
        sync()
        start = time.perf_counter()
        with torch.autocast(work.device.type, dtype=cast, enabled=cast is not None):
            value = work.loss_fn(model(x), y)
        if forward_clock is not None:
            sync()
            forward_clock.append(time.perf_counter() - start)
        value.backward()
        if hooks is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return value.detach()

    step.model, step.optimizer, step.config = model, opt, cfg
    return step


def _family(cfg: Config) -> str:
    return "packed" if cfg.precision == "bf16" else "torch"


def _anchors(configs: Sequence[Config]) -> dict[str, Config]:
    """Per precision, the plain configuration (no step in backward, no checkpoints) of its first optimizer
    variant: the whole step every candidate of that precision is predicted from."""
    anchors: dict[str, Config] = {}
    for cfg in configs:
        anchors.setdefault(cfg.precision, replace(cfg, step_in_backward=False, checkpoint="none"))
    return anchors


def _affine(times: dict[int, float], batch_size: int) -> float:
    """Seconds at `batch_size` from those timed at it, or at two batches below it (the line through them, never
    below the larger batch's time)."""
    if len(times) == 1:
        (size, seconds), = times.items()
        return seconds * batch_size / size
    (b0, t0), (b1, t1) = sorted(times.items())
    return max(t1, t1 + (t1 - t0) / (b1 - b0) * (batch_size - b1))


def timing_batches(fits: Callable[[int], bool], batch_size: int) -> list[int]:
    """Where a precision's whole step is timed: the user's batch where its real step fits the memory free now,
    else the largest batch that fits and half of it (the step's time extrapolated on the line through them)."""
    if fits(batch_size):
        return [batch_size]
    top = search_max(fits, max(1, batch_size // 2), limit=batch_size)[0]
    if top == 0:
        raise ValueError(f"the model's plainest step does not fit the memory free now even at batch 1: "
                         f"nothing can be timed (batch {batch_size})")
    return sorted({max(1, top // 2), top})


def measure_time(work: Workload, configs: Sequence[Config], min_run_time: float, runs: dict[str, int], *,
                 fits: Callable[[Config, int, float], bool] | None = None, checkpoints: Checkpoints | None = None
                 ) -> tuple[dict[str, float], dict[str, str]]:
    """The cost model's inputs (see the module docstring) at the user's batch: seconds of each precision's whole
    step (`step <precision>`) and forward, timed at the batches `timing_batches` picks (`fits(anchor, size,
    share)`: whether that real step fits `share` of the memory free now; default: always); of the optimizer
    steps a candidate swaps
    in (`optimizer <variant>`); what the update inside backward adds per family (`in backward <family>`); and,
    given the layer profile `checkpoints`, what a checkpointed segment adds beyond its recomputation
    (`per checkpointed segment`, from a uniformly checkpointed step). Returns (seconds, how each key was timed:
    the batches, and 'unreliable' where the machine was too busy to time it, `steptime.StepTime.reliable`)."""
    seconds: dict[str, float] = {}
    how: dict[str, str] = {}

    def note(key: str, what: str, measured: StepTime) -> StepTime:
        runs[what] = runs.get(what, 0) + measured.calls
        if not measured.reliable:
            how[key] = f"unreliable: {measured.stalled} of {measured.samples} samples stalled"
        return measured

    def wholes(cfgs: Sequence[Config], key: str, size: int) -> list[tuple[Callable, float, float]]:
        """Each step and, read off the same calls, its forward and loss (`time_steps`' parts). Several steps (a plain
        one first, then variants of it that hold no more memory) are timed together where the plain one fits
        the share of the memory each gets (`fits(plain, size, share)`), one after the other otherwise."""
        if len(cfgs) > 1 and fits is not None and not fits(cfgs[0], size, 1 / len(cfgs)):
            return [found for cfg in cfgs for found in wholes([cfg], key, size)]
        steps, fns, parts = [], [], []
        for cfg in cfgs:
            torch.manual_seed(0)
            clock: list[float] = []
            step = training_step(work, cfg, forward_clock=clock)
            batch = work.make_batch(cfg)(size, work.device)
            steps.append(step)
            fns.append(lambda step=step, batch=batch: step(batch))
            parts.append(lambda clock=clock: _drained(clock))
        measured = time_steps(fns, min_run_time=min_run_time, device=work.device, parts=parts)
        for m in measured:
            note(key, "timed training steps", m)
        return [(step, m.seconds, m.part_seconds) for step, m in zip(steps, measured, strict=True)]

    anchors = _anchors(configs)
    needed: dict[str, Config] = {}  # the updates swapped in for their precision's anchor
    for cfg in configs:
        anchor = anchors[cfg.precision]
        if _step_key(cfg) != _step_key(anchor):
            needed.update({_step_key(cfg): cfg, _step_key(anchor): anchor})
    models = {}  # each precision's model, for the updates timed on its parameters
    families = {_family(c) for c in configs if c.step_in_backward}
    largest: dict[str, int] = {}  # per precision: its largest timing batch
    for precision, anchor in anchors.items():
        sizes = timing_batches(lambda n, a=anchor: fits is None or fits(a, n, 1.0), work.batch_size)
        steps, forwards = {}, {}
        family = _family(anchor)
        for size in sizes:  # the forward (and loss), which prices a checkpoint's recomputation, in the same calls
            # what the update inside backward adds: once per family, at its first precision, timed together with
            # its own plain step
            beside = [replace(anchor, step_in_backward=True)] if size == sizes[-1] and family in families else []
            (step, steps[size], forwards[size]), *sib = wholes([anchor, *beside], "step " + precision, size)
            if sib:
                families.discard(family)
                seconds["in backward " + family] = sib[0][1] - steps[size]
            del sib
        seconds["step " + precision] = _affine(steps, work.batch_size)
        seconds[_forward_key(anchor)] = _affine(forwards, work.batch_size)
        largest[precision] = sizes[-1]
        extrapolated = "" if sizes == [work.batch_size] else f"timed at batches {sizes[0]} and {sizes[-1]}, " \
                                                               f"extrapolated"
        how["step " + precision] = "; ".join(filter(None, [extrapolated, how.get("step " + precision, "")]))
        if any(c.precision == precision for c in needed.values()):
            models[precision] = step.model
        del step
    if checkpoints is not None:
        # NOTE: on the precision whose whole step was fastest: the machinery does not depend on the optimizer,
        # and at 1e8 parameters torch's fp32 AdamW step takes 1.5 s on CPU, the packed kernel's 0.05 s
        fastest = min(anchors, key=lambda p: seconds["step " + p])
        segments, plain = checkpoints.uniform, anchors[fastest]
        # timed together with its plain step again: the difference is what checkpointing adds
        (_, plain, forward), (_, uniform, _) = wholes([plain, replace(plain, checkpoint="uniform")],
                                                      "checkpoint uniform", largest[fastest])
        recomputed = forward * checkpoints.recompute_share(segments)
        seconds["per checkpointed segment"] = max(0.0, uniform - plain - recomputed) / max(
            1, sum(c for _, _, c in segments))
    for key, cfg in needed.items():
        # NOTE: on the anchor's model: the update's time does not depend on the values (a 1e8-parameter build
        # takes 0.4 s per variant)
        model = models[cfg.precision]
        plain_cfg = replace(cfg, step_in_backward=False, checkpoint="none")
        opt = training_setup(plain_cfg, work.build, optimizer=work.optimizer, lr=work.lr)["optimizer"](
            model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        seconds[key] = note(key, "timed optimizer steps", time_step(opt.step, min_run_time=min_run_time,
                                                                     device=work.device)).seconds
        del model, opt
    return seconds, how


def _drained(clock: list[float]) -> float:
    """The seconds a `training_step`'s forward clock gathered since last drained."""
    spent = sum(clock)
    clock.clear()
    return spent


def _forward_key(cfg: Config) -> str:
    return "forward " + cfg.precision


def _step_key(cfg: Config) -> str:
    return "optimizer " + (f"bf16+{cfg.extra_bits} {cfg.state_dtype} state" if cfg.precision == "bf16" else "torch")


def time_terms(cfg: Config, configs: Sequence[Config], segments: Sequence[tuple[int, int, bool]] = (),
               checkpoints: Checkpoints | None = None) -> dict[str, float]:
    """One step of `cfg` as a sum of timed quantities (see the module docstring): {key: coefficient}, for a
    candidate checkpointed by `segments` (planned on the profile `checkpoints`); `configs`: the grid timed."""
    own, theirs = _step_key(cfg), _step_key(_anchors(configs)[cfg.precision])
    terms = {"step " + cfg.precision: 1.0}
    if own != theirs:  # the anchor's update swapped for the candidate's own
        terms.update({own: 1.0, theirs: -1.0})
    if cfg.step_in_backward:
        terms["in backward " + _family(cfg)] = 1.0
    if checkpoints is not None and any(c for _, _, c in segments):
        terms[_forward_key(cfg)] = checkpoints.recompute_share(segments)
        terms["per checkpointed segment"] = float(sum(c for _, _, c in segments))
    return terms


def predict_seconds(terms: dict[str, float], seconds: dict[str, float]) -> float:
    """Seconds of one step at the user's batch: the `time_terms` of a candidate, summed."""
    return sum(seconds[key] * coefficient for key, coefficient in terms.items())


@dataclass
class Checkpoints:
    """The per-layer profile (fp32, at a small batch) that checkpoint candidates are planned and timed from."""

    profile: LayerProfile
    uniform: list[tuple[int, int, bool]]  # the segments `sc(model)` runs by default
    # plans already searched, as (budget, the plan's own peak, segments); see `optimal`
    _solved: list[tuple[float, int, list[tuple[int, int, bool]]]] = field(default_factory=list, repr=False)
    _lowest: CheckpointPlan | None = field(default=None, repr=False)

    def recompute_share(self, segments: Sequence[tuple[int, int, bool]]) -> float:
        """The share of one forward pass a plan recomputes in backward (profiled layer times)."""
        return evaluate_plan(self.profile, segments)[1] / max(sum(self.profile.time_s), 1e-12)

    @property
    def unchecked_peak(self) -> int:
        return evaluate_plan(self.profile, [(0, len(self.profile), False)])[0]

    def optimal(self, budget: float) -> list[tuple[int, int, bool]]:
        """The least recomputation under `budget` (profile bytes); the smallest peak when nothing fits it.

        # NOTE: the advisor asks once per candidate, each with its own budget, and each search is
        # the whole dynamic program. The plan found for budget B is also the answer for every budget
        # in [its own peak, B] (fewer plans fit, it still does), so those reuse it exactly.
        """
        if self._lowest is None:
            self._lowest = plan_checkpoints(self.profile, strategy="optimal")
        if budget < self._lowest.predicted_peak_bytes:  # nothing fits: the lowest peak there is
            return self._lowest.segments
        for searched, peak, segments in self._solved:
            if peak <= budget <= searched:
                return segments
        plan = plan_checkpoints(self.profile, memory_budget=int(budget), strategy="optimal")
        self._solved.append((int(budget), plan.predicted_peak_bytes, plan.segments))
        return plan.segments


def profile_checkpoints(work: Workload, size: int, timed: int) -> Checkpoints | BlockCheckpoints:
    """One per-layer profile of the fp32 model at `size` (real forward and backward passes of each layer); for a
    model checkpointed through its blocks, its blocks' profile (`blocks.profile_blocks`). Each layer's (block's)
    share of the forward is timed at batch `timed` in passes the machine did not stall (`steptime.time_parts`).
    """
    torch.manual_seed(0)
    with work.device:
        model = work.build().train()
    x, y = work.make_batch(Config())(size, work.device)
    big = work.make_batch(Config())(timed, work.device)[0] if timed != size else x
    if checkpoint_kind(work.build) == "blocks":
        return profile_blocks(model, x, big)
    profile = profile_layers(model, x, repeats=1, split_blocks=SPLIT_BLOCKS, loss_fn=lambda out: work.loss_fn(out, y))
    units = units_of(model, split_blocks=SPLIT_BLOCKS)
    sync = torch.cuda.synchronize if work.device.type == "cuda" else (lambda: None)

    shapes: list[tuple] = []

    def chain() -> list[float]:
        times, state = [], big
        shapes.clear()
        for unit in units:
            shapes.append(_shapes(state))
            sync()
            start = time.perf_counter()
            state = unit(state)
            sync()
            times.append(time.perf_counter() - start)
        return times

    with preserved_state(units), torch.enable_grad():  # as in training: the forward saves for backward
        seconds, _ = time_parts(chain)
    seconds = pooled(seconds, [(_structure(u), s) for u, s in zip(units, shapes, strict=True)])
    return Checkpoints(replace(profile, time_s=seconds), sc(model, split_blocks=SPLIT_BLOCKS).plan.segments)


def _shapes(state) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(state) if isinstance(t, torch.Tensor))


def _structure(module: nn.Module) -> tuple:
    """What a module computes, up to its values: its class and the shapes of its parameters."""
    return type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
