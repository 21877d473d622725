"""The fake tensors a plan is traced under (issue 45: the cost of a trace): each op's shapes from its meta kernel
where it has one, and a dispatch cache kept from one trace to the next.

`FakeTensorMode` (torch 2.13) prefers an op's Python decomposition (`torch._decomp`) over its meta kernel (the
op's kernel for the meta device: C++, or for some ops, BatchNorm's among them, a decomposition torch registers there)
wherever that kernel is not registered as supporting symbolic sizes. Under fake tensors a decomposition runs the op's
arithmetic op by op, each through fake dispatch again (its cache key, its cache entry); the meta kernel runs once on
meta tensors. A BatchNorm forward took 8 ms through fake dispatch against 0.3 ms for the same call found in the
dispatch cache. A trace started with that cache cold, so a training program's first step ran its normalisation and
activation backward through decompositions: in a DenseNet-BC-100 trace, 1.8 of its 2.6 s were the first step and
0.5 the second.

A plan traces at concrete batch sizes, never symbolic ones, so each op of a CPU program with a meta kernel takes it
here (a CUDA program, or any on a torch other than 2.13, keeps torch's path until a test has compared the two there:
`tracker._fake_mode`). That kernel gives the same shapes, strides and dtypes as the decomposition (the same traces,
byte for byte: tested on CalcGraph's zoo and three CNNs in `tests/calcgraph/test_kernels.py`, and compared once on the
advisor suite's four models at each precision and variant and on transformers' BERT and GPT-2), with one exception,
BatchNorm's saved statistics at a reduced-precision input:

| input, weight | CPU kernel | meta kernel | decomposition under fake tensors |
|---|---|---|---|
| bf16, fp32 (autocast) | fp32 | fp32 | bf16 |
| bf16, bf16 (bf16 weights) | bf16 | fp32 | bf16 |

There the op takes the path that agrees with the kernel that runs: the meta kernel where the weight's dtype is
not the input's; where it is, the meta kernel with its statistics made in the input's dtype, what the decomposition
gives at a quarter of its cost.

BatchNorm's own meta kernel is a Python decomposition torch registers at the meta key: in training (a DenseNet's
every layer) its outputs, laid out as its input, are made by hand (`_batch_norm_outputs`, compared with that kernel in
`tests/calcgraph/test_kernels.py`; a DenseNet-BC-100 x0.125 fp32 trace at a new batch, one thread: 0.93 -> 0.72 s,
AMD EPYC).

Two more of torch's Python paths are cut short at concrete sizes. `aten.slice` takes its C++ kernel on the meta
device rather than torch's rule for unbacked sizes (`fake_impls.slice_forward`: guards on every bound, an `as_strided`
dispatched again), the same view of the same storage. And the dispatch cache keys a dense fake tensor by one tuple of
what torch's `TensorMetadata` holds for it, where torch built the dataclass and walked its fields (half the cost of
an op found in the cache). Both are compared with torch's own in `tests/calcgraph/test_kernels.py`.

The dispatch cache (`plan_cache`) is this process's own, kept across traces and emptied past `CACHE_ENTRIES`. Traces
had started cold because one op came back from torch's cache otherwise than it ran: oneDNN's LSTM backward, whose
meta kernel returns its two bias gradients as one tensor and whose cached call (like the CPU kernel) as two, so an
LSTM's trace depended on what its process had traced before. Such a call is dispatched again once cached, and every
op then gives the same trace on a cold cache and on a warm one (tested on the zoo). A cached call costs a fraction of
a run one: the advisor's traces took 7% less for ResNet-50 and 15% less for DenseNet-BC-100, where each program is
traced once at each batch and shares the cache only with the other programs traced before it in its process.

A forked worker (`forked.run_forked`) sends the entries it made back with each result (`new_entries`), and the process
that forked it adds them to its own cache before its next trace or fork (`receive`, `merge_received`): a checkpoint
placement a new budget asks for (`Advice.rebudget`) is then traced on the entries its program's traces made, not on a
cold cache. An op pickles by its name, and a key is made again where it is loaded (its hash hashes its ops by id).
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator

import torch
from torch._prims_common import get_computation_dtype, make_channels_last_strides_for, make_contiguous_strides_for
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import (FakeTensor, _BypassDispatchCache, _DispatchCacheKey,
                                           in_kernel_invocation_manager)
from torch.utils._pytree import tree_leaves

__all__: list[str] = []  # used through the tracker

# NOTE: `PlanFakeTensorMode` overrides private methods of torch's `FakeTensorMode`, compared (tests) on this torch
# only: another (the GPU machine's image has torch 2.11) traces on torch's own path
CHECKED_TORCH = "2.13"
CACHE_ENTRIES = 50_000  # a process's plan cache is emptied past this many entries (a ResNet-50 program makes ~1,500)
_CACHE: dict = {}
_SENT = 0  # entries of `_CACHE` sent or inherited already (`new_entries`: a forked worker's, those after the fork)
_RECEIVED: list[bytes] = []  # entries forked workers sent back, added to `_CACHE` at the next trace or fork here
_META = torch._C.DispatchKey.Meta
_BATCH_NORM = torch.ops.aten.native_batch_norm.default
_BATCH_NORMS = (_BATCH_NORM, torch.ops.aten.native_batch_norm_backward.default)
_SLICE = torch.ops.aten.slice.Tensor
_DENSE = "dense fake tensor"  # the first element of such a tensor's key (`PlanFakeTensorMode._prep_args_for_hash`)


def checked_torch() -> bool:
    """Whether this torch is the one `PlanFakeTensorMode` was compared on (`CHECKED_TORCH`)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2]) == CHECKED_TORCH


def _meta_agrees(func, args: tuple) -> bool:
    """Whether `func`'s meta kernel gives what the real kernel gives for `args` (see the module docstring)."""
    if func is not _BATCH_NORM:
        return True
    x, weight = args[0], args[1] if len(args) > 1 else None
    return not x.dtype.is_floating_point or x.dtype == torch.float32 or (weight is not None and
                                                                        weight.dtype != x.dtype)


def _dense(x: torch.Tensor) -> bool:
    """Whether `x` (not empty) is laid out as a contiguous or a channels-last tensor, its size-1 dimensions' strides
    included."""
    layouts = [make_contiguous_strides_for] + ([make_channels_last_strides_for] if x.dim() in (4, 5) else [])
    return x.numel() > 0 and any(tuple(layout(x.shape)) == x.stride() for layout in layouts)


def _training_batch_norm(mode: FakeTensorMode, func, args: tuple) -> bool:
    """Whether `func(*args)` is a BatchNorm forward or backward in training whose outputs `_batch_norm_outputs` makes:
    its input one of `mode`'s concrete fake tensors of >= 2 dimensions laid out densely, the backward's incoming
    gradient laid out as the input. Not a forward with running statistics over one value per channel, where the meta
    kernel raises (its unbiased variance divides by zero) and the caller is to meet that error."""
    x, training = args[0 if func is _BATCH_NORM else 1], args[5 if func is _BATCH_NORM else 7]
    if training is not True or not _concrete(mode, x) or x.dim() < 2 or not _dense(x):
        return False
    if func is _BATCH_NORM:
        return args[4] is None or x.numel() > x.shape[1]
    return _concrete(mode, args[0]) and args[0].shape == x.shape and args[0].stride() == x.stride()


def _batch_norm_outputs(func, args: tuple) -> tuple:
    """BatchNorm's outputs in training as its meta kernel makes them (see `PlanFakeTensorMode._dispatch_impl`), where
    `_training_batch_norm` holds: the forward's output laid out as its input, its saved mean and inverse deviation per
    channel in the input's computation dtype (the input's where `_meta_agrees` says the kernel keeps them so); the
    backward's input gradient laid out as its input, its weight and bias gradients per channel in the weight's dtype.

    # NOTE: by hand: that meta kernel is a Python decomposition torch registers at the meta key, 1.5 ms a call on a
    # dispatch cache miss, a third of the misses' time in a DenseNet-BC-100 trace (a BatchNorm of its own channels per
    # layer); compared with torch's kernel on every layout, dtype and mask in `tests/calcgraph/test_kernels.py`
    """
    if func is _BATCH_NORM:
        x = args[0]
        stats = get_computation_dtype(x.dtype) if _meta_agrees(func, args) else x.dtype
        return torch.empty_like(x), x.new_empty(x.shape[1], dtype=stats), x.new_empty(x.shape[1], dtype=stats)
    x, weight, mask = args[1], args[2], args[9]
    per_channel = weight.dtype if weight is not None else x.dtype
    return (torch.empty_like(x), *(x.new_empty(x.shape[1], dtype=per_channel) if keep else None for keep in mask[1:]))


def _concrete(mode: FakeTensorMode, arg: object) -> bool:
    """Whether `arg` is one of `mode`'s fake tensors, of concrete sizes and no constant value."""
    return type(arg) is FakeTensor and arg.fake_mode is mode and arg.constant is None and \
        not arg._has_symbolic_sizes_strides


def _concrete_slice(mode: FakeTensorMode, args: tuple, kwargs: dict) -> bool:
    """Whether `aten.slice.Tensor(*args, **kwargs)` slices one of `mode`'s concrete fake tensors by whole numbers."""
    return not kwargs and bool(args) and _concrete(mode, args[0]) and all(a is None or type(a) is int
                                                                         for a in args[1:])


class PlanFakeTensorMode(FakeTensorMode):
    """`FakeTensorMode` that runs an op's meta kernel rather than its Python decomposition (module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._calls: list[tuple] = []  # the op calls being dispatched, innermost last (a decomposition nests them)

    def _dispatch_impl(self, func, types, args, kwargs):
        if func is _SLICE and _concrete_slice(self, args, kwargs):
            # NOTE: torch's Python rule for `slice` (`fake_impls.slice_forward`, for unbacked sizes) asks the shape
            # environment's guards of every bound and dispatches an `as_strided` again: 0.42 ms a call missing the
            # cache, a ninth of a DenseNet-BC-100 trace at a new batch. At concrete sizes the op's own kernel on the
            # meta device (C++) makes the same view of the same storage.
            with in_kernel_invocation_manager(self):
                out = func(*args, **kwargs)
            return self.wrap_meta_outputs_with_default_device_logic(out, func, (args[0],), device=None)
        if func in _BATCH_NORMS and not kwargs and _training_batch_norm(self, func, args):
            with in_kernel_invocation_manager(self):
                out = _batch_norm_outputs(func, args)
            return self.wrap_meta_outputs_with_default_device_logic(out, func, args, device=None)
        if func is _BATCH_NORM and not kwargs and _concrete(self, args[0]) and not _meta_agrees(func, args):
            # NOTE: the CPU kernel's saved statistics at a bf16 input and weight are bf16, the meta kernel's fp32 (see
            # the module docstring); torch's decomposition gives bf16 op by op through fake dispatch, 0.24 s of a
            # DenseNet-BC-100 trace at bf16 weights and a new batch. The meta kernel with its statistics made bf16
            # gives the same allocations.
            with in_kernel_invocation_manager(self):
                out, mean, invstd = func(*args)
                out = (out, torch.empty_like(mean, dtype=args[0].dtype), torch.empty_like(invstd, dtype=args[0].dtype))
            return self.wrap_meta_outputs_with_default_device_logic(out, func, args, device=None)
        self._calls.append((func, args))
        try:
            return super()._dispatch_impl(func, types, args, kwargs)
        finally:
            self._calls.pop()

    def cpp_meta_supports_symint(self, func) -> bool:
        if super().cpp_meta_supports_symint(func):
            return True
        if not func.has_kernel_for_dispatch_key(_META):
            return False
        calls = self._calls
        return not calls or calls[-1][0] is not func or _meta_agrees(func, calls[-1][1])

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        output = super()._cached_dispatch_impl(func, types, args, kwargs)
        # NOTE: an op whose meta kernel returns one tensor twice (oneDNN's LSTM backward, its two bias gradients) comes
        # back from the dispatch cache as two tensors, as the CPU kernel makes them: such an op, run and now cached,
        # is dispatched again so that a trace is the same on a cold cache and on a warm one (torch's own path gave an
        # LSTM's step 1 one tensor and autograd a copy of it, and its step 2 two)
        if isinstance(output, (tuple, list)) and not func.is_view:
            storages = [o.untyped_storage()._cdata for o in output if isinstance(o, torch.Tensor)]
            if len(set(storages)) < len(storages):
                return super()._cached_dispatch_impl(func, types, args, kwargs)
        return output

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        # NOTE: a dense fake tensor of concrete sizes is keyed by one tuple of what torch's `TensorMetadata` holds for
        # it (its memory format and contiguity follow from its sizes and strides, its sparse fields are empty): torch
        # built the dataclass and walked its fields, 0.13 ms a tensor, half the cost of an op found in the cache. Any
        # other tensor or argument is keyed by torch's own code (after a one-element tuple's prefix).
        if not isinstance(args, (list, tuple)):
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result.append(type(args))
        result.append(f"length_{len(args)}")
        for arg in args:
            if _concrete(self, arg) and arg.layout is torch.strided and not arg.is_quantized:
                result.append((_DENSE, arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                               arg.is_inference()))
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _make_cache_entry(self, state, key, func, args, kwargs, output):
        # NOTE: an argument keyed by its id (a graph module) is evicted only from torch's own cache when it dies
        if any(callable(a) and not isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs))):
            raise _BypassDispatchCache("an argument keyed by its id")
        return super()._make_cache_entry(state, key, func, args, kwargs, output)


@contextlib.contextmanager
def plan_cache() -> Iterator[None]:
    """FakeTensor's dispatch cache for a plan's trace: this process's own, kept from one trace to the next (see the
    module docstring), in place of torch's shared one while the block runs."""
    global _SENT
    merge_received()
    if len(_CACHE) > CACHE_ENTRIES:
        _CACHE.clear()
        _SENT = 0
    shared = FakeTensorMode.cache
    FakeTensorMode.cache = _CACHE
    try:
        yield
    finally:
        FakeTensorMode.cache = shared


def _op(name: str, overload: str) -> torch._ops.OpOverload:
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


class _EntryPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, _DispatchCacheKey):
            return _DispatchCacheKey, (obj.key,)
        return NotImplemented


def _pickled(entries: list) -> bytes:
    buffer = io.BytesIO()
    _EntryPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(entries)
    return buffer.getvalue()


def mark_sent() -> None:
    """Count every entry of this process's cache as sent (a forked worker's start: it inherited them)."""
    global _SENT
    _SENT = len(_CACHE)


def new_entries() -> bytes:
    """The cache entries made here since they were last sent (`mark_sent`), pickled (b"" for none); an entry that does
    not pickle is left out."""
    global _SENT
    entries = list(_CACHE.items())[_SENT:]
    _SENT = len(_CACHE)
    if not entries:
        return b""
    try:
        return _pickled(entries)
    except Exception:  # noqa: BLE001 - an argument of a kind no entry had before: the rest is sent
        return _pickled([entry for entry in entries if _pickles(entry)])


def _pickles(entry: tuple) -> bool:
    try:
        _pickled([entry])
    except Exception:  # noqa: BLE001 - see new_entries
        return False
    return True


def receive(entries: bytes) -> None:
    """Keep a forked worker's `new_entries` for this process's next trace or fork (`merge_received`)."""
    if entries:
        _RECEIVED.append(entries)


def merge_received() -> None:
    """Add the entries `receive` kept to this process's cache, those it has already kept as they are; a batch that does
    not load here (an op this process has not loaded) is dropped. Past `CACHE_ENTRIES` the older entries go first."""
    global _SENT
    while _RECEIVED:
        try:
            entries = pickle.loads(_RECEIVED.pop(0))
        except Exception:  # noqa: BLE001 - see the docstring
            continue
        if len(_CACHE) + len(entries) > CACHE_ENTRIES:
            _CACHE.clear()
            _SENT = 0
        for key, entry in entries:
            _CACHE.setdefault(key, entry)
