"""run.sh's `memory` part: CalcGraph's held-out zoo and the advisor's suite on CUDA, every prediction against
`torch.cuda.max_memory_allocated` and `max_memory_reserved`.

CalcGraph ("taming the high costs of deep learning using models", 2022), Sections 3.2 and 4.3: memory known
before execution, judged here on the GPU's own allocator. `zoo_on_device` plans each zoo case on the device,
calibrates it there (real steps at small batches, the CUDA allocator's events per op call) and runs the same
training program at batches calibration never ran under `AllocatorMeter`, whose CUDA reading is
`max_memory_allocated` relative to entry beside the caching allocator's `max_memory_reserved`; the
uncalibrated plan's error is kept beside. Then the advisor suite runs at the advisor notebook's gpu profile,
one model at a time, through that notebook's own entry point (`python -m workbench.experiments.advisor.on_device`,
`advisor_command`): a program this module starts, not code it imports, since the GPU run sits below the
notebooks' experiments (DESIGN.md).

Each table is rewritten (atomically) after each model, so a run stopped at its deadline keeps every model it
finished; models run cheapest first. Run as `python -m workbench.gpu.memory OUTDIR --device cuda`
(run.sh does, under its deadline); `--profile smoke --device cpu` is the dry run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from ..calcgraph.zoo import ACCURACY_COLUMNS
from ..part_output import log, release_memory, write_csv

__all__ = ["ZOO_BATCH_SIZES", "zoo_on_device", "advisor_command", "main"]

# batches calibration never runs (it runs 1, 2, 4, 8, 32, checks 16 and 64, and doubles a check that misses)
ZOO_BATCH_SIZES = {"gpu": (3, 40, 160, 640), "smoke": (3,)}
ZOO_COLUMNS = [*ACCURACY_COLUMNS, "device"]


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
        release_memory(device)
        try:
            tables.append(accuracy_table([name], batch_sizes, device=device))
        except (RuntimeError, ValueError) as refused:  # one case that cannot be planned stops no other
            tables.append(pd.DataFrame({"model": name, "batch_size": list(batch_sizes),
                                        "refused": f"{type(refused).__name__}: {refused}"}))
        log(f"zoo {name}: {time.perf_counter() - started:.1f} s")
        if out is not None:
            write_csv(_zoo_frame(tables, device), out)
    return _zoo_frame(tables, device)


def _zoo_frame(tables: list[pd.DataFrame], device: torch.device) -> pd.DataFrame:
    frame = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    return frame.reindex(columns=ZOO_COLUMNS).assign(device=str(device))


def _summary(zoo: pd.DataFrame) -> str:
    if not len(zoo):
        return ""
    error, plain = zoo["error"].dropna(), zoo["uncalibrated_error"].dropna()
    return (f"zoo: {zoo['model'].nunique()} models x {zoo['batch_size'].nunique()} batches, calibrated plan "
            f"error against max_memory_allocated {error.min():+.1%} .. {error.max():+.1%} (median |error| "
            f"{error.abs().median():.1%}; uncalibrated {plain.min():+.1%} .. {plain.max():+.1%}); refused: "
            f"{', '.join(sorted(set(zoo.loc[zoo['refused'].notna(), 'model']))) or 'none'}")


def advisor_command(outdir: Path, device: str, profile: str) -> list[str]:
    """The advisor suite's command line (its notebook's own entry point, `workbench.experiments.advisor.on_device`):
    run as a program, so this layer imports no notebook's experiments."""
    return [sys.executable, "-u", "-m", "workbench.experiments.advisor.on_device", str(outdir), "--device", device,
            "--profile", profile]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.gpu.memory", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="gpu", choices=sorted(ZOO_BATCH_SIZES))
    parser.add_argument("--zoo-cases", nargs="*", help="zoo cases to run (default: all)")
    args = parser.parse_args(argv)
    from ..devices import pick_device

    device = pick_device(args.device)
    args.outdir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        log(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    zoo = zoo_on_device(device, ZOO_BATCH_SIZES[args.profile], args.outdir / "memory-zoo.csv", args.zoo_cases)
    print(_summary(zoo), flush=True)
    # NOTE: the advisor half writes memory-advisor.csv and memory-decisions.csv and prints its own summary line;
    # in this process's group, so the part's deadline (Ctrl-C, then a kill) reaches it as it reached the suite
    return subprocess.run(advisor_command(args.outdir, str(device), args.profile)).returncode


if __name__ == "__main__":
    sys.exit(main())
