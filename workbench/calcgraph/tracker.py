"""The allocation tracker behind CalcGraph's compiler (Section 3.2 of "CalcGraph: taming the
high costs of deep learning using models (2022)").

A training program runs under `torch._subclasses.FakeTensorMode` (no real memory) inside a
dispatch mode that records each storage an aten op creates, when it is freed, and tags it
with its zone (forward, gradient, optimizer, workspace), kind and name. `CompiledGraph` in
`plan.py` turns two such traces into per-allocation sizes affine in the batch size.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from workbench.measure import LiveStorageMode, cpu_rng_state_as_op

from .kernels import PlanFakeTensorMode, checked_torch, plan_cache
from .values import _refuse_mixed_matmul, with_known_values

__all__: list[str] = []  # internal to workbench.calcgraph

CALL_PREFIX = "calcgraph.call#"
_CLONE = torch.ops.aten.clone.default


# NOTE: the CUDA caching allocator hands out blocks in multiples of 512 bytes: on CUDA each planned
# allocation is rounded up the same way (what the real kernels add, calibration measures)
CUDA_BLOCK = 512


def on_device(sizes: np.ndarray, device: torch.device) -> np.ndarray:
    """`sizes` as `device`'s allocator counts them: on CUDA each block rounded up to `CUDA_BLOCK`."""
    if device.type != "cuda":
        return sizes
    return np.where(sizes > 0, -(-sizes // CUDA_BLOCK) * CUDA_BLOCK, 0)


class Unplannable(ValueError):
    """An op whose memory torch's fake kernels do not model, so no plan of it would be the program that runs."""


def _cudnn_rnn_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in ("_cudnn_rnn", "_cudnn_rnn_backward", "miopen_rnn",
                                                               "miopen_rnn_backward") if hasattr(aten, name))


def _refuse_unplannable(op) -> None:
    """Refuse cuDNN's (and MIOpen's) fused RNN kernels, which nn.LSTM, nn.GRU and nn.RNN run on a GPU.

    # NOTE: torch's fake `_cudnn_rnn` gives no reserve space (the buffer cuDNN keeps from forward to backward;
    # "TODO: Query cudnnGetRNNTrainingReserveSize" in torch/_meta_registrations.py), returns the weight buffer it
    # was given, which is None for a fake module (its `flatten_parameters` cannot tell fake storages apart), and
    # `_cudnn_rnn_backward` has no fake kernel at all: the first H100 run of the zoo failed inside it.
    """
    if op in _CUDNN_RNN:
        raise Unplannable(
            f"{op.__name__}: CalcGraph cannot plan an RNN layer (nn.LSTM, nn.GRU, nn.RNN) run by cuDNN: torch's "
            f"fake kernels model neither cuDNN's reserve space nor its weight buffer, so the plan would not be the "
            f"program that runs. Plan it on the CPU, or train without cuDNN's RNN kernels "
            f"(`with torch.backends.cudnn.flags(enabled=False):` around both the plan and the training loop)")


_CUDNN_RNN = _cudnn_rnn_ops()


class _Tracker(LiveStorageMode):
    """Records each storage created by an aten op (an allocation) and when it is freed.

    The counting rule of `workbench.measure.MemoryMeter` (`LiveStorageMode`), plus tags: zone,
    kind, name and the program phase of each allocation. A storage resized in place is a free
    and a new allocation.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device  # the program's: on CUDA, host tensors are no part of its memory
        self.sizes: list[int] = []
        self.info: list[dict] = []
        self.events: list[int] = []  # +id for an allocation, -id - 1 for a free
        self.live: dict[int, int] = {}
        self.marks: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self.spec: dict = {}
        self._handles: list = []
        self._modules: list[str] = [""]
        self.layers: dict[str, str] = {}  # module label -> class name
        self._phase = "build"
        self.calls: list[tuple[str, int]] = []  # each dispatched op: (name, events recorded after it)
        self.keys: list[tuple] = []  # under fake tensors, each call's op and arguments (`_call_key`)
        self.profiled = False  # mark each op call for torch.profiler (calibration runs)
        self.call_marks: dict[str, int] = {}
        self.fake = False  # traced under fake tensors (a plan), not for real (calibration)
        self._source: int | None = None  # the allocation a running `clone` copies
        self.sources: dict[int, int] = {}  # under fake tensors, each clone's allocation -> the one it copies
        self.points: list[tuple] = []  # `point`s: where a gradient became ready, where an optimizer step began
        self.recomputing: set[int] = set()  # under fake tensors, calls in a backward with grad on: a recomputation's
        self.uses: dict[int, set[str]] = {}  # under fake tensors, the modules whose forward calls took each allocation

    def _counts(self, tensor: torch.Tensor) -> bool:
        # NOTE: a CUDA program's plan is the GPU's memory: host tensors it makes (AdamW's step counters, which torch
        # keeps on the CPU; the CPU generator's state a checkpoint saves) are not, and each was planned as a 512-byte
        # block (the 2026-11-27 H100 zoo: every Adam case a constant 512 bytes a parameter over)
        return not (self.device is not None and self.device.type == "cuda" and tensor.device.type == "cpu")

    def _counted(self, op, args, kwargs, tensors):
        if self.fake and torch.is_grad_enabled():  # notes for `placements` (plans, not calibration's real runs)
            if torch._C._current_graph_task_id() != -1:
                self.recomputing.add(len(self.calls))
            else:
                for t in tensors:
                    idx = self.live.get(t.untyped_storage()._cdata)
                    if idx is not None:
                        self.uses.setdefault(idx, set()).add(self._modules[-1])
        if self.fake:
            _refuse_unplannable(op)
            _refuse_mixed_matmul(op, args)
            op, real = with_known_values(op, args, tensors)
            if op is _CLONE:
                self._source = self.live.get(args[0].untyped_storage()._cdata)
        else:
            real = False
        with unset_fake_temporarily() if real else contextlib.nullcontext():
            # NOTE: a view allocates nothing (its scratch is 0 unmarked): a mark costs a `record_function` and an event
            # for the profiler to keep and calibration to read, and views were a third of a DenseNet-BC-100 step's calls
            if self.profiled and not getattr(op, "is_view", False):
                with torch.profiler.record_function(f"{CALL_PREFIX}{len(self.calls)}"):
                    out = super()._counted(op, args, kwargs, tensors)
            else:
                out = super()._counted(op, args, kwargs, tensors)
        self._source = None
        self.calls.append((op.__name__, len(self.events)))
        if self.fake:
            self.keys.append(_call_key(op, args))
        return out

    # allocation timeline -------------------------------------------------------------------
    def _released(self, key: int, nbytes: int) -> None:
        idx = self.live.pop(key, None)
        if idx is not None:
            self.events.append(-idx - 1)

    def _allocated(self, key: int, nbytes: int, old_nbytes: int | None, op: str) -> None:
        if old_nbytes is not None:
            self._released(key, old_nbytes)
        idx = len(self.sizes)
        self.sizes.append(nbytes)
        self.info.append({"op": op, "module": self._modules[-1], "phase": self._phase, "call": len(self.calls),
                          "zone": None, "kind": None, "name": None})
        if self._source is not None:
            self.sources[idx] = self._source
        self.live[key] = idx
        self.events.append(idx)

    # tags ------------------------------------------------------------------------------------
    def mark(self, phase: str) -> None:
        gc.collect(1)  # cyclic garbage freed here, not wherever Python's collector happens to run (see `_trace`)
        self.marks[phase] = len(self.events)
        self.call_marks[phase] = len(self.calls)
        self._phase = phase
        # NOTE: no module runs between phases; a checkpoint's recomputation that stops early (torch's non-reentrant
        # checkpoint stops at the last tensor it needs) leaves the modules it entered unleft
        self._modules = [""]

    def point(self, what: str, name: str = "") -> None:
        """Note where the program is (`derive.in_backward` splices steps there): (what, name, events, calls, module,
        the frees since the last allocation: canonical order (`_canonical_frees`) may move them past this point)."""
        events = self.events
        at = len(events)
        while at and events[at - 1] < 0:
            at -= 1
        self.points.append((what, name, len(events), len(self.calls), self._modules[-1], frozenset(events[at:])))

    def grad_ready(self, p: torch.Tensor) -> None:
        self.point("ready", self.names.get(id(p), "?"))

    def tag(self, tensor: torch.Tensor, zone: str, kind: str, name: str) -> None:
        idx = self.live.get(tensor.untyped_storage()._cdata)
        if idx is not None and self.info[idx]["zone"] is None:
            self.info[idx].update(zone=zone, kind=kind, name=name)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        module = self._modules[-1] or "model"
        self.tag(tensor, "forward", "activation", f"{module}:{self.info[-1]['op'] if self.info else '?'}")
        return tensor

    def watch_model(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self.names[id(p)] = name
            self.tag(p, "forward", "parameter", name)
        for name, b in model.named_buffers():
            self.tag(b, "forward", "buffer", name)
        for name, module in model.named_modules():
            label = name or type(module).__name__
            self.layers[label] = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, label=label: self._enter(label)))
            self._handles.append(module.register_forward_hook(lambda *_: self._leave()))

    def _enter(self, label: str) -> None:
        self._modules.append(label)

    def _leave(self) -> None:
        self._modules.pop()

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def tag_grads(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.grad is not None:
                self.tag(p.grad, "gradient", "gradient", name + ".grad")

    def tag_state(self, opt: torch.optim.Optimizer) -> None:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.tag(value, "optimizer", "state", f"{self.names.get(id(p), '?')}.{key}")


@dataclass
class _Trace:
    sizes: np.ndarray
    info: list[dict]
    events: np.ndarray
    marks: dict[str, int]
    spec: dict
    signature: tuple = field(repr=False, default=())
    calls: list[tuple[str, int]] = field(repr=False, default_factory=list)
    call_marks: dict[str, int] = field(repr=False, default_factory=dict)
    keys: list[tuple] = field(repr=False, default_factory=list)  # each call's `_call_key` (traces under fake tensors)
    sources: dict[int, int] = field(repr=False, default_factory=dict)  # a clone's allocation -> the one it copied
    # traced for one step, the second made from it (`derive.repeat_step`): the call of step 1 each of step 2's repeats
    repeats: list[int] | None = field(repr=False, default=None)
    points: list[tuple] = field(repr=False, default_factory=list)  # `_Tracker.point`s
    spliced: bool = field(repr=False, default=False)  # made, not traced: step in backward's updates spliced in
    composed: bool = field(repr=False, default=False)  # made, not traced: a checkpoint placement (`placements`)
    recomputing: set[int] = field(repr=False, default_factory=set)  # `_Tracker.recomputing` (a trace as traced)
    uses: dict[int, set[str]] = field(repr=False, default_factory=dict)  # `_Tracker.uses` (a trace as traced)

    def live(self, sizes: np.ndarray | None = None) -> np.ndarray:
        """Live bytes after each event, each allocation of ``sizes`` bytes (default: its traced size)."""
        sizes, ev = self.sizes if sizes is None else sizes, self.events
        return np.cumsum(np.where(ev >= 0, sizes[np.maximum(ev, 0)], -sizes[np.maximum(-ev - 1, 0)]))

    def lifetimes(self) -> tuple[np.ndarray, np.ndarray]:
        """Each allocation's event of birth and of death (``len(events)`` for one alive at the end)."""
        ev, at = self.events, np.arange(len(self.events))
        born, died = np.full(len(self.sizes), -1), np.full(len(self.sizes), len(ev))
        born[ev[ev >= 0]], died[-ev[ev < 0] - 1] = at[ev >= 0], at[ev < 0]
        return born, died


def _signature(events, info: list[dict]) -> tuple:
    """A trace's allocation sequence as `derive.fit` compares it: each event with its op (an allocation) or "free"."""
    return tuple((int(e), info[e]["op"]) if e >= 0 else (int(e), "free") for e in events)


def _call_key(op, args: tuple) -> tuple:
    """What a kernel's scratch depends on: the op and its positional arguments, tensors by shape and dtype (also
    inside lists: `cat`), other values as they are. Equal in two programs that run the same layer on the same
    shapes, e.g. a checkpointed block's recomputation and the plain program's forward."""
    return op.__name__, tuple([_described(a) for a in args])


def _described(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.dtype
    if isinstance(a, (list, tuple)):
        return tuple([_described(b) for b in a])
    return a if a is None or isinstance(a, (bool, int, float, str, torch.dtype)) else type(a).__name__


class _TraceError(Exception):
    """A training program that failed under fake tensors: where (layer, phase) and the error itself."""

    def __init__(self, error: BaseException, module: str, phase: str) -> None:
        super().__init__(f"{type(error).__name__}: {_last_line(error)}")
        self.error, self.module, self.phase = error, module, phase


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@contextlib.contextmanager
def _quiet_fake_tensor_logs() -> Iterator[None]:
    # NOTE: FakeTensorMode logs the full traceback of every meta kernel that raises (a wrong input shape
    # gives a page of it) before the error itself propagates; the planner re-raises a short message.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _canonical_frees(events: list[int], marks: Sequence[int] = ()) -> list[int]:
    """`events` with each run of consecutive frees sorted: the order in which a burst of tensors dies
    (autocast's weight cache at exit is a dict of tensors) can differ between runs, and the live level
    only falls inside a burst, so its peak and the events' count are unchanged. A burst ends at each of `marks`
    (event positions: the phases' bounds), so that each phase's events are its own (`derive.repeat_step`)."""
    out, burst, bounds = [], [], set(marks)
    for at, e in enumerate([*events, 0]):
        if e >= 0 or at in bounds:
            out += sorted(burst, reverse=True)
            burst = []
        if e < 0:
            burst.append(e)
        else:
            out.append(e)
    return out[:-1]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused inside the block (explicit `gc.collect` still runs), left after it as it was
    found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fake_mode(device: torch.device | None) -> type[FakeTensorMode]:
    # NOTE: the meta kernels (`kernels.py`) for a CPU program on the torch they were compared on only: a CUDA
    # program's (cuDNN's BatchNorm and convolutions) are compared by a CUDA test first
    return PlanFakeTensorMode if checked_torch() and (device is None or device.type == "cpu") else FakeTensorMode


def _trace(program: Callable[[_Tracker], None], *, fake: bool = True, profiled: bool = False,
           device: torch.device | None = None) -> _Trace:
    """Run `program` (on `device`) under the tracker: under fake tensors (a plan), or for real (`fake=False`,
    calibration)."""
    tracker = _Tracker(device)
    tracker.profiled, tracker.fake = profiled, fake
    mode = _fake_mode(device) if fake else None
    if mode is FakeTensorMode:
        # NOTE: a trace must depend on its program and batch only, not on what this process traced before: on torch's
        # warm dispatch cache an LSTM's backward allocated otherwise than on a cold one (`kernels.py`), so with torch's
        # own path every trace starts cold; within it, step 2 still reuses step 1's entries
        FakeTensorMode.cache_clear()
    # NOTE: a tensor held in a reference cycle is freed when Python's cyclic collector runs, which depends on all the
    # process did before: a BERT built for real and copied (`program._build_model`) freed its fp32 fake weights at a
    # different event in each trace at one batch. The collector runs only at each phase mark, over the young
    # generations (what the trace made; a full collection of a notebook's heap took 0.13 s, four per trace), in a
    # real run (calibration) as in the fake trace it is mapped onto: 15% of DenseNet-BC-100's calibration had been
    # the collector's passes over the process's heap, at whichever allocations set them off.
    gc.collect(1)
    try:
        with collector_paused(), _quiet_fake_tensor_logs(), \
                (mode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()), \
                (plan_cache() if mode is PlanFakeTensorMode else contextlib.nullcontext()), \
                cpu_rng_state_as_op(fake=fake):
            with tracker:
                program(tracker)
    except Exception as error:
        label = tracker._modules[-1]
        kind = tracker.layers.get(label, "")
        where = f"layer '{label}' ({kind})" if label and kind != label else (f"layer {label}" if label else "")
        raise _TraceError(error, where, tracker._phase) from error
    finally:
        tracker.unwatch()
        tracker.close()
    events = _canonical_frees(tracker.events, tracker.marks.values())
    return _Trace(np.asarray(tracker.sizes, dtype=np.int64), tracker.info,
                  np.asarray(events, dtype=np.int64), tracker.marks, tracker.spec, _signature(events, tracker.info),
                  tracker.calls, tracker.call_marks, tracker.keys, tracker.sources, points=tracker.points,
                  recomputing=tracker.recomputing, uses=tracker.uses)
