"""The memory advisor: for a user's model, batch and budget, every combination of techniques predicted,
the fastest that fits chosen, and the choice verified with one real run.

Memory: each candidate's training program (build, then two steps: the optimizer state is created in the
first) is traced under fake tensors by CalcGraph ("CalcGraph: taming the high costs of deep learning using
models", 2022, Section 3.2), so no step of any candidate runs at the user's batch. Each program is traced once.
On CPU the kernels' scratch that fake tensors cannot see is calibrated once per precision (the candidate
without step in backward or checkpointing, real steps at batches 1, 2, 4 and 8, `CompiledGraph.calibrate`;
one packed width k stands for all) and added to every candidate of that precision as a workspace term.

The step-time cost model and the checkpoint profile are in `costs`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
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

from workbench.calcgraph import CompiledGraph, search_max
from workbench.measure import AllocatorMeter, check_device

from .configs import Config, checkpoint_kind, default_grid
from .costs import Checkpoints, measure_time, predict_seconds, profile_checkpoints, time_terms, training_step
from .steptime import free_memory_bytes
from .workload import Workload

__all__ = ["Advice", "advise"]

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "workspace")
_KINDS = {"parameter": "weights", "buffer": "weights", "gradient": "gradients", "state": "optimizer_state",
          "input": "activations", "activation": "activations"}


def _categories(graph: CompiledGraph, batch_size: int, extra: int, recomputed: set[int] = frozenset()
                ) -> dict[str, int]:
    """Bytes live at the predicted peak by category; a checkpoint's recomputed tensors (allocation ids
    `recomputed`) are activations; the calibrated scratch term counts as workspace."""
    frame = graph.variables(batch_size)
    live = graph.timeline(batch_size)
    at = int(live.argmax()) if len(live) else 0
    alive = frame[(frame["born"] <= at) & (frame["died"] > at)]
    kinds = alive["kind"].where(~(alive.index.isin(list(recomputed)) & (alive["kind"] == "temporary")), "activation")
    out = dict.fromkeys(CATEGORIES, 0)
    for kind, nbytes in alive["bytes"].groupby(kinds).sum().items():
        out[_KINDS.get(kind, "workspace")] += int(nbytes)
    out["workspace"] += extra
    return out


def _compile(work: Workload, cfg: Config, segments: Sequence | None = None) -> CompiledGraph:
    """CalcGraph's plan of a candidate's program, with `recomputed`: the ids of the allocations its checkpoints'
    recomputation makes (see `workload._recomputation`)."""
    recomputed: set[int] = set()
    graph = CompiledGraph(work.program(cfg, segments=segments, recomputed=recomputed), device=work.device,
                          input_shape=tuple(work.inputs.shape[1:]), description=cfg.name)
    graph.recomputed = recomputed
    return graph


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
    _graphs: dict[str, CompiledGraph] = field(repr=False)
    _extra: dict[tuple, Callable[[int], int]] = field(repr=False)
    _timer: Callable[[], tuple[dict[str, float], dict[str, str]]] = field(repr=False)  # `costs.measure_time`
    _checkpoints: Checkpoints | None = field(repr=False)
    _segments: dict[str, list] = field(default_factory=dict, repr=False)
    _traced: dict[tuple, CompiledGraph] = field(default_factory=dict, repr=False)
    timing: dict[str, str] = field(default_factory=dict)  # how each timed quantity was measured, where not plainly
    _left_out: list[str] = field(default_factory=list, repr=False)  # candidates left out, and why
    _seconds: dict[str, float] = field(default_factory=dict, repr=False)  # timed once a candidate fits a budget
    verification: dict | None = None
    planning_seconds: dict[str, float] = field(default_factory=dict)  # wall seconds per phase of `advise`

    def _trace(self, cfg: Config, segments: Sequence | None = None) -> CompiledGraph:
        key = (cfg.name, None if segments is None else tuple(segments))
        if key not in self._traced:
            self._traced[key] = self._graphs.get(cfg.name) if segments is None and cfg.name in self._graphs else \
                _compile(self._workload, cfg, segments)
        return self._traced[key]

    def _plan_optimal(self, cfg: Config) -> None:
        """Choose the `optimal` candidate's checkpoints for the current budget and trace them: the activations
        may use what the same configuration without checkpoints leaves of the usable budget."""
        plain = replace(cfg, checkpoint="none")
        more = self._extra[cfg.precision, cfg.extra_bits](self.batch_size)
        parts = _categories(self._trace(plain), self.batch_size, more)
        fixed = sum(parts.values()) - parts["activations"]
        scale = max(parts["activations"], 1) / max(self._checkpoints.unchecked_peak, 1)
        segments = self._checkpoints.optimal((self.memory_budget * (1 - self.margin) - fixed) / scale)
        self._segments[cfg.name] = segments
        self._graphs[cfg.name] = self._trace(cfg, segments)

    def _row(self, cfg: Config) -> dict:
        graph, more = self._graphs[cfg.name], self._extra[cfg.precision, cfg.extra_bits](self.batch_size)
        segments = [(0, 0, False)]
        if cfg.checkpoint != "none":  # a checkpoint candidate implies the profile (see `advise`)
            segments = self._segments.get(cfg.name, self._checkpoints.uniform)
        terms = time_terms(cfg, list(self._configs.values()), segments, self._checkpoints)
        return {"config": cfg.name, "precision": cfg.precision, "extra_bits": cfg.extra_bits,
                "state_dtype": cfg.state_dtype, "step_in_backward": cfg.step_in_backward,
                "checkpoint": cfg.checkpoint, "segments": len(segments),
                "predicted_peak_bytes": graph.required_bytes(self.batch_size) + more,
                **_categories(graph, self.batch_size, more, graph.recomputed),
                "predicted_step_seconds": predict_seconds(terms, self._seconds) if self._seconds else math.nan,
                "time_reliable": bool(self._seconds) and not any("unreliable" in self.timing.get(key, "")
                                                                 for key in terms)}

    def rebudget(self, memory_budget: float) -> Advice:
        """The predictions judged against another budget: `fits`, `max_batch` and `best` recomputed, and the
        `optimal` checkpoint candidates planned again for it (traced; no real step). Returns self."""
        _check_budget(memory_budget)
        self.memory_budget = float(memory_budget)
        for cfg in self._configs.values():
            if cfg.checkpoint == "optimal":
                self._plan_optimal(cfg)
        if self.table is None or any(c.checkpoint == "optimal" for c in self._configs.values()):
            self.table = pd.DataFrame([self._row(c) for c in self._configs.values()])
        cap = memory_budget * (1 - self.margin)
        self.table["fits"] = self.table["predicted_peak_bytes"] <= cap
        if self.table["fits"].any() and not self._seconds:  # the real steps, once a candidate fits a budget
            self._seconds, self.timing = self._timer()
            self.table = pd.DataFrame([self._row(c) for c in self._configs.values()])
            self.table["fits"] = self.table["predicted_peak_bytes"] <= cap
        costs = [(self._graphs[name].required_bytes, self._extra[self._configs[name].precision,
                                                                self._configs[name].extra_bits])
                 for name in self.table["config"]]
        # the workspace term m is >= 0 and costly (a calibrated plan): asked only where the plan alone fits
        self.table["max_batch"] = [search_max(lambda b, g=g, m=m: g(b) <= cap and g(b) + m(b) <= cap,
                                              self.batch_size, limit=2**20)[0] for g, m in costs]
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
        model (`step.model`) and optimizer (`step.optimizer`) built now on the advice's device."""
        cfg = self.config(config)
        return training_step(self._workload, cfg, self._segments.get(cfg.name))

    def verify(self, *, repeats: int = 3) -> dict:
        """Run the chosen configuration for real: model and optimizer built and two steps at the user's batch
        under `AllocatorMeter` (the program the plan predicts), then `repeats` more steps of the same model
        timed outside the meter (median). A peak that misses the
        prediction by more than the margin recalibrates that candidate (real steps at small batches) and the
        choice is made again (not verified again). Returns and keeps `verification`."""
        row = self.best
        work, cfg = self._workload, self.config()
        batch = work.make_batch(cfg)
        gc.collect()
        with AllocatorMeter(self.device) as meter:
            step = self.build()
            step(batch(self.batch_size, self.device))
            step(batch(self.batch_size, self.device))
        times = []  # NOTE: timed outside the meter: the profiler's memory events slow every op down
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(repeats):
            data = batch(self.batch_size, self.device)
            sync()
            start = time.perf_counter()
            step(data)
            sync()
            times.append(time.perf_counter() - start)
            del data
        seconds = statistics.median(times)
        del step
        self.real_runs["verification"] = self.real_runs.get("verification", 0) + 1
        measured = meter.peak_bytes
        predicted = int(row["predicted_peak_bytes"])
        error = (predicted - measured) / measured
        result = {"config": row["config"], "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
                  "peak_error": error, "predicted_step_seconds": float(row["predicted_step_seconds"]),
                  "measured_step_seconds": seconds, "within_budget": measured <= self.memory_budget,
                  "recalibrated": False, "choice_after": row["config"]}
        if abs(error) > self.margin and self.device.type == "cpu":
            graph = self._graphs[row["config"]]
            graph.calibrate(sizes=(1, 2, 4, 8), check=(16,), refine=1)
            new = graph.required_bytes(self.batch_size)
            # the candidates that share this trace run the same program: recalibrated with it
            at = self.table["config"].isin([name for name, g in self._graphs.items() if g is graph])
            self.table.loc[at, "predicted_peak_bytes"] = new
            self.table.loc[at, "fits"] = new <= self.memory_budget * (1 - self.margin)
            self.real_runs["calibration"] = self.real_runs.get("calibration", 0) + 1
            result.update(recalibrated=True, choice_after=self.best["config"])
        self.verification = result
        return result


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def _check_budget(memory_budget: object) -> None:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, Real) or not (
            math.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be a finite number of bytes > 0, got {memory_budget!r}")


def advise(
    model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *, memory_budget: float,
    loss_fn: Callable | None = None, optimizer: str = "adamw", lr: float = 1e-3,
    device: torch.device | str | None = None, candidates: Sequence[Config] | Callable[[Config], bool] | None = None,
    margin: float = 0.05, calibrate: bool | None = None, min_run_time: float = 0.2, progress: bool = False,
) -> Advice:
    """Predict every candidate configuration's peak memory (zero steps at the user's batch) and step time,
    and choose the fastest that fits `memory_budget * (1 - margin)` bytes.

    `model_fn()` builds the user's model; `batch = (inputs, targets)` at the batch size wanted (targets as the
    loss takes them; default loss cross-entropy). `candidates`: configs, or a predicate that narrows the
    default grid (`configs.default_grid`). `calibrate` (default: on CPU) adds the kernels' scratch measured
    at small batches. Raises ValueError naming the layer when the model cannot be traced.
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
    work = Workload.of(model_fn, inputs, targets, loss_fn, optimizer, lr, dev)
    checkpointable = checkpoint_kind(model_fn) is not None
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
    calibrate = dev.type == "cpu" if calibrate is None else calibrate
    graphs, extra = {}, {}

    def traced(cfg: Config) -> CompiledGraph:  # each program traced once, candidate or not
        if cfg.name not in graphs:
            graphs[cfg.name] = _compile(work, cfg)
        return graphs[cfg.name]

    with _timed(phases, "traces"):
        for cfg in tqdm([c for c in grid if c.checkpoint != "optimal"], desc="plans", disable=not progress,
                        leave=False):
            traced(cfg)
    # the calibrated scratch per precision, from its plainest candidate
    # NOTE: once for all packed widths k: they run the same forward and backward and differ only in the
    # optimizer's update (one kernel call per parameter, no scratch). Measured: the term is the same to the
    # byte for k = 0, 8, 16 at batches 1 to 256 on the suite's LSTM, transformer, MLP and ResNet-50.
    shared: dict[str, Callable[[int], int]] = {}
    for precision, k in dict.fromkeys((c.precision, c.extra_bits) for c in grid):
        if precision in shared:
            extra[precision, k] = shared[precision]
            continue
        plain = Config(precision, k)
        with _timed(phases, "traces"):
            graph = traced(plain)
        if calibrate and graph.affine:
            uncalibrated = {b: graph.required_bytes(b) for b in (1, batch_size)}
            # NOTE: a shallow copy, not a second trace of the same program (a bf16 one at 100M parameters
            # traces for minutes): calibrating rebinds the copy's own calibration, and an affine plan
            # reads its traces without adding to them
            # NOTE: checked (and refined once where it misses) only at a batch beyond the calibrated sizes,
            # where the fit extrapolates; a batch within them is interpolated between two measured sizes
            check = (min(16, batch_size),) if batch_size > 8 else ()
            with _timed(phases, "calibration"):
                calibrated = copy.copy(graph).calibrate(sizes=(1, 2, 4, 8), check=check, refine=1)
            checks = calibrated.calibration_error
            runs["calibration runs"] = runs.get("calibration runs", 0) + 4 + len(check) + (
                int(checks["refined"].max()) if len(checks) else 0)
            # NOTE: memoized: a calibrated plan adds each op call's scratch in Python (a second per batch size
            # at 100M parameters), asked for the same batches by every candidate of the precision
            peak = functools.lru_cache(maxsize=None)(calibrated.required_bytes)
            extra[precision, k] = lambda b, c=peak, u=graph, cache=uncalibrated: max(
                0, c(b) - (cache[b] if b in cache else u.required_bytes(b)))
        else:
            extra[precision, k] = lambda b: 0
        shared[precision] = extra[precision, k]
    # NOTE: a real step is timed wherever it fits the memory free now (not the budget, which is what the user
    # wants the choice to take; at most 4x it, so that an absurd batch is not timed at a batch that fills the
    # machine): at the user's batch, else two smaller batches (see `costs.timing_batches`)
    room = min(0.9 * free_memory_bytes(dev), 4 * float(memory_budget))

    def fits(cfg: Config, size: int) -> bool:
        with _timed(phases, "traces"):
            graph = traced(cfg)
        return graph.required_bytes(size) + extra[cfg.precision, cfg.extra_bits](size) <= room

    def timer() -> tuple[dict[str, float], dict[str, str]]:
        checkpoints = advice._checkpoints
        with _timed(phases, "timing"):
            return measure_time(work, grid, min_run_time, runs, fits=fits, checkpoints=checkpoints)

    checkpoints = None
    if any(c.checkpoint != "none" for c in grid):
        with _timed(phases, "layer profile"):
            checkpoints = profile_checkpoints(work, min(batch_size, 4))
        runs["layer profile (checkpoints)"] = 1
    with _timed(phases, "traces"):
        for cfg in grid:  # the plain configuration each optimal plan is budgeted against
            if cfg.checkpoint == "optimal":
                traced(replace(cfg, checkpoint="none"))
    left_out = [] if checkpointable else [
        "no checkpoint candidates: the model's layers do not open (not an nn.Sequential, no .as_sequential()) and "
        "no module class repeats as blocks holding half its parameters"]
    advice = Advice(None, float(memory_budget), float(margin), batch_size, dev, runs, work,
                    {c.name: c for c in grid}, graphs, extra, timer, checkpoints, _left_out=left_out)
    with _timed(phases, "plans and table"):
        advice.rebudget(memory_budget)
    phases["plans and table"] -= phases.get("timing", 0.0)
    advice.planning_seconds = phases
    return advice
