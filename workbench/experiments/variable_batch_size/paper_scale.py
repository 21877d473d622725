"""The memory-only claims of Choudhury et al. at the paper's own size (224x224, full width) on any machine.

"Variable batch size across layers for efficient prediction on CNNs", Section IV: which fixed batch fits a
budget (Fig 7's caption: ResNet-50's FBS runs batch 1 at 25 MB and 2 at 30 MB; Fig 9: GoogLeNet's FBS runs 2
images per phase at 20 MB), whether Greedy-VBS fits at all (Fig 8: infeasible at tight memory for request 12)
and what FBS leaves unused (Table III) follow from the activation sizes and the budget alone, not from any
time. Here they are read from tables whose `in` and `out` are the activation bytes of every layer group (and
branch layer) at the paper's size, from one pass of meta tensors through the model built on the meta device:
shapes only, no memory and no arithmetic, seconds on any CPU (`shape_tables`). Bytes are linear in the batch.

What the shapes do not see: the working space (`ws`, the convolution library's scratch: cuDNN's on the
paper's GPU) is 0 here, so a fixed batch read from these tables can only be as large as, or larger than, the
one the same budget gives with working space (more memory per sample, never less). The times are a
placeholder (1 per sample at every batch); the budgets are multiples of the floor as in `budget_sweep`, and
the rows the DP's own plans decide (VBS's batches, Fig 9's per-layer batches, Table III's VBS column) are not
read here: they depend on the layers' times, measured only by running the model at that size (the gpu
profile).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

from workbench import vbs

from .budgets import PAPER_FLOOR_MB, _grid, plan_at_ratio
from .gains import PAPER_BUDGET_MB, TABLE_III
from .tables import PAPER_IMAGE_SIZE, build_network

__all__ = ["SHAPES", "shape_tables", "paper_scale_sweep", "fbs_unused"]

SHAPES = "meta-tensor shapes at 224x224, full width (no working space)"  # how these records were made


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def shape_tables(model: nn.Module, *, image_size: int = PAPER_IMAGE_SIZE, max_batch: int = 12) -> vbs.LayerProfile:
    """`vbs.measure_layers`' tables of `model` (built on the meta device) from shapes alone, in bytes: `in` and
    `out` of every layer group and branch layer at batch 1 from one pass of a meta tensor, times b at batch b;
    `ws` 0 (not seen); `time` 1 per sample at every batch (a placeholder: nothing read from these tables
    depends on it)."""
    if image_size < 16 or max_batch < 1:
        raise ValueError(f"image_size must be >= 16 and max_batch >= 1, got {image_size}, {max_batch}")
    stages = vbs.stages_of(model.eval())
    x = torch.empty(1, 3, image_size, image_size, device="meta")
    main, branches = [], {}
    for i, stage in enumerate(stages):
        for branch in stage.branches if stage.is_branch else ():
            y, rows = x, []
            for k, (_, layer) in enumerate(branch):
                y_next = layer(y)
                rows.append((0 if k == 0 else _nbytes(y), _nbytes(y_next)))  # a branch's input is the group's
                y = y_next
            branches.setdefault(i, []).append((rows, [name for name, _ in branch]))
        y = stage(x)
        main.append((_nbytes(x), _nbytes(y)))
        x = y
    b = np.arange(1, max_batch + 1)

    def profile(rows: list[tuple[int, int]], names: list[str]) -> vbs.LayerProfile:
        inp = np.array([r[0] for r in rows], dtype=np.int64).reshape(-1, 1) * b
        out = np.array([r[1] for r in rows], dtype=np.int64).reshape(-1, 1) * b
        return vbs.LayerProfile(np.ones(inp.shape), inp, out, np.zeros(inp.shape, dtype=np.int64), names)

    result = profile(main, [s.name for s in stages])
    result.branches = {i: [profile(rows, names) for rows, names in parts] for i, parts in branches.items()}
    result.merge = {i: stages[i].merge for i in branches}
    result.__post_init__()
    return result


def paper_scale_sweep(networks=("resnet50", "googlenet"), *, image_size: int = PAPER_IMAGE_SIZE,
                      width: float = 1.0, request: int = 12, ratios=(1.0, 1.33, 1.67, 2.0, 2.33, 2.67),
                      units_at_floor: int = 24) -> pd.DataFrame:
    """FBS and Greedy-VBS on `shape_tables` of each network at the paper's size, on `budget_sweep`'s budgets
    (x floor, shown as paper-equivalent MB): per budget whether each fits and FBS's batch; the DP's own plans
    are left out (they depend on times these tables do not have). `plan_json` holds the plans for `fbs_unused`."""
    rows = []
    for name in networks:
        with torch.device("meta"):  # shapes only: a full-width ResNet-50 in milliseconds, no memory
            model = build_network(name, width=width)
        coarse, floor, budgets = _grid(shape_tables(model, image_size=image_size, max_batch=request),
                                       floor_batch=request, ratios=ratios, units_at_floor=units_at_floor)
        for budget in budgets:
            for method, make in (("fbs", vbs.fbs), ("greedy", vbs.greedy_vbs)):
                try:
                    p = make(coarse, memory=budget, batch=request)
                except ValueError:  # cannot serve the request in this budget
                    p = None
                rows.append({"network": name, "request": request, "budget_units": budget, "floor_units": floor,
                             "unit_bytes": coarse.unit_bytes, "budget_bytes": budget * coarse.unit_bytes,
                             "ratio": budget / floor, "paper_mb": PAPER_FLOOR_MB * budget / floor, "method": method,
                             "feasible": p is not None, "max_batch": p.max_batch_used if p else np.nan,
                             "plan_json": p.to_json() if p else None})
    return pd.DataFrame(rows).assign(image_size=image_size, width=width, source=SHAPES)


def fbs_unused(sweep: pd.DataFrame, *, network: str = "googlenet", ratio: float = PAPER_BUDGET_MB / PAPER_FLOOR_MB,
               request: int = 12) -> pd.DataFrame:
    """Table III's baseline column from `paper_scale_sweep`: the memory FBS leaves unused while each layer runs
    (its fullest phase), as a fraction of the budget, with the paper's value beside each layer it lists; empty
    where FBS cannot serve the request there."""
    try:
        plan = plan_at_ratio(sweep, network=network, method="fbs", ratio=ratio, request=request, kept=False)
    except ValueError:
        return pd.DataFrame()
    frame = plan.to_frame()[["name", "batches", "unused_bytes"]]
    budget = plan.memory * plan.unit_bytes
    floor = sweep[(sweep.network == network) & (sweep.request == request)].floor_units.iloc[0]
    paper = frame.name.map(TABLE_III)
    return frame.assign(
        fbs_unused_fraction=frame.unused_bytes / budget, budget_bytes=budget,
        paper_fbs_unused_fraction=[v[0] / PAPER_BUDGET_MB if isinstance(v, tuple) else np.nan for v in paper],
        network=network, request=request, paper_mb=PAPER_FLOOR_MB * plan.memory / floor, source=SHAPES)
