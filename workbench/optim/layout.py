"""The order in which a parameter's values meet the packed step: its memory order.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1: the update is
elementwise over "one only stream of values", so any fixed order of a parameter's values serves, as long
as its 16-bit value, gradient, extra bits and moments are read in the same one.

The packed optimizers use the parameter's memory order. A contiguous parameter's is its logical order; a
channels_last convolution weight (or any dense, non-overlapping layout) is updated through a 1-D view of
its storage, with moments laid out like it (as ``torch.optim`` keeps them, ``preserve_format``) and the
gradient read in place when autograd gave it the parameter's strides (copied into them otherwise). The
extra bits follow the same order; a state dict shows byte planes as ``(planes, *parameter.shape)`` in
logical indexing, whatever the layout, and dense int32 words as they are kept (in memory order).

# NOTE: the alternative, a contiguous copy of the parameter and its gradient each step, allocates two
# tensors the size of the parameter inside the step (inside backward with ``step_in_backward``), and
# the flat group would turn channels_last weights contiguous.
"""

from __future__ import annotations

import torch

__all__ = ["grad_in_order", "in_layout", "is_dense", "logical_planes", "memory_order", "planes_in_order"]


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill its storage span without gaps or overlaps (any dimension order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of dense ``t`` in memory order (``t.view(-1)`` for a contiguous tensor, ``t`` itself for a 1-D one).

    # NOTE: a 1-D contiguous tensor is not viewed again: each view is an op, and under a plan's fake tensors an op
    # costs tens of microseconds (a DenseNet-BC-100's packed step views the value, gradient and two moments of each of
    # its 299 parameters, 197 of them 1-D, each step)
    """
    if t.is_contiguous():
        return t if t.dim() == 1 else t.view(-1)
    if not is_dense(t):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} has gaps or overlaps in "
                         "memory: the packed step updates dense tensors only")
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def in_layout(value: torch.Tensor, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (shaped like ``p``) laid out like ``p``: itself when its strides are ``p``'s, else a copy."""
    dtype = value.dtype if dtype is None else dtype
    if value.dtype == dtype and value.stride() == p.stride() and value.device == p.device:
        return value
    return torch.empty_like(p, dtype=dtype).copy_(value)


def grad_in_order(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient of ``p`` as a 1-D tensor in ``p``'s memory order (a view when autograd laid it out like p)."""
    return memory_order(in_layout(grad, p))


def logical_planes(planes: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Byte planes ``(planes, numel)`` kept in ``p``'s memory order, viewed as ``(planes, *p.shape)``."""
    if p.is_contiguous():
        return planes.view(planes.shape[0], *p.shape)
    return planes.as_strided((planes.shape[0], *p.shape), (p.numel(), *p.stride()), planes.storage_offset())


def planes_in_order(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Byte planes of a state dict (``(planes, *p.shape)``, or ``(planes, numel)`` in logical order) as kept:
    a new ``(planes, numel)`` tensor in ``p``'s memory order."""
    lead = value.shape[0]
    out = torch.empty((lead, p.numel()), dtype=value.dtype, device=p.device)
    logical_planes(out, p).copy_(value.reshape(lead, *p.shape))
    return out
