"""The memory advisor: for a user's model, batch and budget, every combination of techniques predicted,
the fastest that fits chosen, and the choice verified with one real run.

Memory: each candidate's training program (build, then two steps: the optimizer state is created in the
first) is traced under fake tensors by CalcGraph ("CalcGraph: taming the high costs of deep learning using
models", 2022, Section 3.2), so no step of any candidate runs at the user's batch. On CPU the kernels'
scratch that fake tensors cannot see is calibrated once per precision (the candidate without step in
backward or checkpointing, real steps at batches 1, 2, 4 and 8, `CompiledGraph.calibrate`) and added to
every candidate of that precision as a workspace term.

Time (a cost model, derived from measurements in this process): one baseline step (fp32, the user's
optimizer) timed in three parts, forward+loss, backward and optimizer step, at the user's batch (or the
largest the budget allows for fp32, scaled linearly in the batch); one forward under each other precision
(its ratio to fp32 scales forward and backward); one optimizer step of each optimizer variant on the
model's parameters. A candidate's step is forward + backward (precision ratio) + its optimizer step, plus
a recomputed forward for all but the last of the checkpointed segments. Step in backward moves the
update into backward and is predicted at the same time.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Real

import pandas as pd
import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
from torch import nn
from tqdm.auto import tqdm

from workbench.calcgraph import CompiledGraph, search_max, training_program
from workbench.measure import AllocatorMeter
from workbench.optim import step_in_backward

from .configs import Config, can_checkpoint, default_grid, training_setup

__all__ = ["Advice", "advise"]

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "workspace")
_KINDS = {"parameter": "weights", "buffer": "weights", "gradient": "gradients", "state": "optimizer_state",
          "input": "activations", "activation": "activations"}


@dataclass
class _Workload:
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

    def program(self, config: Config, *, steps: int = 2) -> Callable:
        setup = training_setup(config, self.build, optimizer=self.optimizer, lr=self.lr)
        batch = self.make_batch(config)
        return lambda size, tracker: training_program(
            setup["build"], tuple(self.inputs.shape[1:]), size, loss=self.loss_fn, optimizer=setup["optimizer"],
            device=self.device, steps=steps, annotate=tracker, autocast=setup["autocast"],
            in_backward=setup["in_backward"], make_batch=batch,
            input_dtype=torch.bfloat16 if config.precision == "bf16" and self.inputs.is_floating_point()
            else self.inputs.dtype)


def _categories(graph: CompiledGraph, batch_size: int, extra: int) -> dict[str, int]:
    """Bytes live at the predicted peak by category; the calibrated scratch term counts as workspace."""
    frame = graph.variables(batch_size)
    live = graph.timeline(batch_size)
    at = int(live.argmax()) if len(live) else 0
    alive = frame[(frame["born"] <= at) & (frame["died"] > at)]
    out = dict.fromkeys(CATEGORIES, 0)
    for kind, nbytes in alive.groupby("kind")["bytes"].sum().items():
        out[_KINDS.get(kind, "workspace")] += int(nbytes)
    out["workspace"] += extra
    return out


def _seconds(fn: Callable[[], object], min_run_time: float) -> tuple[float, int]:
    """Median seconds per call of `fn` (torch.utils.benchmark, blocks of calls after a warm-up) and the
    number of calls it made."""
    fn()  # warm-up: first-call allocations and kernel selection
    measured = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    return measured.median, measured.number_per_run * len(measured.raw_times) + 1


@dataclass
class Advice:
    """Every candidate predicted (`table`), the fastest that fits (`best`), `build()` and `verify()`."""

    table: pd.DataFrame
    memory_budget: float
    margin: float
    batch_size: int
    device: torch.device
    real_runs: dict[str, int]
    _workload: _Workload = field(repr=False)
    _configs: dict[str, Config] = field(repr=False)
    _graphs: dict[str, CompiledGraph] = field(repr=False)
    _extra: dict[str, Callable[[int], int]] = field(repr=False)
    verification: dict | None = None

    def rebudget(self, memory_budget: float) -> Advice:
        """The same predictions judged against another budget: `fits`, `max_batch` and `best` recomputed
        (no trace, no real step). Returns self."""
        _check_budget(memory_budget)
        self.memory_budget = float(memory_budget)
        cap = memory_budget * (1 - self.margin)
        self.table["fits"] = self.table["predicted_peak_bytes"] <= cap
        self.table["max_batch"] = [
            search_max(lambda b, g=self._graphs[name], m=self._extra[name]: g.required_bytes(b) + m(b) <= cap,
                       self.batch_size, limit=2**20)[0] for name in self.table["config"]]
        return self

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
        return self._workload.program(self.config(config))

    def make_batch(self, config: str | None = None) -> Callable[[int, torch.device], tuple]:
        """`make_batch(size, device)`: fresh (inputs, targets) like the user's, as the candidate takes them."""
        return self._workload.make_batch(self.config(config))

    def build(self, config: str | None = None) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """`step(batch) -> loss`: one training step of the chosen configuration (or the named one), with its
        model (`step.model`) and optimizer (`step.optimizer`) built now on the advice's device."""
        cfg, work = self.config(config), self._workload
        setup = training_setup(cfg, work.build, optimizer=work.optimizer, lr=work.lr)
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
        for _ in range(repeats):
            data = batch(self.batch_size, self.device)
            start = time.perf_counter()
            step(data)
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
            at = self.table.index[self.table["config"] == row["config"]][0]
            self.table.loc[at, "predicted_peak_bytes"] = new
            self.table.loc[at, "fits"] = new <= self.memory_budget * (1 - self.margin)
            self.real_runs["calibration"] = self.real_runs.get("calibration", 0) + 1
            result.update(recalibrated=True, choice_after=self.best["config"])
        self.verification = result
        return result


def _measure_time(work: _Workload, configs: Sequence[Config], batch_size: int, min_run_time: float,
                  runs: dict[str, int]) -> dict[str, float]:
    """Seconds of forward(+loss) per precision, of forward and backward in fp32, and of each optimizer
    variant's step, at `batch_size` (the cost model's inputs; see the module docstring)."""
    seconds: dict[str, float] = {}

    def timed(key: str, what: str, fn: Callable[[], object]) -> None:
        seconds[key], calls = _seconds(fn, min_run_time)
        runs[what] = runs.get(what, 0) + calls

    for cfg in [Config(), *configs]:
        key, okey = _forward_key(cfg), _step_key(cfg)
        if key in seconds and okey in seconds:
            continue
        setup = training_setup(cfg, work.build, optimizer=work.optimizer, lr=work.lr)
        torch.manual_seed(0)
        with work.device:
            model = setup["build"]().train()
        opt = setup["optimizer"](model.parameters())
        x, y = work.make_batch(cfg)(batch_size, work.device)

        forward = _forward(work, model, x, y, setup["autocast"])
        if key not in seconds:
            timed(key, "timed forward passes", forward)
        if "forward and backward" not in seconds:
            timed("forward and backward", "timed training passes", lambda f=forward: f().backward())
        if okey not in seconds:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            timed(okey, "timed optimizer steps", opt.step)
        del model, opt
    return seconds


def _forward(work: _Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             cast: torch.dtype | None) -> Callable[[], torch.Tensor]:
    def forward() -> torch.Tensor:
        with torch.autocast(work.device.type, dtype=cast, enabled=cast is not None):
            return work.loss_fn(model(x), y)
    return forward


def _forward_key(cfg: Config) -> str:
    return "forward " + cfg.precision


def _step_key(cfg: Config) -> str:
    return "step " + (f"bf16+{cfg.extra_bits} {cfg.state_dtype} state" if cfg.precision == "bf16" else "torch")


def _predict_seconds(cfg: Config, seconds: dict[str, float], scale: float, segments: int) -> float:
    fwd0 = seconds[_forward_key(Config())]
    ratio = seconds[_forward_key(cfg)] / fwd0
    fwd = fwd0 * ratio * scale
    bwd = max(0.0, seconds["forward and backward"] - fwd0) * ratio * scale
    recompute = fwd * (1 - 1 / segments) if cfg.checkpoint != "none" else 0.0
    return fwd + bwd + seconds[_step_key(cfg)] + recompute


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
    dev = torch.device(device) if device is not None else inputs.device
    work = _Workload(model_fn, inputs, targets, loss_fn or F.cross_entropy, optimizer, lr, dev)
    checkpointable = can_checkpoint(model_fn)
    grid = default_grid(dev, checkpointable=checkpointable)
    if callable(candidates):
        grid = [c for c in grid if candidates(c)]
    elif candidates is not None:
        grid = list(candidates)
    if not grid:
        raise ValueError("no candidate configuration left to consider")
    batch_size = int(inputs.shape[0])
    runs: dict[str, int] = {}
    calibrate = dev.type == "cpu" if calibrate is None else calibrate
    graphs, extra = {}, {}
    for cfg in tqdm(grid, desc="plans", disable=not progress, leave=False):
        graphs[cfg.name] = CompiledGraph(work.program(cfg), device=dev, input_shape=tuple(inputs.shape[1:]),
                                         description=cfg.name)
    # the calibrated scratch per precision, from its plainest candidate
    for precision, k in dict.fromkeys((c.precision, c.extra_bits) for c in grid):
        plain = Config(precision, k)
        graph = graphs.get(plain.name) or CompiledGraph(work.program(plain), device=dev, description=plain.name)
        if calibrate and graph.affine:
            uncalibrated = {b: graph.required_bytes(b) for b in (1, batch_size)}
            calibrated = CompiledGraph(work.program(plain), device=dev).calibrate(
                sizes=(1, 2, 4, 8), check=(min(16, max(batch_size, 9)),), refine=1)
            runs["calibration runs"] = runs.get("calibration runs", 0) + 5 + int(calibrated.calibration_error
                                                                                 ["refined"].max())
            extra[precision, k] = lambda b, c=calibrated, u=graph, cache=uncalibrated: max(
                0, c.required_bytes(b) - (cache[b] if b in cache else u.required_bytes(b)))
        else:
            extra[precision, k] = lambda b: 0
    fp32 = graphs.get(Config().name) or CompiledGraph(work.program(Config()), device=dev)
    cap = memory_budget * (1 - margin)
    timing_batch = batch_size if fp32.required_bytes(batch_size) <= cap else max(
        1, search_max(lambda b: fp32.required_bytes(b) <= cap, 1, limit=batch_size)[0])
    seconds = _measure_time(work, grid, timing_batch, min_run_time, runs)
    segments = max(1, round(math.sqrt(len(_units(model_fn))))) if checkpointable else 1
    rows = []
    for cfg in grid:
        graph, more = graphs[cfg.name], extra[(cfg.precision, cfg.extra_bits)]
        peak = graph.required_bytes(batch_size) + more(batch_size)
        rows.append({"config": cfg.name, "precision": cfg.precision, "extra_bits": cfg.extra_bits,
                     "state_dtype": cfg.state_dtype, "step_in_backward": cfg.step_in_backward,
                     "checkpoint": cfg.checkpoint, "predicted_peak_bytes": peak,
                     **_categories(graph, batch_size, more(batch_size)),
                     "predicted_step_seconds": _predict_seconds(cfg, seconds, batch_size / timing_batch, segments)})
    advice = Advice(pd.DataFrame(rows), float(memory_budget), float(margin), batch_size, dev, runs, work,
                    {c.name: c for c in grid}, graphs, {c.name: extra[(c.precision, c.extra_bits)] for c in grid})
    return advice.rebudget(memory_budget)


def _units(model_fn: Callable[[], nn.Module]) -> list[nn.Module]:
    from workbench.checkpoint import units_of
    with torch.device("meta"):
        return units_of(model_fn())
