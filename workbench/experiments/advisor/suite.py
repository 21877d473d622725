"""The advisor judged on a held-out suite (issue 19): every candidate's prediction against real steps.

For each model the budget is a quantile of its candidates' predicted peaks, so the choice is not
trivial. Every candidate then runs for real: its training program (model and optimizer built, two steps)
under `AllocatorMeter`, which shares no counting rule with the plan, at the user's batch and at one calibration
never ran; its step is timed outside the meter, in the same rounds as the model's other run candidates and the
choice (`time_candidates`). The decision's regret is the advisor's choice against every run candidate whose
measured peak fits the same usable budget (budget x (1 - margin)), paired round by round (`paired_regret`).
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.advisor import Advice, advise
from workbench.advisor.steptime import StepTime, time_steps
from workbench.calcgraph.forked import worker_count
from workbench.measure import AllocatorMeter
from workbench.optim import cpu_kernel

from .models import SUITE, suite_model

__all__ = ["SUITE", "evaluate", "held_out_peak", "measure_candidate", "metered_run", "paired_regret", "planning_model",
           "planning_time", "repeat_error", "suite_model", "time_candidates"]

# the least time one sample of `time_candidates` spends on each candidate (single steps of 1-3 ms, paired: +-7% in
# 9 rounds)
PAIRED_SAMPLE_S = 0.03


def metered_run(advice: Advice, config: str, batch_size: int) -> AllocatorMeter:
    """One real run of the very program the plan traced for `config` (build + two steps) at `batch_size`, under
    `AllocatorMeter` on the advice's device (on CUDA it also reads the caching allocator's reserved peak)."""
    gc.collect()
    with AllocatorMeter(advice.device) as meter:
        advice.program(config)(batch_size, None)
    return meter


def measure_candidate(advice: Advice, config: str) -> dict:
    """The real peak of one candidate at the user's batch: `AllocatorMeter` over the very program the plan traced
    (build + two steps; on CUDA also the caching allocator's reserved peak)."""
    meter = metered_run(advice, config, advice.batch_size)
    return {"measured_peak_bytes": meter.peak_bytes, "measured_reserved_bytes": meter.reserved_peak_bytes}


def held_out_peak(advice: Advice, config: str, batch_size: int) -> dict:
    """One candidate's predicted and real peak (`measure_candidate`'s meter) at `batch_size`, a batch its plan's
    calibration never ran (ValueError otherwise): at the suite's own batch, which calibration runs, a plan
    reads its calibration back (issue 45)."""
    plan = advice._by_name[config]
    if batch_size in plan.graph.calibrated_batches:
        raise ValueError(f"held-out batch {batch_size} is one calibration ran ({plan.graph.calibrated_batches})")
    return {"held_out_batch": batch_size, "predicted_held_out_bytes": plan.peak(batch_size),
            "measured_held_out_bytes": metered_run(advice, config, batch_size).peak_bytes}


def time_candidates(advice: Advice, configs: Sequence[str], *, rounds: int, min_run_time: float = 0.05
                    ) -> dict[str, StepTime]:
    """Each candidate's step, all built now and timed at the user's batch in the same rounds, one sample of each
    per round (`steptime.time_steps`, the advisor's own clock: order rotated every round, a round in which any
    step's threads waited for a CPU set aside whole), each sample at least `PAIRED_SAMPLE_S` long.

    # NOTE: in the same rounds, not one candidate after another: this machine's speed moves by a third for seconds
    # at a time, so separately timed candidates differed by a median of up to 33% when timed again (issue 44), and
    # the fastest of them was partly the one whose steps happened to run in a fast phase
    """
    configs = list(dict.fromkeys(configs))
    steps = [_built_step(advice, config) for config in configs]
    times = time_steps(steps, min_run_time=max(min_run_time, rounds * PAIRED_SAMPLE_S), device=advice.device,
                       samples=rounds, most=3 * rounds)
    return dict(zip(configs, times, strict=True))


def repeat_error(step_time: StepTime) -> float:
    """How far two timings of one step at different moments differ: the median of its later half of rounds over
    that of its earlier half, minus 1 (the noise floor under a time error); NaN under 4 rounds."""
    rounds = step_time.rounds
    half = len(rounds) // 2
    if half < 2:
        return math.nan
    return statistics.median(rounds[-half:]) / statistics.median(rounds[:half]) - 1


def paired_regret(times: Mapping[str, StepTime], chosen: str, fitting: Sequence[str]
                  ) -> tuple[float, float, float, str | None]:
    """The choice's regret against every fitting candidate, timed in the same rounds (`time_candidates`): for
    each, the median over rounds of chosen / candidate - 1, with its quartiles; the largest median wins (the
    candidate the choice loses most to). Returns (regret, lo, hi, that candidate); 0 where the choice is the only
    one fitting, NaN where none fits.

    # NOTE: paired round by round, not the two medians divided: both steps of a round ran in the same phase of
    # the machine; the fastest of ~50 separately timed candidates was partly the one whose steps happened to run
    # fastest (identical programs gave regrets of 0.004 and 0.071 in two runs)
    """
    others = [c for c in dict.fromkeys(fitting) if c != chosen]
    if not others:
        return (0.0, 0.0, 0.0, chosen) if chosen in fitting else (math.nan, math.nan, math.nan, None)
    worst = None
    for other in others:
        ratios = [a / b - 1 for a, b in zip(times[chosen].rounds, times[other].rounds, strict=True)]
        lo, median, hi = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        if worst is None or median > worst[0]:
            worst = (median, lo, hi, other)
    return worst


def _built_step(advice: Advice, config: str) -> Callable[[], object]:
    """One training step of `config`, built now, as a call on one fresh batch at the user's batch size."""
    step, batch = advice.build(config), advice.make_batch(config)
    data = batch(advice.batch_size, advice.device)
    return lambda: step(data)


def evaluate(models: Sequence[str], *, batch_size: int, width: float, image_size: int, budget_quantile: float,
             repeats: int = 3, min_run_time: float = 0.1, candidates=None, device: torch.device | str = "cpu",
             progress: bool = True, sample: int = 0, seed: int = 0, held_out: int | None = None
             ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Advice]]:
    """Advise on each model, with the budget at the `budget_quantile` of its candidates' predicted peaks (so
    that some fit and some do not), verify the choice, and run its candidates for real, all on `device`: every
    candidate, or (`sample` > 0) a random sample of `sample` of them per model drawn with `seed` before any is
    run (`sampled_from` in each row: how many there were). Each run candidate's peak is measured at the user's batch
    and again at `held_out` (default 3 x `batch_size`), a batch calibration never ran (`held_out_error`); the run
    candidates and the choice are timed in the same rounds (`_decision`; `repeat_error`: the later half of a
    candidate's rounds against the earlier). Returns (candidates, decisions, advice per model)."""
    held_out = 3 * batch_size if held_out is None else held_out
    rows, decisions, advices = [], [], {}
    # NOTE: the packed CPU kernel is compiled once per environment (torch's extension cache: about 20 s from a
    # fresh clone, in a compiler process the planning's CPU seconds do not see): here, before any planning clock
    start = time.perf_counter()
    if torch.device(device).type == "cpu":
        cpu_kernel.available()
    kernel_seconds = time.perf_counter() - start
    for name in tqdm(models, desc="models", disable=not progress):
        model = suite_model(name, width=width, image_size=image_size)
        torch.manual_seed(0)
        batch = model.batch(batch_size, device=device)
        gc.collect()
        load, start, cpu = _load(), time.perf_counter(), _cpu_seconds()
        advice = advise(model.build, batch, memory_budget=2**62, loss_fn=model.loss_fn, candidates=candidates,
                        min_run_time=min_run_time, device=device)
        # the process's CPU seconds beside the wall time: on a shared machine the wall time measures its load too
        planning = {"planning_seconds": time.perf_counter() - start, "planning_cpu_seconds": _cpu_seconds() - cpu,
                    "load_before": load, "load_after": _load(),
                    "threads": torch.get_num_threads(), "trace_processes": worker_count(),
                    "candidates": len(advice.table),
                    "programs": advice._plans.programs, "traces": advice._plans.traces,
                    "one_step_traces": advice._plans.one_step_traces,
                    "spliced_traces": advice._plans.spliced_traces,
                    "kernel_build_seconds": kernel_seconds if not decisions else 0.0,
                    **{f"{phase.replace(' ', '_')}_seconds": t for phase, t in advice.planning_seconds.items()}}
        peaks = advice.table["predicted_peak_bytes"]
        budget = float(peaks.quantile(budget_quantile, interpolation="lower")) / (1 - advice.margin)
        traced, start = advice._plans.traces, time.perf_counter()
        advice.rebudget(budget)  # the budget's checkpoint placements: traced, or composed (`calcgraph.placements`)
        planning.update(rebudget_seconds=time.perf_counter() - start, rebudget_traces=advice._plans.traces - traced,
                        composed_traces=advice._plans.composed_traces)
        advices[name] = advice
        run = list(advice.table.index)
        if 0 < sample < len(run):  # drawn from the table's order alone: no prediction or measurement chooses;
            # seeded by model too, so models whose tables share one order are not all sampled at the same rows
            run = sorted(random.Random(f"{seed}:{name}").sample(run, sample))
        first = len(rows)
        for _, row in tqdm(list(advice.table.loc[run].iterrows()), desc=name, disable=not progress, leave=False):
            rows.append({"model": name, "config": row["config"], "budget_bytes": budget,
                         "predicted_peak_bytes": int(row["predicted_peak_bytes"]),
                         "predicted_step_seconds": float(row["predicted_step_seconds"]), "fits": bool(row["fits"]),
                         "sampled_from": len(advice.table), **measure_candidate(advice, row["config"]),
                         **held_out_peak(advice, row["config"], held_out)})
        decisions.append(_decision(name, advice, budget, planning, rows[first:], repeats, min_run_time))
    table = pd.DataFrame(rows)
    table["peak_error"] = (table["predicted_peak_bytes"] - table["measured_peak_bytes"]) / table["measured_peak_bytes"]
    table["held_out_error"] = (table["predicted_held_out_bytes"] - table["measured_held_out_bytes"]) \
        / table["measured_held_out_bytes"]
    table["time_error"] = (table["predicted_step_seconds"] - table["measured_step_seconds"]) \
        / table["measured_step_seconds"]
    return table, pd.DataFrame(decisions), advices


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the advisor's forked trace workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _load() -> float:
    """The 1-minute load average (planning times are wall times on a machine other processes may share)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def _decision(name: str, advice: Advice, budget: float, planning: dict, rows: list[dict], repeats: int,
              min_run_time: float) -> dict:
    """Verify the choice, then time it with the model's run candidates in the same rounds (`time_candidates`):
    each row gets its measured step time and `repeat_error`, the decision its regret against every run candidate
    whose measured peak fits (`paired_regret`)."""
    try:
        choice = advice.best["config"]
    except ValueError as error:
        choice, result, decision = None, None, {"error": str(error)}
    else:
        result = advice.verify(repeats=repeats)
        decision = {"choice_after": result["choice_after"], "predicted_peak_bytes": result["predicted_peak_bytes"],
                    "verified_peak_bytes": result["measured_peak_bytes"], "within_budget": result["within_budget"]}
    chosen = [] if result is None else [result["choice_after"]]
    times = time_candidates(advice, [r["config"] for r in rows] + chosen, rounds=max(9, 3 * repeats),
                            min_run_time=min_run_time)
    for row in rows:
        measured = times[row["config"]]
        row.update(measured_step_seconds=measured.seconds, measured_time_reliable=measured.reliable,
                   repeat_error=repeat_error(measured))
    usable = budget * (1 - advice.margin)  # the advisor's own usable budget: a fair race
    fitting = [r["config"] for r in rows if r["measured_peak_bytes"] <= usable]
    if result is not None:
        regret, lo, hi, against = paired_regret(times, result["choice_after"], fitting)
        fastest = min(fitting, key=lambda c: times[c].seconds) if fitting else None
        decision.update(fastest_fitting=fastest, fitting_timed=len(fitting), regret=regret, regret_lo=lo,
                        regret_hi=hi, regret_against=against,
                        verifications=advice.real_runs.get("verification", 0),
                        real_passes=sum(advice.real_runs.values()), real_runs=str(advice.real_runs))
    return {"model": name, "budget_bytes": budget, "choice": choice, **decision, **planning,
            "parameters": _parameters(advice)}


def _parameters(advice: Advice) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in advice._workload.build().parameters())


def planning_model(parameters: int) -> tuple[Callable[[], nn.Module], tuple[int, ...]]:
    """An MLP of about `parameters` parameters (1024 inputs, three hidden layers of one width, 10 classes)
    and its per-example input shape: the model the planning-time target is stated for."""
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 10_000:
        raise ValueError(f"parameters must be an int >= 10000, got {parameters!r}")
    # 1024 w + w (first layer) + 2 (w^2 + w) + 10 w + 10 = parameters, solved for the width w
    a, b = 2, 1024 + 1 + 2 + 10
    width = max(1, round((-b + (b * b + 4 * a * (parameters - 10)) ** 0.5) / (2 * a)))
    return lambda: nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)), (1024,)


def planning_time(parameters: int, *, batch_size: int, min_run_time: float, candidates=None) -> dict:
    """Wall time of one `advise()` (every candidate traced, calibrated, timed; `candidates` narrows them) on
    `planning_model(parameters)` at `batch_size`, split by phase (`Advice.planning_seconds`: `<phase>_seconds`),
    with its real passes counted. Nothing else is run."""
    factory, shape = planning_model(parameters)
    x, y = torch.randn(batch_size, *shape), torch.randint(0, 10, (batch_size,))
    gc.collect()
    load, start = _load(), time.perf_counter()
    advice = advise(factory, (x, y), memory_budget=2**62, min_run_time=min_run_time, candidates=candidates)
    seconds = time.perf_counter() - start
    with torch.device("meta"):
        width = factory()[0].out_features
    return {"model": f"MLP, width {width}", "parameters": _parameters(advice),
            "batch_size": batch_size, "candidates": len(advice.table), "programs": advice._plans.programs,
            "traces": advice._plans.traces, "one_step_traces": advice._plans.one_step_traces,
            "spliced_traces": advice._plans.spliced_traces, "planning_seconds": seconds,
            "load_before": load, "load_after": _load(), "threads": torch.get_num_threads(),
            "trace_processes": worker_count(),
            **{f"{phase.replace(' ', '_')}_seconds": t for phase, t in advice.planning_seconds.items()},
            "real_runs": str(advice.real_runs)}
