"""run.sh's `memory` part: CalcGraph's held-out zoo and the advisor's suite on CUDA, every prediction against
`torch.cuda.max_memory_allocated` and `max_memory_reserved`.

CalcGraph ("taming the high costs of deep learning using models", 2022), Sections 3.2 and 4.3: memory known
before execution, judged here on the GPU's own allocator. `zoo_on_device` plans each zoo case on the device,
calibrates it there (real steps at small batches, the CUDA allocator's events per op call) and runs the same
training program at batches calibration never ran under `AllocatorMeter`, whose CUDA reading is
`max_memory_allocated` relative to entry beside the caching allocator's `max_memory_reserved`; the
uncalibrated plan's error is kept beside. The advisor suite (`workbench.experiments.advisor.suite.evaluate`)
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

from ..calcgraph.zoo import ACCURACY_COLUMNS

__all__ = ["ZOO_BATCH_SIZES", "ADVISOR_ORDER", "zoo_on_device", "advisor_on_device", "main"]

# batches calibration never runs (it runs 1, 2, 4, 8, 32, checks 16 and 64, and doubles a check that misses)
ZOO_BATCH_SIZES = {"gpu": (3, 40, 160, 640), "smoke": (3,)}
ZOO_COLUMNS = [*ACCURACY_COLUMNS, "device"]
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
    """Each zoo case planned on `device`, calibrated there, and measured there (`calcgraph.zoo.accuracy_table`):
    predicted and uncalibrated bytes against max_memory_allocated (`allocator`, relative to the bytes live before
    the step) beside max_memory_reserved (`reserved`, absolute: what runs out), and whether calibration ever ran
    that batch (`held_out`). A case the planner refuses is a row per batch with the reason (`refused`); one
    refused for cuDNN's RNN kernels is then planned and run again without them ("<case> (cuDNN off)")."""
    from ..calcgraph.zoo import ZOO, accuracy_table

    device = torch.device(device)
    tables = []
    for name in cases or list(ZOO):
        started = time.perf_counter()
        _reset(device)
        try:
            tables.append(accuracy_table([name], batch_sizes, device=device))
        except (RuntimeError, ValueError) as refused:  # one case that cannot be planned stops no other
            tables.append(pd.DataFrame({"model": name, "batch_size": list(batch_sizes),
                                        "refused": f"{type(refused).__name__}: {refused}"}))
        _log(f"zoo {name}: {time.perf_counter() - started:.1f} s")
        if out is not None:
            _write_csv(_zoo_frame(tables, device), out)
    return _zoo_frame(tables, device)


def _zoo_frame(tables: list[pd.DataFrame], device: torch.device) -> pd.DataFrame:
    frame = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    return frame.reindex(columns=ZOO_COLUMNS).assign(device=str(device))


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
                device=device, progress=False, sample=p["run_candidates"], seed=p["seed"],
                candidates=lambda c: c.extra_bits is None or c.extra_bits in p["packed_bits"])
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
        error, plain = zoo["error"].dropna(), zoo["uncalibrated_error"].dropna()
        lines.append(f"zoo: {zoo['model'].nunique()} models x {zoo['batch_size'].nunique()} batches, calibrated plan "
                     f"error against max_memory_allocated {error.min():+.1%} .. {error.max():+.1%} (median |error| "
                     f"{error.abs().median():.1%}; uncalibrated {plain.min():+.1%} .. {plain.max():+.1%}); refused: "
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
