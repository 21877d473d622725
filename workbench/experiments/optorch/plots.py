"""Pure plot functions for the OpTorch notebook: DataFrame in, matplotlib Figure out.

Paper: Ahmed & Naveed, "OpTorch" (arXiv 2105.00619), Figs 8-11; the encoding capacity plot
tests Sec. II-A-3's "16 images" / "32 images" per float64.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

__all__ = [
    "plot_capacity",
    "plot_checkpoint_position",
    "plot_loader_throughput",
    "plot_memory_over_iteration",
    "plot_pareto",
    "plot_pipeline_memory",
    "plot_time_accuracy",
]

_MIB = 2**20


def plot_memory_over_iteration(trace: pd.DataFrame, *, title: str = "") -> Figure:
    """Fig 8: live tensor memory (MiB) over one iteration, one line per variant.

    The x axis is progress through the iteration (allocation/free events scaled to [0, 1]) so
    variants with different event counts line up.
    """
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for variant, frame in trace.groupby("variant", sort=False):
        ax.plot(frame["progress"], frame["bytes"] / _MIB, label=variant, lw=1.2)
    ax.set_xlabel("progress through one iteration (forward, then backward)")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title(title or "Memory over one training iteration")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_time_accuracy(df: pd.DataFrame, *, time_column: str = "robust_cum_seconds") -> Figure:
    """Fig 9: final test accuracy against training time, one point per pipeline."""
    last = df.sort_values("epoch").groupby("pipeline", sort=False).tail(1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (_, row) in enumerate(last.iterrows()):
        ax.scatter(row[time_column], 100 * row["test_acc"], s=40)
        # staggered labels: pipelines with identical accuracy would otherwise overprint
        ax.annotate(row["pipeline"], (row[time_column], 100 * row["test_acc"]),
                    textcoords="offset points", xytext=(4, 4 + 9 * (i % 3)), fontsize=8)
    pts = last.set_index("pipeline")
    for a, b, style in (("B", "E-D+S-C", "-"), ("M-P", "E-D+M-P+S-C", "--")):
        if a in pts.index and b in pts.index:
            ax.plot([pts.loc[a, time_column], pts.loc[b, time_column]],
                    [100 * pts.loc[a, "test_acc"], 100 * pts.loc[b, "test_acc"]], style,
                    color="grey", lw=1)
    label = "median step time x steps (s)" if time_column.startswith("robust") else "wall time (s)"
    ax.set_xlabel(f"training time for {int(df.epoch.max())} epochs: {label}")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Time vs accuracy per pipeline")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_pipeline_memory(df: pd.DataFrame) -> Figure:
    """Fig 10: peak memory (MiB) of one training step per pipeline, grouped by model."""
    table = df.pivot(index="pipeline", columns="model", values="peak_bytes") / _MIB
    table = table.loc[list(dict.fromkeys(df.pipeline))]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    table.plot.bar(ax=ax, rot=20)
    ax.set_xlabel("pipeline")
    ax.set_ylabel("peak tensor memory of one step (MiB)")
    ax.set_title("Memory per pipeline per model")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def plot_checkpoint_position(df: pd.DataFrame) -> Figure:
    """Fig 11: measured and predicted peak (MiB) with one checkpoint after each layer."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(df.boundary, df.measured_peak_bytes / _MIB, "o-", label="measured")
    ax.plot(df.boundary, df.predicted_peak_bytes / _MIB, "x--", label="predicted (profile)")
    best = df.loc[df.is_smallest]
    ax.scatter(best.boundary, best.measured_peak_bytes / _MIB, s=160, facecolors="none",
               edgecolors="red", label="smallest layer")
    ticks = [f"{b}\n(w={w:.0f})" if b else "none" for b, w in zip(df.boundary, df.stored_width,
                                                                  strict=True)]
    ax.set_xticks(df.boundary, ticks, fontsize=8)
    ax.set_xlabel("checkpoint after layer (stored width)")
    ax.set_ylabel("peak tensor memory of one step (MiB)")
    ax.set_title("One checkpoint in a 7-layer autoencoder")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_pareto(df: pd.DataFrame, *, time_column: str = "min_s") -> Figure:
    """Memory-time points of the planning strategies (measured peak MiB vs step seconds)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = {"uniform": "o", "smallest": "s", "optimal": "^"}
    for strategy, frame in df.dropna(subset=["measured_peak_bytes"]).groupby("strategy"):
        ax.scatter(frame.measured_peak_bytes / _MIB, frame[time_column],
                   marker=markers.get(strategy, "o"), label=strategy, s=45, alpha=0.7)
    ax.set_xlabel("measured peak tensor memory of one step (MiB)")
    ax.set_ylabel(f"step time, {time_column.replace('_s', '')} of repeats (s)")
    ax.set_title("Checkpoint plans: memory vs time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_capacity(df: pd.DataFrame) -> Figure:
    """Reconstruction error (max |pixel error|) against images packed per element."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for scheme, frame in df.groupby("scheme", sort=False):
        ax.plot(frame.per_element, frame.max_abs_error, "o-", ms=3, label=scheme)
        bx.plot(frame.per_element, frame.bytes_per_pixel, "o-", ms=3, label=scheme)
    for a in (ax, bx):
        for claim in (16, 32):
            a.axvline(claim, color="grey", ls=":", lw=1)
        a.set_xlabel("images packed per element")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("max absolute pixel error (0-255)")
    ax.set_title("Round-trip error (dotted: the paper's 16 and 32)")
    bx.axhline(4.0, color="black", lw=0.8, ls="--")
    bx.axhline(1.0, color="black", lw=0.8, ls="-.")
    bx.set_ylabel("bytes per pixel per image (dashed: float32, dash-dot: uint8)")
    bx.set_title("Size of the encoded batch")
    fig.tight_layout()
    return fig


def plot_loader_throughput(df: pd.DataFrame) -> Figure:
    """Images per second per loader on the same data."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(df.loader, df.images_per_s)
    ax.set_xlabel("images per second (start-up included)")
    ax.set_title("Loader throughput")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig
