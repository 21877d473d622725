"""Pure plot functions for the OpTorch notebook: DataFrame in, matplotlib Figure out.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Figs 8-11; the encoding capacity plot tests Sec. II-A-3's "16 images" /
"32 images" per float64; the planner plots show predicted against measured peaks, the floor a
single unit sets, and torch's own activation-memory budget beside our planner.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from workbench.report.marks import TOY_SCALE, marked

__all__ = [
    "TOY_SCALE",
    "plot_capacity",
    "plot_checkpoint_position",
    "plot_loader_throughput",
    "plot_memory_over_iteration",
    "plot_pareto",
    "plot_peer",
    "plot_pipeline_memory",
    "plot_prediction",
    "plot_time_accuracy",
    "plot_unit_floor",
]

_MIB = 2**20


def plot_memory_over_iteration(trace: pd.DataFrame, *, title: str = "", verdicts: bool = True) -> Figure:
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
    return marked(fig, verdicts)


def plot_time_accuracy(df: pd.DataFrame, *, time_column: str = "robust_cum_seconds", verdicts: bool = True) -> Figure:
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
    # NOTE: the staggered labels reach 22 points above their point: room for them below the title
    ax.margins(x=0.12, y=0.25)
    ax.grid(alpha=0.3)
    return marked(fig, verdicts)


def plot_pipeline_memory(df: pd.DataFrame, *, device: str = "", verdicts: bool = True) -> Figure:
    """Fig 10: peak memory (MiB) of one training step per pipeline, grouped by model; measured (``peak_bytes``) or
    planned (``planned_peak_bytes``, `paper_scale`). The title states the scale: batch, input size, width, stem and
    the device (``device``, else the frame's)."""
    planned = "planned_peak_bytes" in df
    table = df.pivot(index="pipeline", columns="model", values="planned_peak_bytes" if planned else "peak_bytes")
    table = table.loc[list(dict.fromkeys(df.pipeline))] / _MIB
    fig, ax = plt.subplots(figsize=(7, 4.2))
    table.plot.bar(ax=ax, rot=20)
    ax.set_xlabel("pipeline")
    ax.set_ylabel(f"peak tensor memory of one step (MiB, {'planned' if planned else 'measured'})")
    r = df.iloc[0]
    how = (f"planned without running ({r.planner}), for {device or r.device}" if planned
           else f"measured on {device or r.device}")
    ax.set_title(f"Memory per pipeline per model: {r.batch} images {r.image_size}x{r.image_size} px, width "
                 f"x{float(r.width):g}, {r.stem} stem\n{how}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return marked(fig, verdicts)


def plot_checkpoint_position(df: pd.DataFrame, *, verdicts: bool = True) -> Figure:
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
    return marked(fig, verdicts)


def plot_pareto(df: pd.DataFrame, *, time_column: str = "min_s", verdicts: bool = True) -> Figure:
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
    return marked(fig, verdicts)


def plot_capacity(df: pd.DataFrame, *, verdicts: bool = True) -> Figure:
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
    return marked(fig, verdicts)


def plot_loader_throughput(df: pd.DataFrame, *, verdicts: bool = True) -> Figure:
    """Images per second per loader on the same data."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(df.loader, df.images_per_s)
    ax.set_xlabel("images per second (start-up included)")
    ax.set_title("Loader throughput")
    ax.grid(alpha=0.3, axis="x")
    return marked(fig, verdicts)


def plot_prediction(frames: dict[str, pd.DataFrame], *, verdicts: bool = True) -> Figure:
    """Predicted against measured peak (MiB) of every plan, one marker set per experiment.

    Each frame needs ``predicted_peak_bytes`` and ``measured_peak_bytes`` (or ``peak_bytes``).
    Points above the diagonal are over-predictions (a budget is kept with room to spare), points
    below it under-predictions (a budget can be exceeded).
    """
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    top = 0.0
    for label, frame in frames.items():
        measured = frame["measured_peak_bytes"] if "measured_peak_bytes" in frame else frame["peak_bytes"]
        ok = measured.notna() & frame["predicted_peak_bytes"].notna()
        ax.scatter(measured[ok] / _MIB, frame.loc[ok, "predicted_peak_bytes"] / _MIB, s=30, alpha=0.7,
                   label=label)
        if ok.any():
            top = max(top, float(measured[ok].max()), float(frame.loc[ok, "predicted_peak_bytes"].max()))
    ax.plot([0, top / _MIB], [0, top / _MIB], color="grey", lw=0.8, ls="--", label="exact")
    ax.set_xlabel("measured peak of one step (MiB)")
    ax.set_ylabel("planner's predicted peak (MiB)")
    ax.set_title("Cost model: predicted vs measured peak per plan")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return marked(fig, verdicts)


def plot_unit_floor(floors: pd.DataFrame, *, verdicts: bool = True) -> Figure:
    """The least peak each unit allows (ratio to the baseline's peak), one line per stem."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for stem, frame in floors.groupby("stem", sort=False):
        ax.plot(frame.unit, frame.floor_ratio, "o-", ms=3, lw=1, label=f"{stem} stem")
        worst = frame.loc[frame.floor_ratio.idxmax()]
        ax.annotate(f"{worst['name']}: {worst.floor_ratio:.2f}x", (worst.unit, worst.floor_ratio),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("checkpoint unit (stem, then blocks opened into their layers)")
    ax.set_ylabel("floor / baseline peak")
    ax.set_title("No plan goes below the largest single-unit floor")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return marked(fig, verdicts)


def plot_peer(df: pd.DataFrame, *, verdicts: bool = True) -> Figure:
    """Retained bytes and step time against the budget fraction: our planner and torch's."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for method, frame in df.dropna(subset=["retained_ratio"]).groupby("method", sort=False):
        ax.plot(frame.fraction, frame.retained_ratio, "o-", label=method)
        err = [frame.time_ratio - frame.time_ratio_lo, frame.time_ratio_hi - frame.time_ratio]
        bx.errorbar(frame.fraction, frame.time_ratio, yerr=[e.clip(lower=0) for e in err], fmt="o-",
                    capsize=3, label=method)
    ax.set_xlabel("budget fraction")
    ax.set_ylabel("retained bytes / eager baseline")
    ax.set_title("Memory kept for backward")
    bx.set_xlabel("budget fraction")
    bx.set_ylabel("step time / eager baseline")
    bx.set_title("Step time (bars: spread over rounds)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return marked(fig, verdicts)
