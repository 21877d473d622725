"""run.sh's `memory` part: CalcGraph's held-out zoo and the advisor's suite on CUDA, every prediction against
`torch.cuda.max_memory_allocated` and `max_memory_reserved`.

CalcGraph ("taming the high costs of deep learning using models", 2022), Sections 3.2 and 4.3: memory known
before execution, judged here on the GPU's own allocator. `zoo_on_device` plans each zoo case on the device
(the fake-tensor plan alone: CUDA plans are not calibrated) and runs the same training program under
`AllocatorMeter`, whose CUDA reading is `max_memory_allocated` relative to entry beside the caching allocator's
`max_memory_reserved`. The advisor suite (`workbench.experiments.advisor.suite.evaluate`, on CUDA already)
runs at the advisor notebook's gpu profile, one model at a time.

Each table is rewritten (atomically) after each model, so a run stopped at its deadline keeps every model it
finished; models run cheapest first. Run as `python -m workbench.report.gpu_memory OUTDIR --device cuda`
(run.sh does, under its deadline); `--profile smoke --device cpu` is the dry run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

__all__ = ["ZOO_BATCH_SIZES", "ADVISOR_ORDER", "zoo_on_device", "advisor_on_device", "main"]

ZOO_BATCH_SIZES = {"gpu": (1, 8, 64, 256), "smoke": (1, 4)}  # the cpu build's zoo batches (paper profile's too)
ZOO_COLUMNS = ["model", "batch_size", "cudnn", "predicted_bytes", "max_memory_allocated", "max_memory_reserved",
               "error", "device", "refused"]
ADVISOR_ORDER = ("mlp", "lstm", "transformer", "gpt2", "densenet_bc_100", "resnet50", "vit")  # cheapest first


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    frame.to_csv(temporary, index=False)
    os.replace(temporary, path)


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def zoo_on_device(device: torch.device | str, batch_sizes: Sequence[int], out: Path | None = None,
                  cases: Sequence[str] | None = None) -> pd.DataFrame:
    """Each zoo case planned on `device` and measured there: predicted bytes, max_memory_allocated (relative to
    the bytes live before the step) and max_memory_reserved (absolute, what runs out), error of the plan.

    # NOTE: not `workbench.calcgraph.zoo.accuracy_table`, which calibrates against the CPU allocator: CUDA plans
    # are not calibrated. Same cases, same plan and measurement (`plan_case`, `measure_case`), the device's peaks.
    """
    from ..calcgraph import Unplannable
    from ..calcgraph.zoo import ZOO

    device = torch.device(device)
    rows = []
    for name in cases or list(ZOO):
        case = ZOO[name]
        started = time.perf_counter()
        for cudnn in (True, False):
            try:
                with torch.backends.cudnn.flags(enabled=cudnn):
                    rows += _zoo_case(name, case, device, batch_sizes, cudnn=cudnn)
                break
            except (RuntimeError, ValueError) as refused:  # one case that cannot be planned stops no other
                rows += [{"model": name, "batch_size": batch, "cudnn": cudnn, "device": str(device),
                          "refused": f"{type(refused).__name__}: {refused}"} for batch in batch_sizes]
                if not isinstance(refused, Unplannable):
                    break
                # the plan refused cuDNN's RNN kernels and said how to plan without them: that advice, measured
        _log(f"zoo {name}: {time.perf_counter() - started:.1f} s")
        if out is not None:
            _write_csv(pd.DataFrame(rows, columns=ZOO_COLUMNS), out)
    return pd.DataFrame(rows, columns=ZOO_COLUMNS)


def _zoo_case(name: str, case, device: torch.device, batch_sizes: Sequence[int], *, cudnn: bool) -> list[dict]:
    from ..calcgraph.zoo import measure_case, plan_case

    graph = plan_case(case, device)
    # cuBLAS's per-process workspaces are allocated by the first matmul and live on: made before the meter
    measure_case(case, 2, device)
    rows = []
    for batch in batch_sizes:
        _reset(device)
        try:
            meter = measure_case(case, batch, device)
            allocated, reserved = meter.peak_bytes, meter.reserved_peak_bytes
        except (RuntimeError, ValueError):  # e.g. BatchNorm1d cannot train on a batch of one
            allocated = reserved = float("nan")
        predicted = graph.required_bytes(batch)
        rows.append({"model": name, "batch_size": batch, "cudnn": cudnn, "predicted_bytes": predicted,
                     "max_memory_allocated": allocated, "max_memory_reserved": reserved,
                     "error": (predicted - allocated) / allocated, "device": str(device)})
    return rows


def _advisor_parameters(profile: str) -> dict:
    """The advisor notebook's parameters at `profile`: its defaults, then the profile's overrides."""
    from ..devices import repo_root
    from .parameters import load_profile, notebook_parameters

    declared = notebook_parameters(repo_root() / "notebooks" / "advisor.ipynb")
    return {**{k: d.default for k, d in declared.items()}, **load_profile("advisor", profile)}


def advisor_on_device(device: torch.device | str, profile: str, candidates_csv: Path | None = None,
                      decisions_csv: Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The advisor suite at the advisor notebook's `profile` on `device`, one model at a time (cheapest first):
    every candidate's predicted peak against max_memory_allocated (`measured_peak_bytes`) and
    max_memory_reserved (`measured_reserved_bytes`), and each decision."""
    from ..experiments.advisor import suite

    p = _advisor_parameters(profile)
    models = sorted(p["models"], key=lambda m: ADVISOR_ORDER.index(m) if m in ADVISOR_ORDER else len(ADVISOR_ORDER))
    tables, decisions = [], []
    for model in models:
        started = time.perf_counter()
        _reset(torch.device(device))
        try:
            table, decided, _ = suite.evaluate(
                [model], batch_size=p["batch_size"], width=p["width"], image_size=p["image_size"],
                budget_quantile=p["budget_quantile"], repeats=p["repeats"], min_run_time=p["min_run_time"],
                device=device, progress=False)
        except (RuntimeError, ValueError):  # one model that fails stops no other; its traceback is in the log
            _log(f"advisor {model}: failed after {time.perf_counter() - started:.1f} s\n{traceback.format_exc()}")
            continue
        tables.append(table)
        decisions.append(decided)
        _log(f"advisor {model}: {len(table)} candidates, {time.perf_counter() - started:.1f} s")
        if candidates_csv is not None:
            _write_csv(pd.concat(tables, ignore_index=True), candidates_csv)
        if decisions_csv is not None:
            _write_csv(pd.concat(decisions, ignore_index=True), decisions_csv)
    if not tables:
        return pd.DataFrame(), pd.DataFrame()
    return pd.concat(tables, ignore_index=True), pd.concat(decisions, ignore_index=True)


def _summary(zoo: pd.DataFrame, candidates: pd.DataFrame) -> str:
    lines = []
    if len(zoo):
        error = zoo["error"].dropna()
        lines.append(f"zoo: {zoo['model'].nunique()} models x {zoo['batch_size'].nunique()} batches, plan error "
                     f"against max_memory_allocated {error.min():+.1%} .. {error.max():+.1%} "
                     f"(median |error| {error.abs().median():.1%}); refused: "
                     f"{', '.join(sorted(set(zoo.loc[zoo['refused'].notna(), 'model']))) or 'none'}")
    if len(candidates):
        error = candidates["peak_error"].dropna()
        lines.append(f"advisor: {candidates['model'].nunique()} models, {len(candidates)} candidates, peak error "
                     f"{error.min():+.1%} .. {error.max():+.1%} (median |error| {error.abs().median():.1%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.report.gpu_memory", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="gpu", choices=sorted(ZOO_BATCH_SIZES))
    parser.add_argument("--zoo-cases", nargs="*", help="zoo cases to run (default: all)")
    args = parser.parse_args(argv)
    from ..devices import pick_device

    device = pick_device(args.device)
    args.outdir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        _log(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    zoo = zoo_on_device(device, ZOO_BATCH_SIZES[args.profile], args.outdir / "memory-zoo.csv", args.zoo_cases)
    candidates, _ = advisor_on_device(device, args.profile, args.outdir / "memory-advisor.csv",
                                      args.outdir / "memory-decisions.csv")
    print(_summary(zoo, candidates), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
