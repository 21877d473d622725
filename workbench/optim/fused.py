"""The fused step's flat buffers: one stream of values per param group ("Fused" in section 3.1).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 ("we provide
a Fused-version of the optimizers ... handling the parameters as one only stream of values combined
all together", so one kernel launch covers a whole group).

A group's 16-bit halves, extra bits (``workbench.optim.packing``: uint8 byte planes for 8 and 16
bits, else dense int32 words) and optimizer states live in flat buffers. Each parameter is a
32-value-aligned segment, so a segment of dense words starts on a word boundary and the
per-parameter state entries stay views of the buffers (``state_dict`` looks the same as unfused).
Unlike the paper's fused kernels (8 and 16 extra bits only), every width is supported.

Which code runs an update is chosen in one place, :func:`select_step`: ``fused=True`` asks for the
fastest step available on the device (the hand-written Triton kernel on CUDA, every format; the
hand-written C++ kernel on CPU, byte-plane formats, 8-bit moments too; else the ``torch.compile``d update, with
the eager update as fallback where compile is unavailable); ``STEP_BACKENDS`` lists the candidates, fastest first.
The per-parameter step (unfused groups, ``step_in_backward``) runs the same hand-written kernels on one
parameter, which allocate nothing, else the eager update in bounded chunks.
"""

from __future__ import annotations

import functools
import importlib
import operator
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from .kernel_args import GradSegments, as_flat
from .layout import grad_in_order, in_layout, memory_order
from .packing import extra_storage
from .quantized import GROUP, code_dtype, kind_of, scales_for, stored_keys
from .update import chunked_update, compiled_update

__all__ = ["FlatGroup", "PER_PARAMETER_BACKENDS", "STEP_BACKENDS", "StepSpec", "compile_available", "compiled_step",
           "cpu_kernel_step", "eager_step", "lazy_backend", "select_step"]

#: An update: ``step(half, grad, extra, states, coef, key)`` changes ``half``, ``extra`` and ``states``
#: in place (``workbench.optim.update.packed_update``'s positional arguments; ``key`` an int or None).
Step = Callable[..., None]


@dataclass(frozen=True)
class StepSpec:
    """What an update computes: ``packed_update``'s static keyword arguments and the tensors' types.

    ``static`` holds math_fn, extra_bits, stochastic_rounding, master_rounding, options and scaled;
    ``bits`` the stored bits per value; ``dynamic`` says the lengths vary between calls (the
    per-parameter step, byte planes) rather than one fixed flat length.
    """

    static: dict[str, Any]
    bits: int
    dtype: torch.dtype
    state_dtype: torch.dtype
    dynamic: bool


@functools.cache
def compile_available(device_type: str) -> bool:
    """Whether ``torch.compile`` can build the update here (dynamo, plus a C++ compiler or Triton)."""
    try:
        if not torch._dynamo.is_dynamo_supported():
            return False
        if device_type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            return True
        if device_type == "cuda":
            from torch.utils._triton import has_triton

            return bool(has_triton())
    except Exception:  # noqa: BLE001 - any failure to find a toolchain means "not available"
        return False
    return False


def eager_step(device: torch.device, spec: StepSpec) -> Step:
    """The eager update in chunks (``update.chunked_update``): available everywhere."""

    def step(half, grad, extra, states, coef, key):
        chunked_update(half, as_flat(grad), extra, states, coef, key, bits=spec.bits, **spec.static)

    return step


def compiled_step(device: torch.device, spec: StepSpec) -> Step | None:
    """The ``torch.compile``d update (bit-identical to the eager one), or None where compile is unavailable."""
    if not compile_available(device.type):
        return None
    update = compiled_update(dynamic=spec.dynamic, device_type=device.type, key=(spec.dtype, spec.state_dtype),
                             **spec.static)

    def step(half, grad, extra, states, coef, key):
        if key is not None:
            key = torch.tensor(key, dtype=torch.int32, device=half.device)
        update(half, as_flat(grad), extra, states, coef, key)

    return step


def lazy_backend(module: str, attr: str) -> Callable[..., Step | None]:
    """A backend imported at its first use: ``module.attr(device, spec, **kw)``; None while it cannot be imported."""

    def backend(device: torch.device, spec: StepSpec, **kw: Any) -> Step | None:
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError:
            return None
        return fn(device, spec, **kw)

    return backend


def cpu_kernel_step(device: torch.device, spec: StepSpec, *, fallback: Step | None = None) -> Step | None:
    """The hand-written CPU kernel (``workbench.optim.cpu_kernel``) for the specs it takes, else None.

    In :data:`STEP_BACKENDS`, and the per-parameter step's (see :func:`select_step`). It takes the byte-plane
    formats (0, 8 or 16 stored bits); updates it does not take fall back to ``fallback`` (by default the compiled
    step, or the eager one) inside ``cpu_kernel.kernel_update``.
    ``WORKBENCH_CPU_KERNEL=0`` turns it off; without a C++ compiler it warns once and is skipped.
    """
    static, options = spec.static, spec.static["options"]
    # NOTE: the kernel reads its options by name and would ignore the ones it does not know: loss
    # scaling (the ``scaled`` coefficients), maximize and amsgrad are kept away from it until it has them.
    if (device.type != "cpu" or spec.bits not in (0, 8, 16) or static.get("scaled") or options.get("maximize")
            or options.get("amsgrad")):
        return None
    try:
        kernel = importlib.import_module("workbench.optim.cpu_kernel")
    except ImportError:
        return None
    if not kernel.available():
        return None
    fallback = fallback or compiled_step(device, spec) or eager_step(device, spec)
    return kernel.kernel_update(fallback=fallback, **{k: v for k, v in static.items() if k != "scaled"})


#: Update backends, fastest first: ``(name, backend)``, where ``backend(device, spec)`` returns a
#: :data:`Step` (bit-identical to the eager update) or None when it cannot run that spec on that
#: device (another device type, an unsupported format). A new kernel is plugged in with one line at
#: the front, for another module ``("name", lazy_backend("workbench.optim.module", "backend")),``.
STEP_BACKENDS: list[tuple[str, Callable[[torch.device, StepSpec], Step | None]]] = [
    ("triton_kernel", lazy_backend("workbench.optim.triton_kernel", "triton_step")),
    ("cpu_kernel", cpu_kernel_step),
    ("compiled", compiled_step),
    ("eager", eager_step),
]
#: The per-parameter step's kernels (unfused groups, ``step_in_backward``): ``backend(device, spec, fallback=)``
#: returns a step that runs the kernel where it takes the update and ``fallback`` (the eager update) else.
PER_PARAMETER_BACKENDS: list[tuple[str, Callable[..., Step | None]]] = [
    ("triton_kernel", lazy_backend("workbench.optim.triton_kernel", "triton_step")),
    ("cpu_kernel", cpu_kernel_step),
]
_FAILED: set[tuple[str, str]] = set()  # (backend, device type) whose build failed: skipped from then on


def _guarded(name: str, device: torch.device, step: Step, fallback: Step) -> Step:
    # NOTE: a toolchain can pass compile_available and still fail to build (a broken compiler, a
    # Triton/driver mismatch). torch raises those as TorchDynamoException before running anything,
    # so the eager update can take over that call and, with a warning, every later one.
    failed = []

    def run(*args):
        if failed:
            fallback(*args)
            return
        try:
            step(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            failed.append(e)
            _FAILED.add((name, device.type))
            warnings.warn(f"the {name} packed update failed to build on {device.type} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0]}); using the eager update from now on", stacklevel=3)
            fallback(*args)

    return run


def select_step(device: torch.device, spec: StepSpec, *, fused: bool, compile: bool | None) -> tuple[str, Step]:
    """The update to run, and its backend's name: the one place where the step is chosen.

    ``compile=False``: the eager update. ``compile=True``: the compiled update (RuntimeError where
    torch.compile is unavailable). ``compile=None``: for ``fused`` groups the first backend of
    :data:`STEP_BACKENDS` that serves ``spec`` on ``device`` (the fastest available), for the
    others (one update per parameter) the first of :data:`PER_PARAMETER_BACKENDS` (the hand-written
    kernels: Triton on CUDA, C++ on CPU) that takes the spec, with the eager update for what they refuse.
    """
    device = torch.device(device)
    eager = eager_step(device, spec)
    if compile is False:
        return "eager", eager
    if spec.state_dtype == torch.int8 and device.type != "cpu" and compile is None:
        # NOTE: 8-bit moments off the CPU: the Triton kernel does not take them, and the compiled (Triton) step was
        # checked against the eager one on CPU only (test_int8_moments), not on a GPU yet; compile=True asks for it
        return "eager", eager
    if compile is None and not fused:
        # NOTE: one call per parameter: the hand-written kernels have no temporaries and no per-shape
        # compile, and give the eager bits; the eager step runs ~30 ops per chunk (CHUNK values on CPU: 3000
        # chunks for 1e8 parameters, which CalcGraph's fake-tensor plan of a step then traces one by one:
        # 135 s, against 0.3 s; on CUDA, CUDA_CHUNK values with ~43 MB of temporaries on top of live
        # activations inside backward, issue 33). Both kernels skip fake tensors (nothing to allocate).
        for name, backend in PER_PARAMETER_BACKENDS:
            step = backend(device, spec, fallback=eager)
            if step is not None:
                return name, step
        return "eager", eager
    if compile is True:
        step = compiled_step(device, spec)
        if step is None:
            raise RuntimeError(f"compile=True, but torch.compile cannot build code for {device.type} here (no "
                               "C++ compiler or Triton); use compile=None (the fastest step available) or False")
        return "compiled", step
    for name, backend in STEP_BACKENDS:
        if (name, device.type) in _FAILED:
            continue
        step = backend(device, spec)
        if step is not None:
            return name, (step if step is eager or name == "eager" else _guarded(name, device, step, eager))
    return "eager", eager


# NOTE: the fused path rebinds each ``p.data`` to a view of the group's flat buffer (as apex's
# flat-buffer optimizers do). The hand-written kernels read each gradient where autograd left it
# (``grad_segments``); for the compiled and eager steps, gradients are copied into a flat gradient buffer
# unless they already are its views (``zero_grad(set_to_none=False)`` keeps them so), which the optimizer
# holds only weakly, so ``zero_grad(set_to_none=True)`` frees it with the gradients. A group where some
# parameter has no gradient takes the per-parameter path, which computes the same update.
class FlatGroup:
    """Flat buffers of one fused param group; params and states become views into them."""

    def __init__(self, params: list[torch.Tensor], state: dict, keys: list[str], bits: int,
                 state_dtype: torch.dtype):
        self.params, self.keys, self.bits = params, keys, bits
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += (p.numel() + 31) // 32 * 32
        self.total = off
        self._offsets = tuple(self.offsets)
        # made like the first parameter: its device, and fake under a plan's trace (see `quantized.new_quantized`)
        like = params[0]
        self.half = like.new_zeros(off)
        shape, edtype = extra_storage(off, bits, aligned=True)
        self.extra = like.new_zeros(shape, dtype=edtype)
        int8 = state_dtype == torch.int8
        if int8:  # 8-bit moments: 1-D codes and a scale per 32 values (``quantized``), segments on group bounds
            self.keys = keys = stored_keys(keys)
            self.states = {k: like.new_zeros(off // GROUP, dtype=torch.bfloat16) if i % 2 else
                           like.new_zeros(off, dtype=code_dtype(kind_of(k))) for i, k in enumerate(keys)}
        else:
            self.states = {k: like.new_zeros(off, dtype=state_dtype) for k in keys}
        self._grad: weakref.ref | None = None
        for p, o in zip(params, self.offsets, strict=True):
            # each segment in its parameter's memory order, viewed with its strides (``layout``)
            n, st = p.numel(), state[p]
            self.half[o : o + n].copy_(memory_order(p.detach()))
            p.data = self.half.as_strided(p.shape, p.stride(), o)
            for i, k in enumerate(keys):
                if int8:
                    at, size = (o // GROUP, scales_for(n)) if i % 2 else (o, n)
                    self.states[k][at : at + size].copy_(st[k])
                    st[k] = self.states[k][at : at + size]
                    continue
                self.states[k][o : o + n].copy_(memory_order(in_layout(st[k], p)))
                st[k] = self.states[k].as_strided(p.shape, p.stride(), o)
            seg = self._extra_view(o, n)
            seg.copy_(st["extra"])
            st["extra"] = seg
        # what every parameter must keep for the buffers to stay its own: its storage, and the very state
        # dict and state tensors made here (identity checks each step, iterated by map in C: ~2 us for 8 tensors)
        self._ptrs = [self.half[o:].data_ptr() for o in self.offsets]
        #: the parameters' state dicts, in order (while :meth:`valid`, the optimizer's own)
        self.state_dicts = [state[p] for p in params]
        self._entries = operator.itemgetter("extra", *keys)
        self._views = [t for p in params for t in self._entries(state[p])]
        self._contiguous = [p.is_contiguous() for p in params]
        self._item = self.half.element_size()
        #: the extra bits as the update takes them: byte planes as 1-D views, or the words
        self.extra_arg = list(self.extra.unbind(0)) if self.extra.dtype == torch.uint8 else self.extra

    def _extra_view(self, o: int, n: int) -> torch.Tensor:
        if self.extra.dtype == torch.uint8:
            return self.extra[:, o : o + n]
        ws = o * self.bits // 32
        return self.extra[ws : ws + (n * self.bits + 31) // 32]

    def valid(self, state: dict) -> bool:
        """Whether every parameter still has its storage in the buffers, and its state dict and state tensors
        (``extra`` and the moments) are still the ones made here."""
        dicts = list(map(state.get, self.params))
        if not all(map(operator.is_, dicts, self.state_dicts)):
            return False
        if list(map(torch.Tensor.data_ptr, self.params)) != self._ptrs:
            return False
        try:
            entries = chain.from_iterable(map(self._entries, dicts))
            return all(map(operator.is_, entries, self._views))
        except KeyError:  # a state entry was deleted
            return False

    def grad_segments(self) -> GradSegments:
        """The gradients where autograd left them, as the kernels read them (``kernel_args.GradSegments``)."""
        grads = tuple(g if plain and g.is_contiguous() else grad_in_order(g, p)
                      for p, plain, g in zip(self.params, self._contiguous, (p.grad for p in self.params),
                                             strict=True))
        return GradSegments(self._offsets, grads, self.gather_grads)

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient: reused when every ``.grad`` is still its view, else copied into a new one."""
        buf = self._grad() if self._grad is not None else None
        if buf is not None:
            base = buf.data_ptr()
            if all(p.grad.data_ptr() == base + o * self._item and p.grad.stride() == p.stride()
                   for p, o in zip(self.params, self.offsets, strict=True)):
                return buf
        buf = torch.empty(self.total, dtype=self.half.dtype, device=self.half.device)
        end = 0
        for p, o in zip(self.params, self.offsets, strict=True):
            buf[end:o].zero_()  # padding between segments: a defined value, never read back
            view = buf.as_strided(p.shape, p.stride(), o)
            view.copy_(p.grad)
            p.grad = view
            end = o + p.numel()
        buf[end:].zero_()
        self._grad = weakref.ref(buf)
        return buf
