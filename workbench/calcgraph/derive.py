"""Each allocation's size as a function of the batch: fitted from traces at two batch sizes, or, for a variant
of a program already fitted, borrowed from it so that the variant is traced once (issue 45).

CalcGraph ("CalcGraph: taming the high costs of deep learning using models", 2022, Sections 3.2 and 4.3) compiles
a training program once and answers any batch by arithmetic. A plan here is one trace per allocation size
`a + b * batch`: two traces give `a` and `b`, a third checks them (`fit`), or, where the plan is calibrated
anyway, the real runs at other batches do (`Calibration.line_held`, the advisor's `Plans`).

A variant of a program (the same model and optimizer with step in backward or activation checkpoints) runs the
same kernels on the same shapes in another order, and a checkpoint's recomputation runs the forward's kernels
again. Traced once, at the batch its program was fitted at, each of its allocations takes the slope of the
program's allocations made at the same place (the op, its arguments' shapes and dtypes, its order among the
call's allocations) with the same size (`borrowed_slopes`). What that cannot place is refused, and the variant is
traced at a second batch as before: a place the program never had, or one whose allocations grow differently
(two tensors of one shape at the traced batch but not at others). Two kinds of the checkpoints' own allocations
are placed without the program: the CPU generator's state (`measure.cpu_rng_state_as_op`, a constant size) and a
clone of a tensor of this trace (the state of a BatchNorm's buffers a checkpoint keeps), which grows as what it
copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .calibrate import _places
from .tracker import _Trace

__all__: list[str] = []  # used through CompiledGraph


def fit(traced: Callable[[int], _Trace], sizes: Sequence[int]) -> tuple[bool, np.ndarray, np.ndarray, list[dict]]:
    """(affine, slope, intercept, rows) of the traces at `sizes` (the first two fit, the rest check): `rows` name
    each allocation a check found off the line, or a check whose allocation sequence differs."""
    (s1, s2), checks = sizes[:2], sizes[2:]
    t1, t2 = traced(s1), traced(s2)
    if t1.signature != t2.signature:
        return False, np.zeros(0, np.int64), np.zeros(0, np.int64), []
    slope = (t2.sizes - t1.sizes) // (s2 - s1)
    intercept = t1.sizes - slope * s1
    exact = (t2.sizes - t1.sizes) % (s2 - s1) == 0
    rows = []
    for s in checks:
        t = traced(s)
        if t.signature != t1.signature:
            rows.append({"size": s, "allocation": -1, "op": "sequence differs", "predicted": -1, "traced": -1})
            continue
        bad = np.nonzero((intercept + slope * s != t.sizes) | ~exact)[0]
        rows += [{"size": s, "allocation": int(i), "op": t.info[i]["op"],
                  "predicted": int(intercept[i] + slope[i] * s), "traced": int(t.sizes[i])} for i in bad]
    return not rows, slope, intercept, rows


def _rng_state_place() -> tuple:
    # the stand-in `cpu_rng_state_as_op` makes under fake tensors: `torch.empty(size, dtype=torch.uint8)`
    return ("empty.memory_format", ((torch.default_generator.get_state().numel(),),)), 0


def borrowed_slopes(trace: _Trace, reference: _Trace, reference_slope: np.ndarray) -> np.ndarray | None:
    """Each allocation's slope in `trace` (a variant traced at `reference`'s batch), or None where one cannot be
    placed (see the module docstring)."""
    known: dict[tuple, set[int]] = {}
    for i, place in enumerate(_places(reference)):
        known.setdefault((place, int(reference.sizes[i])), set()).add(int(reference_slope[i]))
    rng_state = _rng_state_place()
    slopes = np.zeros(len(trace.sizes), dtype=np.int64)
    for i, place in enumerate(_places(trace)):
        found = known.get((place, int(trace.sizes[i])), ())
        source = trace.sources.get(i)
        if len(found) == 1:
            slopes[i] = next(iter(found))
        elif found:  # allocations of one place and size that grow differently: which is this one?
            return None
        elif place == rng_state:
            slopes[i] = 0
        elif source is not None and trace.sizes[source] == trace.sizes[i]:  # a whole copy grows as its original
            slopes[i] = slopes[source]
        else:
            return None
    return slopes
