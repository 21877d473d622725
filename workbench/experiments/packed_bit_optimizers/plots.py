"""Pure plot functions for the packed-bit optimizer notebook (Lewandowski & Kosson, "Memory Efficient
Mixed Precision Optimizers": Fig 2 and its timeline panels, Fig 3, Fig 4 / Table 3, Fig 6, Table 2),
plus the side-by-side comparison with other low-memory optimizers.

Each takes the DataFrame its benchmark returns and gives back a matplotlib Figure. ``scale`` (model, input
size, batch, device) is a line under the title; ``note`` (e.g. "toy scale: not evidence") is added to the
figure's title: a figure measured at a scale where the notebook gives no verdicts says so on itself, since a
toy run can show the opposite of the paper.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_memory", "plot_timeline", "plot_throughput", "plot_accuracy", "plot_addition_error",
           "plot_fused_backward", "plot_peers"]

def _noted(fig: Figure, note: str, scale: str = "") -> Figure:
    """``fig`` with ``scale`` (model, input size, batch, device: issue 44) as a line under its suptitle and ``note``
    appended to it (or as its suptitle), in red; laid out."""
    if scale:
        title = fig.get_suptitle()
        fig.suptitle(f"{title}\n{scale}" if title else scale, fontsize=9)
    if note:
        title = fig.get_suptitle()
        fig.suptitle(f"{title} [{note}]" if title else f"[{note}]", color="C3", fontsize=10)
    fig.tight_layout()
    return fig


_CATEGORIES = (("parameters", "parameters"), ("optimizer_state", "optimizer state (+ extra bits)"),
               ("gradients", "gradients"), ("activations_temporaries", "activations + temporaries"))


def _ran(df: pd.DataFrame, fmt: str) -> str:
    """``fmt``, with the format that ran in its place where a bf16 twin did (``ran_as``: fp16 slow here)."""
    ran = df.loc[df["format"] == fmt, "ran_as"].iloc[0] if "ran_as" in df else fmt
    return f"{fmt}\n(ran {ran})" if isinstance(ran, str) and ran != fmt else fmt


def plot_memory(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
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
    amp = df[(df["format"] == "amp") & ~df["step_in_backward"]]
    if len(amp):
        ax.axhline(float(amp["peak_bytes_per_param"].iloc[0]), color="C3", ls=":", lw=1,
                   label="AMP measured peak (the real baseline)")
    ax.set_xticks(x, [_ran(df, f) for f in formats], rotation=20)
    ax.set_ylabel("peak memory (bytes per parameter)")
    params = int(df["params"].iloc[0])
    ax.set_title(f"Peak tensor memory of {df['steps'].iloc[0]} training steps, {params / 1e6:.1f}M params")
    ax.legend(fontsize=8)
    return _noted(fig, note, scale)


def plot_timeline(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Fig 2's panels: live tensor memory over the steps, stacked by category, one panel per
    (format, step in backward) block of :func:`step_timeline`; forward / backward / step shaded."""
    blocks = list(dict.fromkeys(zip(df["format"], df["step_in_backward"], strict=True)))
    fig, axes = plt.subplots(1, len(blocks), figsize=(6.5 * len(blocks), 3.8), squeeze=False, sharey=True)
    shades = {"forward": "#f2f2f2", "backward": "#e4ecf7", "step": "#f7e8e4", "end": "white"}
    for ax, (fmt, sib) in zip(axes[0], blocks, strict=True):
        sub = df[(df["format"] == fmt) & (df["step_in_backward"] == sib)].reset_index(drop=True)
        x = np.arange(len(sub))
        ax.stackplot(x, *[sub[c] / 2**20 for c, _ in _CATEGORIES], labels=[lab for _, lab in _CATEGORIES],
                     colors=["#4c72b0", "#dd8452", "#55a868", "#c44e52"], alpha=0.85)
        change = np.flatnonzero(sub["phase"].ne(sub["phase"].shift()).to_numpy())
        for start, stop in zip(change, list(change[1:]) + [len(sub)], strict=True):
            phase = sub["phase"].iloc[start]
            ax.axvspan(start, stop, color=shades.get(phase, "white"), zorder=-1, lw=0)
            if stop - start > len(sub) / 40:
                ax.text((start + stop) / 2, 0, f"{phase[0]}{sub['step'].iloc[start]}", ha="center",
                        va="bottom", fontsize=7, color="#333")
        peak = int(sub["total"].idxmax())
        ax.plot([peak], [sub["total"].iloc[peak] / 2**20], "kv", ms=6)
        ax.set_title(f"{_ran(sub, fmt)}{', step in backward' if sib else ''}: peak in {sub['phase'].iloc[peak]} "
                     f"{sub['step'].iloc[peak]}", fontsize=9)
        ax.set_xlabel("allocation / free event (f = forward, b = backward, s = optimizer step)")
        ax.set_ylabel("live tensor memory (MiB)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    return _noted(fig, note, scale)


def plot_throughput(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Fig 3: update throughput as % of the measured in-place update bandwidth, per method."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    pct = 100 * df["bandwidth_fraction"]
    ax.barh(df["method"], pct, color=["grey"] + ["C0"] * (len(df) - 1))
    for y, (p, r) in enumerate(zip(pct, df["ratio_vs_torch_fused"], strict=True)):
        ax.text(p, y, f" {p:.0f}%  ({r:.2f}x torch steps/s)", va="center", fontsize=8)
    ax.set_xlabel("bytes moved per second (% of measured in-place update bandwidth)")
    ax.set_title(f"AdamW step, {df['numel'].iloc[0] / 1e6:.1f}M params on {df['device'].iloc[0]}")
    ax.set_xlim(0, max(100.0, float(pct.max()) * 1.4))
    return _noted(fig, note, scale)


def plot_accuracy(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Table 3 / Fig 4: test accuracy by format, one panel per regime; bar = mean over seeds,
    whisker = lowest to highest seed."""
    regimes = list(dict.fromkeys(df["regime"]))
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.8 * len(regimes), 3.6), squeeze=False)
    for ax, regime in zip(axes[0], regimes, strict=True):
        sub = df[df["regime"] == regime]
        g = (100 * sub.set_index("format")["test_acc"]).groupby(level=0, sort=False)
        mean, lo, hi = g.mean(), g.min(), g.max()
        ax.bar(mean.index, mean, color="C2", yerr=[mean - lo, hi - mean], capsize=3)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{regime} (lr={sub['lr'].iloc[0]:g}, {sub['seed'].nunique()} seeds)", fontsize=9)
        ax.tick_params(axis="x", rotation=45)
        ax.set_ylim(0, 100)
    return _noted(fig, note, scale)


def plot_addition_error(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
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
    return _noted(fig, note, scale)


def plot_fused_backward(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Table 2: peak tensor memory (phase of the peak, and the ordinary run's saving ceiling: its gradient
    bytes at the peak) and step time with and without the step in backward; time whiskers = paired
    per-round extremes of the ratio, applied to the median. An empty ``df`` (transformers absent, so Table 2's
    T5 was not built) gives a figure that says so; a peer that could not run (``available`` False) is named with
    its reason under the title."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    if df.empty:
        for ax in axes:
            ax.axis("off")
        fig.text(0.5, 0.5, "Table 2 not run: its T5 needs transformers (pip install transformers)", ha="center")
        return _noted(fig, note, scale)
    ran = df["available"] if "available" in df else pd.Series(True, index=df.index)
    missing = df[~ran].drop_duplicates("format")
    df = df[ran].reset_index(drop=True)
    labels = [f"{f.split(' (')[0]}\n{'in backward' if s else 'ordinary'}"  # a peer's name without its format
              for f, s in zip(df["format"], df["step_in_backward"], strict=True)]
    axes[0].bar(labels, df["peak_bytes"] / 2**20, color="C1")
    for i, (mib, phase) in enumerate(zip(df["peak_bytes"] / 2**20, df["peak_phase"], strict=True)):
        axes[0].text(i, mib, f"peak in {phase}", ha="center", va="bottom", fontsize=8)
    axes[0].set_ylabel("peak tensor memory (MiB)")
    if "ceiling" in df:
        axes[0].set_title(f"saving ceiling (gradients at the ordinary peak): {df['ceiling'].iloc[0]:.1%}",
                          fontsize=9)
    base = df["step_s"] / df["time_ratio"]
    lo, hi = base * df["time_ratio_lo"], base * df["time_ratio_hi"]
    axes[1].bar(labels, df["step_s"] * 1e3, color="C4",
                yerr=[(df["step_s"] - lo).clip(lower=0) * 1e3, (hi - df["step_s"]).clip(lower=0) * 1e3], capsize=3)
    axes[1].set_ylabel("time per training step (ms, median)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    model = df["model"].iloc[0] if "model" in df else "transformer"
    gaps = "; ".join(f"{f}: {n}" for f, n in zip(missing["format"], missing["note"], strict=True))
    fig.suptitle(f"{model}: {df['params'].iloc[0] / 1e6:.1f}M params, {int(df['tokens'].iloc[0])} tokens per batch"
                 + (f"\nnot run: {gaps}" if gaps else ""), fontsize=10)
    return _noted(fig, note, scale)


def plot_peers(df: pd.DataFrame, *, note: str = "", scale: str = "") -> Figure:
    """Side by side: bytes per parameter by kind, optimizer-step speed vs torch fp32 (median,
    whiskers = paired per-round extremes) and test accuracy over seeds (mean, lowest..highest).
    Methods that could not run are listed with their reason."""
    ok = df[df["available"]].reset_index(drop=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.45 * max(len(ok), 4) + 1.6), sharey=True)
    y = np.arange(len(ok))
    left = np.zeros(len(ok))
    for col, label, color in (("weight_bytes_per_param", "weights", "#4c72b0"),
                              ("grad_bytes_per_param", "gradients", "#55a868"),
                              ("state_bytes_per_param", "optimizer state", "#dd8452")):
        axes[0].barh(y, ok[col], left=left, color=color, label=label)
        left += ok[col].to_numpy()
    axes[0].set_xlabel("bytes per parameter held between steps")
    axes[0].legend(fontsize=7)
    if "speed_vs_torch_fp32" in ok:
        s = ok["speed_vs_torch_fp32"]
        axes[1].barh(y, s, color="C4", xerr=[(s - ok["speed_vs_torch_fp32_lo"]).clip(lower=0),
                                             (ok["speed_vs_torch_fp32_hi"] - s).clip(lower=0)], capsize=2)
        axes[1].axvline(1.0, color="k", lw=0.8, ls=":")
        axes[1].set_xscale("log")
    axes[1].set_xlabel("optimizer-step speed vs torch fp32 AdamW (x, log)")
    if "acc_mean" in ok:
        a = ok["acc_mean"]
        axes[2].barh(y, a, color="C2", xerr=[a - ok["acc_min"], ok["acc_max"] - a], capsize=2)
    axes[2].set_xlabel(f"test accuracy (%), lr {df['lr'].iloc[0]:g}, {df['epochs'].iloc[0]} epochs")
    axes[0].set_yticks(y, ok["method"], fontsize=8)
    axes[0].invert_yaxis()
    missing = df[~df["available"]]
    gaps = "; ".join(f"{m}: {n}" for m, n in zip(missing["method"], missing["note"], strict=True))
    fig.suptitle("AdamW side by side, same model and data" + (f"\nnot run: {gaps}" if gaps else ""), fontsize=9)
    return _noted(fig, note, scale)
