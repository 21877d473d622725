"""Plots of the efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten, Weinberger,
"Memory-Efficient Implementation of DenseNets" (2017). Pure functions: a DataFrame in, a
matplotlib Figure out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.report.marks import TOY_SCALE, marked

from .memory import LABELS

__all__ = ["TOY_SCALE", "plot_memory_vs_depth", "plot_budget", "plot_time_per_minibatch", "plot_conv_contiguity"]

_MIB = 2**20


def _log_ticks(lo: float, hi: float, *, at_least: int = 4) -> list[float]:
    """Tick values for a log axis from `lo` to `hi`: 1-2-5 steps, or every digit where those give fewer than
    `at_least`, so a span of one decade still shows a scale to read."""
    ticks: list[float] = []
    for steps in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [float(f"{m}e{e}") for e in range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
                 for m in steps if lo <= m * 10.0**e <= hi]
        if len(ticks) >= at_least:
            break
    return ticks


def plot_memory_vs_depth(df: pd.DataFrame, fits: pd.DataFrame | None = None, *,
                         value: str = "activation_peak_bytes", verdicts: bool = True, scale: str = ""):
    """Peak memory (MiB) against depth per form, linear axes and log-log with fitted exponents."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    exps = {} if fits is None else {r.form: f" (exponent {r.exponent:.2f}, deepest pair "
                                    f"{r.local_exponent:.2f})" for r in fits.itertuples()}
    for form, g in df.groupby("form", sort=False):
        g = g.sort_values("depth")
        axes[0].plot(g["depth"], g[value] / _MIB, marker="o", label=LABELS.get(form, form))
        axes[1].plot(g["depth"], g[value] / _MIB, marker="o", label=form + exps.get(form, ""))
    first = df.iloc[0]
    axes[0].set_title(f"DenseNet-BC k={first['growth_rate']}, batch {first['batch_size']}, "
                      f"{first['image_size']}px, {first['device']}")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    ticks: list[int] = []
    for t in sorted(int(d) for d in df["depth"].unique()):
        if not ticks or t >= 1.2 * ticks[-1]:  # every depth measured where the labels do not collide
            ticks.append(t)
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xticks(ticks, [str(t) for t in ticks])
    axes[1].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    values = _log_ticks(*axes[1].get_ylim())  # a sweep spans one or two decades: 10^1, 10^2 alone said little
    axes[1].set_yticks(values, [f"{v:g}" for v in values])
    axes[1].set_title("log-log: slope = growth exponent")
    for ax in axes:
        ax.set_xlabel("depth (layers)")
        ax.set_ylabel(f"peak {value.replace('_bytes', '').replace('_', ' ')} (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return marked(fig, verdicts, scale=scale)


def plot_budget(budget_df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Deepest measured depth per form within the memory budget."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    depths = budget_df["deepest_depth"].fillna(0)
    bars = ax.bar(budget_df["form"], depths, color=[f"C{i}" for i in range(len(budget_df))])
    for bar, lim in zip(bars, budget_df["limited_by_sweep"], strict=True):
        ax.annotate(f"{int(bar.get_height())}" + ("+" if lim else ""),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.set_ylabel("deepest depth that fits (layers)")
    ax.set_xlabel("implementation")
    r = budget_df.iloc[0]
    what = (f"training step at batch {r['step_batch_size']} (measured at {r.get('batch_size', '?')}), state included"
            if "step_batch_size" in budget_df else "feature maps")
    ax.set_title(f"DenseNet-BC k={r.get('growth_rate', '?')}, {r.get('image_size', '?')}px: budget = naive "
                 f"{what} at depth {r.get('budget_depth', '?')}, {r['budget_bytes'] / _MIB:,.1f} MiB "
                 f"('+': sweep limit)", fontsize=9)
    return marked(fig, verdicts, scale=scale)


def plot_time_per_minibatch(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Median seconds per training step per form, min-max bars, ratio to naive on top."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    err = np.vstack([df["median_s"] - df["min_s"], df["max_s"] - df["median_s"]])
    bars = ax.bar(df["form"], df["median_s"], yerr=err, capsize=4,
                  color=[f"C{i}" for i in range(len(df))])
    for bar, ratio in zip(bars, df["ratio_to_naive"], strict=True):
        ax.annotate(f"{ratio:.2f}x naive", (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                    ha="center", va="center", color="white", fontweight="bold")
    r = df.iloc[0]
    ax.set_title(f"DenseNet-BC-{r['depth']} k={r['growth_rate']}, batch {r['batch_size']}, "
                 f"{r.get('image_size', '?')}px, {r['device']}")
    ax.set_ylabel("time per minibatch (s)")
    ax.set_xlabel("implementation")
    return marked(fig, verdicts, scale=scale)


def plot_conv_contiguity(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """3x3 convolution time (ms) against input channels, contiguous vs strided input."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for layout, g in df.groupby("layout", sort=False):
        ax.plot(g["in_channels"], g["median_s"] * 1e3, marker="o", label=layout)
    r = df.iloc[0]
    ax.set_title(f"3x3 conv, {r['image_size']}x{r['image_size']}, batch {r['batch_size']}, "
                 f"{r['device']}")
    ax.set_xlabel("input channels")
    ax.set_ylabel("time per convolution (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    return marked(fig, verdicts, scale=scale)
