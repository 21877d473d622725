"""What fake tensors do not know, for CalcGraph's traces: values that shape memory, and kernels' dtype rules.

Support for Section 3.2 of "CalcGraph: taming the high costs of deep learning using models (2022)": a plan
is traced under `FakeTensorMode`, which keeps shapes and drops values. Two things follow that the real
program does not do, and this module puts them back:

- Values that decide shapes. A tagger that packs its batch (`pack_padded_sequence`) computes the lengths
  from its token ids, and the packed data has as many rows as the lengths add up to: under fake tensors
  torch raises `DynamicOutputShapeException`. Integer inputs therefore enter a plan's trace as real tensors
  (the user's own batch where `plan_training` has it), every op whose tensor arguments are all real
  integer or boolean tensors runs for real (lengths, masks, their sums: tiny next to activations), as
  does every factory of integers (positions, the lengths `pad_packed_sequence` writes), and
  `_pack_padded_sequence` runs torch's own kernel on a one-element-per-step stand-in for its real lengths
  and returns fake data of the packed size with the real `batch_sizes`, which the recurrent kernels and
  `pad_packed_sequence` read as the real program does. A real boolean mask indexing a fake tensor (a
  classifier that reads the hidden state at each sequence's end token: `hidden[input_ids == eos]`) is turned
  into the positions it holds, as torch's indexing kernels turn it, and the fake kernel sizes the result from
  them. The lengths come from the batch, so the plan of
  such a model is exact at the batches it is traced at and not affine in the batch size: each batch size
  is traced on its own (`CompiledGraph.nonaffine`).
- Dtype rules fake kernels skip. The meta kernels of matrix products accept a `Long` input against `Float`
  weights, which the real CPU and CUDA kernels refuse ("mat1 and mat2 must have the same dtype"): a model
  given an integer input it cannot take was planned as if it could train.
"""

from __future__ import annotations

import torch
from torch._subclasses import FakeTensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..measure import op_tensors

__all__: list[str] = []  # internal to workbench.calcgraph

_aten = torch.ops.aten
# matrix products whose real kernels require one dtype for all their tensor arguments
_ONE_DTYPE = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
              _aten.addbmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
              _aten.vdot.default, _aten._addmm_activation.default}
_PACK = _aten._pack_padded_sequence.default
# ops that take a list of index tensors, where a boolean mask stands for the positions it holds
_MASKED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


def _refuse_mixed_matmul(func, args) -> None:
    """Raise as the real kernel would for a matrix product of tensors of different dtypes."""
    if func in _ONE_DTYPE:
        dtypes = [t.dtype for t in op_tensors(args)]
        if len(set(dtypes)) > 1:
            raise RuntimeError(f"{func.__name__} needs one dtype for all its tensors (as the real kernel does), "
                               f"got {', '.join(str(d) for d in dtypes)}")


class _PackAtKnownLengths:
    """`aten._pack_padded_sequence` on a fake input with real lengths (see the module docstring)."""

    def __init__(self, op) -> None:
        self.op, self.__name__ = op, op.__name__

    def __call__(self, data: torch.Tensor, lengths: torch.Tensor, batch_first: bool):
        # NOTE: torch's kernel itself, on a stand-in of one element per (step, sequence), checks the lengths
        # (sorted, positive, one per sequence) and counts `batch_sizes`; only the data is sized by hand
        with unset_fake_temporarily():
            stand_in = torch.zeros((*data.shape[:2], *([1] * (data.dim() - 2))))
            rows, batch_sizes = self.op(stand_in, lengths, batch_first)
        return data.new_empty((rows.shape[0], *data.shape[2:])), batch_sizes


def _real_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and index.dtype in (torch.bool,
                                                                                                   torch.uint8)


class _IndexAtKnownMasks:
    """`aten.index` (and `index_put`) on a fake tensor indexed by a real boolean mask (see the module docstring)."""

    def __init__(self, op) -> None:
        self.op, self.__name__ = op, op.__name__

    def __call__(self, tensor: torch.Tensor, indices, *args, **kwargs):
        # NOTE: torch's own kernels expand a mask into the positions it holds (one index tensor per mask dimension,
        # `nonzero`) before indexing; done here for real, the fake kernel is left only shapes it knows
        with unset_fake_temporarily():
            known = [part for index in indices
                     for part in (index.nonzero().unbind(1) if _real_mask(index) else (index,))]
        return self.op(tensor, known, *args, **kwargs)


class _RealIntegers:
    """A factory op under fake tensors, run again for real where it makes integer or boolean tensors (whose
    dtype the arguments may not say: `arange(0, n)`)."""

    def __init__(self, op) -> None:
        self.op, self.__name__ = op, op.__name__

    def __call__(self, *args, **kwargs):
        out = self.op(*args, **kwargs)
        if not any(t.is_floating_point() or t.is_complex() for t in op_tensors(out)):
            with unset_fake_temporarily():
                out = self.op(*args, **kwargs)
        return out


def with_known_values(func, args: tuple, tensors: list[torch.Tensor]) -> tuple[object, bool]:
    """The op to run in a fake trace for `func(*args, ...)`, whose arguments hold `tensors`, and whether to run it
    for real (outside the fake mode): ops on real integer or boolean tensors only keep their values."""
    if not tensors:  # a factory: real where it makes integers (`pad_packed_sequence` writes its lengths)
        return (func if torch.Tag.nondeterministic_seeded in func.tags else _RealIntegers(func)), False
    if isinstance(tensors[0], FakeTensor) and func is not _PACK and func not in _MASKED:  # most calls: nothing known
        return func, False
    if not any(isinstance(t, FakeTensor) for t in tensors) and not any(
            t.is_floating_point() or t.is_complex() for t in tensors):
        return func, True
    if func is _PACK and not isinstance(args[1], FakeTensor):
        return _PackAtKnownLengths(func), False
    if func in _MASKED and any(_real_mask(index) for index in args[1]):
        return _IndexAtKnownMasks(func), False
    return func, False
