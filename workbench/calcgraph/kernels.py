"""The fake tensors a plan is traced under, with each op's shapes from torch's C++ meta kernel where it has one
(issue 45: the cost of a trace).

`FakeTensorMode` (torch 2.13) prefers an op's Python decomposition (`torch._decomp`) over its C++ meta kernel
wherever the meta kernel is not registered as supporting symbolic sizes. A decomposition computes the outputs'
shapes by running the op's arithmetic op by op, each through fake dispatch again: a BatchNorm forward took 8 ms
against 0.3 ms for the same call found in the dispatch cache. Every trace starts with that cache cold
(`tracker._trace`), so a training program's first step ran its normalisation and activation backward through
decompositions: in a DenseNet-BC-100 trace, 1.8 of its 2.6 s were the first step and 0.5 the second.

A plan traces at concrete batch sizes, never symbolic ones, so each op of a CPU program with a C++ meta kernel takes
it here (a CUDA program keeps torch's path until a CUDA test has compared the two: `tracker._fake_mode`). That
kernel gives the same shapes, strides and dtypes as the decomposition (the same traces, byte for byte, for the
advisor's suite and CalcGraph's zoo: `tests/calcgraph/test_kernels.py`), with one exception, BatchNorm's saved
statistics at a reduced-precision input:

| input, weight | CPU kernel | C++ meta kernel | decomposition |
|---|---|---|---|
| bf16, fp32 (autocast) | fp32 | fp32 | bf16 |
| bf16, bf16 (bf16 weights) | bf16 | fp32 | bf16 |

There the op takes the path that agrees with the kernel that runs: the meta kernel where the weight's dtype is
not the input's, the decomposition where it is.
"""

from __future__ import annotations

import torch
from torch._subclasses import FakeTensorMode

__all__: list[str] = []  # used through the tracker

_META = torch._C.DispatchKey.Meta
_BATCH_NORM = torch.ops.aten.native_batch_norm.default


def _meta_agrees(func, args: tuple) -> bool:
    """Whether `func`'s C++ meta kernel gives what the real kernel gives for `args` (see the module docstring)."""
    if func is not _BATCH_NORM:
        return True
    x, weight = args[0], args[1] if len(args) > 1 else None
    return not x.dtype.is_floating_point or x.dtype == torch.float32 or (weight is not None and
                                                                        weight.dtype != x.dtype)


class PlanFakeTensorMode(FakeTensorMode):
    """`FakeTensorMode` that runs an op's C++ meta kernel rather than its Python decomposition (module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._calls: list[tuple] = []  # the op calls being dispatched, innermost last (a decomposition nests them)

    def _dispatch_impl(self, func, types, args, kwargs):
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
