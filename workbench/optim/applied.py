"""``AppliedGradient``: what ``p.grad`` holds after ``step_in_backward`` applied and freed a gradient.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4.1: once the
optimizer step runs inside backward, the gradients are gone when backward returns, so clipping them
afterwards (``torch.nn.utils.clip_grad_norm_``) or calling backward again before the next forward
(gradient accumulation) cannot work. With ``p.grad = None`` both were accepted silently:
``clip_grad_norm_`` skips None gradients and returns 0, and a second backward made a second step.

# NOTE: the marker is a tensor subclass in ``p.grad`` (an expanded view of one shared zero scalar
# per dtype and device, so it holds no memory) rather than None, because clip_grad_norm_/
# clip_grad_value_ skip None gradients without a trace; every torch function that would read its
# values raises (``__torch_function__``), and so does autograd accumulating a second backward into
# it (``__torch_dispatch__`` sees AccumulateGrad's add), each with an error naming the fix. Metadata
# (shape, dtype, storage size) stays readable, and zeroing it (``zero_grad(set_to_none=False)``)
# is a no-op. ``step_in_backward`` puts it back to None at the model's next forward.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["AppliedGradient", "CLIP_FIX", "SECOND_BACKWARD_FIX"]

CLIP_FIX = ("clip inside backward with step_in_backward(..., clip_value=c) (per value, as clip_grad_value_; "
            "paper 4.1), or, for global-norm clipping, which needs every gradient at once, call "
            "handle.remove() and clip before an ordinary optimizer.step()")
SECOND_BACKWARD_FIX = ("sum the losses and call backward once per forward, or accumulate gradients over "
                       "micro-batches with step_in_backward(..., accumulate=N), one forward of the model each")

# Tensor methods and properties that only read metadata (never values): allowed on the marker.
_METADATA = frozenset({
    "untyped_storage", "storage", "_typed_storage", "data_ptr", "storage_offset", "size", "stride", "dim",
    "ndimension", "numel", "nelement", "element_size", "is_contiguous", "is_floating_point", "is_complex",
    "get_device", "__len__", "__hash__",
})
_VALUE_PROPERTIES = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})
_NO_OPS = frozenset({"zero_", "_foreach_zero_", "requires_grad_", "detach_"})  # zero_grad(set_to_none=False)


class AppliedGradient(torch.Tensor):
    """Stands in ``p.grad`` once ``step_in_backward`` has applied and freed the gradient (paper 4.1).

    Reading its values raises an error naming the fix; see the module's NOTE.
    """

    _zeros: ClassVar[dict[tuple[torch.dtype, torch.device], torch.Tensor]] = {}

    @classmethod
    def like(cls, p: torch.Tensor) -> AppliedGradient:
        """A marker with ``p``'s shape, dtype and device, viewing a shared zero scalar (no new memory)."""
        with torch._C.DisableTorchFunctionSubclass():
            dtype, device, shape = p.dtype, p.device, tuple(p.shape)
        key = (dtype, device)
        zero = cls._zeros.get(key)
        if zero is None:
            zero = cls._zeros[key] = torch.zeros((), dtype=dtype, device=device)
        return torch.Tensor._make_subclass(cls, zero.expand(shape))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype
        return f"AppliedGradient(shape={shape}, dtype={dtype}: applied inside backward by step_in_backward)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", "")
            if name not in _VALUE_PROPERTIES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        elif name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        elif name in _NO_OPS:
            return args[0]
        elif name == "__deepcopy__":
            return cls.like(args[0])
        raise RuntimeError(
            f"{name or func}() on a gradient that step_in_backward already applied: the optimizer update of "
            "this parameter ran inside backward and its gradient was freed, so clip_grad_norm_/"
            f"clip_grad_value_ or any read of p.grad would act on nothing. Fix: {CLIP_FIX}. Gradients are "
            "None again after the model's next forward or handle.remove()")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"a second backward before the next forward of the model reached a parameter whose update "
            f"step_in_backward already applied ({func}): it would step twice. Fix: {SECOND_BACKWARD_FIX}")
