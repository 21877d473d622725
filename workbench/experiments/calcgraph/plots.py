"""Figures of the CalcGraph notebook ("CalcGraph: taming the high costs of deep learning using models",
2022): pure functions from a record (DataFrame) to a matplotlib Figure, shared by reports and widgets."""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.report.marks import TOY_SCALE, marked

__all__ = [
    "TOY_SCALE", "plot_accuracy", "plot_multi_model", "plot_parallel", "plot_peers", "plot_prediction_error",
    "plot_single_model",
]

MIB = 2**20


def plot_prediction_error(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Predicted vs measured peak per model (left) and the relative error per batch size (right)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, part in df.groupby("model", sort=False):
        axes[0].plot(part["measured_bytes"] / MIB, part["predicted_bytes"] / MIB, "o", label=name)
        axes[1].plot(part["batch_size"], 100 * part["error"], "o-", label=name)
    lim = [0, df["measured_bytes"].max() / MIB * 1.05]
    axes[0].plot(lim, lim, "k--", lw=0.8, label="exact")
    meter = df["meter"].iloc[0] if "meter" in df and len(df) else "MemoryMeter"
    axes[0].set_xlabel(f"measured peak (MiB, {meter})")
    axes[0].set_ylabel("predicted peak (MiB, plan)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("batch size")
    axes[1].set_ylabel("prediction error (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Memory known before execution: predicted vs measured peak of a training step")
    return marked(fig, verdicts, scale=scale)


def plot_accuracy(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Fig 9: train (left) and test (right) accuracy per round, heap-bound vs plain PyTorch."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, col, title in ((axes[0], "train_accuracy", "train"), (axes[1], "test_accuracy", "test")):
        for (name, part), style in zip(df.groupby("framework", sort=False), ("-", "--"), strict=False):
            ax.plot(part["round"], 100 * part[col], style, label=name)
        ax.set_xlabel("round")
        ax.set_title(f"{title} accuracy (Fig 9)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("accuracy (%)")
    return marked(fig, verdicts, scale=scale)


def plot_single_model(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Fig 10: peak tensor memory, predicted and measured (left), and time per round (right)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(df))
    axes[0].bar(x - 0.2, df["predicted_peak_bytes"] / MIB, 0.4, label="predicted before running")
    axes[0].bar(x + 0.2, df["measured_peak_bytes"] / MIB, 0.4, label="measured")
    axes[0].set_ylabel("peak tensor memory (MiB)")
    err = [df["round_median_s"] - df["round_min_s"], df["round_max_s"] - df["round_median_s"]]
    axes[1].bar(x, 1e3 * df["round_median_s"], yerr=1e3 * np.array(err), capsize=4)
    axes[1].set_ylabel("time per round (ms, median, min-max)")
    for ax in axes:
        ax.set_xticks(x, df["framework"])
        ax.grid(alpha=0.3, axis="y")
    # NOTE: below the axes, not over the bars (inside, it covered the measured bar of the tallest pair)
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle("Single model: memory (left) and time per round (right), Fig 10")
    return marked(fig, verdicts, scale=scale)


def plot_multi_model(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Fig 11: total time against models x rounds, both axes logarithmic."""
    import matplotlib.pyplot as plt

    ran = df[df["run"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.scatter(ran["complexity"], 1e3 * ran["plain_s"], marker="o", label="PyTorch: build each model anew")
    ax.scatter(ran["complexity"], 1e3 * ran["switching_s"], marker="x", label="CalcGraph heap: model switching")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("models x rounds")
    ax.set_ylabel("total time (ms)")
    ax.set_title("Many models (Fig 11)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return marked(fig, verdicts, scale=scale)


def plot_parallel(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Fig 12: models in parallel per mode and budget: CalcGraph's plan, its layout found by trials,
    and plain PyTorch found by trials (the paper's comparison)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    labels = [f"{m}\n{b / MIB:.1f} MiB" for m, b in zip(df["mode"], df["budget_bytes"], strict=True)]
    x = np.arange(len(df))
    bars = (("planned_models", "CalcGraph plan (0 trials)", None),
            ("trial_models", "CalcGraph layout, trials", "trials"),
            ("pytorch_models", "plain PyTorch, trials", "pytorch_trials"))
    for i, (col, label, trials) in enumerate(bars):
        drawn = ax.bar(x + (i - 1) * 0.27, df[col], 0.27, label=label)
        for bar, t in zip(drawn, df[trials] if trials else [], strict=False):
            ax.annotate(f"{t}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_ylabel("models in parallel (numbers: trial runs)")
    ax.set_title("Models that fit in a budget (Fig 12)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return marked(fig, verdicts, scale=scale)


def plot_peers(df: pd.DataFrame, *, verdicts: bool = True, scale: str = ""):
    """Trial runs (left) and wall time (right) each method needs to find the largest batch."""
    import matplotlib.pyplot as plt

    ran = df[df["max_batch"].notna()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    y = np.arange(len(ran))
    axes[0].barh(y, ran["trials"].astype(float))
    axes[0].set_xlabel("trial runs")
    axes[1].barh(y, ran["seconds"].astype(float))
    axes[1].set_xlabel("wall time to the answer (s)")
    for ax in axes:
        ax.set_yticks(y, [f"{m} -> {int(b)}" for m, b in zip(ran["method"], ran["max_batch"], strict=True)])
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_ylabel("method -> largest batch found")
    axes[1].set_yticklabels([])
    fig.suptitle("Largest batch for a budget: plan vs trial-based finders")
    return marked(fig, verdicts, scale=scale)
