"""Argument checks shared by the hand-written packed-step kernels (``cpu_kernel``, ``triton_kernel``).

Both take :func:`workbench.optim.update.packed_update`'s flat arguments (Lewandowski & Kosson section 3.1):
the extra bits as uint8 byte planes (8 or 16 stored bits, the fused layouts) or, for the Triton kernel,
as dense int32 words (Fig 1: any width, values packed LSB-first across word boundaries); with 0 stored bits
(k = 0) there is no extra storage. What each kernel refuses beyond that (algorithms, options) stays in its
own module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workbench.optim.formats import FORMATS, storage_bits
from workbench.optim.packing import packed_words

__all__ = ["GradSegments", "as_flat", "extra_layout", "flat_args_reason", "planes_of"]


@dataclass(frozen=True)
class GradSegments:
    """A fused group's gradient as autograd left it: ``grads[i]`` (1-D, in its parameter's memory order) is the
    gradient of the stream's values ``offsets[i] .. offsets[i] + grads[i].numel() - 1``.

    The hand-written kernels read each segment in place; a step that needs one flat gradient tensor (the
    compiled and eager updates) calls ``gather()``, which copies them into one (``fused.FlatGroup.gather_grads``).
    # NOTE: the flat copy each step cost a read and a write of every gradient, and a fresh allocation where
    # ``zero_grad(set_to_none=True)`` (torch's default) left new gradient tensors: 0.5-0.6x of torch's fused
    # AdamW step on CPU (issue 34) where the kernel alone was 1.16x.
    """

    offsets: tuple[int, ...]
    grads: tuple[torch.Tensor, ...]
    gather: Callable[[], torch.Tensor]


def as_flat(grad: torch.Tensor | GradSegments) -> torch.Tensor:
    """The flat gradient: ``grad`` itself, or the segments gathered into one tensor."""
    return grad.gather() if isinstance(grad, GradSegments) else grad


def _grad_ok(grad: Any, half: torch.Tensor) -> bool:
    n, dtype, device = half.numel(), half.dtype, half.device
    if not isinstance(grad, GradSegments):
        return _flat_ok(grad, dtype, n, device)
    end = 0
    for at, g in zip(grad.offsets, grad.grads, strict=True):
        if at < end or at + g.numel() > n or not _flat_ok(g, dtype, g.numel(), device):
            return False
        end = at + g.numel()
    return True


def planes_of(extra: Any, bits: int | None = None) -> Any:
    """Byte planes as a list: a list/tuple as given, a 2-D uint8 tensor by rows (else unchanged); with 0
    stored `bits` (k = 0: the extra storage is empty) no plane."""
    if bits == 0:
        return []
    if torch.is_tensor(extra) and extra.dtype == torch.uint8 and extra.dim() == 2:
        return list(extra.unbind(0))
    return extra


def extra_layout(extra: Any, bits: int) -> str:
    """How ``extra`` holds ``bits`` stored bits per value: "none" (0 bits), "planes" or "words"."""
    if bits == 0:
        return "none"
    return "words" if torch.is_tensor(extra) and extra.dtype == torch.int32 else "planes"


def _flat_ok(t: Any, dtype: torch.dtype, n: int, device: torch.device) -> bool:
    return (torch.is_tensor(t) and t.device == device and t.dtype == dtype and t.numel() == n
            and t.is_contiguous())


def flat_args_reason(
    half: torch.Tensor, grad: torch.Tensor, extra: Any, states: Sequence[torch.Tensor], coef: torch.Tensor, *,
    device_type: str, extra_bits: int, stochastic_rounding: bool, master_rounding: str, n_states: int, n_coef: int,
    planes: tuple[int, ...] = (1, 2), words: bool = False, quantized: tuple[str, ...] = (),
) -> str | None:
    """Why a kernel on ``device_type`` cannot take these flat tensors (None when it can).

    ``half``/``grad``: contiguous bf16/fp16 of one size (or ``grad`` as :class:`GradSegments`); ``extra``: as
    many uint8 byte planes as one of ``planes`` allows (or their 2-D tensor; with 0 planes, k = 0, the empty
    extra storage), or with ``words`` the ``packed_words(n, bits)`` contiguous int32 words of any width;
    ``n_states`` fp32 or bf16 states (``quantized``: a pair of 8-bit codes and bf16 scales per kind listed,
    ``workbench.optim.quantized``, gradient segments on group bounds); ``coef``: ``n_coef`` fp32 values; all on
    one device.
    """
    if not torch.is_tensor(half) or half.device.type != device_type or half.dtype not in FORMATS:
        return f"half must be a bf16/fp16 {device_type.upper()} tensor"
    n, device = half.numel(), half.device
    if not _flat_ok(half, half.dtype, n, device) or not _grad_ok(grad, half):
        return (f"half and grad must be contiguous {device_type.upper()} tensors of one dtype and size (or the grad "
                "segments of a fused group, each contiguous, in order, within half)")
    if master_rounding not in ("truncate", "stochastic", "nearest") or (master_rounding == "nearest"
                                                                         and stochastic_rounding):
        return f"master_rounding={master_rounding!r}"
    if isinstance(extra_bits, bool) or not isinstance(extra_bits, int) or not 0 <= extra_bits <= FORMATS[half.dtype][0]:
        return f"extra_bits={extra_bits!r} out of range for {half.dtype}"
    bits = storage_bits(extra_bits, stochastic_rounding)
    layout = extra_layout(extra, bits)
    if layout == "words" and words:
        if not _flat_ok(extra, torch.int32, packed_words(n, bits), device):
            return (f"dense words must be a contiguous int32 tensor of packed_words({n}, {bits}) = "
                    f"{packed_words(n, bits)} words on the parameters' device")
    elif layout != "none" or 0 not in planes:
        extra = planes_of(extra, bits)
        if not isinstance(extra, list | tuple) or bits % 8 or bits // 8 not in planes or len(extra) != bits // 8:
            takes = f"byte planes ({' or '.join(str(8 * p) for p in planes)} stored bits)"
            return f"{bits} stored bits: the kernel takes {takes}{' or dense int32 words' if words else ''} only"
        if not all(_flat_ok(p, torch.uint8, n, device) for p in extra):
            return "byte planes must be contiguous uint8 tensors of the parameters' size on their device"
    if quantized:
        return _quantized_reason(half, grad, states, quantized, n_states) or (
            None if _flat_ok(coef, torch.float32, n_coef, device) else f"coef must be {n_coef} contiguous fp32 values")
    if len(states) != n_states:
        return f"expected {n_states} state tensors, got {len(states)}"
    if states and (states[0].dtype not in (torch.float32, torch.bfloat16)
                   or not all(_flat_ok(t, states[0].dtype, n, device) for t in states)):
        return "states must be contiguous fp32 or bf16 tensors of one dtype and the parameters' size"
    if not _flat_ok(coef, torch.float32, n_coef, device):
        return f"coef must be a contiguous fp32 tensor of {n_coef} values on the parameters' device"
    return None


def _quantized_reason(half: torch.Tensor, grad: Any, states: Sequence[torch.Tensor], kinds: tuple[str, ...],
                      n_states: int) -> str | None:
    """Why these (codes, scales) pairs of 8-bit moments cannot go to a kernel (None when they can)."""
    from workbench.optim.quantized import GROUP, code_dtype, scales_for

    n, device = half.numel(), half.device
    if len(kinds) != n_states or len(states) != 2 * n_states:
        return f"expected {n_states} pairs of 8-bit codes and scales, got {len(states)} tensors for kinds {kinds}"
    for i, kind in enumerate(kinds):
        if not (_flat_ok(states[2 * i], code_dtype(kind), n, device)
                and _flat_ok(states[2 * i + 1], torch.bfloat16, scales_for(n), device)):
            return f"8-bit state {i} ({kind}) must be contiguous {code_dtype(kind)} codes and bf16 scales"
    if isinstance(grad, GradSegments) and any(at % GROUP for at in grad.offsets):
        return f"8-bit moments: gradient segments must start on groups of {GROUP} values"
    return None
