"""CalcGraph's model compiler: a training step's memory known before it runs.

Implements Sections 3.1-3.2 of "CalcGraph: taming the high costs of deep learning using models
(2022)". One training program (build the model and optimizer, then forward, loss, backward and
optimizer step, twice: the first step creates the optimizer state, the second is the steady
state) is executed under `torch._subclasses.FakeTensorMode`, so no real memory is allocated,
while a dispatch-mode tracker records every storage an aten op creates and when it is freed.
Each allocation is tagged with the paper's zone: forward (parameters, buffers, inputs and the
activations autograd keeps for backward), gradient, optimizer (state) and workspace (every
other temporary).

The program runs at two batch sizes; the allocation sequence must be identical and every
allocation's size is fitted as `a + b * batch` (checked on a third batch size). The peak live
bytes at any batch size is then the maximum of a cumulative sum over that timeline: the paper's
`requiredMem`, an iteration over variables with no trial run. `max_batch_size` is the paper's
dichotomic search (Algorithm 1) over it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from numbers import Real

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..measure import MemoryMeter
from .tracker import _Trace, _TraceError, _Tracker, _trace

__all__ = [
    "ZONES", "CompiledGraph", "make_optimizer", "measure_required_bytes", "plan_training", "search_max",
    "training_program",
]

ZONES = ("forward", "gradient", "optimizer", "workspace")
_OPTIMIZERS = ("adam", "adamw", "sgd")
# NOTE: the CUDA caching allocator hands out blocks in multiples of 512 bytes; on CUDA each
# planned allocation is rounded up the same way (block splitting is not modelled: the issue's
# CUDA tolerance of 5% covers it).
_CUDA_BLOCK = 512

OptimizerSpec = str | Callable[..., torch.optim.Optimizer]


class _DtypeMismatch(ValueError):
    """The model's floating parameters and the input disagree on dtype (raised before any step)."""


def _build_model(build: Callable[[], nn.Module], device: torch.device, tracing: bool) -> nn.Module:
    try:
        with device:
            return build().train()
    except RuntimeError as error:
        if not tracing or "Couldn't swap" not in str(error):
            raise
    # NOTE: under FakeTensorMode, `Module._apply` swaps each parameter for its converted copy
    # (`.to(torch.bfloat16)` in a factory) and torch refuses to swap a fake tensor that has a weak
    # reference. The factory then runs on the meta device outside the fake mode (no memory, no swap)
    # and the finished model's tensors are materialised as fake ones of the same dtypes and shapes.
    with unset_fake_temporarily(), torch.device("meta"):
        model = build().train()
    return model.to_empty(device=device)


def _check_dtypes(model: nn.Module, input_dtype: torch.dtype) -> None:
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if input_dtype.is_floating_point and floats and input_dtype not in floats:
        names = ", ".join(sorted(str(d) for d in floats))
        raise _DtypeMismatch(
            f"the model's parameters are {names} but the input is {input_dtype}: the real step would fail on "
            f"a dtype mismatch; pass a sample_input of the model's dtype (or input_dtype=...) or convert the model"
        )


def make_optimizer(
    spec: OptimizerSpec, params, *, lr: float = 1e-3, device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """"adam", "adamw", "sgd" (momentum 0.9) or a callable `spec(params)`.

    # NOTE: `foreach` is fixed from the device, not left to torch's default: torch picks the
    # foreach kernels only for plain CUDA tensors, so a fake tensor would silently take the
    # single-tensor path and plan a different program from the one that runs.
    """
    if callable(spec):
        return spec(params)
    if spec not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS} or a callable, got {spec!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    foreach = torch.device(device or "cpu").type == "cuda"
    if spec == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=foreach)
    if spec == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)


def training_program(
    build: Callable[[], nn.Module], input_shape: Sequence[int], batch_size: int, *,
    loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
    device: torch.device | str = "cpu", steps: int = 2, persistent_grads: bool = False,
    annotate: _Tracker | None = None, input_dtype: torch.dtype = torch.float32,
) -> None:
    """Build model and optimizer, then `steps` training steps on a batch created each step.

    The program that `plan_training` traces under fake tensors and `measure_required_bytes` runs for
    real, so that both count exactly the same tensors. `persistent_grads` keeps gradient
    buffers for the whole run (zeroed in place, as a `Heap` does) instead of freeing them.
    Inputs are `randn` of `input_dtype`, or zeros for an integer dtype (token ids); a floating input
    dtype that no floating parameter has is refused before any step.
    """
    device = torch.device(device)
    loss = loss or F.cross_entropy
    # NOTE: built under the device so that parameters are born there: moving them afterwards swaps
    # tensors, which torch refuses for fake tensors that the tracker holds weak references to.
    model = _build_model(build, device, tracing=annotate is not None)
    # "cuda" names the current CUDA device: a parameter on cuda:0 is already in place
    elsewhere = [t for t in [*model.parameters(), *model.buffers()] if t.device.type != device.type
                 or (device.index is not None and t.device.index != device.index)]
    if elsewhere:
        model = model.to(device)
    _check_dtypes(model, input_dtype)
    if annotate is not None:
        annotate.watch_model(model)
    if persistent_grads:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            if annotate is not None:
                annotate.tag(p.grad, "gradient", "gradient", annotate.names.get(id(p), "?") + ".grad")
    opt = make_optimizer(optimizer, model.parameters(), lr=lr, device=device)
    for step in range(steps):
        if annotate is not None:
            annotate.mark(f"step{step + 1}")
        if input_dtype.is_floating_point:
            x = torch.randn(batch_size, *input_shape, device=device, dtype=input_dtype)
        else:
            x = torch.zeros(batch_size, *input_shape, device=device, dtype=input_dtype)
        y = torch.zeros(batch_size, dtype=torch.long, device=device)
        if annotate is not None:
            annotate.tag(x, "forward", "input", "input")
            annotate.tag(y, "forward", "input", "target")
            with torch.autograd.graph.saved_tensors_hooks(annotate.pack, lambda t: t):
                value = loss(model(x), y)
        else:
            value = loss(model(x), y)
        value.backward()
        del value
        if annotate is not None:
            annotate.tag_grads(model)
        opt.step()
        if annotate is not None:
            annotate.tag_state(opt)
        opt.zero_grad(set_to_none=not persistent_grads)
        del x, y
    if annotate is not None:
        annotate.mark("end")
        annotate.spec = {
            "parameters": [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
            "buffers": [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()],
            "state": [[(k, tuple(v.shape), v.dtype, v.device.type) for k, v in opt.state[p].items()
                       if isinstance(v, torch.Tensor)] for p in model.parameters()],
        }
        annotate.unwatch()


def measure_required_bytes(
    build: Callable[[], nn.Module], input_shape: Sequence[int], batch_size: int, **kwargs,
) -> int:
    """Measured truth: `MemoryMeter`'s peak over a real run of `training_program`."""
    device = torch.device(kwargs.get("device") or "cpu")
    kwargs["device"] = device
    if device.type == "cuda":
        # NOTE: cuBLAS and cuBLASLt keep per-process workspaces that the first matmul allocates
        # through torch's allocator and that live as long as the process (measured on an H100,
        # torch 2.11: 68 MB). They are no tensor of the program, so a plan cannot count them; one
        # unmetered step at batch 1 creates them before the meter opens, as in any process that
        # has already trained.
        training_program(build, input_shape, 1, **{**kwargs, "steps": 1})
        torch.cuda.empty_cache()
    with MemoryMeter(device) as meter:
        training_program(build, input_shape, batch_size, **kwargs)
    return meter.peak_bytes


def search_max(fits: Callable[[int], bool], first_guess: int, *, limit: int = 2**24) -> tuple[int, int]:
    """Largest n >= 1 with `fits(n)` (monotone), by the dichotomic search of Algorithm 1.

    Start from the linear guess, step up (doubling) while it fits and down (halving) while it
    does not, then bisect until n fits and n + 1 does not. Returns (n, evaluations); n = 0 when
    1 does not fit. # NOTE: the paper steps by +-1 from the linear guess; doubling and bisection
    reach the same fixed point in O(log n) evaluations of the plan.
    """
    calls = 0

    def test(n: int) -> bool:
        nonlocal calls
        calls += 1
        return fits(n)

    if not test(1):
        return 0, calls
    n = min(max(1, int(first_guess)), limit)
    if test(n):
        lo, hi = n, None
        while hi is None and lo < limit:
            nxt = min(lo * 2, limit)
            if test(nxt):
                lo = nxt
            else:
                hi = nxt
        if hi is None:
            return lo, calls
    else:
        hi, lo = n, 1
        while lo * 2 < hi and not test(hi // 2):
            hi //= 2
        lo = max(1, hi // 2)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return lo, calls


class CompiledGraph:
    """The compiled memory plan of one training program, affine in the batch size."""

    def __init__(self, program: Callable[[int, _Tracker], None], *, device: torch.device,
                 trace_sizes: Sequence[int] = (2, 3, 4), description: str = "",
                 input_shape: Sequence[int] | None = None) -> None:
        if len(trace_sizes) < 2 or min(trace_sizes) < 1 or len(set(trace_sizes)) != len(trace_sizes):
            raise ValueError(f"trace_sizes needs >= 2 distinct sizes >= 1, got {trace_sizes}")
        self._program = program
        self.device = device
        self.description = description
        self._input_shape = tuple(input_shape) if input_shape is not None else None
        self._exact: dict[int, _Trace] = {}
        s1, s2, *checks = trace_sizes
        t1, t2 = self._traced(s1), self._traced(s2)
        self._base = t2
        self.affine = t1.signature == t2.signature
        rows = []
        if self.affine:
            self.slope = (t2.sizes - t1.sizes) // (s2 - s1)
            self.intercept = t1.sizes - self.slope * s1
            exact = (t2.sizes - t1.sizes) % (s2 - s1) == 0
            for s in checks:
                t = self._traced(s)
                if t.signature != t1.signature:
                    self.affine = False
                    rows.append({"size": s, "allocation": -1, "op": "sequence differs", "predicted": -1,
                                 "traced": -1})
                    continue
                bad = np.nonzero((self.intercept + self.slope * s != t.sizes) | ~exact)[0]
                rows += [{"size": s, "allocation": int(i), "op": t.info[i]["op"],
                          "predicted": int(self.intercept[i] + self.slope[i] * s), "traced": int(t.sizes[i])}
                         for i in bad]
            self.affine = self.affine and not rows
        # NOTE: where the program is not affine in the batch size (a different allocation sequence,
        # or sizes off the fitted line) every prediction traces the program at that exact size.
        self.nonaffine = pd.DataFrame(rows, columns=["size", "allocation", "op", "predicted", "traced"])
        # shapes of parameters, buffers and optimizer state: what a `Heap` lays out
        self.spec = t2.spec
        self.evaluations = 0

    def _traced(self, size: int) -> _Trace:
        if size not in self._exact:
            try:
                self._exact[size] = _trace(lambda tracker: self._program(size, tracker))
            except _TraceError as failure:
                if isinstance(failure.error, _DtypeMismatch):
                    raise _DtypeMismatch(str(failure.error)) from None
                shape = f"input [{size}, {', '.join(map(str, self._input_shape))}]" if self._input_shape else "input"
                where = failure.module or "the training program"
                raise ValueError(
                    f"{where} refused the {shape} (per-example shape {self._input_shape}, batch {size}, "
                    f"{failure.phase}): {failure}"
                ) from None
        return self._exact[size]

    # sizes and timeline ----------------------------------------------------------------------
    def _sizes(self, batch_size: int, *, inputs: bool = True) -> tuple[np.ndarray, _Trace]:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if self.affine:
            sizes, trace = self.intercept + self.slope * int(batch_size), self._base
        else:
            trace = self._traced(int(batch_size))
            sizes = trace.sizes
        if not inputs:  # the batch is a view of a data set resident elsewhere
            sizes = np.where([i["kind"] == "input" for i in trace.info], 0, sizes)
        if self.device.type == "cuda":
            sizes = np.where(sizes > 0, -(-sizes // _CUDA_BLOCK) * _CUDA_BLOCK, 0)
        return sizes, trace

    def timeline(self, batch_size: int, *, inputs: bool = True) -> np.ndarray:
        """Live bytes after each allocation or free event of the program."""
        sizes, trace = self._sizes(batch_size, inputs=inputs)
        ev = trace.events
        delta = np.where(ev >= 0, sizes[np.maximum(ev, 0)], -sizes[np.maximum(-ev - 1, 0)])
        return np.cumsum(delta)

    def required_bytes(self, batch_size: int, *, inputs: bool = True) -> int:
        """Predicted peak live tensor bytes of the program (model, optimizer and two steps).

        `inputs=False` leaves out the batch's own tensors, for loops that slice batches out of
        a data set already in memory.
        """
        self.evaluations += 1
        return int(self.timeline(batch_size, inputs=inputs).max(initial=0))

    def max_batch_size(self, memory_budget: float, *, margin: float = 0.0, limit: int = 2**24) -> int:
        """Largest batch whose prediction fits `memory_budget * (1 - margin)` (Algorithm 1).

        Zero trial runs: only the plan is evaluated. `memory_budget` is a finite number of bytes
        > 0. Raises ValueError when batch 1 does not fit, and when even batch `limit` fits (the
        answer lies beyond the search: pass a larger `limit`).
        """
        if isinstance(margin, bool) or not isinstance(margin, Real) or not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, Real):
            raise TypeError(f"memory_budget must be a number of bytes in (0, inf), got {memory_budget!r}")
        if not (math.isfinite(memory_budget) and memory_budget > 0):
            raise ValueError(f"memory_budget must be a finite number of bytes in (0, inf), got {memory_budget!r}")
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        cap = memory_budget * (1.0 - margin)
        one = self.required_bytes(1)
        if one > cap:
            raise ValueError(
                f"batch size 1 needs {one} bytes, more than the budget {memory_budget:.0f} bytes "
                f"with margin {margin} ({cap:.0f} bytes usable)"
            )
        best, self.last_search_evaluations = search_max(
            lambda b: self.required_bytes(b) <= cap, int(min(cap // one, limit)), limit=limit)
        if best >= limit:
            raise ValueError(
                f"batch size {limit} (the search limit) still fits the budget {memory_budget:.4g} bytes "
                f"(needs {self.required_bytes(limit)} bytes): the largest batch is beyond the search; "
                f"pass a larger limit"
            )
        return best

    # zones -----------------------------------------------------------------------------------
    def variables(self, batch_size: int) -> pd.DataFrame:
        """Every allocation of the program: zone, kind, name, op, phase, bytes, live span."""
        sizes, trace = self._sizes(batch_size)
        n = len(sizes)
        born = np.full(n, -1)
        died = np.full(n, len(trace.events))
        for pos, e in enumerate(trace.events):
            if e >= 0:
                born[e] = pos
            else:
                died[-e - 1] = pos
        frame = pd.DataFrame(trace.info)
        frame["zone"] = frame["zone"].fillna("workspace")
        frame["kind"] = frame["kind"].fillna("temporary")
        frame["name"] = frame["name"].fillna(frame["module"].where(frame["module"] != "", "model") + ":" + frame["op"])
        frame["bytes"] = sizes
        frame["born"], frame["died"] = born, died
        return frame

    def zones(self, batch_size: int) -> pd.DataFrame:
        """Per-variable sizes by zone in the steady-state step (the program's second step).

        `live_at_peak` marks the variables live at the moment of the predicted peak; the bytes
        of those rows sum to `required_bytes(batch_size)` when the peak is in that step.
        """
        frame = self.variables(batch_size)
        timeline = self.timeline(batch_size)
        # the last event at the peak level: the steady-state step reaches the same peak as the first
        peak_at = len(timeline) - 1 - int(timeline[::-1].argmax()) if len(timeline) else 0
        marks = (self._base.marks if self.affine else self._traced(batch_size).marks)
        start, end = marks.get("step2", 0), marks.get("end", len(timeline))
        steady = frame[(frame["born"] < end) & (frame["died"] >= start)].copy()
        steady["live_at_peak"] = (steady["born"] <= peak_at) & (steady["died"] > peak_at)
        steady["zone"] = pd.Categorical(steady["zone"], categories=list(ZONES), ordered=True)
        cols = ["zone", "kind", "name", "op", "phase", "bytes", "live_at_peak"]
        return steady.sort_values(["zone", "born"])[cols].reset_index(drop=True)

    def zone_bytes(self, batch_size: int) -> pd.DataFrame:
        """Bytes per zone live at the predicted peak (what a dynamic allocator needs), and the bytes of
        every variable live in the steady-state step summed (`bytes_allocated_in_step`: what a static
        layout needs that gives each variable its own offset, the CalcHeap's rule in Section 3.2)."""
        z = self.zones(batch_size)
        at_peak = z[z["live_at_peak"]].groupby("zone", observed=False)["bytes"].sum()
        total = z.groupby("zone", observed=False)["bytes"].sum()
        return pd.DataFrame({"zone": list(ZONES), "bytes_at_peak": [int(at_peak.get(k, 0)) for k in ZONES],
                             "bytes_allocated_in_step": [int(total.get(k, 0)) for k in ZONES]})

    def persistent_bytes(self) -> int:
        """Bytes of parameters, buffers, gradients and optimizer state (batch-independent)."""
        frame = self.variables(1)
        keep = frame["kind"].isin(["parameter", "buffer", "gradient", "state"]) & (frame["phase"] != "step2")
        return int(frame.loc[keep, "bytes"].sum())

    def __repr__(self) -> str:
        return f"CompiledGraph({self.description}, affine={self.affine}, device={self.device})"


def plan_training(
    model: nn.Module | Callable[[], nn.Module], sample_input: torch.Tensor | Sequence[int], *,
    loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
    device: torch.device | str | None = None, persistent_grads: bool = False,
    trace_sizes: Sequence[int] = (2, 3, 4), input_dtype: torch.dtype | None = None,
) -> CompiledGraph:
    """Compile one training step's memory plan without allocating real memory.

    `model` is a module (deep-copied into fake tensors) or a zero-argument factory;
    `sample_input` a tensor whose first dimension is the batch (or the per-example shape).
    Labels are class indices (cross-entropy) unless `loss` says otherwise. The input's dtype is
    `input_dtype`, else the sample tensor's, else float32. # NOTE: traced at batches 2, 3 and 4 by
    default (BatchNorm refuses a batch of one in training); batch 1 comes from the affine fit.
    """
    if input_dtype is None:
        input_dtype = sample_input.dtype if isinstance(sample_input, torch.Tensor) else torch.float32
    if not isinstance(input_dtype, torch.dtype):
        raise TypeError(f"input_dtype must be a torch.dtype, got {input_dtype!r}")
    if isinstance(sample_input, torch.Tensor):
        if sample_input.dim() < 2:
            raise ValueError(f"sample_input must be [batch, ...], got shape {tuple(sample_input.shape)}")
        input_shape = tuple(sample_input.shape[1:])
    else:
        input_shape = tuple(int(s) for s in sample_input)
    if not input_shape or min(input_shape) < 1:
        raise ValueError(f"per-example input shape must be non-empty and positive, got {input_shape}")
    if isinstance(model, nn.Module):
        template = model
        build = lambda: copy.deepcopy(template)  # noqa: E731
    elif callable(model):
        build = model
    else:
        raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
    if isinstance(optimizer, str) and optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS} or a callable, got {optimizer!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def program(size: int, tracker: _Tracker) -> None:
        training_program(build, input_shape, size, loss=loss, optimizer=optimizer, lr=lr, device=dev,
                         persistent_grads=persistent_grads, annotate=tracker, input_dtype=input_dtype)

    name = optimizer if isinstance(optimizer, str) else "custom"
    graph = CompiledGraph(program, device=dev, trace_sizes=trace_sizes, input_shape=input_shape,
                          description=f"input {input_shape} {input_dtype}, optimizer {name}")
    graph.input_shape, graph.input_dtype = input_shape, input_dtype
    graph.build, graph.loss, graph.optimizer, graph.lr = build, loss, optimizer, lr
    graph.persistent_grads = persistent_grads
    return graph
