"""Throughput gains and where the memory goes: Table II, Fig 8's comparisons, Fig 9 and Table III of
Choudhury et al., from the sweeps of `budgets`.

Gain. Section IV: "Our performance metric is the overall throughput gain, which is defined as the
percentage reduction in per image inference time for our algorithm over the baseline", so
gain = (t_baseline - t_vbs) / t_baseline x 100, never above 100%. The ratio t_baseline / t_vbs
(how many times more images per second) is kept beside it as `speedup_vs_<baseline>`.

Budget. An executed gain counts only where both plans stayed within the budget as executed (their
measured peaks, the request included, at most the budget): a plan that breaks the budget the
baseline respected is not a faster plan for that budget. Table II says how many budgets did.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench import vbs

from .budgets import LOOSE_MB, METHODS, PAPER_FLOOR_MB, TIGHT_MB, plan_at_ratio

__all__ = ["TABLE_II", "TABLE_III", "PAPER_BUDGET_MB", "reduction_pct", "gains", "table_ii", "unused_memory",
           "table_iii", "layer_batches"]

# Table II of the paper: largest throughput gain (%) with memory < 30 MB and > 35 MB, request 12
TABLE_II = {"googlenet": (60.25, 36.55), "resnet50": (38.91, 22.75), "squeezenet1_0": (44.03, 29.50),
            "mobilenet_v1": (5.68, 1.61)}
# Table III of the paper: un-utilised memory (MB) per GoogLeNet layer at 20 MB, (baseline, VBS);
# the paper's Caffe names (conv1/7x7_s2, ..., loss3/classifier) by the stage names of workbench.models
TABLE_III = {"conv1": (9.29, 0.30), "pool1": (12.99, 0.00), "norm1": (16.93, 0.38), "conv2_reduce": (17.69, 0.13),
             "conv2": (9.63, 0.38), "pool2": (14.67, 1.33), "inception_3a": (18.66, 1.96),
             "inception_5b": (19.65, 6.9), "pool5": (19.61, 6.91), "classifier": (16.08, 1.67)}
PAPER_BUDGET_MB = 20.0  # Fig 9 and Table III: GoogLeNet with 20 MB available


def reduction_pct(t_baseline, t_vbs):
    """The paper's throughput gain: percentage reduction in per-image time, (t_b - t_v) / t_b x 100."""
    return (1.0 - np.asarray(t_vbs, dtype=float) / np.asarray(t_baseline, dtype=float)) * 100.0


def _within(m: pd.DataFrame, method: str) -> bool:
    """Whether `method`'s plan ran within the budget as executed (True where it was not executed)."""
    if "executed_peak_bytes" not in m.columns:
        return True
    value = m.loc[method, "within_budget"] if "within_budget" in m.columns else None
    return False if value is None or pd.isna(value) else bool(value)


def gains(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per network, request and budget: gain of the DP over FBS and over Greedy-VBS (the paper's
    definition, % reduction of per-image time), predicted and, where executed, per paired round
    (median, min, max) where both plans stayed within the budget (`within_budget_vs_<base>`);
    Greedy-VBS against FBS; and which method is fastest (what `vbs.plan` takes)."""
    rows = []
    for (name, request, budget), grp in sweep.groupby(["network", "request", "budget_units"]):
        m = grp.set_index("method")
        if not m.loc["vbs", "feasible"]:
            continue
        t = {k: m.loc[k, "time_per_image_s"] for k in METHODS if m.loc[k, "feasible"]}
        row = {"network": name, "request": request, "budget_units": budget, "ratio": m.loc["vbs", "ratio"],
               "paper_mb": m.loc["vbs", "paper_mb"], "budget_bytes": m.loc["vbs", "budget_bytes"],
               "vbs_max_batch": m.loc["vbs", "max_batch"], "fastest": min(t, key=lambda k: (t[k], METHODS.index(k)))}
        for base in ("fbs", "greedy"):
            ok = base in t
            row[f"{base}_feasible"] = ok
            row[f"{base}_batch"] = m.loc[base, "max_batch"] if ok else np.nan
            row[f"gain_vs_{base}_pct"] = float(reduction_pct(t[base], t["vbs"])) if ok else np.nan
            row[f"speedup_vs_{base}"] = t[base] / t["vbs"] if ok else np.nan
            within = ok and _within(m, "vbs") and _within(m, base)
            row[f"within_budget_vs_{base}"] = within
            if "rounds" in m.columns and within and m.loc[base, "rounds"] is not None \
                    and m.loc["vbs", "rounds"] is not None:
                g = reduction_pct(m.loc[base, "rounds"], m.loc["vbs", "rounds"])
                row[f"executed_gain_vs_{base}_pct"] = float(np.median(g))
                row[f"executed_gain_vs_{base}_lo"], row[f"executed_gain_vs_{base}_hi"] = float(g.min()), float(g.max())
        both = "fbs" in t and "greedy" in t
        row["greedy_vs_fbs_pct"] = float(reduction_pct(t["fbs"], t["greedy"])) if both else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def table_ii(gain: pd.DataFrame, *, request: int = 12) -> pd.DataFrame:
    """Table II: largest gain over FBS per network with paper-equivalent memory < 30 MB and > 35 MB,
    predicted and executed (the executed one with the min-max of its paired rounds), over the
    budgets where both plans stayed within the budget: `within_<range>` of `points_<range>`."""
    rows = []
    g = gain[gain.request == request]
    for name in g.network.unique():
        sub = g[g.network == name]
        paper = TABLE_II.get(name, (np.nan, np.nan))
        row = {"network": name, "paper_tight_pct": paper[0], "paper_loose_pct": paper[1]}
        for label, mask in (("tight", sub.paper_mb < TIGHT_MB), ("loose", sub.paper_mb > LOOSE_MB)):
            part = sub[mask & sub.fbs_feasible]
            row[f"points_{label}"] = len(part)
            if "within_budget_vs_fbs" in part:
                part = part[part.within_budget_vs_fbs.astype(bool)]
            row[f"within_{label}"] = len(part)
            row[f"predicted_{label}_pct"] = part.gain_vs_fbs_pct.max() if len(part) else np.nan
            row[f"predicted_{label}_speedup"] = part.speedup_vs_fbs.max() if len(part) else np.nan
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
    budget = vbs_plan.memory * vbs_plan.unit_bytes
    return pd.DataFrame({"name": a.name, "fbs_batches": a.batches, "vbs_batches": b.batches,
                         "fbs_unused_bytes": a.unused_bytes, "vbs_unused_bytes": b.unused_bytes,
                         "budget_bytes": budget, "fbs_unused_fraction": a.unused_bytes / budget,
                         "vbs_unused_fraction": b.unused_bytes / budget})


def table_iii(sweep: pd.DataFrame, *, network: str, ratio: float, request: int) -> pd.DataFrame:
    """Table III at the swept budget nearest `ratio` x floor, with the paper's values beside each
    layer it lists (as fractions of its 20 MB). Empty where FBS cannot serve the request."""
    try:
        p = plan_at_ratio(sweep, network=network, method="vbs", ratio=ratio, request=request, kept=False)
        f = plan_at_ratio(sweep, network=network, method="fbs", ratio=ratio, request=request, kept=False)
    except ValueError:
        return pd.DataFrame()
    frame = unused_memory(p, f)
    floor = sweep[(sweep.network == network) & (sweep.request == request)].floor_units.iloc[0]
    paper = frame.name.map(TABLE_III)
    frame["paper_fbs_unused_fraction"] = [v[0] / PAPER_BUDGET_MB if isinstance(v, tuple) else np.nan for v in paper]
    frame["paper_vbs_unused_fraction"] = [v[1] / PAPER_BUDGET_MB if isinstance(v, tuple) else np.nan for v in paper]
    return frame.assign(network=network, request=request, paper_mb=PAPER_FLOOR_MB * p.memory / floor)


def layer_batches(sweep: pd.DataFrame, tables: vbs.LayerProfile, *, network: str, ratio: float,
                  request: int) -> pd.DataFrame:
    """Fig 9: the DP's phases per main-path layer at the swept budget nearest `ratio` x floor, with
    each layer's memory need per sample (in + ws + out at batch 1, the DP's accounting) and the
    batch size FBS runs at the same budget (NaN where it cannot serve the request)."""
    p = plan_at_ratio(sweep, network=network, method="vbs", ratio=ratio, request=request, kept=False)
    try:
        fbs_batch = plan_at_ratio(sweep, network=network, method="fbs", ratio=ratio, request=request,
                                  kept=False).max_batch_used
    except ValueError:
        fbs_batch = np.nan
    floor = sweep[(sweep.network == network) & (sweep.request == request)].floor_units.iloc[0]
    frame = p.to_frame()[["layer", "name", "phases", "batches"]]
    frame["max_batch"] = [max(b) for b in frame.batches]
    frame["need_bytes_per_sample"] = [vbs.uniform_step(tables, i, 1, 0).peak * tables.unit_bytes
                                      for i in range(tables.n_layers)]
    return frame.assign(network=network, request=request, paper_mb=PAPER_FLOOR_MB * p.memory / floor,
                        fbs_batch=fbs_batch)
