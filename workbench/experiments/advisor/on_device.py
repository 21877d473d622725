"""The advisor notebook's suite on a device, as the GPU run's `memory` part runs it: every candidate's predicted
peak against `torch.cuda.max_memory_allocated` and `max_memory_reserved`, at the notebook's own profile.

The advisor's held-out suite (issue 19; `suite.evaluate`) at the advisor notebook's parameters for a profile
(its defaults, then `notebooks/profiles/advisor.yaml`), one model at a time, cheapest first, each table
rewritten (atomically) after each model so that a run stopped at its deadline keeps every model it finished.
The GPU run (`workbench.gpu.memory`, after CalcGraph's zoo) starts it as a program, which keeps the layers one
way: the GPU run imports no notebook's experiments::

    python -m workbench.experiments.advisor.on_device OUTDIR --device cuda --profile gpu

writes OUTDIR/memory-advisor.csv and OUTDIR/memory-decisions.csv; `--profile smoke --device cpu` is the dry run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from workbench.devices import pick_device, repo_root
from workbench.part_output import log, release_memory, write_csv
from workbench.report.parameters import load_profile, notebook_parameters

from . import suite

__all__ = ["ADVISOR_ORDER", "advisor_on_device", "main"]

ADVISOR_ORDER = ("mlp", "lstm", "transformer", "gpt2", "densenet_bc_100", "resnet50", "vit")  # cheapest first


def _advisor_parameters(profile: str) -> dict:
    """The advisor notebook's parameters at `profile`: its defaults, then the profile's overrides."""
    declared = notebook_parameters(repo_root() / "notebooks" / "advisor.ipynb")
    return {**{k: d.default for k, d in declared.items()}, **load_profile("advisor", profile)}


def advisor_on_device(device: torch.device | str, profile: str, candidates_csv: Path | None = None,
                      decisions_csv: Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The advisor suite at the advisor notebook's `profile` on `device`, one model at a time (cheapest first):
    every candidate's predicted peak against max_memory_allocated (`measured_peak_bytes`) and
    max_memory_reserved (`measured_reserved_bytes`), and each decision."""
    p = _advisor_parameters(profile)
    models = sorted(p["models"], key=lambda m: ADVISOR_ORDER.index(m) if m in ADVISOR_ORDER else len(ADVISOR_ORDER))
    tables, decisions = [], []
    for model in models:
        started = time.perf_counter()
        release_memory(torch.device(device))
        try:
            table, decided, _ = suite.evaluate(
                [model], batch_size=p["batch_size"], width=p["width"], image_size=p["image_size"],
                budget_quantile=p["budget_quantile"], repeats=p["repeats"], min_run_time=p["min_run_time"],
                device=device, progress=False, sample=p["run_candidates"], seed=p["seed"],
                candidates=lambda c: c.extra_bits is None or c.extra_bits in p["packed_bits"])
        except (RuntimeError, ValueError):  # one model that fails stops no other; its traceback is in the log
            log(f"advisor {model}: failed after {time.perf_counter() - started:.1f} s\n{traceback.format_exc()}")
            continue
        tables.append(table)
        decisions.append(decided)
        log(f"advisor {model}: {len(table)} candidates, {time.perf_counter() - started:.1f} s")
        if candidates_csv is not None:
            write_csv(pd.concat(tables, ignore_index=True), candidates_csv)
        if decisions_csv is not None:
            write_csv(pd.concat(decisions, ignore_index=True), decisions_csv)
    if not tables:
        return pd.DataFrame(), pd.DataFrame()
    return pd.concat(tables, ignore_index=True), pd.concat(decisions, ignore_index=True)


def _summary(candidates: pd.DataFrame) -> str:
    if not len(candidates):
        return ""
    error, held = candidates["peak_error"].dropna(), candidates.get("held_out_error", pd.Series(dtype=float)).dropna()
    out = (f"advisor: {candidates['model'].nunique()} models, {len(candidates)} candidates, peak error "
           f"{error.min():+.1%} .. {error.max():+.1%} (median |error| {error.abs().median():.1%})")
    return out + (f"; at the held-out batch {held.min():+.1%} .. {held.max():+.1%} (median |error| "
                  f"{held.abs().median():.1%})" if len(held) else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.experiments.advisor.on_device",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="gpu", choices=["gpu", "smoke"])
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    args.outdir.mkdir(parents=True, exist_ok=True)
    candidates, _ = advisor_on_device(device, args.profile, args.outdir / "memory-advisor.csv",
                                      args.outdir / "memory-decisions.csv")
    print(_summary(candidates), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
