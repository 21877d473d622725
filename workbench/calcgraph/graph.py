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
import warnings
from collections.abc import Callable, Sequence
from numbers import Real

import numpy as np
import pandas as pd
import torch

from .calibrate import Calibration, is_aligned
from .calibrate import calibrate as _fit_calibration
from .calibrate import observe as _observe_at
from .calibrate import transfer as _transfer
from .calibrate import warm_up as _warm_up
from .program import _DtypeMismatch
from .derive import StepTracer, borrowed_slopes, fit
from .forked import trace_ahead
from .search import search_max
from .tracker import _Trace, _TraceError, _Tracker, Unplannable, on_device

__all__ = ["CALIBRATED_ZONE", "MAX_BATCH", "ZONES", "CompiledGraph", "search_max"]

ZONES = ("forward", "gradient", "optimizer", "workspace")
# bytes a calibrated plan adds from real kernels (Calibration): scratch and tensors larger than their meta size
CALIBRATED_ZONE = "workspace (calibrated)"
_CHECK_COLUMNS = ["batch_size", "predicted", "allocator", "error", "refined", "calibrated_at"]


MAX_BATCH = 2**40  # largest batch a plan sizes: beyond it the byte counts of even a tiny model leave int64


class CompiledGraph:
    """The compiled memory plan of one training program, affine in the batch size."""

    def __init__(self, program: Callable[[int, _Tracker], None], *, device: torch.device | str,
                 trace_sizes: Sequence[int] = (2, 3, 4), description: str = "",
                 input_shape: Sequence[int] | None = None, input_dtype: torch.dtype | None = None,
                 like: CompiledGraph | None = None, traced: dict[int, _Trace] | None = None,
                 one_step: Callable[[int, _Tracker], None] | None = None) -> None:
        trace_sizes = tuple(trace_sizes) if isinstance(trace_sizes, (list, tuple)) else (trace_sizes,)
        whole = all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in trace_sizes)
        if (len(trace_sizes) < 2 or not whole or min(trace_sizes) < 1 or len(set(trace_sizes)) != len(trace_sizes)):
            raise ValueError(f"trace_sizes needs >= 2 distinct whole sizes >= 1, got {trace_sizes!r}")
        self._program = program
        self.device = torch.device(device)  # "cpu" as well as torch.device("cpu")
        self.description = description
        self._input_shape = tuple(input_shape) if input_shape is not None else None
        self._input_dtype = input_dtype  # named where the program refuses its input
        # `traced`: made already (forked); `one_step`: the build and first step alone, traced in the program's place
        # where it may be (`StepTracer`)
        self._tracer = StepTracer(program, one_step, self.device, like._tracer if like is not None else None, traced)
        self._exact = {s: t for s, t in (traced or {}).items() if s not in self._tracer.first_steps}  # batch -> trace
        s1, s2 = trace_sizes[:2]
        self.derived = False  # traced once, the slopes borrowed from `like` (`derive.borrowed_slopes`)
        if like is not None and like.affine and like._base_size == s2:
            slope = borrowed_slopes(self._traced(s2), like._base, like.slope)
            self.derived = slope is not None
        self._like = like if self.derived else None
        if self.derived:
            self.affine, self.slope, rows = True, slope, []
            self.intercept = self._exact[s2].sizes - slope * s2
        else:
            trace_ahead(self, trace_sizes)
            self.affine, self.slope, self.intercept, rows = fit(self._traced, trace_sizes)
        self._base, self._base_size, self._fitted_at = self._exact[s2], s2, (s1, s2)
        # NOTE: where the program is not affine in the batch size (a different allocation sequence,
        # or sizes off the fitted line) every prediction traces the program at that exact size.
        self.nonaffine = pd.DataFrame(rows, columns=["size", "allocation", "op", "predicted", "traced"])
        # shapes of parameters, buffers and optimizer state: what a `Heap` lays out
        self.spec = self._base.spec
        self.evaluations = 0
        self.calibration: Calibration | None = None
        self.calibration_error = pd.DataFrame(columns=_CHECK_COLUMNS)
        self._one_calibration: Calibration | None = None  # of batch 1's own program (`_batch_one`)

    def _traced(self, size: int) -> _Trace:
        if size not in self._exact:
            try:
                self._exact[size] = self._tracer(size)
            except _TraceError as failure:
                if isinstance(failure.error, (_DtypeMismatch, Unplannable)):  # their messages say it all
                    raise type(failure.error)(": ".join(filter(None, (failure.module, str(failure.error))))) from None
                shape = f"input [{size}, {', '.join(map(str, self._input_shape))}]" if self._input_shape else "input"
                shape += f" of {self._input_dtype}" if self._input_dtype is not None else ""
                where = failure.module or "the training program"
                raise ValueError(f"{where} refused the {shape} (per-example shape {self._input_shape}, batch {size}, "
                                 f"{failure.phase}): {failure}") from None
        return self._exact[size]

    def check(self, size: int) -> bool:
        """Trace the program at batch `size` and check the fitted line there, as `trace_sizes` beyond the first two
        do (`derive.fit`): for a plan fitted at two batches and not yet checked. Off the line, the plan becomes one
        that is not affine (each batch traced on its own, see `nonaffine`; uncalibrated). Returns `affine`."""
        if self.affine and not self.derived:
            self.affine, _, _, rows = fit(self._traced, (*self._fitted_at, size))
            self.nonaffine = pd.DataFrame(rows, columns=self.nonaffine.columns)
            if not self.affine:
                self.calibration = None
        return self.affine

    def _batch_one(self) -> _Trace | None:
        """Batch 1's own trace where its program is not the fitted one, else None (traced at the first need).

        # NOTE: a dimension of size 1 changes strides, and strides choose kernels: `nn.MultiheadAttention`'s
        # projections run one `addmm` on a contiguous batch of one and `clone`, `mm` and `add` on a transposed
        # larger batch. Batch 1 is therefore traced on its own; where its allocations are the fit's (most
        # models) the fit serves it, else its own trace does (and calibration fits it on its own). A derived
        # variant runs its program's kernels on the same shapes: where the program's batch 1 is on its line, so is
        # the variant's, which is then not traced again.
        """
        if not self.affine:
            return None
        if not hasattr(self, "_one") and self._like is not None and self._like._batch_one() is None:
            self._one = None
        if not hasattr(self, "_one"):
            try:
                one = self._traced(1)
            except ValueError:  # a model that cannot train on one example (BatchNorm): the fit answers
                one = None
            on_line = one is None or (one.signature == self._base.signature
                                      and np.array_equal(one.sizes, self._planned_sizes(1)))
            self._one = None if on_line else one
        return self._one

    # sizes and timeline ----------------------------------------------------------------------
    def _plan_at(self, batch_size: int, envelope: bool = True) -> tuple[np.ndarray, _Trace, Calibration | None]:
        """The allocation sizes, the trace and the calibration that predict `batch_size` (`envelope`: see
        `Calibration`)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_size > MAX_BATCH:
            raise ValueError(f"batch_size must be at most MAX_BATCH=2**40 (a plan's byte counts are int64), "
                             f"got {batch_size!r}")
        batch_size = int(batch_size)
        one = self._batch_one() if batch_size == 1 else None
        if one is not None:
            calibration = self._one_calibration
            return (calibration.allocations(1) if calibration else one.sizes), one, calibration
        if self.affine:
            # the calibrated plan (`calibrate`) replaces the plan's own sizes
            calibration = self.calibration
            return (calibration.allocations(batch_size, envelope=envelope) if calibration
                    else self._planned_sizes(batch_size),
                    self._base, calibration)
        trace = self._traced(batch_size)
        calibration = self._one_calibration if batch_size == 1 else None  # see `calibrate`
        return (calibration.allocations(1) if calibration else trace.sizes), trace, calibration

    def _sizes(self, batch_size: int, *, inputs: bool = True, envelope: bool = True) -> tuple[np.ndarray, _Trace]:
        sizes, trace, _ = self._plan_at(batch_size, envelope)
        if not inputs:  # the batch is a view of a data set resident elsewhere
            sizes = np.where([i["kind"] == "input" for i in trace.info], 0, sizes)
        return on_device(sizes, self.device), trace

    def _planned_sizes(self, batch_size: int) -> np.ndarray:
        """The plan's own allocation sizes (fake tensors, uncalibrated) at `batch_size`."""
        return self.intercept + self.slope * batch_size

    def timeline(self, batch_size: int, *, inputs: bool = True, envelope: bool = True) -> np.ndarray:
        """Live bytes after each allocation or free event of the program."""
        sizes, trace = self._sizes(batch_size, inputs=inputs, envelope=envelope)
        return trace.live(sizes)

    def _scratch(self, batch_size: int, length: int, envelope: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated scratch at each event (bytes above the live level while the op at it runs) and
        the op call index that needs it (-1 where none)."""
        extra, which = np.zeros(length, dtype=np.int64), np.full(length, -1)
        _, trace, calibration = self._plan_at(batch_size, envelope)
        if calibration is None or not length:
            return extra, which
        scratch = calibration.scratch(batch_size, envelope=envelope)
        at = np.fromiter((pos for _, pos in trace.calls), dtype=np.int64, count=len(trace.calls)) - 1
        calls = np.nonzero((at >= 0) & (scratch > 0))[0]
        np.maximum.at(extra, at[calls], scratch[calls])
        most = calls[scratch[calls] == extra[at[calls]]]
        which[at[most]] = len(scratch)
        np.minimum.at(which, at[most], most)  # the first call with the most scratch at its event
        return extra, which

    def live_bytes(self, batch_size: int, *, inputs: bool = True, envelope: bool = True) -> np.ndarray:
        """Live bytes at each event with the calibrated scratch of the op running there (the timeline
        itself for an uncalibrated plan)."""
        timeline = self.timeline(batch_size, inputs=inputs, envelope=envelope)
        return timeline + self._scratch(batch_size, len(timeline), envelope)[0]

    def required_bytes(self, batch_size: int, *, inputs: bool = True, envelope: bool = True) -> int:
        """Predicted peak live bytes of the program (model, optimizer and two steps).

        `inputs=False` leaves out the batch's own tensors, for loops that slice batches out of
        a data set already in memory. A calibrated plan includes the kernels' scratch, at a batch that is not a
        power of two the most its real runs at such batches showed (`Calibration`); `envelope=False` gives the
        line through the powers of two alone, and `envelope_bytes` the difference.
        """
        self.evaluations += 1
        return int(self.live_bytes(batch_size, inputs=inputs, envelope=envelope).max(initial=0))

    def envelope_bytes(self, batch_size: int) -> int:
        """What the alignment envelope adds at `batch_size` (0 at powers of two, and where kernels take the same
        at every alignment): bytes this plan could not place without a real run at this batch's alignment."""
        return self.required_bytes(batch_size) - self.required_bytes(batch_size, envelope=False)

    def step_peaks(self, batch_size: int) -> dict[str, int]:
        """Predicted peak of the model build, the first step (optimizer state created) and the
        steady-state step (state already allocated)."""
        live = self.live_bytes(batch_size)
        marks = self._plan_at(batch_size)[1].marks
        bounds = {"build": (0, marks.get("step1", 0)), "first_step": (marks.get("step1", 0), marks.get("step2", 0)),
                  "steady_state": (marks.get("step2", 0), marks.get("end", len(live)))}
        return {k: int(live[a:b].max(initial=0)) for k, (a, b) in bounds.items()}

    def calibrate(self, sizes: Sequence[int] = (1, 2, 4, 8, 17, 32, 33), *, check: Sequence[int] = (16, 64, 65),
                  tolerance: tuple[float, float] = (-0.02, 0.05), refine: int = 3) -> CompiledGraph:
        """Add the bytes real kernels allocate beyond their fake tensors (see `calibrate.py`),
        measured in real training steps at the small batch `sizes`, and measure the calibrated
        prediction's error against the allocator at the `check` sizes (`calibration_error`,
        covered by `max_batch_size`'s default margin). On CPU and CUDA (its own allocator); returns the graph.

        Each check is one more real step, whose allocator peak judges the plan fitted to the runs before it
        and which then joins the calibration. A check whose error falls outside `tolerance` is followed by a
        check at twice its size (one more where it is not a power of two, to keep its alignment), at most `refine`
        times: kernels whose scratch grows in steps (oneDNN's bf16 GEMM from batch 40 on) are measured where they
        step. Sizes and checks that are powers of two (aligned) fit the plan's line; the others (odd ones, one past
        a power of two) measure what kernels take at batches that do not fill their tiles, which every batch that
        is not a power of two is then given (`Calibration`'s envelope). The plan is then fitted once to every run
        (`calibration`). `calibration_error` keeps every check, with its round (`refined`) and the batches
        the plan it judged was fitted at; `calibrated_batches` lists every batch a real step ran at (a
        prediction elsewhere is held out from calibration).
        """
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"calibration reads the CPU or CUDA allocator; this plan is for {self.device}")
        if not self.affine:
            return self._calibrate_one()
        low, high = tolerance
        if not (math.isfinite(low) and math.isfinite(high) and low <= 0 <= high):
            raise ValueError(f"tolerance must be finite (low <= 0 <= high), got {tolerance!r}")
        if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0:
            raise ValueError(f"refine must be an integer >= 0, got {refine!r}")
        if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
            raise ValueError(f"calibration needs >= 2 distinct batch sizes >= 1, got {tuple(sizes)}")
        one = self._batch_one() if 1 in sizes else None
        if one is not None and len(sizes) < 3:
            raise ValueError(f"batch 1 runs a program of its own here (see `_batch_one`), calibrated alone: the "
                             f"fit needs >= 2 more batch sizes, got {tuple(sizes)}")
        self.calibration = self._one_calibration = None
        _warm_up(self._program, int(min(sizes)), self.device)
        observed = self._tracer.observe(sizes)
        if one is not None and not isinstance(observed[1], str):  # batch 1 runs its own program: calibrated alone
            self._one_calibration = _fit_calibration(one, lambda _: one.sizes, {1: observed.pop(1)}, least=1)
        checks, rows = sorted({int(c) for c in check} - set(observed) - {1}), []
        # NOTE: every fit is of the plan's own sizes, from all real runs so far, and the last one is the plan:
        # a correction is never corrected again (refining a correction flipped a checkpointed convolution's
        # error between -19% and +19% round after round)
        for round_ in range(refine + 1):
            self.calibration = _fit_calibration(self._base, self._planned_sizes, observed)
            missed = []
            for size in checks:
                observed[size] = run = _observe_at(self._program, size, self.device)
                if isinstance(run, str):  # the real step refused this batch: nothing to judge
                    continue
                predicted = self.required_bytes(size)
                error = (predicted - run.peak) / run.peak
                rows.append({"batch_size": size, "predicted": predicted, "allocator": run.peak, "error": error,
                             "refined": round_, "calibrated_at": ", ".join(map(str, self.calibration.sizes))})
                if not low <= error <= high:
                    missed.append(size)
            checks = sorted({2 * s + (not is_aligned(s)) for s in missed} - set(observed))
            if not checks or round_ == refine:
                break
        self.calibration = _fit_calibration(self._base, self._planned_sizes, observed)
        self.calibration_error = pd.DataFrame(rows, columns=_CHECK_COLUMNS)
        return self

    def _calibrate_one(self) -> CompiledGraph:
        """A plan not affine in the batch size (traced at each batch) calibrated at batch 1 alone, by one real step.

        # NOTE: such a plan is exact where its kernels are the traced ones, but a batch of one can run others: a
        # BiLSTM over one packed sequence took oneDNN's workspace, which its meta kernel reports as 0 bytes (issue
        # 47: -7.9% to -33% at batch 1, exact at 2, 3, 24). One step at batch 1 is the cheapest real run there is.
        """
        self._one_calibration = None
        try:
            one = self._traced(1)
        except ValueError:  # a model that cannot train on one example: nothing to calibrate
            return self
        _warm_up(self._program, 1, self.device)
        observed = _observe_at(self._program, 1, self.device)
        if not isinstance(observed, str):
            self._one_calibration = _fit_calibration(one, lambda _: one.sizes, {1: observed}, least=1)
        return self

    def calibrated_like(self, reference: CompiledGraph) -> CompiledGraph:
        """A copy of this plan with `reference`'s calibration carried over (`calibrate.transfer`), for a variant
        of the calibrated program (the same layers; step in backward, checkpoints) without real steps of its own.
        Its batch 1, where that runs a program of its own (`_batch_one`), stays uncalibrated."""
        if reference.calibration is None or not (self.affine and reference.affine) or \
                self._base_size != reference._base_size:  # at other batches the calls' shapes differ
            raise ValueError(f"needs affine plans traced at one batch, got {reference._base_size}, {self._base_size}")
        out = copy.copy(self)
        out.calibration = _transfer(reference.calibration, reference._base, self._base, self._planned_sizes)
        out.calibration_error, out._one_calibration = pd.DataFrame(columns=_CHECK_COLUMNS), None
        return out

    @property
    def calibrated_batches(self) -> list[int]:
        """Batch sizes at which calibration ran real steps (fitted there, checked there or refused there): a
        prediction at any other batch is held out from it."""
        if self.calibration is None:
            return [1] if self._one_calibration is not None else []
        ran = {*map(int, self.calibration.sizes), *self.calibration.skipped,
               *map(int, self.calibration_error["batch_size"])}
        return sorted(ran | ({1} if self._one_calibration is not None else set()))

    @property
    def default_margin(self) -> float:
        """`max_batch_size`'s margin: 0 for an uncalibrated plan (it counts tensors only); for a calibrated
        one 2% plus the largest under-prediction measured at any check, of any round.

        # NOTE: every round, not the last alone: a check that missed joins the fit, so the plan is right there
        # afterwards, but the miss showed how far the plan can be off at a batch it never ran (issue 48: a first
        # check missed by -11.2% at batch 64 and the last round's margin read 2.02%)."""
        if self.calibration is None:
            return 0.0
        checks = self.calibration_error
        under = max(0.0, -float(checks["error"].min())) if len(checks) else 0.0
        return min(0.5, 0.02 + under)

    def max_batch_size(self, memory_budget: float, *, margin: float | None = None, limit: int = 2**24) -> int:
        """Largest batch whose prediction fits `memory_budget * (1 - margin)` (Algorithm 1).

        Zero trial runs: only the plan is evaluated. `memory_budget` is a finite number of bytes
        > 0. Raises ValueError when batch 1 does not fit, and when even batch `limit` fits (the
        answer lies beyond the search: pass a larger `limit`). `margin` None is `default_margin`.
        """
        uncovered = margin is None and self.calibration is None
        margin = self.default_margin if margin is None else margin
        if isinstance(margin, bool) or not isinstance(margin, Real) or not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, Real):
            raise TypeError(f"memory_budget must be a number of bytes in (0, inf), got {memory_budget!r}")
        if not (math.isfinite(memory_budget) and memory_budget > 0):
            raise ValueError(f"memory_budget must be a finite number of bytes in (0, inf), got {memory_budget!r}")
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 1 <= limit <= MAX_BATCH:
            raise ValueError(f"limit must be an integer in 1..MAX_BATCH=2**40, got {limit!r}")
        if uncovered:
            warnings.warn("this plan is not calibrated (it counts tensors only): kernel scratch is not covered "
                          "by the default margin 0; calibrate the plan (CPU) or pass margin=", stacklevel=2)
        cap = memory_budget * (1.0 - margin)
        one = self.required_bytes(1)
        # NOTE: batch 1 can run kernels of its own (`_batch_one`) and need more than batches 2-5 (a bf16 LayerNorm
        # MLP on AMX: 566,016 bytes at batch 1, 488,504 at 3): where it does not fit, the search starts at 2
        first = 2 if one > cap and limit >= 2 and self.required_bytes(2) <= cap else 1
        if first == 1 and one > cap:
            raise ValueError(
                f"batch size 1 needs {one} bytes, more than the budget {memory_budget:.0f} bytes "
                f"with margin {margin} ({cap:.0f} bytes usable)"
            )
        best, self.last_search_evaluations = search_max(
            lambda b: self.required_bytes(b + first - 1) <= cap,
            int(min(cap // self.required_bytes(first), limit - first + 1)), limit=limit - first + 1)
        best += first - 1
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
        born, died = trace.lifetimes()
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
        timeline = self.live_bytes(batch_size)
        # the last event at the peak level: the steady-state step reaches the same peak as the first
        peak_at = len(timeline) - 1 - int(timeline[::-1].argmax()) if len(timeline) else 0
        _, trace, calibration = self._plan_at(batch_size)
        start, end = trace.marks.get("step2", 0), trace.marks.get("end", len(timeline))
        steady = frame[(frame["born"] < end) & (frame["died"] >= start)].copy()
        steady["live_at_peak"] = (steady["born"] <= peak_at) & (steady["died"] > peak_at)
        zones = list(ZONES)
        if self.calibration is not None:  # tensors the real kernel makes larger, and scratch, are calibrated
            zones.append(CALIBRATED_ZONE)
            if calibration is not None:
                steady.loc[calibration.corrected[steady.index], "zone"] = CALIBRATED_ZONE
            extra, which = self._scratch(batch_size, len(timeline))
            calls = trace.calls
            scratch = [{"zone": CALIBRATED_ZONE, "kind": "scratch", "name": f"{calls[which[e]][0]} scratch",
                        "op": calls[which[e]][0], "phase": "step2", "bytes": int(extra[e]), "born": e,
                        "live_at_peak": e == peak_at} for e in np.nonzero(extra)[0] if start <= e < end]
            steady = pd.concat([steady, pd.DataFrame(scratch, columns=list(steady.columns))], ignore_index=True)
        steady["zone"] = pd.Categorical(steady["zone"], categories=zones, ordered=True)
        cols = ["zone", "kind", "name", "op", "phase", "bytes", "live_at_peak"]
        return steady.sort_values(["zone", "born"])[cols].reset_index(drop=True)

    def zone_bytes(self, batch_size: int) -> pd.DataFrame:
        """Bytes per zone live at the predicted peak (what a dynamic allocator needs), and the bytes of
        every variable live in the steady-state step summed (`bytes_allocated_in_step`: what a static
        layout needs that gives each variable its own offset, the CalcHeap's rule in Section 3.2)."""
        z = self.zones(batch_size)
        at_peak = z[z["live_at_peak"]].groupby("zone", observed=False)["bytes"].sum()
        total = z.groupby("zone", observed=False)["bytes"].sum()
        zones = list(z["zone"].cat.categories)
        return pd.DataFrame({"zone": zones, "bytes_at_peak": [int(at_peak.get(k, 0)) for k in zones],
                             "bytes_allocated_in_step": [int(total.get(k, 0)) for k in zones]})

    def persistent_bytes(self) -> int:
        """Bytes of parameters, buffers, gradients and optimizer state (batch-independent)."""
        frame = self.variables(1)
        keep = frame["kind"].isin(["parameter", "buffer", "gradient", "state"]) & (frame["phase"] != "step2")
        return int(frame.loc[keep, "bytes"].sum())

    def __repr__(self) -> str:
        return f"CompiledGraph({self.description}, affine={self.affine}, device={self.device})"
