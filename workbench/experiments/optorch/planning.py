"""OpTorch's sequential checkpoints measured: Fig 8, Fig 11, the planners' front, the unit floor.

Paper: Ahmed & Naveed, "OpTorch: optimized deep learning architectures for resource limited
environments" (2021), Sec. II-B-2 (sequential checkpoints), Fig 8 (memory over one ResNet-18
iteration, 7000 -> 2000 MB) and Sec. IV / Fig 11 (the best checkpoint at the smallest layer).
Every plan's measured peak stands beside the peak the planner predicted for it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.checkpoint import (
    CheckpointPlan, LayerProfile, evaluate_plan, plan_checkpoints, profile_layers, sc,
)
from workbench.data import normalize
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, time_interleaved
from workbench.models import build

from .pipelines import Pipeline, _batch, autoencoder, measure_step

__all__ = [
    "experiment_checkpoint_position",
    "experiment_floor",
    "experiment_planner_pareto",
    "experiment_sc_resnet",
    "floor_summary",
    "optimal_vs_uniform",
    "smallest_layer_rank",
    "unit_floor",
]


def _ce(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels)
    return loss


def unit_floor(profile: LayerProfile) -> pd.DataFrame:
    """The least peak any plan can reach because of each unit alone (bytes, sample excluded).

    A unit cannot be split: its backward needs its input (kept, or recomputed from something
    kept), what it saved, its output gradient and its own scratch at once, and its forward its
    input, outputs and scratch. No checkpoint plan goes below the largest of these.
    """
    rows = []
    for i in range(len(profile)):
        inp = profile.input_keys(i)
        held = {**inp, **profile.saved[i]}
        fwd = sum(inp.values()) + profile.forward_bytes[i]
        bwd = sum(held.values()) + profile.grad_bytes[i] + profile.backward_bytes[i]
        rows.append({"unit": i, "name": profile.names[i], "forward_floor_bytes": fwd,
                     "backward_floor_bytes": bwd, "floor_bytes": max(fwd, bwd)})
    return pd.DataFrame(rows)


def experiment_sc_resnet(
    *, model: str = "resnet18", batch: int = 16, image_size: int = 32, width: float = 1.0,
    device: torch.device | str = "cpu", repeats: int = 3, seed: int = 0, stem: str = "cifar",
    progress: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Fig 8 and the S-C targets: baseline vs ``sc`` on one ResNet iteration.

    Variants: B; ``S-C uniform`` (``sc(model)``: round(sqrt(n)) equal segments of units);
    ``S-C optimal, block boundaries`` (the planner's minimum-peak plan with whole residual
    blocks as units); ``S-C optimal`` (the same with checkpoint units inside the blocks).
    Returns (summary, trace, floor). summary: peak_bytes (input batch counted),
    predicted_peak_bytes (the plan's cost model plus the input batch) and prediction_error,
    peak_ratio and time ratios against B (min and median of interleaved repeats, with the
    spread over rounds), and floor_ratio (the largest unit floor over B's peak). trace: memory
    over time (variant, event, op, bytes, progress in [0, 1]). floor: :func:`unit_floor` per unit.
    """
    device = torch.device(device)
    seed_everything(seed)
    net = build(model, width=width, stem=stem).to(device)
    images, labels = _batch(batch, image_size, seed=seed)
    sample = normalize(images).to(device)
    y = labels.to(device)
    loss = _ce(y)
    # NOTE: one bar over every stage (two profiles, four measured variants, the timing rounds), so
    # a large setting in the notebook's explore widget shows where it is instead of nothing.
    bar = tqdm(total=6 + repeats + 1, desc=f"Fig 8 {model} {batch}x{image_size}px", disable=not progress,
               leave=False)
    bar.set_postfix_str("profiling units")
    prof = profile_layers(net, sample, loss_fn=loss)
    bar.update()
    bar.set_postfix_str("profiling blocks")
    prof_blocks = profile_layers(net, sample, loss_fn=loss, split_blocks=False)
    bar.update()
    variants: dict[str, tuple[nn.Module, CheckpointPlan | None, LayerProfile]] = {}
    base = sc(net, 1)
    base.plan = plan_checkpoints(prof, segments=1)
    variants["B"] = (net, base.plan, prof)
    uniform = sc(net)
    uniform.plan = plan_checkpoints(prof, strategy="uniform")
    variants["S-C uniform"] = (uniform, uniform.plan, prof)
    blocks = sc(net, 1, split_blocks=False)
    blocks.plan = plan_checkpoints(prof_blocks, strategy="optimal")
    variants["S-C optimal, block boundaries"] = (blocks, blocks.plan, prof_blocks)
    optimal = sc(net, 1)
    optimal.plan = plan_checkpoints(prof, strategy="optimal")
    variants["S-C optimal"] = (optimal, optimal.plan, prof)
    input_bytes = sample.untyped_storage().nbytes()
    rows, traces = [], []
    for name, (m, plan, _) in variants.items():
        bar.set_postfix_str(f"measuring {name}")
        pipeline = Pipeline(checkpoint=name != "B")
        peak, trace = measure_step(m, images, labels, pipeline, device=device, trace=True)
        traces.append(trace.assign(variant=name, progress=trace.event / max(len(trace) - 1, 1)))
        predicted = plan.predicted_peak_bytes + input_bytes
        rows.append({"variant": name, "peak_bytes": peak, "units": plan.segments[-1][1],
                     "segments": plan.num_segments, "kept": plan.kept,
                     "predicted_peak_bytes": predicted, "prediction_error": predicted / peak - 1})
        bar.update()

    def step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=False)
            loss(m(sample)).backward()
        return run
    bar.set_postfix_str(f"timing {len(variants)} variants x {repeats} rounds")
    times = time_interleaved({k: step(m) for k, (m, _, _) in variants.items()}, repeats=repeats,
                             device=device)
    bar.update(repeats + 1)
    bar.close()
    df = pd.DataFrame(rows)
    df["median_s"] = [statistics.median(times[v]) for v in df.variant]
    df["min_s"] = [min(times[v]) for v in df.variant]
    df["peak_ratio"] = df.peak_bytes / df.peak_bytes.iloc[0]
    # NOTE: the ratio uses the minimum of interleaved repeats, the figure least disturbed by
    # other processes on a shared machine; the median ratio and the spread of per-round ratios
    # (the rounds are paired: every variant runs once per round) are reported beside it.
    df["time_ratio"] = df.min_s / df.min_s.iloc[0]
    df["time_ratio_median"] = df.median_s / df.median_s.iloc[0]
    rounds = {v: [t / b for t, b in zip(times[v], times["B"], strict=True)] for v in df.variant}
    df["time_ratio_lo"] = [min(rounds[v]) for v in df.variant]
    df["time_ratio_hi"] = [max(rounds[v]) for v in df.variant]
    floor = unit_floor(prof)
    base_predicted = df.predicted_peak_bytes.iloc[0]
    df["floor_ratio"] = (floor.floor_bytes.max() + input_bytes) / base_predicted
    df["min_predicted_ratio"] = (plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes
                                 + input_bytes) / base_predicted
    df = df.assign(model=model, batch=batch, image_size=image_size, width=width, stem=stem,
                   device=str(device))
    floor = floor.assign(floor_ratio=(floor.floor_bytes + input_bytes) / base_predicted, stem=stem)
    return df, pd.concat(traces, ignore_index=True), floor


def _measured_peak(model: nn.Module, plan: CheckpointPlan | None, x: torch.Tensor,
                   target: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                   *, split_blocks: bool = True) -> int:
    m = sc(model, 1, split_blocks=split_blocks)  # one plain segment: the baseline
    if plan is not None:
        m.plan = plan
    for p in m.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    with MemoryMeter(device) as meter:
        target(m(x)).backward()
    return meter.peak_bytes


def experiment_checkpoint_position(
    *, widths: Sequence[int] = (256, 128, 64, 8, 64, 128, 256, 256), batch: int = 2048,
    device: torch.device | str = "cpu", seed: int = 0,
) -> pd.DataFrame:
    """Fig 11: one checkpoint after each layer of the 7-layer autoencoder, measured.

    Rows: boundary (checkpoint after layer ``boundary - 1``; 0 = no checkpoint), the output
    bytes stored there, the measured and predicted peak, ``is_smallest`` for the bottleneck.
    """
    device = torch.device(device)
    seed_everything(seed)
    net = autoencoder(widths).to(device)
    x = torch.randn(batch, widths[0], device=device)

    def target(y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()
    prof = profile_layers(net, x, loss_fn=target)
    n = len(prof)
    smallest = min(range(n - 1), key=lambda i: prof.out_bytes[i]) + 1
    rows = []
    for e in range(0, n):
        segs = [(0, n, False)] if e == 0 else [(0, e, True), (e, n, False)]
        peak, rec = evaluate_plan(prof, segs)
        plan = CheckpointPlan("manual", segs, peak, rec)
        rows.append({"boundary": e, "stored_bytes": prof.out_bytes[e - 1] if e else 0,
                     "stored_width": widths[e] if e else None,
                     "measured_peak_bytes": _measured_peak(net, plan, x, target, device),
                     "predicted_peak_bytes": peak, "is_smallest": e == smallest})
    df = pd.DataFrame(rows)
    df["prediction_error"] = df.predicted_peak_bytes / df.measured_peak_bytes - 1
    return df.assign(batch=batch, widths=",".join(map(str, widths)), device=str(device))


def smallest_layer_rank(position: pd.DataFrame) -> int:
    """Rank (1 = lowest measured peak) of the checkpoint at the smallest layer among all single
    checkpoints of :func:`experiment_checkpoint_position` (ties broken by position)."""
    with_ckpt = position[position.boundary > 0].sort_values(["measured_peak_bytes", "boundary"])
    smallest = position.loc[position.is_smallest.astype(bool), "boundary"].item()
    return 1 + list(with_ckpt.boundary).index(smallest)


def experiment_planner_pareto(
    *, model: str = "resnet18", batch: int = 16, image_size: int = 32, width: float = 1.0,
    budgets: int = 6, device: torch.device | str = "cpu", repeats: int = 3, seed: int = 0,
    progress: bool = True, stem: str = "cifar",
) -> pd.DataFrame:
    """Memory-time front of the three planning strategies on one ResNet at shared budgets.

    Budgets are spaced between the minimum achievable and the baseline predicted peak; each
    strategy plans under each budget (NaN where it has no plan), then every distinct plan is
    measured: peak (MemoryMeter, the input batch made before the region as in the cost model)
    beside the predicted peak (``prediction_error`` = predicted / measured - 1;
    ``over_budget`` where the measured peak exceeds the budget) and step time (interleaved).
    """
    device = torch.device(device)
    seed_everything(seed)
    net = build(model, width=width, stem=stem).to(device)
    images, labels = _batch(batch, image_size, seed=seed)
    x, y = normalize(images).to(device), labels.to(device)
    prof = profile_layers(net, x, loss_fn=_ce(y))
    n = len(prof)
    lo = plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes
    hi = evaluate_plan(prof, [(0, n, False)])[0]
    grid = [int(lo + (hi - lo) * i / max(budgets - 1, 1)) for i in range(budgets)]
    rows, plans = [], {}
    for budget in grid:
        for strategy in ("uniform", "smallest", "optimal"):
            try:
                plan = plan_checkpoints(prof, memory_budget=budget, strategy=strategy)
            except ValueError:
                rows.append({"budget_bytes": budget, "strategy": strategy, "plan": None})
                continue
            key = tuple(plan.segments)
            plans[key] = plan
            rows.append({"budget_bytes": budget, "strategy": strategy, "plan": key,
                         "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "predicted_recompute_s": plan.predicted_recompute_s,
                         "segments": plan.num_segments})
    measured: dict[tuple, dict] = {}

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    for key, plan in tqdm(plans.items(), desc="plans", disable=not progress, leave=False):
        measured[key] = {"measured_peak_bytes": _measured_peak(net, plan, x, loss, device)}
    wrapped = {}
    for key, plan in plans.items():
        w = sc(net, 1)
        w.plan = plan
        wrapped[key] = w

    def step(m: nn.Module) -> Callable[[], None]:
        return lambda: loss(m(x)).backward()
    times = time_interleaved({str(k): step(w) for k, w in wrapped.items()}, repeats=repeats,
                             device=device, progress=progress, desc="plan timing")
    for key in plans:
        measured[key]["median_s"] = statistics.median(times[str(key)])
        measured[key]["min_s"] = min(times[str(key)])
        measured[key]["max_s"] = max(times[str(key)])
    df = pd.DataFrame(rows)
    for col in ("measured_peak_bytes", "median_s", "min_s", "max_s"):
        df[col] = [measured[k][col] if k is not None else math.nan for k in df.plan]
    df["prediction_error"] = df.predicted_peak_bytes / df.measured_peak_bytes - 1
    df["over_budget"] = df.measured_peak_bytes > df.budget_bytes
    df["plan"] = df.plan.map(lambda k: None if k is None else [list(s) for s in k])
    return df.assign(model=model, batch=batch, image_size=image_size, width=width,
                     device=str(device))




def experiment_floor(
    stems: Sequence[str] = ("cifar", "imagenet"), *, model: str = "resnet18", batch: int = 16,
    image_size: int = 32, width: float = 1.0, device: torch.device | str = "cpu", seed: int = 0,
) -> pd.DataFrame:
    """:func:`unit_floor` per stem, as ratios to the baseline's predicted peak (input batch
    included), with ``min_plan_ratio``: the least predicted peak any plan reaches, same ratio."""
    device = torch.device(device)
    frames = []
    for stem in stems:
        seed_everything(seed)
        net = build(model, width=width, stem=stem).to(device)
        images, labels = _batch(batch, image_size, seed=seed)
        x, y = normalize(images).to(device), labels.to(device)
        prof = profile_layers(net, x, loss_fn=_ce(y), repeats=1)
        extra = x.untyped_storage().nbytes()
        base = evaluate_plan(prof, [(0, len(prof), False)])[0] + extra
        lowest = plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes + extra
        floor = unit_floor(prof)
        frames.append(floor.assign(floor_ratio=(floor.floor_bytes + extra) / base, min_plan_ratio=lowest / base,
                                   stem=stem, model=model, batch=batch, image_size=image_size, width=width))
    return pd.concat(frames, ignore_index=True)


def floor_summary(floors: pd.DataFrame) -> pd.DataFrame:
    """The unit that sets the floor for each stem (:func:`experiment_floor`), with the least plan's ratio."""
    worst = floors.groupby("stem", sort=False).floor_ratio.idxmax()
    return floors.loc[worst, ["stem", "unit", "name", "floor_ratio", "min_plan_ratio"]].reset_index(drop=True)


def optimal_vs_uniform(pareto: pd.DataFrame) -> pd.DataFrame:
    """``optimal`` against ``uniform`` at every budget of :func:`experiment_planner_pareto` where both plan.

    One row per such budget: ``differ`` (the two chose different plans), the ratio of their predicted
    recomputation (the planner's own cost model), and the measured step-time ratio optimal/uniform
    (``time_ratio``: min over repeats of each; ``time_ratio_lo``/``_hi``: the least and the most
    favourable pairing of the repeats' extremes). Where the plans are equal the ratios are 1 by
    construction, so only rows with ``differ`` say anything about the planners' measured time.
    """
    rows = []
    for budget, group in pareto.groupby("budget_bytes", sort=True):
        by = group.set_index("strategy")
        if not {"optimal", "uniform"} <= set(by.index):
            continue
        opt, uni = by.loc["optimal"], by.loc["uniform"]
        if _no_plan(opt.plan) or _no_plan(uni.plan):
            continue
        rows.append({"budget_bytes": budget, "differ": str(opt.plan) != str(uni.plan),
                     "predicted_recompute_ratio": _ratio(opt.predicted_recompute_s, uni.predicted_recompute_s),
                     "time_ratio": opt.min_s / uni.min_s, "time_ratio_lo": opt.min_s / uni.max_s,
                     "time_ratio_hi": opt.max_s / uni.min_s})
    columns = ["budget_bytes", "differ", "predicted_recompute_ratio", "time_ratio", "time_ratio_lo", "time_ratio_hi"]
    return pd.DataFrame(rows, columns=columns)


def _no_plan(plan) -> bool:
    return plan is None or (isinstance(plan, float) and math.isnan(plan)) or str(plan) == "None"


def _ratio(a: float, b: float) -> float:
    """a / b for recomputation times, 1 where both are 0 (neither plan recomputes)."""
    return 1.0 if a == b else a / b if b else math.inf
