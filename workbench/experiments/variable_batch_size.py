"""Experiments of the notebook ``variable_batch_size``: "Variable batch size across layers for
efficient prediction on CNNs" (Choudhury et al.), Sections II and IV.

Each experiment returns a pandas DataFrame; plot functions are pure (`plot_x(df) -> Figure`).

- Fig 1: per-image time against batch size (`time_vs_batch`, from the measured profile).
- Fig 2: memory per layer at batch 1, input + output + workspace (`layer_memory`).
- Figs 7 and 8: per-image time against the memory budget for VBS (the DP), FBS and Greedy-VBS,
  predicted from the profile (`budget_sweep`) and executed on the model (`execute_sweep`).
- Fig 9: the batch sizes the DP picks per layer (`plot_layer_batches`).
- Table II: the largest throughput gain over FBS at tight and loose budgets (`table_ii`);
  Table III: un-utilised memory per layer, FBS against VBS (`unused_memory`).
- Planner speed against layers and memory units (`planner_timing`).

Budgets. The paper restricted working memory to 15-40 MB at 224x224 on edge devices, 15 MB being
"the average memory required to process most of the CNNs with a batch of size one". Here every
network's budgets are multiples of its own *floor*: the smallest budget in which the DP can serve
the request at all (one sample at a time). A budget of `ratio` x floor is shown as the paper's
`15 * ratio` MB, so "tight" (< 30 MB) is below 2x the floor and "loose" (> 35 MB) above 2.33x.
Memory units are `floor / units_at_floor` rounded up to whole KiB (the paper used 2 MB units).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench import vbs
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models import googlenet, mobilenet_v1, resnet50, squeezenet1_0

__all__ = [
    "NETWORKS", "TABLE_II", "PAPER_FLOOR_MB", "build_model", "measure_profiles", "time_vs_batch", "layer_memory",
    "budget_sweep", "execute_sweep", "gains", "table_ii", "unused_memory", "planner_timing", "sweep_plan",
    "plot_time_vs_batch", "plot_layer_memory", "plot_budget_sweep", "plot_request_sizes", "plot_layer_batches",
    "plot_planner_timing", "random_profile",
]

NETWORKS = ("googlenet", "resnet50", "squeezenet1_0", "mobilenet_v1")
LABELS = {"googlenet": "GoogLeNet", "resnet50": "ResNet-50", "squeezenet1_0": "SqueezeNet-v1.0",
          "mobilenet_v1": "MobileNet-v1"}
# Table II of the paper: largest throughput gain (%) with memory < 30 MB and > 35 MB
TABLE_II = {"googlenet": (60.25, 36.55), "resnet50": (38.91, 22.75), "squeezenet1_0": (44.03, 29.50),
            "mobilenet_v1": (5.68, 1.61)}
PAPER_FLOOR_MB, TIGHT_MB, LOOSE_MB = 15.0, 30.0, 35.0
METHODS = ("vbs", "fbs", "greedy")
_MIB = 2**20


def build_model(name: str, *, width: float = 1.0, num_classes: int = 1000) -> nn.Module:
    """One of NETWORKS, ImageNet-shaped (224x224 inputs work; smaller ones too), eval mode."""
    if name == "resnet50":
        return resnet50(num_classes, stem="imagenet", width=max(1, round(64 * width))).eval()
    factories = {"googlenet": googlenet, "mobilenet_v1": mobilenet_v1, "squeezenet1_0": squeezenet1_0}
    if name not in factories:
        raise ValueError(f"network must be one of {NETWORKS}, got {name!r}")
    return factories[name](num_classes, width=width).eval()


def measure_profiles(
    names, *, image_size: int, width: float, max_batch: int, repeats: int = 3, statistic: str = "median",
    device: torch.device | str = "cpu", seed: int = 0, progress: bool = False,
) -> tuple[dict[str, nn.Module], dict[str, vbs.Profile]]:
    """Build each network and measure its per-layer profile (bytes) at batch sizes 1..max_batch."""
    if image_size < 16 or max_batch < 1:
        raise ValueError(f"image_size must be >= 16 and max_batch >= 1, got {image_size}, {max_batch}")
    models, profiles = {}, {}
    for name in tqdm(list(names), desc="profiling networks", disable=not progress):
        seed_everything(seed)
        models[name] = build_model(name, width=width).to(device)
        sample = torch.randn(3, image_size, image_size, device=device)
        profiles[name] = vbs.profile(models[name], sample, max_batch, repeats=repeats,
                                     statistic=statistic, device=device)
    return models, profiles


def time_vs_batch(profiles: dict[str, vbs.Profile]) -> pd.DataFrame:
    """Per-image time of the whole network with every layer at batch b (sum of the profile)."""
    rows = []
    for name, prof in profiles.items():
        t = prof.uniform_time()
        rows += [{"network": name, "batch": b + 1, "time_per_image_s": float(t[b]),
                  "relative_to_batch_1": float(t[b] / t[0])} for b in range(prof.max_batch)]
    return pd.DataFrame(rows)


def layer_memory(profile: vbs.Profile, *, batch: int = 1) -> pd.DataFrame:
    """Memory to process each main-path layer at `batch` (in + out + workspace, bytes); a branch
    group's workspace is its largest branch layer's need beyond the group's input and output."""
    rows = []
    for i, name in enumerate(profile.names):
        step = vbs.baselines.uniform_step(profile, i, batch, 0)
        inp, out = int(profile.inp[i, batch - 1]), int(profile.out[i, batch - 1])
        rows.append({"layer": i, "name": name, "special": profile.is_special(i), "in_bytes": inp,
                     "out_bytes": out, "ws_bytes": step.peak * profile.unit_bytes - inp - out,
                     "total_bytes": step.peak * profile.unit_bytes})
    return pd.DataFrame(rows)


def _grid(prof: vbs.Profile, *, floor_batch: int, ratios, units_at_floor: int):
    upper = vbs.fbs_peak(prof, batch=floor_batch, size=1)
    unit = vbs.unit_for(upper, units_at_floor)
    coarse = prof.coarsen(unit)
    top = vbs.fbs_peak(coarse, batch=floor_batch, size=1)
    floor = vbs.Planner(coarse, memory=top).smallest_feasible(floor_batch)
    budgets = sorted({max(floor, int(round(r * floor))) for r in ratios})
    return coarse, floor, budgets


def budget_sweep(
    profiles: dict[str, vbs.Profile], *, requests=(12,), ratios=(1.0, 1.33, 1.67, 2.0, 2.33, 2.67),
    units_at_floor: int = 24, floor_batch: int | None = None, progress: bool = False,
) -> pd.DataFrame:
    """Predicted per-image time of VBS, FBS and Greedy-VBS per network, request size and budget.

    Budgets are `ratios` x the floor of the largest request (or `floor_batch`), see the module
    docstring. One DP per network and request serves every budget (`Planner`). Infeasible
    baselines are rows with `feasible` False. `plan_json` holds the plan for `execute_sweep`.
    """
    rows = []
    for name, prof in tqdm(profiles.items(), desc="planning", disable=not progress):
        coarse, floor, budgets = _grid(prof, floor_batch=floor_batch or max(requests), ratios=ratios,
                                       units_at_floor=units_at_floor)
        for request in requests:
            planner = vbs.Planner(coarse, memory=max(budgets))
            for budget in budgets:
                base = {"network": name, "request": request, "budget_units": budget, "unit_bytes": coarse.unit_bytes,
                        "budget_bytes": budget * coarse.unit_bytes, "floor_units": floor,
                        "paper_mb": PAPER_FLOOR_MB * budget / floor}
                for method in METHODS:
                    try:
                        p = (planner.plan(memory=budget, batch=request) if method == "vbs" else
                             vbs.fbs(coarse, memory=budget, batch=request) if method == "fbs" else
                             vbs.greedy_vbs(coarse, memory=budget, batch=request))
                    except ValueError:
                        rows.append({**base, "method": method, "feasible": False, "time_per_image_s": np.nan})
                        continue
                    rows.append({**base, "method": method, "feasible": True, "time_per_image_s": p.time_per_sample,
                                 "peak_bytes": p.peak_bytes, "max_batch": p.max_batch_used, "steps": len(p.steps),
                                 "plan_json": p.to_json()})
    return pd.DataFrame(rows)


def sweep_plan(sweep: pd.DataFrame, *, network: str, method: str, budget_units: int, request: int) -> vbs.Plan:
    """The plan of one row of `budget_sweep`."""
    row = sweep[(sweep.network == network) & (sweep.method == method) & (sweep.budget_units == budget_units)
                & (sweep.request == request) & sweep.feasible]
    if row.empty:
        raise ValueError(f"no feasible {method} plan for {network}, request {request}, budget {budget_units} units")
    return vbs.Plan.from_json(row.plan_json.iloc[0])


def execute_sweep(
    models: dict[str, nn.Module], sweep: pd.DataFrame, *, image_size: int, repeats: int = 3,
    device: torch.device | str = "cpu", seed: int = 0, progress: bool = False,
) -> pd.DataFrame:
    """Run every feasible plan of `sweep` on its model: per budget, the methods are timed in
    interleaved rounds (median, min, max per image) and each distinct plan's peak is measured once.
    Adds executed columns to the feasible rows of `sweep` and checks outputs against the model."""
    out = sweep.copy()
    for col in ("executed_s", "executed_min_s", "executed_max_s", "executed_peak_bytes", "max_abs_diff"):
        out[col] = np.nan
    out["rounds"] = None
    out["input_bytes"] = out.request * 3 * image_size**2 * 4
    groups = list(out[out.feasible].groupby(["network", "request", "budget_units"]).groups.items())
    peaks: dict[str, float] = {}
    g = torch.Generator().manual_seed(seed)
    for (name, request, _), index in tqdm(groups, desc="executing plans", disable=not progress):
        model = models[name]
        x = torch.randn(request, 3, image_size, image_size, generator=g).to(device)
        with torch.no_grad():
            want = model(x)
        runners = {}
        for i in index:
            ex = vbs.Executor(model, vbs.Plan.from_json(out.at[i, "plan_json"]))
            ex.prepare(x)
            runners[i] = ex
            out.at[i, "max_abs_diff"] = float((ex(x) - want).abs().max())
        # NOTE: the correctness run above was each runner's warm-up
        times = time_interleaved({i: (lambda ex=ex, x=x: ex(x)) for i, ex in runners.items()}, warmup=0,
                                 repeats=repeats, device=device)
        for i, ex in runners.items():
            key = out.at[i, "plan_json"]
            if key not in peaks:
                with MemoryMeter(device) as meter:
                    ex(x)
                peaks[key] = meter.peak_bytes + x.numel() * x.element_size()
            t = np.asarray(times[i]) / request
            out.at[i, "executed_s"], out.at[i, "executed_min_s"] = float(np.median(t)), float(t.min())
            out.at[i, "executed_max_s"], out.at[i, "executed_peak_bytes"] = float(t.max()), peaks[key]
            out.at[i, "rounds"] = [float(v) for v in t]
    return out


def gains(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per network, request and budget: throughput gain of VBS over FBS and Greedy-VBS, in %.

    gain = (t_baseline / t_vbs - 1) x 100 ("higher throughput"); `time_reduction_pct` is the
    reduction of per-image time, (1 - t_vbs / t_fbs) x 100. Executed gains use the paired rounds
    (one ratio per round), with their min and max.
    """
    rows = []
    for (name, request, budget), grp in sweep.groupby(["network", "request", "budget_units"]):
        m = grp.set_index("method")
        if not m.loc["vbs", "feasible"]:
            continue
        row = {"network": name, "request": request, "budget_units": budget, "paper_mb": m.loc["vbs", "paper_mb"],
               "budget_bytes": m.loc["vbs", "budget_bytes"], "vbs_max_batch": m.loc["vbs", "max_batch"]}
        for base in ("fbs", "greedy"):
            ok = bool(m.loc[base, "feasible"])
            t_v, t_b = m.loc["vbs", "time_per_image_s"], m.loc[base, "time_per_image_s"]
            row[f"{base}_feasible"] = ok
            row[f"gain_vs_{base}_pct"] = (t_b / t_v - 1) * 100 if ok else np.nan
            if "executed_s" in m.columns and ok and m.loc[base, "rounds"] is not None:
                r = np.asarray(m.loc[base, "rounds"]) / np.asarray(m.loc["vbs", "rounds"])
                row[f"executed_gain_vs_{base}_pct"] = (float(np.median(r)) - 1) * 100
                row[f"executed_gain_vs_{base}_lo"] = (float(r.min()) - 1) * 100
                row[f"executed_gain_vs_{base}_hi"] = (float(r.max()) - 1) * 100
        if m.loc["fbs", "feasible"]:
            row["fbs_batch"] = m.loc["fbs", "max_batch"]
            row["time_reduction_pct"] = (1 - m.loc["vbs", "time_per_image_s"] / m.loc["fbs", "time_per_image_s"]) * 100
        rows.append(row)
    return pd.DataFrame(rows)


def table_ii(gain: pd.DataFrame, *, request: int = 12) -> pd.DataFrame:
    """Largest gain over FBS per network with paper-equivalent memory < 30 MB and > 35 MB."""
    rows = []
    g = gain[gain.request == request]
    for name in g.network.unique():
        sub = g[g.network == name]
        row = {"network": name, "paper_tight_pct": TABLE_II.get(name, (np.nan,))[0],
               "paper_loose_pct": TABLE_II.get(name, (np.nan, np.nan))[1]}
        for label, mask in (("tight", sub.paper_mb < TIGHT_MB), ("loose", sub.paper_mb > LOOSE_MB)):
            part = sub[mask & sub.fbs_feasible]
            row[f"predicted_{label}_pct"] = part.gain_vs_fbs_pct.max() if len(part) else np.nan
            if "executed_gain_vs_fbs_pct" in part and len(part) and part.executed_gain_vs_fbs_pct.notna().any():
                best = part.loc[part.executed_gain_vs_fbs_pct.idxmax()]
                row[f"executed_{label}_pct"] = best.executed_gain_vs_fbs_pct
                row[f"executed_{label}_lo"] = best.executed_gain_vs_fbs_lo
                row[f"executed_{label}_hi"] = best.executed_gain_vs_fbs_hi
        rows.append(row)
    return pd.DataFrame(rows)


def unused_memory(vbs_plan: vbs.Plan, fbs_plan: vbs.Plan) -> pd.DataFrame:
    """Table III: memory left unused while each layer runs (its worst phase), FBS against VBS."""
    if vbs_plan.names != fbs_plan.names or vbs_plan.memory != fbs_plan.memory:
        raise ValueError("plans must be for the same network and budget")
    a, b = fbs_plan.to_frame(), vbs_plan.to_frame()
    return pd.DataFrame({"name": a.name, "fbs_batches": a.batches, "vbs_batches": b.batches,
                         "fbs_unused_bytes": a.unused_bytes, "vbs_unused_bytes": b.unused_bytes})


def random_profile(n: int, batch: int, *, seed: int = 0) -> vbs.Profile:
    """A synthetic linear profile (memory in units of 1, sized so ~64 units is a tight budget)."""
    rng = np.random.default_rng(seed)
    b = np.arange(1, batch + 1)
    size = rng.integers(1, 3, n + 1)
    t = rng.uniform(1e-3, 2e-3, (n, batch)) / (1 + 0.5 * rng.uniform(0, 1, (n, 1)) * (b - 1))
    return vbs.Profile(t, size[:-1, None] * b, size[1:, None] * b, rng.integers(0, 3, (n, 1)) * b)


def planner_timing(*, layers=(15, 30, 60), memory_units=(16, 32, 64, 128), batch: int = 16, repeats: int = 3,
                   seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Seconds to fill the DP tables and reconstruct the plan (median of `repeats`) per size:
    wall time, and CPU time of this process (`cpu_s`; on a shared machine, the cost on one core).

    An infeasible budget is timed for the tables alone (`feasible` False): `plan` would then also
    search for the smallest feasible budget, which is a second solve, not the planner's speed.
    """
    import time

    rows = []
    for n in tqdm(layers, desc="planner timing", disable=not progress):
        prof = random_profile(n, batch, seed=seed)
        for m in memory_units:
            times, cpu, feasible = [], [], False
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                planner = vbs.Planner(prof, memory=m)
                feasible = bool(np.isfinite(planner.curve(batch)[m]))
                if feasible:
                    planner.plan(memory=m, batch=batch)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            rows.append({"layers": n, "batch": batch, "memory_units": m, "feasible": feasible,
                         "median_s": float(np.median(times)), "min_s": min(times), "max_s": max(times),
                         "cpu_s": float(np.median(cpu)), "cpu_min_s": min(cpu), "cpu_max_s": max(cpu)})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Plots (pure: DataFrame in, Figure out)

_STYLE = {"vbs": ("VBS (DP)", "C0"), "fbs": ("FBS", "C1"), "greedy": ("Greedy-VBS", "C2")}


def plot_time_vs_batch(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, grp in df.groupby("network"):
        ax.plot(grp.batch, grp.time_per_image_s * 1e3, marker="o", label=LABELS.get(name, name))
    ax.set_xlabel("batch size (all layers)")
    ax.set_ylabel("time per image (ms)")
    ax.set_title("Per-image time against batch size (Fig 1)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_layer_memory(df: pd.DataFrame, *, title: str = "Memory per layer at batch 1 (Fig 2)"):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(df)), 3.8))
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    for col, label in (("in_bytes", "input"), ("out_bytes", "output"), ("ws_bytes", "workspace")):
        ax.bar(x, df[col] / _MIB, bottom=bottom, label=label)
        bottom += df[col] / _MIB
    ax.set_xticks(x, df.name, rotation=90, fontsize=7)
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def _sweep_axes(ax, grp: pd.DataFrame, *, executed: bool) -> None:
    for method, (label, color) in _STYLE.items():
        m = grp[(grp.method == method) & grp.feasible].sort_values("paper_mb")
        if m.empty:
            continue
        ax.plot(m.paper_mb, m.time_per_image_s * 1e3, marker="o", color=color, label=f"{label} predicted")
        if executed and "executed_s" in m and m.executed_s.notna().any():
            ax.errorbar(m.paper_mb, m.executed_s * 1e3, yerr=[(m.executed_s - m.executed_min_s) * 1e3,
                        (m.executed_max_s - m.executed_s) * 1e3], color=color, ls="--", marker="x",
                        label=f"{label} executed")
    ax.grid(alpha=0.3)


def plot_budget_sweep(df: pd.DataFrame, *, request: int = 12, executed: bool = True):
    """Fig 7: per-image time against budget, one panel per network (x: paper-equivalent MB)."""
    import matplotlib.pyplot as plt

    df = df[df.request == request]
    names = list(df.network.unique())
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        grp = df[df.network == name]
        _sweep_axes(ax, grp, executed=executed)
        unit = grp.unit_bytes.iloc[0] * grp.floor_units.iloc[0] / _MIB
        ax.set_title(f"{LABELS.get(name, name)} (floor {unit:.2f} MiB)", fontsize=10)
        ax.set_xlabel("budget (paper-equivalent MB = 15 x budget / floor)")
        ax.set_ylabel("time per image (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Per-image time against memory budget, request {request} (Fig 7)")
    fig.tight_layout()
    return fig


def plot_request_sizes(df: pd.DataFrame, *, network: str = "googlenet", executed: bool = True):
    """Fig 8: VBS, FBS and Greedy-VBS for one network at several request sizes."""
    import matplotlib.pyplot as plt

    df = df[df.network == network]
    requests = sorted(df.request.unique())
    fig, axes = plt.subplots(1, len(requests), figsize=(3.8 * len(requests), 3.4), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], requests, strict=True):
        _sweep_axes(ax, df[df.request == r], executed=executed)
        ax.set_title(f"request {r}")
        ax.set_xlabel("budget (paper-equivalent MB)")
    axes[0][0].set_ylabel("time per image (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{LABELS.get(network, network)}: VBS against both baselines by request size (Fig 8)")
    fig.tight_layout()
    return fig


def plot_layer_batches(plan: vbs.Plan, *, title: str = "Batch sizes per layer (Fig 9)"):
    """Fig 9: for each main-path layer, its phases as stacked bars (height = batch size)."""
    import matplotlib.pyplot as plt

    frame = plan.to_frame()
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(frame)), 3.6))
    for x, batches in enumerate(frame.batches):
        bottom = 0
        for k, b in enumerate(batches):
            ax.bar(x, b, bottom=bottom, color=f"C{k % 10}", edgecolor="white")
            if b > 1 or len(batches) < 6:
                ax.text(x, bottom + b / 2, str(b), ha="center", va="center", fontsize=6)
            bottom += b
    ax.set_xticks(range(len(frame)), frame.name, rotation=90, fontsize=7)
    ax.set_ylabel("samples (stacked phases)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_planner_timing(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for k, (n, grp) in enumerate(df.groupby("layers")):
        ax.plot(grp.memory_units, grp.cpu_s, marker="o", color=f"C{k}", label=f"{n} layers (CPU time)")
        ax.plot(grp.memory_units, grp.median_s, marker="x", ls="--", color=f"C{k}", label=f"{n} layers (wall)")
    ax.set_xlabel("memory units")
    ax.set_ylabel("plan time (s)")
    ax.set_title(f"DP planner time (batch {df.batch.iloc[0]})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
