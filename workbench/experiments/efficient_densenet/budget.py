"""Section 5 of the efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten, Weinberger,
"Memory-Efficient Implementation of DenseNets" (2017).

"Under the same memory budget": the deepest model each variant fits in a budget, read off the
measured sweep (`memory_budget`, `deepest_within_budget`), and at the paper's scale (batch 64,
a 12 GB GPU) extrapolated per sample from the sweep (`extrapolate_to_budget`); the parameter
counts the paper quotes in Sections 1 and 5 (`parameter_counts` of `PAPER_MODELS`, and
`cifar_bc_params` by arithmetic for the thousands of depths the extrapolation searches).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import torch

from workbench.models import densenet_bc

from .memory import _forms

__all__ = [
    "PAPER_BUDGET_BYTES", "PAPER_BATCH_SIZE", "PAPER_MODELS", "STEP_BYTES", "with_state", "memory_budget",
    "deepest_within_budget",
    "cifar_bc_params", "parameter_counts", "extrapolate_to_budget",
]

# The paper's GPU budget (Section 5: "the same memory budget (12 GB)") and a typical DenseNet CIFAR
# batch. NOTE: 12 GB is read as 12 GiB (a Maxwell Titan-X holds 12,288 MiB).
PAPER_BUDGET_BYTES = 12 * 2**30
PAPER_BATCH_SIZE = 64
# (depth, growth rate, classes, ImageNet stem) of every model whose parameters the paper states.
# NOTE: footnote 10 gives the 264- and 232-layer models blocks (6, 32, 64, 48) and (6, 32, 48, 48),
# which would have 305 and 273 layers; the standard (6, 12, 64, 48) and (6, 12, 48, 48) match both
# the names and the stated 33M, 73M and 55M parameters, so `densenet_bc` builds those.
# 136 = 340 / 2.5: the best naive model of Section 5's budget sentence ("2.5x as deep").
PAPER_MODELS = ((40, 12, 10, False), (136, 12, 10, False), (160, 12, 10, False), (340, 12, 10, False),
                (161, 48, 1000, True), (201, 32, 1000, True), (232, 48, 1000, True), (264, 32, 1000, True),
                (264, 48, 1000, True))


STEP_BYTES = "step_bytes"  # the column `with_state` adds: a whole training step's bytes at the paper's batch


def with_state(df: pd.DataFrame, *, batch_size: int = PAPER_BATCH_SIZE, state_copies: int = 3) -> pd.DataFrame:
    """`df` (a `memory_vs_depth` sweep) with `STEP_BYTES`: a whole training step at `batch_size`, the paper's
    budget (Section 5: 12 GB holds everything), namely the measured feature maps and workspace per sample x
    `batch_size` + `state_copies` x the parameter bytes (3: weights, gradients, SGD momentum), and
    `step_batch_size`. Per sample as `extrapolate_to_budget` does: at the measured batch the factor is 1."""
    if batch_size < 1 or state_copies < 0:
        raise ValueError(f"batch_size={batch_size} (>= 1), state_copies={state_copies} (>= 0)")
    out = df.copy()
    out[STEP_BYTES] = (out["activation_peak_bytes"] / out["batch_size"] * batch_size
                       + state_copies * out["param_bytes"])
    out["step_batch_size"], out["state_copies"] = batch_size, state_copies
    return out


def memory_budget(df: pd.DataFrame, budget_depth: int, *, baseline: str = "luatorch",
                  value: str = "activation_peak_bytes") -> pd.DataFrame:
    """`deepest_within_budget` with the budget set to the `baseline` form's measured peak at
    `budget_depth` (a column of the result); an empty frame when that point is not in the sweep.
    `value` (also a column of the result) is the bytes compared: `STEP_BYTES` of `with_state` for the
    paper's budget, parameters included."""
    at = df[(df["form"] == baseline) & (df["depth"] == budget_depth)][value].dropna()
    if at.empty:
        return pd.DataFrame()
    out = deepest_within_budget(df, float(at.iloc[0]), value=value, baseline=baseline)
    out["budget_depth"], out["value"] = int(budget_depth), value
    if value == STEP_BYTES:
        out["step_batch_size"] = int(df["step_batch_size"].iloc[0])
    out["depth_max"] = int(df["depth"].max())
    for column in ("growth_rate", "batch_size", "image_size"):  # the sweep's scale, for the figure
        out[column] = int(df[column].iloc[0]) if column in df else None
    return out


def deepest_within_budget(df: pd.DataFrame, budget_bytes: float, *,
                          value: str = "activation_peak_bytes",
                          baseline: str = "naive") -> pd.DataFrame:
    """Deepest measured depth per form whose memory fits `budget_bytes`.

    Only measured depths count. ``limited_by_sweep`` is True when the deepest depth measured
    still fits, so the true deepest model is at least that deep. ``depth_ratio`` is relative to
    the `baseline` form's deepest depth when that form is in `df`.
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
    base = out.loc[out["form"] == baseline, "deepest_depth"]
    out["depth_ratio"] = out["deepest_depth"] / float(base.iloc[0]) if len(base) else math.nan
    out["baseline"] = baseline
    return out


@functools.lru_cache(maxsize=512)
def _meta_model(depth: int, growth_rate: int, num_classes: int,
                imagenet: bool | None) -> tuple[int, bool, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = densenet_bc(depth, growth_rate, num_classes, imagenet=imagenet)
    return sum(p.numel() for p in model.parameters()), model.small_inputs, model.block_config


def cifar_bc_params(depth: int, growth_rate: int, num_classes: int = 10) -> int:
    """Parameters of ``densenet_bc(depth, growth_rate, num_classes)`` (CIFAR, 6n+4 layers) by
    arithmetic: the extrapolation searches depths of thousands of layers, too many to build.
    (A test checks it against built models.)"""
    n, k = (depth - 4) // 6, growth_rate
    channels = 2 * k
    total = 3 * channels * 9  # stem: 3x3 convolution, no bias
    for block in range(3):
        for j in range(n):  # BN (2c), 1x1 conv to 4k, BN (2 * 4k), 3x3 conv to k
            c = channels + j * k
            total += 2 * c + c * 4 * k + 2 * 4 * k + 4 * k * k * 9
        channels += n * k
        if block < 2:  # transition: BN, 1x1 conv halving the channels
            total += 2 * channels + channels * (channels // 2)
            channels //= 2
    return total + 2 * channels + channels * num_classes + num_classes


def parameter_counts(models) -> pd.DataFrame:
    """Parameters of each ``(depth, growth_rate, num_classes, imagenet)`` DenseNet-BC in `models`
    (``imagenet`` True, False or None as in `densenet_bc`), counted on the meta device."""
    rows = []
    for depth, growth_rate, num_classes, imagenet in models:
        params, small, blocks = _meta_model(depth, growth_rate, num_classes, imagenet)
        rows.append({"depth": depth, "growth_rate": growth_rate, "num_classes": num_classes,
                     "network": "CIFAR" if small else "ImageNet", "block_config": list(blocks),
                     "params": params})
    return pd.DataFrame(rows)


def extrapolate_to_budget(df: pd.DataFrame, budget_bytes: float = PAPER_BUDGET_BYTES, *,
                          batch_size: int = PAPER_BATCH_SIZE,
                          forms=None, state_copies: int = 3, bytes_per_param: int = 4,
                          max_depth: int = 2002) -> pd.DataFrame:
    """Deepest CIFAR DenseNet-BC per form whose training step is predicted to fit `budget_bytes`
    at `batch_size`, extrapolated per sample from the measured sweep `df`.

    Prediction: ``batch_size * per_sample(depth) + state_copies * bytes_per_param * params(depth)``,
    where ``per_sample`` is a least-squares fit ``a + b*d + c*d**2`` (c >= 0; linear if the
    quadratic fit bends down) of activation peak / measured batch size, and the parameter count
    is exact (`cifar_bc_params`). ``state_copies`` 3 = weights, gradients and SGD momentum. The CPU
    meter sees tensors only: no CUDA context, cuDNN workspace or allocator fragmentation, so the
    prediction is a lower bound on GPU memory. ``capped`` marks a form that still fits at
    `max_depth` (the search limit).
    """
    if not budget_bytes > 0 or batch_size < 1 or state_copies < 0 or max_depth < 10:
        raise ValueError(f"budget_bytes={budget_bytes} (> 0), batch_size={batch_size} (>= 1), "
                         f"state_copies={state_copies} (>= 0), max_depth={max_depth} (>= 10)")
    forms = _forms(forms if forms is not None else df["form"].unique())
    rows = []
    for form in forms:
        g = df[(df["form"] == form)].dropna(subset=["activation_peak_bytes"])
        if g["depth"].nunique() < 3:
            rows.append({"form": form, "deepest_depth": math.nan, "params": math.nan})
            continue
        k = int(g["growth_rate"].iloc[0])
        d = g["depth"].to_numpy(float)
        per_sample = (g["activation_peak_bytes"] / g["batch_size"]).to_numpy(float)
        coef = np.polyfit(d, per_sample, 2)
        if coef[0] < 0:
            coef = np.concatenate([[0.0], np.polyfit(d, per_sample, 1)])

        def predict(depth: int, coef=coef, k=k) -> float:
            return (batch_size * float(np.polyval(coef, depth))
                    + state_copies * bytes_per_param * cifar_bc_params(depth, k))

        # depth = 6n + 4 and predict() increases with n: binary search on n
        lo, hi = 0, (max_depth - 4) // 6
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if predict(6 * mid + 4) <= budget_bytes else (lo, mid - 1)
        depth = 6 * lo + 4 if lo >= 1 else math.nan
        rows.append({
            "form": form, "deepest_depth": depth,
            "params": cifar_bc_params(depth, k) if lo >= 1 else math.nan,
            "predicted_bytes": predict(depth) if lo >= 1 else math.nan,
            "capped": lo == (max_depth - 4) // 6, "budget_bytes": float(budget_bytes),
            "batch_size": batch_size, "state_copies": state_copies,
            "fit_c2": float(coef[0]), "fit_c1": float(coef[1]), "fit_c0": float(coef[2]),
            "measured_depth_max": int(d.max()), "measured_batch_size": int(g["batch_size"].iloc[0]),
        })
    return pd.DataFrame(rows)
