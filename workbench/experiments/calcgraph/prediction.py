"""Memory known before execution (Sections 3.2 and 4.3 of "CalcGraph: taming the high costs of deep
learning using models", 2022): the plan's prediction against a real run, and the size of a static
heap laid out the CalcHeap's way.

What each comparison is worth:

- On CPU the measured peak (`measured_bytes`) comes from `MemoryMeter`'s live-storage tracker, which
  counts with the plan's own rule (`workbench.measure.LiveStorageMode`): agreement there shows the
  plan is consistent with that rule, not that it is right. On CUDA it is the caching allocator's
  `max_memory_allocated`. The `meter` column says which one each row used.
- `allocator_bytes` is the same run measured by `AllocatorMeter`, which shares nothing with the plan
  on either device: on CPU the c10 allocator's running total from torch.profiler's allocation events
  (kernel scratch included), on CUDA `max_memory_allocated`. `allocator_error` judges the plan
  against it (the paper's "known before execution").
- `calcheap_layout` gives the paper's quantity for batch 10,000 (Section 4.3's "83 MB"): a heap in
  which every variable has its own offset (Section 3.2), i.e. the bytes of every tensor the
  steady-state training step touches, summed. The dynamic peak (what PyTorch's allocator needs,
  tensors reusing freed memory) is beside it, for contrast only.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.calcgraph import ZONES, plan_training, training_program
from workbench.measure import MemoryMeter, format_bytes

from .workload import model_factory, paper_mlp_plan

__all__ = [
    "ALLOCATORS", "METERS", "PAPER_HEAP_BATCH", "calcheap_layout", "explain_max_batch", "meter_name",
    "prediction_error",
]

PAPER_HEAP_BATCH = 10_000  # Section 4.3: "for a batch size of 10,000, we need a CalcHeap of 83MB"
# what measured a row's peak: the CUDA caching allocator (independent of the plan) or the live-storage
# tracker (the plan's own counting rule)
METERS = {"cuda": "cuda allocator", "cpu": "live-storage tracker"}
# what measured a row's `allocator_bytes` (AllocatorMeter): independent of the plan on both devices
ALLOCATORS = {"cuda": "cuda allocator", "cpu": "cpu allocator (torch.profiler)"}


def _measure(build, shape, batch_size: int, device: torch.device) -> MemoryMeter:
    """One real run of the planned program under `MemoryMeter` with its allocator measure."""
    if device.type == "cuda":
        # NOTE: as in `measure_required_bytes`: one unmetered step creates cuBLAS's per-process workspaces
        training_program(build, shape, 1, device=device, steps=1)
        torch.cuda.empty_cache()
    gc.collect()  # garbage of an earlier run freed inside the meter would lower the allocator's count
    with MemoryMeter(device, allocator=True) as meter:
        training_program(build, shape, batch_size, device=device)
    return meter


def meter_name(device: torch.device | str) -> str:
    """Which measure `MemoryMeter` uses on `device` (a value of `METERS`)."""
    return METERS["cuda" if torch.device(device).type == "cuda" else "cpu"]


def prediction_error(
    models: Sequence[str], batch_sizes: Sequence[int], *, resnet_width: float = 1.0, image_size: int = 32,
    resnet_batch_sizes: Sequence[int] | None = None, device=None, progress: bool = False,
) -> pd.DataFrame:
    """Predicted (plan, fake tensors) vs measured (`MemoryMeter`, real run) peak bytes of the same
    program: build model and Adam, two training steps. One row per model and batch size; `error` is
    against `measured_bytes` (`meter`), `allocator_error` against `allocator_bytes` (`allocator`)."""
    dev = torch.device(device or "cpu")
    rows = []
    for name in models:
        build, shape = model_factory(name, resnet_width=resnet_width, image_size=image_size)
        start = time.perf_counter()
        graph = plan_training(build, shape, device=dev, calibrate=False)  # the paper's plan
        plan_s = time.perf_counter() - start
        sizes = resnet_batch_sizes if (name == "resnet18" and resnet_batch_sizes) else batch_sizes
        for b in tqdm(sizes, desc=name, disable=not progress, leave=False):
            predicted = graph.required_bytes(b)
            torch.manual_seed(0)
            start = time.perf_counter()
            meter = _measure(build, shape, b, dev)
            measured, allocated = meter.peak_bytes, meter.allocator_peak_bytes
            rows.append({"model": name, "batch_size": b, "predicted_bytes": predicted, "measured_bytes": measured,
                         "error": (predicted - measured) / measured, "affine": graph.affine,
                         "meter": meter_name(dev), "allocator_bytes": allocated,
                         "allocator_error": (predicted - allocated) / allocated,
                         "allocator": ALLOCATORS["cuda" if dev.type == "cuda" else "cpu"],
                         "compile_s": plan_s, "measure_s": time.perf_counter() - start})
    return pd.DataFrame(rows)


def calcheap_layout(*, batch_size: int = PAPER_HEAP_BATCH, lr: float = 1e-2, device=None) -> pd.DataFrame:
    """The paper's MLP with Adam at `batch_size`, per zone: `static_bytes` (every variable the
    steady-state step touches at its own offset, the CalcHeap's layout rule) and `peak_bytes` (bytes
    live at the predicted peak, what a dynamic allocator needs). Plan only: nothing is allocated."""
    graph = paper_mlp_plan(lr=lr, device=device)
    zones = graph.zone_bytes(batch_size).set_index("zone")
    variables = graph.zones(batch_size)["zone"].astype(str).value_counts()
    return pd.DataFrame({
        "zone": list(ZONES), "batch_size": batch_size,
        "static_bytes": [int(zones.loc[z, "bytes_allocated_in_step"]) for z in ZONES],
        "peak_bytes": [int(zones.loc[z, "bytes_at_peak"]) for z in ZONES],
        "variables": [int(variables.get(z, 0)) for z in ZONES],
    })


def explain_max_batch(model: str, budget_bytes: float, *, margin: float = 0.0, resnet_width: float = 1.0,
                      image_size: int = 32, device=None) -> str:
    """One sentence: the plan's largest batch of `model` within `budget_bytes` (for the notebook's
    interactive explorer), or why batch 1 does not fit."""
    build, shape = model_factory(model, resnet_width=resnet_width, image_size=image_size)
    graph = plan_training(build, shape, device=device, calibrate=False)
    try:
        b = graph.max_batch_size(budget_bytes, margin=margin)
    except ValueError as err:
        return str(err)
    return (f"{model}: largest batch {b} ({format_bytes(graph.required_bytes(b))} of {format_bytes(budget_bytes)}, "
            f"margin {margin:.0%}); batch {b + 1} needs {format_bytes(graph.required_bytes(b + 1))}")
