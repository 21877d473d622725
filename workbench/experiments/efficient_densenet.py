"""Experiments for the memory-efficient DenseNet notebook (Pleiss et al. 2017, paper 001).

Each function measures on the chosen device and returns a pandas DataFrame; the plot functions
are pure (`plot_x(df) -> Figure`). What is reproduced:

- Fig 4 / Section 5: peak training memory against depth for the naive, checkpointed and
  shared-storage DenseNet-BC (k=12), with the growth exponent of feature-map memory fitted in
  log-log space (`memory_vs_depth`, `fit_growth_exponents`).
- Section 5, "Under the same memory budget": the deepest model each form fits in a budget
  (`deepest_within_budget`, computed from the measured sweep, never extrapolated).
- Fig 5: time per minibatch of the 100-layer DenseNet-BC per form, as paired ratios to the naive
  form measured in interleaved rounds of one run (`time_per_minibatch`).
- Fig 2 right: 3x3 convolution on contiguous vs non-contiguous (strided) input
  (`conv_contiguity`).

Memory is `workbench.measure.MemoryMeter` around one forward + backward with the gradient
buffers allocated beforehand, so `activation_peak_bytes` is feature maps plus workspace
(including the shared storages and transient gradients); parameters and their gradients are
added analytically in `total_bytes`.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.devices import pick_device
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models.densenet import FORMS, densenet_bc

__all__ = [
    "step_memory", "memory_vs_depth", "fit_growth_exponents", "deepest_within_budget",
    "time_per_minibatch", "conv_contiguity", "plot_memory_vs_depth", "plot_budget",
    "plot_time_per_minibatch", "plot_conv_contiguity",
]

_MIB = 2**20


def _forms(forms) -> tuple[str, ...]:
    forms = tuple(forms)
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise ValueError(f"forms={forms!r}; allowed: non-empty subset of {FORMS}")
    return forms


def _batch(batch_size: int, image_size: int, device: torch.device, seed: int):
    if batch_size < 1 or image_size < 4:
        raise ValueError(f"batch_size={batch_size} (>= 1), image_size={image_size} (>= 4)")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    return x.to(device), y.to(device)


def step_memory(depth: int, form: str, *, growth_rate: int = 12, batch_size: int = 2,
                image_size: int = 32, device: torch.device | str | None = None,
                seed: int = 0) -> dict:
    """Peak memory of one training step (forward + backward) of ``densenet_bc(depth)``.

    Gradient buffers exist before the step (as in every step after the first), so the peak is
    feature maps plus workspace; ``total_bytes`` adds parameters and gradients. A CUDA
    out-of-memory error is recorded (``oom`` True, NaN bytes), as in the paper's Fig 4 where
    the naive curve stops.
    """
    device = pick_device(str(device) if device is not None else None)
    torch.manual_seed(seed)
    model = densenet_bc(depth, growth_rate, 10, memory=form).to(device).train()
    x, y = _batch(batch_size, image_size, device, seed)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    peak, oom = math.nan, False
    try:
        if device.type == "cuda":  # cuDNN autotuning and lazy initialisation outside the region
            F.cross_entropy(model(x), y).backward()
        with MemoryMeter(device) as meter:
            F.cross_entropy(model(x), y).backward()
        peak = float(meter.peak_bytes)
    except torch.OutOfMemoryError:
        oom = True
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if oom:
        torch.cuda.empty_cache()
    return {"depth": depth, "form": form, "params": params, "activation_peak_bytes": peak,
            "param_bytes": param_bytes, "total_bytes": peak + 2 * param_bytes, "oom": oom,
            "growth_rate": growth_rate, "batch_size": batch_size, "image_size": image_size,
            "device": str(device)}


def memory_vs_depth(depths, *, forms=FORMS, growth_rate: int = 12, batch_size: int = 2,
                    image_size: int = 32, device: torch.device | str | None = None,
                    seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """`step_memory` for every (depth, form): the data of the paper's Fig 4.

    Once a form runs out of memory, its deeper models are recorded as out of memory unrun.
    """
    forms, depths = _forms(forms), sorted(int(d) for d in depths)
    rows, failed = [], set()
    for d, f in tqdm(list(itertools.product(depths, forms)), desc="memory vs depth",
                     disable=not progress):
        if f in failed:
            rows.append({**rows[-len(forms)], "depth": d, "params": math.nan})
            continue
        rows.append(step_memory(d, f, growth_rate=growth_rate, batch_size=batch_size,
                                image_size=image_size, device=device, seed=seed))
        if rows[-1]["oom"]:
            failed.add(f)
    return pd.DataFrame(rows)


def fit_growth_exponents(df: pd.DataFrame, *,
                         value: str = "activation_peak_bytes") -> pd.DataFrame:
    """Exponent b of ``memory ~ a * depth**b`` per form (least squares in log-log space).

    ``local_exponent`` uses only the two deepest points, where the leading term dominates;
    1 means linear growth, 2 quadratic. NaN for a form with fewer than two measured depths.
    """
    rows = []
    for form, g in df.groupby("form", sort=False):
        g = g.dropna(subset=[value]).sort_values("depth")  # out-of-memory rows are NaN
        if len(g) < 2:
            slope = local = math.nan
        else:
            logd, logv = np.log(g["depth"].to_numpy(float)), np.log(g[value].to_numpy(float))
            slope = float(np.polyfit(logd, logv, 1)[0])
            local = float((logv[-1] - logv[-2]) / (logd[-1] - logd[-2]))
        rows.append({"form": form, "exponent": slope, "local_exponent": local,
                     "depth_min": g["depth"].min() if len(g) else math.nan,
                     "depth_max": g["depth"].max() if len(g) else math.nan,
                     "points": len(g), "value": value})
    return pd.DataFrame(rows)


def deepest_within_budget(df: pd.DataFrame, budget_bytes: float, *,
                          value: str = "activation_peak_bytes") -> pd.DataFrame:
    """Deepest measured depth per form whose memory fits `budget_bytes`.

    Only measured depths count. ``limited_by_sweep`` is True when the deepest depth measured
    still fits, so the true deepest model is at least that deep. ``depth_ratio`` is relative to
    the naive form's deepest depth when naive is in `df`.
    """
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes={budget_bytes}; must be > 0")
    rows = []
    for form, g in df.groupby("form", sort=False):
        fits = g[g[value] <= budget_bytes]
        best = fits.loc[fits["depth"].idxmax()] if len(fits) else None
        rows.append({
            "form": form, "budget_bytes": float(budget_bytes),
            "deepest_depth": int(best["depth"]) if best is not None else math.nan,
            "bytes_at_deepest": float(best[value]) if best is not None else math.nan,
            "params_at_deepest": int(best["params"]) if best is not None else math.nan,
            "limited_by_sweep": bool(best is not None and best["depth"] == g["depth"].max()),
        })
    out = pd.DataFrame(rows)
    naive = out.loc[out["form"] == "naive", "deepest_depth"]
    out["depth_ratio"] = out["deepest_depth"] / float(naive.iloc[0]) if len(naive) else math.nan
    return out


def time_per_minibatch(depth: int = 100, *, forms=FORMS, growth_rate: int = 12,
                       batch_size: int = 64, image_size: int = 32, rounds: int = 5,
                       warmup: int = 1, device: torch.device | str | None = None,
                       seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Seconds per training step (forward + backward) per form, paper Fig 5.

    One model per form with identical weights; the forms are timed in interleaved rounds
    (order rotated each round) so drift and other load hit all of them alike.
    ``ratio_to_naive`` is the median over rounds of time(form) / time(naive) in that round;
    ``ratio_to_checkpoint`` likewise.
    """
    forms = _forms(forms)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} (>= 1), warmup={warmup} (>= 0)")
    device = pick_device(str(device) if device is not None else None)
    torch.manual_seed(seed)
    model = densenet_bc(depth, growth_rate, 10).to(device).train()
    x, y = _batch(batch_size, image_size, device, seed)

    def make_step(form):
        m = densenet_bc(depth, growth_rate, 10, memory=form).to(device).train()
        m.load_state_dict(model.state_dict())

        def step():
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
        return step

    # warmup + 1: the first timed call of each form was discarded before as well
    times = time_interleaved({f: make_step(f) for f in forms}, warmup=warmup + 1, repeats=rounds,
                             device=device, rotate=True, progress=progress, desc="time per minibatch")
    def paired(t: np.ndarray, ref: str) -> float:
        return float(np.median(t / np.asarray(times[ref]))) if ref in times else math.nan

    rows = []
    for f in forms:
        t = np.asarray(times[f])
        rows.append({"form": f, "median_s": float(np.median(t)), "min_s": float(t.min()),
                     "max_s": float(t.max()), "ratio_to_naive": paired(t, "naive"),
                     "ratio_to_checkpoint": paired(t, "checkpoint"), "depth": depth,
                     "growth_rate": growth_rate, "batch_size": batch_size,
                     "image_size": image_size, "rounds": rounds, "device": str(device)})
    return pd.DataFrame(rows)


def conv_contiguity(channels=(48, 96, 192, 384), *, out_channels: int = 12,
                    batch_size: int = 64, image_size: int = 32, repeats: int = 5,
                    device: torch.device | str | None = None, seed: int = 0,
                    progress: bool = True) -> pd.DataFrame:
    """3x3 convolution time on a contiguous input vs the same values as a strided view.

    The non-contiguous input is a channel slice of a buffer twice as wide (batch stride
    larger than the tensor), the layout a layer reading from a wider feature store sees.
    Timed interleaved; ``ratio_to_contiguous`` is the median paired ratio (paper Fig 2 right).
    """
    device = pick_device(str(device) if device is not None else None)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in tqdm(list(channels), desc="conv contiguity", disable=not progress):
        if c < 1:
            raise ValueError(f"channels must be >= 1, got {c}")
        wide = torch.randn(batch_size, 2 * c, image_size, image_size, generator=g).to(device)
        inputs = {"contiguous": wide[:, :c].contiguous(), "non-contiguous": wide[:, :c]}
        weight = torch.randn(out_channels, c, 3, 3, generator=g).to(device)
        calls = {k: functools.partial(F.conv2d, v, weight, padding=1) for k, v in inputs.items()}
        with torch.no_grad():
            times = time_interleaved(calls, warmup=2, repeats=repeats, device=device)
        base = np.asarray(times["contiguous"])
        for k, t in times.items():
            t = np.asarray(t)
            rows.append({"in_channels": c, "layout": k, "median_s": float(np.median(t)),
                         "ratio_to_contiguous": float(np.median(t / base)),
                         "out_channels": out_channels, "batch_size": batch_size,
                         "image_size": image_size, "device": str(device)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Plots (pure: a DataFrame in, a Figure out)


def plot_memory_vs_depth(df: pd.DataFrame, fits: pd.DataFrame | None = None, *,
                         value: str = "activation_peak_bytes"):
    """Peak memory (MiB) against depth per form, linear axes and log-log with fitted exponents."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    exps = {} if fits is None else {
        r.form: f" (exponent {r.exponent:.2f}, deepest pair {r.local_exponent:.2f})"
        for r in fits.itertuples()}
    for form, g in df.groupby("form", sort=False):
        g = g.sort_values("depth")
        label = form + exps.get(form, "")
        for ax in axes:
            ax.plot(g["depth"], g[value] / _MIB, marker="o", label=label)
    first = df.iloc[0]
    axes[0].set_title(f"DenseNet-BC k={first['growth_rate']}, batch {first['batch_size']}, "
                      f"{first['image_size']}px, {first['device']}")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    ticks: list[int] = []
    for t in sorted(int(d) for d in df["depth"].unique()):
        if not ticks or t >= 1.4 * ticks[-1]:  # readable labels on a log axis
            ticks.append(t)
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xticks(ticks, [str(t) for t in ticks])
    axes[1].set_title("log-log: slope = growth exponent")
    for ax in axes:
        ax.set_xlabel("depth (layers)")
        ax.set_ylabel(f"peak {value.replace('_bytes', '').replace('_', ' ')} (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_budget(budget_df: pd.DataFrame):
    """Deepest measured depth per form within the memory budget."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    depths = budget_df["deepest_depth"].fillna(0)
    bars = ax.bar(budget_df["form"], depths, color=["C0", "C1", "C2"][: len(budget_df)])
    for bar, lim in zip(bars, budget_df["limited_by_sweep"], strict=True):
        ax.annotate(f"{int(bar.get_height())}" + ("+" if lim else ""),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.set_ylabel("deepest depth that fits (layers)")
    ax.set_xlabel("implementation")
    ax.set_title(f"budget {budget_df['budget_bytes'].iloc[0] / _MIB:.1f} MiB ('+': sweep limit)")
    fig.tight_layout()
    return fig


def plot_time_per_minibatch(df: pd.DataFrame):
    """Median seconds per training step per form, min-max bars, ratio to naive on top."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    err = np.vstack([df["median_s"] - df["min_s"], df["max_s"] - df["median_s"]])
    bars = ax.bar(df["form"], df["median_s"], yerr=err, capsize=4,
                  color=["C0", "C1", "C2"][: len(df)])
    for bar, ratio in zip(bars, df["ratio_to_naive"], strict=True):
        ax.annotate(f"{ratio:.2f}x naive", (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                    ha="center", va="center", color="white", fontweight="bold")
    r = df.iloc[0]
    ax.set_title(f"DenseNet-BC-{r['depth']} k={r['growth_rate']}, batch {r['batch_size']}, "
                 f"{r['device']}")
    ax.set_ylabel("time per minibatch (s)")
    ax.set_xlabel("implementation")
    fig.tight_layout()
    return fig


def plot_conv_contiguity(df: pd.DataFrame):
    """3x3 convolution time (ms) against input channels, contiguous vs strided input."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for layout, g in df.groupby("layout", sort=False):
        ax.plot(g["in_channels"], g["median_s"] * 1e3, marker="o", label=layout)
    r = df.iloc[0]
    ax.set_title(f"3x3 conv, {r['image_size']}x{r['image_size']}, batch {r['batch_size']}, "
                 f"{r['device']}")
    ax.set_xlabel("input channels")
    ax.set_ylabel("time per convolution (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
