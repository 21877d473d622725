"""The held-out zoo in the notebook (issues 18 and 37): CalcGraph's plan alone and calibrated, judged against
the allocator (`workbench.calcgraph.zoo.accuracy_table`: 17 small networks, on the notebook's device), and the
measure of our target on it, at batches calibration never ran: within 5% of the allocator everywhere, never
under by more than 2%."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import torch

from workbench.calcgraph.zoo import accuracy_table
from workbench.report import Measured, Records, record_frame

__all__ = ["ZOO_BAND", "zoo_accuracy", "zoo_worst"]

ZOO_BAND = (-0.02, 0.05)  # our target: never under by more than 2%, never over by more than 5%


def zoo_accuracy(batch_sizes: Sequence[int], *, models: Sequence[str] = (), device: torch.device | str = "cpu"
                 ) -> pd.DataFrame:
    """The zoo's error table at `batch_sizes` on `device` (CPU: one intra-op thread, scratch depends on the thread
    count), for the networks named in `models` (`ZOO`'s names; empty: all of them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = accuracy_table(list(models) or None, batch_sizes=batch_sizes, device=device)
    finally:
        torch.set_num_threads(threads)
    return table.assign(device=str(torch.device(device)))


def zoo_worst(records: Records, params: Mapping) -> Measured | None:
    """The calibrated error farthest outside the target band (or the largest |error| when all are inside), over
    the batches calibration never ran (`held_out`; none held out: nothing to judge)."""
    df = record_frame(records, "zoo")
    if df is None or "held_out" not in df:
        return None
    rows = df[df["held_out"].astype(bool)].dropna(subset=["error"])
    if rows.empty:
        return None
    low, high = ZOO_BAND
    outside = (low - rows["error"]).clip(lower=0) + (rows["error"] - high).clip(lower=0)
    worst = rows.loc[outside.idxmax()] if outside.max() > 0 else rows.loc[rows["error"].abs().idxmax()]
    plain = rows.loc[rows["uncalibrated_error"].abs().idxmax()]
    cuda = "device" in rows and str(rows["device"].iloc[0]).startswith("cuda")
    allocator = "CUDA's max_memory_allocated" if cuda else "CPU allocator (torch.profiler), one thread"
    return Measured(float(worst["error"]), scale=(
        f"{rows['model'].nunique()} networks x held-out batches {sorted({int(b) for b in rows['batch_size']})}, "
        f"{allocator}; worst: {worst['model']} at batch {int(worst['batch_size'])}; the plan alone "
        f"misses by up to {float(plain['uncalibrated_error']):+.1%} ({plain['model']})"))
