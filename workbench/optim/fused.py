"""The fused step's flat buffers: one stream of values per param group ("Fused" in section 3.1).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 ("we provide
a Fused-version of the optimizers ... handling the parameters as one only stream of values combined
all together", so one kernel launch covers a whole group).

A group's 16-bit halves, extra bits (``workbench.optim.packing``: uint8 byte planes for 8 and 16
bits, else dense int32 words) and optimizer states live in flat buffers. Each parameter is a
32-value-aligned segment, so a segment of dense words starts on a word boundary and the
per-parameter state entries stay views of the buffers (``state_dict`` looks the same as unfused).
Unlike the paper's fused kernels (8 and 16 extra bits only), every width is supported.
"""

from __future__ import annotations

import weakref

import torch

from .packing import extra_storage

__all__ = ["FlatGroup"]


# NOTE: the fused path rebinds each ``p.data`` to a view of the group's flat buffer (as apex's
# flat-buffer optimizers do). Gradients are copied into a flat gradient buffer unless they already
# are its views (``zero_grad(set_to_none=False)`` keeps them so); the optimizer holds that buffer
# only weakly, so ``zero_grad(set_to_none=True)`` frees it with the gradients. A group where some
# parameter has no gradient takes the per-parameter path, which computes the same update.
class FlatGroup:
    """Flat buffers of one fused param group; params, grads and states become views into them."""

    def __init__(self, params: list[torch.Tensor], state: dict, keys: list[str], bits: int,
                 state_dtype: torch.dtype):
        self.params, self.keys, self.bits = params, keys, bits
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += (p.numel() + 31) // 32 * 32
        self.total = off
        dev, dtype = params[0].device, params[0].dtype
        self.half = torch.zeros(off, dtype=dtype, device=dev)
        shape, edtype = extra_storage(off, bits, aligned=True)
        self.extra = torch.zeros(shape, dtype=edtype, device=dev)
        self.states = {k: torch.zeros(off, dtype=state_dtype, device=dev) for k in keys}
        self._grad: weakref.ref | None = None
        for p, o in zip(params, self.offsets, strict=True):
            n, st = p.numel(), state[p]
            view = self.half[o : o + n]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            for k in keys:
                self.states[k][o : o + n].copy_(st[k].reshape(-1))
                st[k] = self.states[k][o : o + n].view_as(p)
            seg = self._extra_view(o, n)
            seg.copy_(st["extra"])
            st["extra"] = seg
        # data pointers every view must keep; checked each step in plain integers (cheap)
        self._expect = [
            (p, self.half[o:].data_ptr(), state[p]["extra"].data_ptr(),
             tuple(self.states[k][o:].data_ptr() for k in keys))
            for p, o in zip(params, self.offsets, strict=True)
        ]
        self._item = self.half.element_size()

    def _extra_view(self, o: int, n: int) -> torch.Tensor:
        if self.extra.dtype == torch.uint8:
            return self.extra[:, o : o + n]
        ws = o * self.bits // 32
        return self.extra[ws : ws + (n * self.bits + 31) // 32]

    def valid(self, state: dict) -> bool:
        for p, hp, ep, sps in self._expect:
            st = state.get(p)
            if st is None or p.data_ptr() != hp or "extra" not in st or st["extra"].data_ptr() != ep:
                return False
            if any(st[k].data_ptr() != sp for k, sp in zip(self.keys, sps, strict=True)):
                return False
        return True

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient: reused when every ``.grad`` is still its view, else copied into a new one."""
        buf = self._grad() if self._grad is not None else None
        if buf is not None:
            base = buf.data_ptr()
            if all(p.grad.data_ptr() == base + o * self._item
                   for p, o in zip(self.params, self.offsets, strict=True)):
                return buf
        buf = torch.empty(self.total, dtype=self.half.dtype, device=self.half.device)
        end = 0
        for p, o in zip(self.params, self.offsets, strict=True):
            buf[end:o].zero_()  # padding between segments: a defined value, never read back
            view = buf[o : o + p.numel()]
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
            end = o + p.numel()
        buf[end:].zero_()
        self._grad = weakref.ref(buf)
        return buf
