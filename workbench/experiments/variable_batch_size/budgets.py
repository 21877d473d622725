"""Per-image time against the memory budget (Figs 7 and 8 of Choudhury et al.), predicted from the
tables and executed on the model, and how well the prediction holds.

Budgets. The paper restricted working memory to 15-40 MB at 224x224 on edge devices, 15 MB being
"the average memory required to process most of the CNNs with a batch of size one" (Section IV).
Here every network's budgets are multiples of its own *floor*: the smallest budget in which the DP
can serve the request at all (one sample at a time). A budget of `ratio` x floor is shown as the
paper's `15 * ratio` MB ("paper-equivalent MB"), so "tight" (< 30 MB) is below 2x the floor and
"loose" (> 35 MB) above 2.33x. Memory units are `floor / units_at_floor` rounded up to whole KiB
(the paper used 2 MB units).

Methods: "vbs" is the paper's DP alone (`vbs.Planner`, optimal among nested schedules), "fbs"
and "greedy" the baselines of Section IV; `vbs.plan` would return the fastest of the three.

Memory. Every plan's predicted peak is what the executor allocates, the request included
(`workbench.vbs.flow`); executed, each plan's peak is read from the allocator while the request
is handed over sample by sample (`vbs.measure_peak`), and `within_budget` says whether it stayed
within the budget. A plan the executor refuses (`vbs.UnexecutablePlan`) is not run (`refused`).

The request. The sweep's plans count it as the paper does (`Plan.request` "pieces": each sample
freed once consumed). Beside each, `kept_plan_json` holds the same method's plan at the same
budget for a request the caller keeps (`request="kept"`: what `vbs.run(model, plan, x)` executes
within its prediction), None where that does not fit; `plan_at_ratio` returns it by default.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench import vbs
from workbench.measure import time_interleaved

__all__ = ["PAPER_FLOOR_MB", "TIGHT_MB", "LOOSE_MB", "METHODS", "budget_sweep", "sweep_plan", "plan_at_ratio",
           "execute_sweep", "agreement"]

PAPER_FLOOR_MB, TIGHT_MB, LOOSE_MB = 15.0, 30.0, 35.0
METHODS = ("vbs", "fbs", "greedy")


def _grid(tables: vbs.LayerProfile, *, floor_batch: int, ratios, units_at_floor: int):
    upper = vbs.fbs_peak(tables, batch=floor_batch, size=1)
    unit = vbs.unit_for(upper, units_at_floor)
    coarse = tables.coarsen(unit)
    top = vbs.fbs_peak(coarse, batch=floor_batch, size=1)
    floor = vbs.Planner(coarse, memory=top).smallest_feasible(floor_batch)
    budgets = sorted({max(floor, int(round(r * floor))) for r in ratios})
    return coarse, floor, budgets


def _planned(method: str, planners: dict[str, vbs.Planner], coarse: vbs.LayerProfile, budget: int, batch: int,
             request: str) -> vbs.Plan | None:
    try:
        if method == "vbs":
            return planners[request].plan(memory=budget, batch=batch)
        make = vbs.fbs if method == "fbs" else vbs.greedy_vbs
        return make(coarse, memory=budget, batch=batch, request=request)
    except ValueError:
        return None


def budget_sweep(
    tables: dict[str, vbs.LayerProfile], *, requests=(12,), ratios=(1.0, 1.33, 1.67, 2.0, 2.33, 2.67),
    units_at_floor: int = 24, floor_batch: int | None = None, progress: bool = False,
) -> pd.DataFrame:
    """Predicted per-image time of the DP ("vbs"), FBS and Greedy-VBS per network, request and budget.

    Budgets are `ratios` x the floor of the largest request (or `floor_batch`), see the module
    docstring. One DP per network and request serves every budget (`Planner`), one more the plans
    for a request the caller keeps (`kept_plan_json`, None where infeasible). Infeasible baselines
    are rows with `feasible` False. `plan_json` holds the plan for `execute_sweep`.
    """
    rows = []
    for name, t in tqdm(tables.items(), desc="planning", disable=not progress):
        coarse, floor, budgets = _grid(t, floor_batch=floor_batch or max(requests), ratios=ratios,
                                       units_at_floor=units_at_floor)
        for request in requests:
            planners = {r: vbs.Planner(coarse, memory=max(budgets), request=r) for r in vbs.REQUESTS}
            for budget in budgets:
                base = {"network": name, "request": request, "budget_units": budget, "unit_bytes": coarse.unit_bytes,
                        "budget_bytes": budget * coarse.unit_bytes, "floor_units": floor, "ratio": budget / floor,
                        "paper_mb": PAPER_FLOOR_MB * budget / floor}
                for method in METHODS:
                    p = _planned(method, planners, coarse, budget, request, "pieces")
                    if p is None:
                        rows.append({**base, "method": method, "feasible": False, "time_per_image_s": np.nan})
                        continue
                    kept = _planned(method, planners, coarse, budget, request, "kept")
                    rows.append({**base, "method": method, "feasible": True, "time_per_image_s": p.time_per_sample,
                                 "peak_bytes": p.peak_bytes, "max_batch": p.max_batch_used, "steps": len(p.steps),
                                 "plan_json": p.to_json(), "kept_plan_json": kept.to_json() if kept else None})
    return pd.DataFrame(rows)


def sweep_plan(sweep: pd.DataFrame, *, network: str, method: str, budget_units: int, request: int,
               kept: bool = False) -> vbs.Plan:
    """The plan of one row of `budget_sweep` (`kept`: its plan for a request the caller keeps)."""
    row = sweep[(sweep.network == network) & (sweep.method == method) & (sweep.budget_units == budget_units)
                & (sweep.request == request) & sweep.feasible]
    if kept and not row.empty:
        row = row[row.kept_plan_json.notna()]
    if row.empty:
        what = " for a request the caller keeps" if kept else ""
        raise ValueError(f"no feasible {method} plan{what} for {network}, request {request}, budget {budget_units} "
                         f"units")
    return vbs.Plan.from_json(row.kept_plan_json.iloc[0] if kept else row.plan_json.iloc[0])


def plan_at_ratio(sweep: pd.DataFrame, *, network: str, method: str, ratio: float, request: int,
                  kept: bool = True) -> vbs.Plan:
    """The plan of `method` at the swept budget nearest `ratio` x floor (e.g. 1.33: the paper's 20 MB).

    By default the plan for a request the caller keeps, which `vbs.run(model, plan, x)` executes
    within its prediction, at the nearest budget where there is one (it needs the request's bytes
    that the paper's accounting frees as the samples are consumed); `kept=False`: the paper's plan
    (the request handed over sample by sample), which `execute_sweep` runs and Fig 9 shows."""
    rows = sweep[(sweep.network == network) & (sweep.request == request)]
    if rows.empty:
        raise ValueError(f"no sweep rows for {network}, request {request}")
    if kept:
        fits = rows[(rows.method == method) & rows.feasible & rows.kept_plan_json.notna()]
        rows = fits if not fits.empty else rows
    budget = int(rows.budget_units.loc[(rows.ratio - ratio).abs().idxmin()])
    return sweep_plan(sweep, network=network, method=method, budget_units=budget, request=request, kept=kept)


def execute_sweep(
    models: dict[str, nn.Module], sweep: pd.DataFrame, *, image_size: int, repeats: int = 3,
    device: torch.device | str = "cpu", seed: int = 0, min_run_time: float = 0.0, progress: bool = False,
) -> pd.DataFrame:
    """Run every feasible plan of `sweep` on its model: per budget, the methods are timed in
    interleaved rounds (median, min, max per image) and each distinct plan's peak is measured once
    (`vbs.measure_peak`: the allocator's count, the request handed over and included), with
    `within_budget` beside it. Adds executed columns to the feasible rows of `sweep` and checks
    outputs against the model; a plan the executor refuses is marked `refused` and not run. The
    timed rounds (and the first, checked one) read the request as one tensor, whatever hand-over
    the plan counts: their memory is not what is measured.

    At least `repeats` rounds run per budget, more (up to 10 x `repeats`) while they have taken
    less than `min_run_time` seconds (0, the default: exactly `repeats`): at toy sizes one round
    takes milliseconds, and a single round disturbed by other processes would otherwise be the
    whole measurement; 0.2 s is torch.utils.benchmark's `blocked_autorange` default."""
    out = sweep.drop(columns=["kept_plan_json"], errors="ignore")  # plans this does not execute
    for col in ("executed_s", "executed_min_s", "executed_max_s", "executed_peak_bytes", "max_abs_diff"):
        out[col] = np.nan
    out["rounds"], out["within_budget"], out["refused"] = None, None, False
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
            plan = vbs.Plan.from_json(out.at[i, "plan_json"])
            try:  # the execution as measured: the request handed over as the plan counts it
                vbs.Executor(model, plan, check=False).prepare(_handed_over(x, plan))
            except vbs.UnexecutablePlan:
                out.at[i, "refused"] = True
                continue
            runners[i] = ex = vbs.Executor(model, plan, check_memory=False)
            out.at[i, "max_abs_diff"] = float((ex(x) - want).abs().max())
        # NOTE: the correctness run above was each runner's warm-up
        calls = {i: (lambda ex=ex, x=x: ex(x)) for i, ex in runners.items()}
        times: dict = {i: [] for i in runners}
        start, rounds = time.perf_counter(), 0
        while rounds < repeats or (time.perf_counter() - start < min_run_time and rounds < 10 * repeats):
            for i, t in time_interleaved(calls, warmup=0, repeats=1, device=device).items():
                times[i] += t
            rounds += 1
        for i, ex in runners.items():
            key = out.at[i, "plan_json"]
            if key not in peaks:  # the allocator's count, not the plan's own rule
                peaks[key] = vbs.measure_peak(ex, x)
            t = np.asarray(times[i]) / request
            out.at[i, "executed_s"], out.at[i, "executed_min_s"] = float(np.median(t)), float(t.min())
            out.at[i, "executed_max_s"], out.at[i, "executed_peak_bytes"] = float(t.max()), peaks[key]
            out.at[i, "within_budget"] = bool(peaks[key] <= out.at[i, "budget_bytes"])
            out.at[i, "rounds"] = [float(v) for v in t]
    return out


def _handed_over(x: torch.Tensor, plan: vbs.Plan) -> torch.Tensor | list[torch.Tensor]:
    return [x[k:k + 1].clone() for k in range(x.shape[0])] if plan.request == "pieces" else x


def _round_noise(ok: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Repeat noise of the time ratios, per method: round r's executed time over the prediction at every budget,
    the median over budgets, for each of the first n rounds (n: the fewest any budget ran); `<ratio>_rounds_lo`
    and `_hi` are the least and largest of those medians, `noise_rounds` is n. The vs-FBS ratio pairs round r
    of a plan with round r of FBS at the same budget (the rounds interleave the methods)."""
    if "rounds" not in ok:
        return pd.DataFrame()
    timed = ok[ok["rounds"].map(lambda r: isinstance(r, (list, tuple, np.ndarray)) and len(r) > 0)]
    if timed.empty:
        return pd.DataFrame()
    n = int(timed["rounds"].map(len).min())
    per_round = np.stack([np.asarray(r[:n], dtype=float) for r in timed["rounds"]]) / timed[
        ["time_per_image_s"]].to_numpy()
    fbs = {tuple(k): row for k, row, m in zip(timed[keys].itertuples(index=False), per_round, timed["method"],
                                              strict=True) if m == "fbs"}
    rows = []
    for method in timed["method"].unique():
        mine = (timed["method"] == method).to_numpy()
        ratio = np.median(per_round[mine], axis=0)
        row = {"method": method, "noise_rounds": n, "time_ratio_rounds_lo": ratio.min(),
               "time_ratio_rounds_hi": ratio.max(), "time_ratio_rounds_median": np.median(ratio)}
        paired = [r / fbs[tuple(k)] for k, r in zip(timed[mine][keys].itertuples(index=False), per_round[mine],
                                                     strict=True) if tuple(k) in fbs]
        if paired:
            vs = np.median(np.stack(paired), axis=0)
            row["time_ratio_vs_fbs_rounds_lo"], row["time_ratio_vs_fbs_rounds_hi"] = vs.min(), vs.max()
            row["time_ratio_vs_fbs_rounds_median"] = np.median(vs)
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def agreement(executed: pd.DataFrame, *, statistic: str = "median") -> pd.DataFrame:
    """Per method: executed / predicted time and memory over the feasible points of `executed`.

    `time_ratio` compares like with like (the executed minimum over rounds when the tables took
    the minimum of their repeats, else the medians); `time_ratio_vs_fbs` divides a plan's ratio by
    the FBS plan's at the same budget, so what the machine does to every method alike cancels.
    `memory_ratio` is the measured peak, the request included, over the predicted peak; `over_budget`
    counts the plans whose measured peak exceeded their budget, `refused` those the executor refused.
    `_min` and `_max` are the dispersion over budgets (settings, not uncertainty); the repeat noise of the time
    ratios is `_rounds_lo` and `_rounds_hi` (`_round_noise`: the same median over budgets, round by round, its
    spread about its own median carried onto the value).
    """
    ok = executed[executed.feasible & ~executed.refused.astype(bool)].copy()
    executed_t = ok.executed_min_s if statistic == "min" else ok.executed_s
    ok["time_ratio"] = executed_t / ok.time_per_image_s
    keys = ["network", "request", "budget_units"]
    fbs_ratio = ok[ok.method == "fbs"].set_index(keys).time_ratio
    ok["time_ratio_vs_fbs"] = ok.time_ratio / fbs_ratio.reindex(pd.MultiIndex.from_frame(ok[keys])).to_numpy()
    ok["memory_ratio"] = ok.executed_peak_bytes / ok.peak_bytes
    ok["over_budget"] = ok.executed_peak_bytes > ok.budget_bytes
    ratios = ["time_ratio", "time_ratio_vs_fbs", "memory_ratio"]
    grouped = ok.groupby("method")
    frame = grouped[[*ratios, "steps"]].median().add_suffix("_median")
    frame = frame.join(grouped[ratios].min().add_suffix("_min")).join(grouped[ratios].max().add_suffix("_max"))
    frame = frame.join(_round_noise(ok, keys))
    for ratio in ("time_ratio", "time_ratio_vs_fbs"):
        # NOTE: the noise is read from per-round medians, the value may be another statistic (the minimum over rounds
        # where the tables took minima): the rounds' relative spread about their own median is carried onto the
        # value, which then sits inside its spread (it sat below it: 1.215 against 1.23-1.25 on a cpu build)
        if f"{ratio}_rounds_median" in frame:
            scale = frame[f"{ratio}_median"] / frame.pop(f"{ratio}_rounds_median")
            frame[f"{ratio}_rounds_lo"] *= scale
            frame[f"{ratio}_rounds_hi"] *= scale
    frame["points"] = grouped.size()
    frame["over_budget"] = grouped.over_budget.sum()
    refused = executed[executed.feasible & executed.refused.astype(bool)].groupby("method").size()
    frame = frame.reindex(frame.index.union(refused.index))  # a method whose every plan was refused too
    frame["refused"] = refused.reindex(frame.index, fill_value=0)
    frame[["points", "over_budget", "refused"]] = frame[["points", "over_budget", "refused"]].fillna(0).astype(int)
    frame["max_abs_diff"] = grouped.max_abs_diff.max()
    return frame.rename_axis("method").reset_index()
