"""In-place ops torch runs only where no dispatch mode is active, run in place under every tensor-counting mode.

A tensor count (DESIGN.md, "Measuring honestly": `workbench.measure.MemoryMeter` on CPU, CalcGraph's plan,
"CalcGraph: taming the high costs of deep learning using models (2022)", Section 3.2, and its budget guard)
runs the program inside a Python dispatch mode, and must count the user's own program. A dispatch mode
changes what some of torch's C++ code does: it asks `at::isTensorSubclassLike`, which answers yes for every
tensor while any dispatch mode is active, and then takes an out-of-place path meant for tensor subclasses.
Two such paths are on every training step's way, each one more tensor that the real program never
allocates (+4.5% to +8.1% on an `nn.MultiheadAttention` self-attention model, in CalcGraph's plan and in
MemoryMeter's peak alike):

- the autograd engine's buffer sums: when a tensor feeds several ops, the engine adds the gradients that
  reach it, in place into the first one (`old.add_(new)`) where it holds the last reference to it, else out
  of place (one sum per residual connection, per tied weight, three in self-attention);
- `at::linear` on an input it cannot flatten (more than 2 dimensions, not a contiguous 3-d one: the
  projections of `nn.MultiheadAttention` on its transposed input) computes `matmul` and then adds the bias
  in place into the product.

`InPlace` runs both in place as the real program does, for real and under fake tensors alike: the mode asks
it for the op to run (`op_for`) and tells it the result (`done`). The engine's sums are followed from node
hooks (`Accumulation`): which gradients each node hands to the input buffers of the next ones, how many
buffer slots hold each gradient, and which ops run between a node's end and the next node's start (the
sums). A linear's bias add is the one `add` of the bias while `torch.nn.functional.linear` runs. Both are
followed while `as_the_user_runs` is active; outside it `op_for` changes nothing.

# NOTE: the engine's condition (torch/csrc/autograd/input_buffer.cpp, `can_accumulate_inplace`): grad mode
# off, the first gradient dense and non-overlapping, its tensor and its storage referenced once. The
# tensor's references are counted here from the hooks (a gradient a node hands to two buffers, as an add's
# backward does, is referenced twice until one of them is consumed); the storage's with
# `torch._C._storage_Use_Count` (a view of a gradient another tensor still holds shares its storage).
# References held outside the engine (a `retain_grad`, a hook keeping a gradient) are not seen. Other
# subclass-only paths (a few backward formulas: `masked_fill`, `gather`, `masked_scatter`) are left as they
# are: a tensor count runs them out of place (CalcGraph's calibration sees them in its real runs only where
# they cost scratch).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch._prims_common import is_non_overlapping_and_dense_or_false

__all__ = ["Accumulation", "InPlace", "as_the_user_runs"]

_ADD = torch.ops.aten.add.Tensor
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def _storage_references(tensor: torch.Tensor) -> int:
    """References to the tensor's storage, less the Python storage object this call makes to count them."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


class Accumulation:
    """The autograd engine's input buffers as node hooks see them (see the module docstring)."""

    def __init__(self) -> None:
        self.held: Counter[int] = Counter()  # tensor (its TensorImpl address) -> buffer slots holding it
        self.routing = False  # between a node's end and the next node's start: the engine fills buffers
        self._nodes: list = []  # the hooked nodes of the graphs being differentiated (kept until `reset`)
        self._seen: set[int] = set()
        self._handles: list = []

    # hooks -----------------------------------------------------------------------------------
    def watch(self, roots: Sequence[torch.Tensor]) -> None:
        """Hook every node of the graph behind `roots` (once each) before the engine runs it."""
        stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or id(node) in self._seen:
                continue
            self._seen.add(id(node))
            self._nodes.append(node)
            self._handles.append(node.register_prehook(self._started))
            self._handles.append(node.register_hook(lambda grads_in, grads_out, node=node:
                                                    self._finished(node, grads_in, grads_out)))
            stack.extend(following for following, _ in node.next_functions)

    def _started(self, grads_out) -> None:
        self.routing = False

    def _finished(self, node, grads_in, grads_out) -> None:
        # the node's inputs (its incoming gradients) are released; its outputs go to the next nodes' buffers
        for grad in grads_out:
            if isinstance(grad, torch.Tensor):
                self._release(grad._cdata)
        for grad, (following, _) in zip(grads_in, node.next_functions, strict=False):
            if isinstance(grad, torch.Tensor) and following is not None:
                self.held[grad._cdata] += 1
        self.routing = True

    def _release(self, key: int) -> None:
        if self.held.get(key, 0) > 1:
            self.held[key] -= 1
        else:
            self.held.pop(key, None)

    def reset(self) -> None:
        """Forget the graphs (after a backward pass): their nodes and hooks go with them."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()
        self._seen.clear()
        self.held.clear()
        self.routing = False

    # the engine's decision -------------------------------------------------------------------
    def is_buffer_sum(self, args) -> bool:
        """`add(*args)` is the engine adding a gradient into an input buffer that holds one already."""
        return self.routing and args[0]._cdata in self.held

    def in_place(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """The engine without a dispatch mode would add `new` into `old` in place."""
        return (not torch.is_grad_enabled() and self.held[old._cdata] == 1 and old.layout == torch.strided
                and old.shape == new.shape and old.dtype == new.dtype
                and is_non_overlapping_and_dense_or_false(old) and _storage_references(old) == 1)

    def sum_op(self, func, args) -> object:
        """The op that runs the engine's buffer sum `func(*args)` as the user's program runs it: `add_` where
        the engine without a dispatch mode sums in place, else `func`; then `summed` with its result."""
        old, new = args
        in_place = self.in_place(old, new)
        self._release(new._cdata)  # the added gradient is consumed
        if in_place:
            return _ADD_IN_PLACE
        self._release(old._cdata)
        return func

    def summed(self, op, result: torch.Tensor) -> None:
        """The buffer holds the sum: the first gradient itself (in place) or a new tensor."""
        if op is not _ADD_IN_PLACE:
            self.held[result._cdata] += 1


class InPlace:
    """The in-place ops of the user's program that a dispatch mode would run out of place (module docstring)."""

    def __init__(self) -> None:
        self.accumulation = Accumulation()
        self.biases: list[torch.Tensor] = []  # the bias of each `linear` running (innermost last)
        self.count = 0  # ops run in place that the dispatch mode would not have
        self._summing = False  # the op being run is an engine's buffer sum

    def op_for(self, func, args, kwargs) -> object:
        """The op to run for `func(*args, **kwargs)`: `add_` where the user's program adds in place; then
        `done` with its result."""
        self._summing = False
        if func is not _ADD or kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
            return func
        if self.accumulation.is_buffer_sum(args):
            self._summing = True
            op = self.accumulation.sum_op(func, args)
        elif self.biases and args[1] is self.biases[-1] and args[0].shape[-1:] == args[1].shape:
            op = _ADD_IN_PLACE
        else:
            return func
        self.count += op is _ADD_IN_PLACE
        return op

    def done(self, op, result) -> None:
        if self._summing:
            self.accumulation.summed(op, result)
            self._summing = False


@contextlib.contextmanager
def as_the_user_runs(in_place: InPlace) -> Iterator[None]:
    """Follow the graphs that `torch.autograd.backward` and `torch.autograd.grad` differentiate, and the bias
    of each `torch.nn.functional.linear`, while active.

    # NOTE: patched process-wide while a counting mode is active (as CalcGraph's tracker patches the CPU
    # generator's state), so that every backward pass of the program is followed, the reentrant
    # checkpoint's inner one too (each call's graph is forgotten once the outermost call returns), and
    # every linear layer (`nn.Linear` and `nn.MultiheadAttention` look `F.linear` up at each call).
    """
    accumulation = in_place.accumulation
    backward, grad, linear = torch.autograd.backward, torch.autograd.grad, F.linear
    depth = 0

    def wrap(function):
        def followed(tensors, *args, **kwargs):
            nonlocal depth
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            accumulation.watch(roots)
            depth += 1
            try:
                return function(tensors, *args, **kwargs)
            finally:
                depth -= 1
                if depth == 0:
                    accumulation.reset()
        return followed

    def followed_linear(input, weight, bias=None):
        if bias is None:
            return linear(input, weight, bias)
        in_place.biases.append(bias)
        try:
            return linear(input, weight, bias)
        finally:
            in_place.biases.pop()

    torch.autograd.backward, torch.autograd.grad = wrap(backward), wrap(grad)
    F.linear = followed_linear
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad, F.linear = backward, grad, linear
