"""Pure plot functions for the packed-bit optimizer notebook (paper 004, Fig 2, 3, 4/Table 3, 6).

Each takes the DataFrame its benchmark returns and gives back a matplotlib Figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_memory", "plot_throughput", "plot_accuracy", "plot_addition_error",
           "plot_fused_backward"]


def plot_memory(df: pd.DataFrame) -> Figure:
    """Fig 2: measured peak bytes per parameter by format, +- step in backward, analytic beside."""
    fig, ax = plt.subplots(figsize=(10, 4))
    formats = list(dict.fromkeys(df["format"]))
    x = np.arange(len(formats))
    for i, sib in enumerate((False, True)):
        sub = df[df["step_in_backward"] == sib].set_index("format").loc[formats]
        label = "step in backward" if sib else "ordinary step"
        ax.bar(x + (i - 0.5) * 0.38, sub["peak_bytes_per_param"], 0.36, label=f"measured, {label}")
        ax.scatter(x + (i - 0.5) * 0.38, sub["analytic_bytes_per_param"], color="k", marker="_",
                   s=300, zorder=3, label="analytic (params+grads+states)" if i else None)
    ax.set_xticks(x, formats, rotation=20)
    ax.set_ylabel("peak memory (bytes per parameter)")
    params = int(df["params"].iloc[0])
    ax.set_title(f"Peak tensor memory of {df['steps'].iloc[0]} training steps, {params / 1e6:.1f}M params")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_throughput(df: pd.DataFrame) -> Figure:
    """Fig 3: update throughput as % of measured copy bandwidth, per method / extra bits."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    pct = 100 * df["bandwidth_fraction"]
    ax.barh(df["method"], pct, color=["grey"] + ["C0"] * (len(df) - 1))
    for y, (p, r) in enumerate(zip(pct, df["ratio_vs_torch_fused"], strict=True)):
        ax.text(p, y, f" {p:.0f}%  ({r:.2f}x torch steps/s)", va="center", fontsize=8)
    ax.set_xlabel("bytes moved per second (% of measured copy bandwidth)")
    ax.set_title(f"AdamW step, {df['numel'].iloc[0] / 1e6:.1f}M params on {df['device'].iloc[0]}")
    ax.set_xlim(0, max(100.0, float(pct.max()) * 1.4))
    fig.tight_layout()
    return fig


def plot_accuracy(df: pd.DataFrame) -> Figure:
    """Table 3 / Fig 4: final test accuracy by format, one panel per regime."""
    regimes = list(dict.fromkeys(df["regime"]))
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.5 * len(regimes), 3.5), squeeze=False)
    for ax, regime in zip(axes[0], regimes, strict=True):
        sub = df[df["regime"] == regime]
        ax.bar(sub["format"], 100 * sub["test_acc"], color="C2")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{regime} (lr={sub['lr'].iloc[0]:g})", fontsize=9)
        ax.tick_params(axis="x", rotation=45)
        ax.set_ylim(0, 100)
    fig.tight_layout()
    return fig


def plot_addition_error(df: pd.DataFrame) -> Figure:
    """Fig 6: relative forward error of 16-bit in-place additions vs size and vs number of ops."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (panel, xcol, xlabel) in zip(
        axes, (("one op", "n", "tensor size n"), ("many ops", "ops", "number of additions")),
        strict=True,
    ):
        sub = df[df["panel"] == panel]
        for fmt, g in sub.groupby("format", sort=False):
            ax.plot(g[xcol], g["rel_error"], marker="o", label=fmt)
        ax.axhline(df["fp16_eps"].iloc[0], color="k", ls=":", label="fp16 unit roundoff")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("relative error ||x16 - exact|| / ||exact||")
        ax.set_title(f"error after {panel}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_fused_backward(df: pd.DataFrame) -> Figure:
    """Table 2 analogue: peak memory and step time with and without the step in backward."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [f"{f}\n{'in backward' if s else 'ordinary'}"
              for f, s in zip(df["format"], df["step_in_backward"], strict=True)]
    axes[0].bar(labels, df["peak_bytes"] / 2**20, color="C1")
    axes[0].set_ylabel("peak tensor memory (MiB)")
    axes[1].bar(labels, df["step_s"] * 1e3, color="C4")
    axes[1].set_ylabel("time per training step (ms)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Transformer encoder, {df['params'].iloc[0] / 1e6:.1f}M params")
    fig.tight_layout()
    return fig
