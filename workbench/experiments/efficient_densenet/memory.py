"""Memory experiments of the efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten,
Weinberger, "Memory-Efficient Implementation of DenseNets" (2017).

Fig 4 (memory against depth per variant), Section 5's budgets (measured, and extrapolated per
sample to the paper's batch and GPU), the parameter counts of Sections 1 and 5, and the parity
of every variant with the naive form.

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
from workbench.measure import MemoryMeter
from workbench.models.densenet import DenseNet, densenet_bc

__all__ = [
    "VARIANTS", "LABELS", "parity", "step_memory", "memory_vs_depth", "fit_growth_exponents",
    "deepest_within_budget", "parameter_counts", "cifar_bc_params", "extrapolate_to_budget",
]

_MIB = 2**20
# name -> (DenseNet memory form, shared_buffer policy)
VARIANTS = {
    "luatorch": ("luatorch", "per_block"),
    "naive": ("naive", "per_block"),
    "checkpoint": ("checkpoint", "per_block"),
    "shared": ("shared", "per_block"),
    "shared_max": ("shared", "max"),
}
LABELS = {
    "luatorch": "naive, LuaTorch-style (the paper's baseline)",
    "naive": "naive, PyTorch (the paper's 'shared gradient')",
    "checkpoint": "checkpoint (torch.utils.checkpoint)",
    "shared": "shared storage, resized per block",
    "shared_max": "shared storage, one max-size buffer (the paper's)",
}


def _forms(forms) -> tuple[str, ...]:
    forms = (forms,) if isinstance(forms, str) else tuple(forms)
    bad = [f for f in forms if f not in VARIANTS]
    if bad or not forms:
        raise ValueError(f"forms={forms!r}; allowed: non-empty subset of {tuple(VARIANTS)}")
    return forms


def _model(depth: int, form: str, growth_rate: int, **kwargs) -> DenseNet:
    memory, buffer = VARIANTS[_forms(form)[0]]
    return densenet_bc(depth, growth_rate, 10, memory=memory, shared_buffer=buffer, **kwargs)


def _batch(batch_size: int, image_size: int, device: torch.device, seed: int):
    if batch_size < 1 or image_size < 4:
        raise ValueError(f"batch_size={batch_size} (>= 1), image_size={image_size} (>= 4)")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    return x.to(device), y.to(device)


def parity(depth: int = 16, *, growth_rate: int = 12, batch_size: int = 4, image_size: int = 16,
           seed: int = 0) -> pd.DataFrame:
    """One training step of every variant from the same weights on CPU, against the naive form:
    largest output difference, largest gradient difference relative to the largest naive
    gradient, and the BN step counter (1 if the recomputation did not advance it again)."""
    torch.manual_seed(seed)
    state = densenet_bc(depth, growth_rate, 10).state_dict()
    x, _ = _batch(batch_size, image_size, torch.device("cpu"), seed)
    rows, ref = [], None
    for form in ("naive", *(f for f in VARIANTS if f != "naive")):
        model = _model(depth, form, growth_rate)
        model.load_state_dict(state)
        out = model(x)
        out.square().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        ref = ref or (out.detach(), grads)
        rows.append({"form": form, "max_abs_output_diff": (out.detach() - ref[0]).abs().max().item(),
                     "max_rel_grad_diff": ((grads - ref[1]).abs().max() / ref[1].abs().max()).item(),
                     "num_batches_tracked": int(model.blocks[0].layers[0].norm1.num_batches_tracked),
                     "depth": depth, "growth_rate": growth_rate, "batch_size": batch_size})
    return pd.DataFrame(rows)


def step_memory(depth: int, form: str, *, growth_rate: int = 12, batch_size: int = 2,
                image_size: int = 32, device: torch.device | str | None = None,
                seed: int = 0) -> dict:
    """Peak memory of one training step (forward + backward) of ``densenet_bc(depth)``.

    `form` is a key of `VARIANTS`. Gradient buffers exist before the step (as in every step
    after the first), so the peak is feature maps plus workspace; ``total_bytes`` adds
    parameters and gradients. A CUDA out-of-memory error is recorded (``oom`` True, NaN bytes),
    as in the paper's Fig 4 where the naive curve stops.
    """
    device = pick_device(str(device) if device is not None else None)
    torch.manual_seed(seed)
    model = _model(depth, form, growth_rate).to(device).train()
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


def memory_vs_depth(depths, *, forms=tuple(VARIANTS), growth_rate: int = 12,
                    batch_size: int = 2, image_size: int = 32,
                    device: torch.device | str | None = None, seed: int = 0,
                    progress: bool = True) -> pd.DataFrame:
    """`step_memory` for every (depth, form): the data of the paper's Fig 4.

    Once a form runs out of memory, its deeper models are recorded as out of memory unrun.
    """
    forms, depths = _forms(forms), sorted(int(d) for d in depths)
    rows, failed = [], {}
    for d, f in tqdm(list(itertools.product(depths, forms)), desc="memory vs depth",
                     disable=not progress):
        if f in failed:
            rows.append({**failed[f], "depth": d, "params": math.nan})
            continue
        rows.append(step_memory(d, f, growth_rate=growth_rate, batch_size=batch_size,
                                image_size=image_size, device=device, seed=seed))
        if rows[-1]["oom"]:
            failed[f] = rows[-1]
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


def extrapolate_to_budget(df: pd.DataFrame, budget_bytes: float, *, batch_size: int = 64,
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
