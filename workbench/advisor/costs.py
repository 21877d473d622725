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
- one forward per precision, and one whole step with uniform checkpoints (of the precision whose whole step
  was fastest): a checkpoint plan adds the share of the forward it recomputes (profiled layer times) plus,
  per checkpointed segment, what the uniform step measured beyond its own recomputation
  (torch.utils.checkpoint's machinery).

Each is timed after a warm-up call, in blocks of calls (torch.utils.benchmark), or in single calls where one
lasts `min_run_time` (one call for a step of seconds: a 100M-parameter model's optimizer step).

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

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.utils.benchmark as benchmark
from torch import nn

from workbench.calcgraph import training_program
from workbench.checkpoint import CheckpointPlan, LayerProfile, evaluate_plan, plan_checkpoints, profile_layers, sc
from workbench.optim import step_in_backward

from .configs import SPLIT_BLOCKS, Config, training_setup

__all__ = ["Checkpoints", "Workload", "measure_time", "predict_seconds", "profile_checkpoints", "training_step"]


@dataclass
class Workload:
    build: Callable[[], nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable
    optimizer: str
    lr: float
    device: torch.device

    def make_batch(self, config: Config) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
        """Fresh tensors shaped like the user's batch at any batch size (float inputs in bf16 for bf16 weights)."""
        def fresh(t: torch.Tensor, size: int, device: torch.device, cast: bool) -> torch.Tensor:
            dtype = torch.bfloat16 if cast and t.is_floating_point() else t.dtype
            shape = (size, *t.shape[1:])
            if t.is_floating_point():
                return torch.randn(shape, device=device, dtype=dtype)
            return torch.zeros(shape, device=device, dtype=dtype)

        bf16 = config.precision == "bf16"
        return lambda size, device: (fresh(self.inputs, size, device, bf16), fresh(self.targets, size, device, False))

    def program(self, config: Config, *, steps: int = 2, segments: Sequence | None = None) -> Callable:
        setup = training_setup(config, self.build, optimizer=self.optimizer, lr=self.lr, segments=segments)
        batch = self.make_batch(config)
        return lambda size, tracker: training_program(
            setup["build"], tuple(self.inputs.shape[1:]), size, loss=self.loss_fn, optimizer=setup["optimizer"],
            device=self.device, steps=steps, annotate=tracker, autocast=setup["autocast"],
            in_backward=setup["in_backward"], make_batch=batch,
            input_dtype=torch.bfloat16 if config.precision == "bf16" and self.inputs.is_floating_point()
            else self.inputs.dtype)


def _seconds(fn: Callable[[], object], min_run_time: float, device: torch.device) -> tuple[float, int]:
    """Median seconds per call of `fn` after a warm-up call, and the number of calls it made: blocks of calls
    (torch.utils.benchmark's `blocked_autorange`) for calls shorter than `min_run_time`, else single calls
    until `min_run_time` is spent (one, for a call as long as the warm-up)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # as benchmark.Timer's clock
    sync()
    start = time.perf_counter()
    fn()  # warm-up: first-call allocations (an optimizer's state) and kernel selection
    sync()
    if time.perf_counter() - start < min_run_time:
        # NOTE: num_threads: benchmark.Timer runs single-threaded unless told; the steps it predicts run
        # on the caller's intra-op threads (a 2-thread LSTM step measured 1.3 ms by default, 1.5-1.7 ms real)
        measured = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                                   ).blocked_autorange(min_run_time=min_run_time)
        return measured.median, measured.number_per_run * len(measured.raw_times) + 1
    # NOTE: blocked_autorange would spend one more untimed call sizing its block: for a step of seconds
    # (a 100M-parameter model's packed optimizer step) it times one call of one either way
    times: list[float] = []
    while sum(times) < min_run_time:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times) + 1


def training_step(work: Workload, cfg: Config, segments: Sequence | None = None
                  ) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`step(batch) -> loss`: one training step of `cfg` (model, optimizer, precision, step in backward,
    checkpoints) built now on the workload's device, with `step.model`, `step.optimizer`, `step.config`."""
    setup = training_setup(cfg, work.build, optimizer=work.optimizer, lr=work.lr, segments=segments)
    with work.device:
        model = setup["build"]().train()
    opt = setup["optimizer"](model.parameters())
    hooks = step_in_backward(model, opt) if setup["in_backward"] else None
    cast = setup["autocast"]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(work.device) for t in batch)
        if cfg.precision == "bf16" and x.is_floating_point():
            x = x.to(torch.bfloat16)
        with torch.autocast(work.device.type, dtype=cast, enabled=cast is not None):
            value = work.loss_fn(model(x), y)
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
    for cfg in [Config(), *configs]:
        anchors.setdefault(cfg.precision, replace(cfg, step_in_backward=False, checkpoint="none"))
    return anchors


def measure_time(work: Workload, configs: Sequence[Config], batch_size: int, min_run_time: float,
                 runs: dict[str, int], *, scaled: bool = False, checkpoints: Checkpoints | None = None
                 ) -> dict[str, float]:
    """The cost model's inputs (see the module docstring) at `batch_size`: seconds of each precision's whole
    step (`step <precision>`) and forward; of the optimizer steps a candidate swaps in (`optimizer <variant>`;
    with `scaled`, the user's batch is not `batch_size`, all of them); what the update inside backward adds per
    family (`in backward <family>`); and, given the layer profile `checkpoints`, what a checkpointed segment
    adds beyond its recomputation (`per checkpointed segment`, from a uniformly checkpointed step)."""
    seconds: dict[str, float] = {}

    def timed(key: str, what: str, fn: Callable[[], object]) -> None:
        seconds[key], calls = _seconds(fn, min_run_time, work.device)
        runs[what] = runs.get(what, 0) + calls

    def whole(cfg: Config, key: str, segments: Sequence | None = None) -> Callable:
        torch.manual_seed(0)
        step = training_step(work, cfg, segments)
        batch = work.make_batch(cfg)(batch_size, work.device)
        timed(key, "timed training steps", lambda: step(batch))
        return step

    anchors = _anchors(configs)
    needed: dict[str, Config] = {}  # the updates swapped in for their precision's anchor (all of them when scaled)
    for cfg in configs:
        anchor = anchors[cfg.precision]
        if scaled or _step_key(cfg) != _step_key(anchor):
            needed.update({_step_key(cfg): cfg, _step_key(anchor): anchor})
    models = {}  # each precision's model, for the updates timed on its parameters
    families = {_family(c) for c in configs if c.step_in_backward}
    for precision, anchor in anchors.items():
        step = whole(anchor, "step " + precision)
        x, y = work.make_batch(anchor)(batch_size, work.device)
        timed(_forward_key(anchor), "timed forward passes",
              _forward(work, step.model, x, y, training_setup(anchor, work.build)["autocast"]))
        if any(c.precision == precision for c in needed.values()):
            models[precision] = step.model
        del step
        family = _family(anchor)
        if family in families:  # measured once per family, at its first precision
            families.discard(family)
            whole(replace(anchor, step_in_backward=True), "in backward " + family)
            seconds["in backward " + family] -= seconds["step " + precision]
    if checkpoints is not None:
        # NOTE: on the precision whose whole step was fastest: the machinery does not depend on the optimizer,
        # and at 1e8 parameters torch's fp32 AdamW step takes 1.5 s on CPU, the packed kernel's 0.05 s
        fastest = min(anchors, key=lambda p: seconds["step " + p])
        segments = checkpoints.uniform
        whole(replace(anchors[fastest], checkpoint="uniform"), "checkpoint uniform")
        recomputed = seconds[_forward_key(anchors[fastest])] * checkpoints.recompute_share(segments)
        seconds["per checkpointed segment"] = max(0.0, seconds.pop("checkpoint uniform") - seconds["step " + fastest]
                                                  - recomputed) / max(1, sum(c for _, _, c in segments))
    for key, cfg in needed.items():
        # NOTE: on the anchor's model: the update's time does not depend on the values (a 1e8-parameter build
        # takes 0.4 s per variant)
        model = models[cfg.precision]
        plain = replace(cfg, step_in_backward=False, checkpoint="none")
        opt = training_setup(plain, work.build, optimizer=work.optimizer, lr=work.lr)["optimizer"](model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        timed(key, "timed optimizer steps", opt.step)
        del model, opt
    return seconds


def _forward(work: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             cast: torch.dtype | None) -> Callable[[], torch.Tensor]:
    def forward() -> torch.Tensor:
        with torch.autocast(work.device.type, dtype=cast, enabled=cast is not None):
            return work.loss_fn(model(x), y)
    return forward


def _forward_key(cfg: Config) -> str:
    return "forward " + cfg.precision


def _step_key(cfg: Config) -> str:
    return "optimizer " + (f"bf16+{cfg.extra_bits} {cfg.state_dtype} state" if cfg.precision == "bf16" else "torch")


def predict_seconds(cfg: Config, seconds: dict[str, float], scale: float, configs: Sequence[Config],
                    segments: Sequence[tuple[int, int, bool]] = (), checkpoints: Checkpoints | None = None) -> float:
    """Seconds of one step of `cfg` (see the module docstring), checkpointed by `segments` (planned on the
    profile `checkpoints`); `scale` = the user's batch / the timing batch; `configs`: the grid timed."""
    own, theirs = _step_key(cfg), _step_key(_anchors(configs)[cfg.precision])
    total = seconds["step " + cfg.precision]
    if scale != 1 or own != theirs:  # the forward and backward scaled, the anchor's update swapped for its own
        total = (total - seconds[theirs]) * scale + seconds[own]
    if cfg.step_in_backward:
        total += seconds["in backward " + _family(cfg)]
    if checkpoints is not None and any(c for _, _, c in segments):
        total += seconds[_forward_key(cfg)] * scale * checkpoints.recompute_share(segments)
        total += seconds["per checkpointed segment"] * sum(c for _, _, c in segments)
    return total


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


def profile_checkpoints(work: Workload, size: int) -> Checkpoints:
    """One per-layer profile of the fp32 model at `size` (real forward and backward passes of each layer)."""
    torch.manual_seed(0)
    with work.device:
        model = work.build().train()
    x, y = work.make_batch(Config())(size, work.device)
    profile = profile_layers(model, x, split_blocks=SPLIT_BLOCKS, loss_fn=lambda out: work.loss_fn(out, y))
    return Checkpoints(profile, sc(model, split_blocks=SPLIT_BLOCKS).plan.segments)
