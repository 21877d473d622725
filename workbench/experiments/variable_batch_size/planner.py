"""The planner itself: Section III's worked example, and how fast the DP plans.

"Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section III, "Illustration with an example": three layers with in = out = b, workspaces b, 4b, b,
per-sample time 4 at batch 1 and 3 at batch 2, 7 units of memory and a request of 2. FBS can
only run batch 1 (12 per image); the DP runs 2 / 1,1 / 2 (10 per image).

Planner speed is a target of ours (the paper plans offline and gives no time): the tables are
filled and the plan reconstructed on synthetic tables of growing size.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from workbench import vbs

__all__ = ["example_tables", "worked_example", "random_layers", "planner_timing"]


def example_tables() -> vbs.LayerProfile:
    """The three-layer network of Section III's worked example."""
    return vbs.LayerProfile(time=[[4, 3]] * 3, inp=[[1, 2]] * 3, out=[[1, 2]] * 3, ws=[[1, 2], [4, 8], [1, 2]])


def worked_example(*, memory: int = 7, batch: int = 2) -> pd.DataFrame:
    """The DP ("vbs"), FBS, Greedy-VBS and `vbs.plan` ("best", the fastest of the three) on the
    worked example: time per sample, peak units and each layer's phases."""
    tables = example_tables()
    plans = {"vbs": vbs.dp(tables, memory=memory, batch=batch), "fbs": vbs.fbs(tables, memory=memory, batch=batch),
             "greedy": vbs.greedy_vbs(tables, memory=memory, batch=batch),
             "best": vbs.plan(tables, memory=memory, batch=batch)}
    return pd.DataFrame([{"method": k, "chosen": p.method, "time_per_sample": p.time_per_sample, "peak_units": p.peak,
                          **{f"{n} batches": b for n, b in p.layer_batches.items()}} for k, p in plans.items()])


def random_layers(n: int, batch: int, *, seed: int = 0) -> vbs.LayerProfile:
    """Synthetic linear tables (memory in units of 1, sized so ~64 units is a tight budget)."""
    rng = np.random.default_rng(seed)
    b = np.arange(1, batch + 1)
    size = rng.integers(1, 3, n + 1)
    t = rng.uniform(1e-3, 2e-3, (n, batch)) / (1 + 0.5 * rng.uniform(0, 1, (n, 1)) * (b - 1))
    return vbs.LayerProfile(t, size[:-1, None] * b, size[1:, None] * b, rng.integers(0, 3, (n, 1)) * b)


def planner_timing(*, layers=(15, 30, 60), memory_units=(16, 32, 64, 128), batch: int = 16, repeats: int = 3,
                   seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Seconds to fill the DP tables and reconstruct the plan (median of `repeats`) per size:
    wall time, and CPU time of this process (`cpu_s`; on a shared machine, the cost on one core).

    An infeasible budget is timed for the tables alone (`feasible` False): planning would then also
    search for the smallest feasible budget, which is a second solve, not the planner's speed.
    """
    rows = []
    for n in tqdm(layers, desc="planner timing", disable=not progress):
        tables = random_layers(n, batch, seed=seed)
        for m in memory_units:
            times, cpu, feasible = [], [], False
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                planner = vbs.Planner(tables, memory=m)
                feasible = bool(np.isfinite(planner.curve(batch)[m]))
                if feasible:
                    planner.plan(memory=m, batch=batch)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            rows.append({"layers": n, "batch": batch, "memory_units": m, "feasible": feasible,
                         "median_s": float(np.median(times)), "min_s": min(times), "max_s": max(times),
                         "cpu_s": float(np.median(cpu)), "cpu_min_s": min(cpu), "cpu_max_s": max(cpu)})
    return pd.DataFrame(rows)
