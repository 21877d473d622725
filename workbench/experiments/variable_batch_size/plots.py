"""Plots of the variable-batch-size notebook (Choudhury et al., Figs 1, 2, 7, 8 and 9): pure
functions, a DataFrame in and a matplotlib Figure out, so reports and widgets share them.

Each takes `verdicts`, the notebook parameter that also turns the ledger's verdicts on: a figure
made where it is False (toy sizes: the interactive defaults, the smoke profile) carries the
`TOY_SCALE` mark on itself, since a toy run can show the opposite of the paper.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.report.marks import TOY_SCALE, marked

from .budgets import PAPER_FLOOR_MB
from .tables import LABELS

__all__ = ["TOY_SCALE", "plot_time_vs_batch", "plot_layer_memory", "plot_budget_sweep", "plot_request_sizes",
           "plot_layer_batches", "plot_planner_timing"]

_MIB = 2**20
_STYLE = {"vbs": ("VBS (DP)", "C0"), "fbs": ("FBS", "C1"), "greedy": ("Greedy-VBS", "C2")}


def plot_time_vs_batch(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Fig 1: per-image time (ms) against the batch size all layers run at, one line per network."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, grp in df.groupby("network"):
        ax.plot(grp.batch, grp.time_per_image_s * 1e3, marker="o", label=LABELS.get(name, name))
    ax.set_xlabel("batch size (all layers)")
    ax.set_ylabel("time per image (ms)")
    ax.set_title("Per-image time against batch size (Fig 1)")
    ax.grid(alpha=0.3)
    ax.legend()
    return marked(fig, verdicts, scale=scale)


def plot_layer_memory(df: pd.DataFrame, *, title: str = "Memory per layer at batch 1 (Fig 2)", verdicts: bool = True,
                      scale: str = ""):
    """Fig 2: input, output and workspace bytes (MiB) of every layer group, stacked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.16 * len(df)), 3.8))
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    for col, label in (("in_bytes", "input"), ("out_bytes", "output"), ("ws_bytes", "workspace")):
        ax.bar(x, df[col] / _MIB, bottom=bottom, label=label)
        bottom += df[col] / _MIB
    ax.set_xticks(x, df.name, rotation=90, fontsize=5 if len(df) > 40 else 7)
    ax.set_xlabel("layer")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title)
    ax.legend()
    return marked(fig, verdicts, scale=scale)


def _sweep_axes(ax, grp: pd.DataFrame, *, executed: bool) -> None:
    for method, (label, color) in _STYLE.items():
        m = grp[(grp.method == method) & grp.feasible].sort_values("paper_mb")
        if m.empty:
            continue
        ax.plot(m.paper_mb, m.time_per_image_s * 1e3, marker="o", color=color, label=f"{label} predicted")
        if executed and "executed_s" in m and m.executed_s.notna().any():
            ax.errorbar(m.paper_mb, m.executed_s * 1e3, yerr=[(m.executed_s - m.executed_min_s) * 1e3,
                        (m.executed_max_s - m.executed_s) * 1e3], color=color, ls="--", marker="x",
                        label=f"{label} executed")
    ax.grid(alpha=0.3)


def plot_budget_sweep(df: pd.DataFrame, *, request: int = 12, executed: bool = True, verdicts: bool = True,
                      scale: str = ""):
    """Fig 7: per-image time against budget, one panel per network (x: paper-equivalent MB)."""
    import matplotlib.pyplot as plt

    df = df[df.request == request]
    names = list(df.network.unique())
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        grp = df[df.network == name]
        _sweep_axes(ax, grp, executed=executed)
        unit = grp.unit_bytes.iloc[0] * grp.floor_units.iloc[0] / _MIB
        ax.set_title(f"{LABELS.get(name, name)} (floor {unit:.2f} MiB)", fontsize=10)
        ax.set_xlabel(f"budget (paper-equivalent MB = {PAPER_FLOOR_MB:g} x budget / floor)")
        ax.set_ylabel("time per image (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Per-image time against memory budget, request {request} (Fig 7)")
    return marked(fig, verdicts, scale=scale)


def plot_request_sizes(df: pd.DataFrame, *, network: str = "googlenet", executed: bool = True,
                       verdicts: bool = True, scale: str = ""):
    """Fig 8: VBS, FBS and Greedy-VBS for one network at several request sizes."""
    import matplotlib.pyplot as plt

    df = df[df.network == network]
    requests = sorted(df.request.unique())
    fig, axes = plt.subplots(1, len(requests), figsize=(3.8 * len(requests), 3.4), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], requests, strict=True):
        _sweep_axes(ax, df[df.request == r], executed=executed)
        ax.set_title(f"request {r}")
        ax.set_xlabel("budget (paper-equivalent MB)")
    axes[0][0].set_ylabel("time per image (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{LABELS.get(network, network)}: VBS against both baselines by request size (Fig 8)")
    return marked(fig, verdicts, scale=scale)


def plot_layer_batches(frame: pd.DataFrame, *, title: str = "Batch sizes per layer (Fig 9)", verdicts: bool = True,
                       scale: str = ""):
    """Fig 9: for each main-path layer, its phases as stacked bars (height = batch size).

    `frame` has one row per layer with `name` and `batches` (the list of phase sizes), as
    `Plan.to_frame()` and `layer_batches` give it.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(frame)), 3.6))
    for x, batches in enumerate(frame.batches):
        bottom = 0
        for k, b in enumerate(batches):
            ax.bar(x, b, bottom=bottom, color=f"C{k % 10}", edgecolor="white")
            if b > 1 or len(batches) < 6:
                ax.text(x, bottom + b / 2, str(b), ha="center", va="center", fontsize=6)
            bottom += b
    ax.set_xticks(range(len(frame)), frame.name, rotation=90, fontsize=7)
    ax.set_xlabel("layer (main path)")
    ax.set_ylabel("samples (stacked phases)")
    ax.set_title(title)
    return marked(fig, verdicts, scale=scale)


def plot_planner_timing(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Planner time (s) against memory units, one colour per number of layers (CPU and wall time)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for k, (n, grp) in enumerate(df.groupby("layers")):
        ax.plot(grp.memory_units, grp.cpu_s, marker="o", color=f"C{k}", label=f"{n} layers (CPU time)")
        ax.plot(grp.memory_units, grp.median_s, marker="x", ls="--", color=f"C{k}", label=f"{n} layers (wall)")
    ax.set_xlabel("memory units")
    ax.set_ylabel("plan time (s)")
    ax.set_title(f"DP planner time (batch {df.batch.iloc[0]})")
    ax.grid(alpha=0.3)
    ax.legend()
    return marked(fig, verdicts, scale=scale)
