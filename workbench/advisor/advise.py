"""The memory advisor: for a user's model, batch and budget, every combination of techniques predicted,
the fastest that fits chosen, and the choice verified with one real run.

Memory: each candidate's training program (build, then two steps: the optimizer state is created in the
first) is traced under fake tensors by CalcGraph ("CalcGraph: taming the high costs of deep learning using
models", 2022, Section 3.2), so no step of any candidate runs at the user's batch; programs that differ only in
the packed optimizer's state are traced once (`plans`). On CPU the kernels' scratch that fake tensors cannot
see is calibrated once per precision and carried over, op call by op call, to every candidate of that precision.

The step-time cost model and the checkpoint profile are in `costs`, the user's batch and loss in `workload`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from numbers import Real

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.calcgraph import search_max
from workbench.measure import AllocatorMeter, check_device

from .configs import Config, checkpoint_kind, default_grid
from .costs import (
    Checkpoints, measure_time, predict_seconds, profile_checkpoints, time_terms, timing_batches, training_step,
)
from .plans import CATEGORIES, Plan, Plans
from .steptime import free_memory_bytes
from .workload import Workload

__all__ = ["CATEGORIES", "Advice", "advise"]

@dataclass
class Advice:
    """Every candidate predicted (`table`), the fastest that fits (`best`), `build()` and `verify()`."""

    table: pd.DataFrame | None
    memory_budget: float
    margin: float
    batch_size: int
    device: torch.device
    real_runs: dict[str, int]
    _workload: Workload = field(repr=False)
    _configs: dict[str, Config] = field(repr=False)
    _plans: Plans = field(repr=False)
    _timer: Callable[[], tuple[dict[str, float], dict[str, str]]] = field(repr=False)  # `costs.measure_time`
    _checkpoints: Checkpoints | None = field(repr=False)
    _segments: dict[str, list] = field(default_factory=dict, repr=False)
    _by_name: dict[str, Plan] = field(default_factory=dict, repr=False)  # each candidate's plan now
    timing: dict[str, str] = field(default_factory=dict)  # how each timed quantity was measured, where not plainly
    _left_out: list[str] = field(default_factory=list, repr=False)  # candidates left out, and why
    _seconds: dict[str, float] = field(default_factory=dict, repr=False)  # timed once a candidate fits a budget
    verification: dict | None = None
    planning_seconds: dict[str, float] = field(default_factory=dict)  # wall seconds per phase of `advise`

    def _optimal_segments(self, cfg: Config) -> list:
        """The `optimal` candidate's checkpoints for the current budget: the activations may use what the same
        configuration without checkpoints leaves of the usable budget."""
        parts = self._plans.plan(replace(cfg, checkpoint="none")).categories(self.batch_size)
        fixed = sum(parts.values()) - parts["activations"]
        scale = max(parts["activations"], 1) / max(self._checkpoints.unchecked_peak, 1)
        return self._checkpoints.optimal((self.memory_budget * (1 - self.margin) - fixed) / scale)

    def _row(self, cfg: Config) -> dict:
        if cfg.name not in self._by_name:  # an optimal candidate's is made for each budget (`rebudget`)
            self._by_name[cfg.name] = self._plans.plan(cfg)
        plan = self._by_name[cfg.name]
        segments = [(0, 0, False)]
        if cfg.checkpoint != "none":  # a checkpoint candidate implies the profile (see `advise`)
            segments = self._segments.get(cfg.name, self._checkpoints.uniform)
        terms = time_terms(cfg, list(self._configs.values()), segments, self._checkpoints)
        return {"config": cfg.name, "precision": cfg.precision, "extra_bits": cfg.extra_bits,
                "state_dtype": cfg.state_dtype, "step_in_backward": cfg.step_in_backward,
                "checkpoint": cfg.checkpoint, "segments": len(segments),
                "predicted_peak_bytes": plan.peak(self.batch_size), **plan.categories(self.batch_size),
                "predicted_step_seconds": predict_seconds(terms, self._seconds) if self._seconds else math.nan,
                "time_reliable": bool(self._seconds) and not any("unreliable" in self.timing.get(key, "")
                                                                 for key in terms)}

    def rebudget(self, memory_budget: float) -> Advice:
        """The predictions judged against another budget: `fits`, `max_batch` and `best` recomputed, and the
        `optimal` checkpoint candidates planned again for it (traced; no real step). Returns self."""
        _check_budget(memory_budget)
        self.memory_budget = float(memory_budget)
        optimal = [c for c in self._configs.values() if c.checkpoint == "optimal"]  # planned again, traced
        for cfg in optimal:
            self._segments[cfg.name] = self._optimal_segments(cfg)
        self._plans.trace_ahead([(cfg, self._segments[cfg.name]) for cfg in optimal])
        for cfg in optimal:
            self._by_name[cfg.name] = self._plans.plan(cfg, self._segments[cfg.name])
        if self.table is None or any(c.checkpoint == "optimal" for c in self._configs.values()):
            self.table = pd.DataFrame([self._row(c) for c in self._configs.values()])
        cap = memory_budget * (1 - self.margin)
        self.table["fits"] = self.table["predicted_peak_bytes"] <= cap
        if self.table["fits"].any() and not self._seconds:  # the real steps, once a candidate fits a budget
            self._seconds, self.timing = self._timer()
            self.table = pd.DataFrame([self._row(c) for c in self._configs.values()])
            self.table["fits"] = self.table["predicted_peak_bytes"] <= cap
        rows = list(zip(self.table["config"], self.table["fits"], strict=True))
        self._plans.trace_batch_one([self._by_name[name] for name, fits in rows
                                     if _searches_batch_one(self._by_name[name], cap, self.batch_size, fits)])
        self.table["max_batch"] = [_max_batch(self._by_name[name], cap, self.batch_size, fits) for name, fits in rows]
        return self

    @property
    def notes(self) -> list[str]:
        """What the table cannot show: how step times were timed where not plainly, candidates left out and why."""
        notes = [f"{key} {how}" for key, how in self.timing.items() if "extrapolated" in how]
        stalled = [key for key, how in self.timing.items() if "unreliable" in how]
        if stalled:
            notes.append(f"the machine was too busy to time {', '.join(stalled)}: in most samples the step's "
                         f"threads waited for a CPU that other processes held, so the step times that use them "
                         f"(time_reliable False) are unreliable; run advise() again on a quieter machine")
        if not self._seconds:
            notes.append("no candidate fits the budget: step times were not measured (no real step was run)")
        return notes + self._left_out

    @property
    def best(self) -> pd.Series:
        """The fastest candidate whose predicted peak fits `memory_budget * (1 - margin)`."""
        fits = self.table[self.table["fits"]]
        if not len(fits):
            smallest = self.table.loc[self.table["predicted_peak_bytes"].idxmin()]
            raise ValueError(
                f"no candidate fits {self.memory_budget:.0f} bytes (margin {self.margin}) at batch {self.batch_size}: "
                f"the smallest, {smallest['config']}, needs {int(smallest['predicted_peak_bytes'])} bytes; its "
                f"largest batch in the budget is {int(smallest['max_batch'])}")
        return fits.loc[fits["predicted_step_seconds"].idxmin()]

    def config(self, name: str | None = None) -> Config:
        return self._configs[name if name is not None else self.best["config"]]

    def program(self, config: str | None = None) -> Callable:
        """The training program the plan traced for the chosen (or named) candidate: `program(batch_size,
        None)` runs it for real (model and optimizer built, two steps on fresh batches)."""
        cfg = self.config(config)
        return self._workload.program(cfg, segments=self._segments.get(cfg.name))

    def make_batch(self, config: str | None = None) -> Callable[[int, torch.device], tuple]:
        """`make_batch(size, device)`: fresh (inputs, targets) like the user's, as the candidate takes them."""
        return self._workload.make_batch(self.config(config))

    def build(self, config: str | None = None) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """`step(batch) -> loss`: one training step of the chosen configuration (or the named one), with its
        model (`step.model`) and optimizer (`step.optimizer`) built now on the advice's device. Planned for
        sharded training (`world_size` > 1), the model is sharded by FSDP2: call it in each rank of your
        initialized process group (or in `with advice.sharding():`, rank 0 alone)."""
        cfg = self.config(config)
        return training_step(self._workload, cfg, self._segments.get(cfg.name))

    def _run_chosen(self, repeats: int) -> tuple[int, float]:
        """The chosen candidate built and stepped twice under `AllocatorMeter`, then timed (median of `repeats`
        steps outside the meter: the profiler's memory events slow every op down)."""
        batch = self._workload.make_batch(self.config())
        gc.collect()
        with AllocatorMeter(self.device) as meter:
            step = self.build()
            step(batch(self.batch_size, self.device))
            step(batch(self.batch_size, self.device))
        times = []
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(repeats):
            data = batch(self.batch_size, self.device)
            sync()
            start = time.perf_counter()
            step(data)
            sync()
            times.append(time.perf_counter() - start)
            del data
        return meter.peak_bytes, statistics.median(times)

    def sharding(self) -> contextlib.AbstractContextManager:
        """For a plan of sharded training (`world_size` > 1): the fake process group `build()` and its steps run
        in (rank 0 alone: its memory and compute, no communication); nothing otherwise."""
        return self._workload.sharding()

    def verify(self, *, repeats: int = 3) -> dict:
        """Run the chosen configuration for real: model and optimizer built and two steps at the user's batch
        under `AllocatorMeter` (the program the plan predicts), then `repeats` more steps of the same model
        timed outside the meter (median). A peak that misses the
        prediction by more than the margin recalibrates that candidate (real steps at small batches) and the
        choice is made again (not verified again). Returns and keeps `verification`."""
        row = self.best
        with self._workload.sharding():  # a sharded candidate: rank 0 in a fake group
            measured, seconds = self._run_chosen(repeats)
        self.real_runs["verification"] = self.real_runs.get("verification", 0) + 1
        predicted = int(row["predicted_peak_bytes"])
        error = (predicted - measured) / measured
        result = {"config": row["config"], "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
                  "peak_error": error, "predicted_step_seconds": float(row["predicted_step_seconds"]),
                  "measured_step_seconds": seconds, "within_budget": measured <= self.memory_budget,
                  "recalibrated": False, "choice_after": row["config"]}
        if abs(error) > self.margin and self.device.type in ("cpu", "cuda") and not self._plans.no_allocator_events:
            graph = self._by_name[row["config"]].graph
            graph.calibrate(sizes=(1, 2, 4, 8, 17), check=(16, 33), refine=1)  # 17, 33: see Calibration
            self._plans.forget_peaks()
            # the candidates that share this plan run the same program: recalibrated with it (its own real steps
            # replace the calibration carried over from its precision's plain program)
            for name, plan in self._by_name.items():
                if plan.graph is graph:
                    at = self.table["config"] == name
                    self.table.loc[at, "predicted_peak_bytes"] = plan.peak(self.batch_size)
                    self.table.loc[at, "fits"] = plan.peak(self.batch_size) <= self.memory_budget * (1 - self.margin)
            self.real_runs["calibration"] = self.real_runs.get("calibration", 0) + 1
            result.update(recalibrated=True, choice_after=self.best["config"])
        self.verification = result
        return result


def _searches_batch_one(plan: Plan, cap: float, batch_size: int, fits: bool) -> bool:
    """Whether `_max_batch` asks `plan` for batch 1: the user's batch does not fit, the held bytes do, and neither does
    batch 2 (the search halves down from the user's batch)."""
    return not fits and plan.held_bytes(batch_size) <= cap and (batch_size == 1 or not plan.fits(2, cap))


def _max_batch(plan: Plan, cap: float, batch_size: int, fits: bool) -> int:
    """The largest batch whose predicted peak fits `cap` (CalcGraph's search). Where the user's batch fits, the
    smaller ones are not asked (the search assumes the peak grows with the batch): batch 1, a program of its own
    (`CompiledGraph._batch_one`), is traced only for a candidate whose search goes down to it, and not where the
    weights, gradients and optimizer state live at one moment already exceed `cap`: every batch holds them (0
    without a search)."""
    if not fits and plan.held_bytes(batch_size) > cap:
        return 0
    return search_max(lambda b: (fits and b <= batch_size) or plan.fits(b, cap), batch_size, limit=2**20)[0]


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """What the process held before out of the cyclic collector's reach inside (`gc.freeze`), where nothing had frozen
    any; all of it back in its reach after.

    # NOTE: each full collection walks every object the collector tracks, torch's and a notebook's (270,000 in a bare
    # process): four in DenseNet-BC-100's `advise` took 0.16-0.31 s each, 1.0 s in all; with that heap frozen, seven
    # over what planning made took 0.49 s
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_budget(memory_budget: object) -> None:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, Real) or not (
            math.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be a finite number of bytes > 0, got {memory_budget!r}")


@_heap_frozen()
def advise(
    model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *, memory_budget: float,
    loss_fn: Callable | None = None, optimizer: str = "adamw", lr: float = 1e-3,
    device: torch.device | str | None = None, candidates: Sequence[Config] | Callable[[Config], bool] | None = None,
    margin: float = 0.05, calibrate: bool | None = None, min_run_time: float = 0.2, progress: bool = False,
    world_size: int = 1,
) -> Advice:
    """Predict every candidate configuration's peak memory (zero steps at the user's batch) and step time,
    and choose the fastest that fits `memory_budget * (1 - margin)` bytes.

    `model_fn()` builds the user's model; `batch = (inputs, targets)` at the batch size wanted (targets as the
    loss takes them; default loss cross-entropy). `candidates`: configs, or a predicate that narrows the
    default grid (`configs.default_grid`). `calibrate` (default: on CPU and CUDA) adds the kernels' scratch measured
    at small batches. Raises ValueError naming the layer when the model cannot be traced.

    `world_size` > 1 plans training sharded by FSDP2 over that many ranks (each child module with parameters,
    then the root, `fully_shard`ed): every figure is one rank's at its own batch (`batch` is the per-rank
    batch, `memory_budget` each rank's), planned as rank 0 in a fake process group (CPU); step times leave
    communication out. Checkpoint candidates are not planned sharded.
    """
    _check_budget(memory_budget)
    if isinstance(margin, bool) or not isinstance(margin, Real) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError("batch must be (inputs, targets), two tensors with the batch first")
    inputs, targets = batch
    if inputs.dim() < 1 or inputs.shape[0] < 1 or targets.shape[:1] != inputs.shape[:1]:
        raise ValueError(f"inputs and targets need the same batch size >= 1, got {tuple(inputs.shape)} and "
                         f"{tuple(targets.shape)}")
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, Real) or not 0 < min_run_time < math.inf:
        raise ValueError(f"min_run_time must be a number of seconds > 0, got {min_run_time!r}")
    dev = check_device(device, "advise") if device is not None else inputs.device
    if isinstance(lr, bool) or not isinstance(lr, Real) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (outputs, targets) -> loss, got {loss_fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 1024:
        raise ValueError(f"world_size must be a whole number of ranks in 1..1024, got {world_size!r}")
    if world_size > 1 and dev.type != "cpu":
        raise ValueError(f"world_size {world_size}: sharded plans are made on the CPU (a fake process group of "
                         f"CPU ranks); got device {dev}")
    work = Workload.of(model_fn, inputs, targets, loss_fn, optimizer, lr, dev, world_size)
    checkpointable = checkpoint_kind(model_fn) is not None and world_size == 1
    grid = default_grid(dev, checkpointable=checkpointable)
    if callable(candidates):
        grid = [c for c in grid if candidates(c)]
    elif candidates is not None:
        grid = list(candidates)
        strays = [c for c in grid if not isinstance(c, Config)]
        if strays:
            raise TypeError(f"candidates must be Config objects (workbench.advisor.Config) or a predicate on them, "
                            f"got {strays[0]!r} ({type(strays[0]).__name__})")
    if not grid:
        raise ValueError("no candidate configuration left to consider")
    batch_size = int(inputs.shape[0])
    runs: dict[str, int] = {}
    phases: dict[str, float] = {}  # wall seconds of each phase of planning (`Advice.planning_seconds`)
    calibrate = dev.type in ("cpu", "cuda") if calibrate is None else calibrate
    # on the CPU, each plain program's line is checked by its calibration's real runs, not by one more trace
    plans = Plans(work, grid, checked_by_calibration=calibrate and dev.type == "cpu" and world_size == 1)
    # each distinct program once, then the plain one each optimal plan is budgeted against
    programs = [replace(c, checkpoint="none") if c.checkpoint == "optimal" else c for c in grid]
    with _timed(phases, "traces"):
        plans.trace_ahead([(cfg, None) for cfg in programs])
        for cfg in tqdm(programs, desc="plans", disable=not progress, leave=False):
            plans.graph(cfg)
    if calibrate:
        for precision in dict.fromkeys(Config(c.precision, c.extra_bits) for c in grid):
            with _timed(phases, "calibration"):
                steps = plans.calibrate(precision, batch_size)
            runs["calibration runs"] = runs.get("calibration runs", 0) + steps
    with _timed(phases, "traces"):  # the lines calibration did not show, by traces at batch 4
        plans.check_lines()
    # NOTE: a real step is timed wherever it fits the memory free now (not the budget, which is what the user
    # wants the choice to take; at most 4x it, so that an absurd batch is not timed at a batch that fills the
    # machine): at the user's batch, else two smaller batches (see `costs.timing_batches`)
    room = min(0.9 * free_memory_bytes(dev), 4 * float(memory_budget))

    def fits(cfg: Config, size: int, share: float = 1.0) -> bool:
        with _timed(phases, "traces"):
            return plans.plan(cfg).fits(size, room * share)

    checkpoints = None
    if any(c.checkpoint != "none" for c in grid):
        with _timed(phases, "layer profile"):
            # memory at a small batch; each layer's share of the forward where fp32's whole step is timed
            timed = timing_batches(lambda n: fits(Config(), n), batch_size)[-1]
            checkpoints = profile_checkpoints(work, min(batch_size, 4), timed)
        plans.uniform = list(checkpoints.uniform)
        runs["layer profile (checkpoints)"] = 1

    def timer() -> tuple[dict[str, float], dict[str, str]]:
        checkpoints = advice._checkpoints
        with _timed(phases, "timing"), work.sharding():
            return measure_time(work, grid, min_run_time, runs, fits=fits, checkpoints=checkpoints)

    left_out = [] if checkpointable or world_size > 1 else [
        "no checkpoint candidates: the model's layers do not open (not an nn.Sequential, no .as_sequential()) and "
        "no module class repeats as blocks holding half its parameters"]
    if world_size > 1:
        left_out.append(f"sharded by FSDP2 over {world_size} ranks: peaks are one rank's at its batch (planned as "
                        f"rank 0 in a fake process group), step times one rank's compute without communication; no "
                        f"checkpoint candidates (not planned sharded)")
    advice = Advice(None, float(memory_budget), float(margin), batch_size, dev, runs, work,
                    {c.name: c for c in grid}, plans, timer, checkpoints, _left_out=left_out)
    with _timed(phases, "plans and table"):
        advice.rebudget(memory_budget)
    phases["plans and table"] -= phases.get("timing", 0.0)
    advice.planning_seconds = phases
    return advice
