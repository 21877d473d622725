"""Memory experiments of the efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten,
Weinberger, "Memory-Efficient Implementation of DenseNets" (2017).

Fig 4 (memory against depth per variant, Sections 3-5) with the growth exponent fitted per
variant, and the parity of every variant with the naive form (the variants are one model).
Section 5's budgets and the parameter counts are in `budget`.

Memory is `workbench.measure.MemoryMeter` around one forward + backward with the gradient
buffers allocated beforehand, so `activation_peak_bytes` is feature maps plus workspace
(including the shared storages and transient gradients); parameters and their gradients are
added analytically in `total_bytes`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.devices import pick_device
from workbench.measure import MemoryMeter
from workbench.models import DenseNet, densenet_bc

__all__ = ["VARIANTS", "LABELS", "parity", "step_memory", "memory_vs_depth", "fit_growth_exponents", "memory_table"]

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


def memory_table(df: pd.DataFrame, *, value: str = "activation_peak_bytes",
                 baseline: str = "luatorch") -> pd.DataFrame:
    """The sweep as a table: MiB per (depth, form), and each other form's ratio to `baseline`."""
    table = df.pivot(index="depth", columns="form", values=value) / _MIB
    if baseline in table:
        for form in table.columns.drop(baseline):
            table[f"{form} / {baseline}"] = table[form] / table[baseline]
    return table
