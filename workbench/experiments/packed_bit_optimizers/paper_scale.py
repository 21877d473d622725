"""Table 3's memory at the paper's own size, planned: ResNet-18 (64 channels) on 32x32 CIFAR images at batch 256.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4, Table 3 ("Global GPU Memory
usage" by format: fp32 4720 MB, AMP 4520, fp16 3840, fp16+8 3776; ResNet-18 / CIFAR-10, batch 256, a V100).

Issue 44: a memory claim is judged at the paper's model, input size and batch, which a CPU cannot train in the
notebook's minutes but can plan. CalcGraph's compiler (`workbench.calcgraph.CompiledGraph`) traces each format's
training program under fake tensors at batches 2, 3 and 4 (no memory, ~2-5 s a program whatever the batch) and
answers any batch by arithmetic; `planned_memory` asks it for the paper's batch. The planner's accuracy is shown in
the same run on the same model at a batch that runs here (``check_batch``): the same program run for real under
`workbench.measure.AllocatorMeter` (the c10 allocator's own total: another counting rule than the plan's tensors).

The program is `workbench.calcgraph.training_program` (build, two steps, fresh optimizer: its state is in the
peak) with this notebook's formats: 16-bit weights take 16-bit inputs, AMP runs fp32 weights under autocast, a
packed format runs its per-parameter step (``compile=None``: the C++ CPU kernel, in place, which allocates
nothing; the eager step's chunk temporaries, at most ~1 MB here, are in neither count), with ``in_backward`` the
step fused into backward. Where fp16 is slow on this CPU the real check runs the bf16 twin (`dtypes`), so the plan
is of the twin too: the same bytes (with the in-place kernel, byte for byte).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.calcgraph import CompiledGraph, training_program
from workbench.dtype_probe import Fp16Probe
from workbench.measure import AllocatorMeter
from workbench.models import build

from .dtypes import plan_formats
from .peak_memory import Format, make_optimizer, parse_format

__all__ = ["PAPER_T3", "T3_CHECKED", "T3_RUNS", "planned_memory", "t3_program"]

#: Table 3's training: ResNet-18 (CIFAR stem, 64 channels), 3 x 32 x 32 images, batch 256, SGD with momentum
PAPER_T3 = {"width": 1.0, "size": 32, "batch": 256}
#: (format, step in backward) the Table 3 rows read: the baselines ordinary, fp16+8 both ways, and fp16+8 with
#: its momentum in 16 bits (as plain fp16's), in backward, for the like-with-like row against plain fp16
T3_RUNS = (("fp32", False), ("amp", False), ("fp16", False), ("fp16+8", True), ("fp16+8", False),
           ("fp16+8 bf16 states", True))
#: the runs checked against the allocator by default: every one a ledger row's value reads (fp16+8 without the step
#: in backward is shown beside them, planned only: its check run cost ~8 s of the cpu profile's budget)
T3_CHECKED = tuple(run for run in T3_RUNS if run != ("fp16+8", False))


def t3_program(fmt: Format, in_backward: bool, *, width: float = 1.0, size: int = 32, optimizer: str = "sgd",
               lr: float = 0.01) -> Callable:
    """``program(batch, tracker=None)``: two training steps of ResNet-18 (``width``) in ``fmt`` on 3 x ``size`` x
    ``size`` inputs; what `CompiledGraph` traces and what the check runs for real."""
    def model_fn() -> torch.nn.Module:
        return build("resnet18", width=width, num_classes=10, stem="cifar").to(fmt.param_dtype)

    def make(params) -> torch.optim.Optimizer:
        return make_optimizer(params, fmt, optimizer=optimizer, lr=lr, compile=None if fmt.packed else False)

    def program(batch: int, tracker=None) -> None:
        training_program(model_fn, (3, size, size), batch, optimizer=make, device="cpu", annotate=tracker,
                         input_dtype=fmt.param_dtype, autocast=fmt.autocast, in_backward=in_backward)
    return program


def planned_memory(
    runs: Iterable[tuple[str, bool]] = T3_RUNS, *, width: float = 1.0, size: int = 32, batch: int = 256,
    check_batch: int = 6, optimizer: str = "sgd", fp16_on_slow_cpu: str = "fp16",
    fp16_probe: Fp16Probe | None = None, progress: bool = True, checked: Iterable[tuple[str, bool]] = T3_CHECKED,
) -> pd.DataFrame:
    """Planned peak bytes of each (format, step in backward) at ``batch``, and the plan against the allocator at
    ``check_batch`` (one real run each of the ``checked`` runs; NaN for the others). On the CPU whatever the
    notebook's device (fake tensors need no GPU).

    Columns: ``format`` (asked), ``ran_as`` (the bf16 twin where fp16 is slow here), ``dtype_note``,
    ``step_in_backward``, ``params``, ``batch``, ``planned_bytes`` (at ``batch``), ``check_batch``,
    ``planned_check_bytes``, ``allocator_check_bytes``, ``plan_error`` (planned / allocator - 1 at
    ``check_batch``), ``width``, ``size``, ``affine`` (the plan's fit held at a third traced batch),
    ``plan_s`` and ``check_s`` (seconds), ``model``.
    """
    runs = list(runs)
    if batch < 1 or check_batch < 1:
        raise ValueError(f"batch and check_batch must be >= 1, got {batch}, {check_batch}")
    plan = plan_formats([parse_format(name) for name, _ in runs], device="cpu",
                        fp16_on_slow_cpu=fp16_on_slow_cpu, fp16_probe=fp16_probe)
    rows = []
    for (asked, ran, note), (_, sib) in tqdm(list(zip(plan, runs, strict=True)), desc="planned memory",
                                            disable=not progress):
        program = t3_program(ran, sib, width=width, size=size, optimizer=optimizer)
        start = time.perf_counter()
        graph = CompiledGraph(program, device="cpu", input_shape=(3, size, size), input_dtype=ran.param_dtype,
                              description=f"ResNet-18 x{width} {ran.name}")
        planned, planned_check = graph.required_bytes(batch), graph.required_bytes(check_batch)
        plan_s, start = time.perf_counter() - start, time.perf_counter()
        allocator = math.nan
        if (asked.name, sib) in checked:
            gc.collect()
            torch.manual_seed(0)
            with AllocatorMeter("cpu") as meter:
                program(check_batch)
            allocator = meter.peak_bytes
        params = sum(math.prod(shape) for _, shape, _ in graph.spec["parameters"])
        rows.append({"format": asked.name, "ran_as": ran.name, "dtype_note": note, "step_in_backward": sib,
                     "params": params, "batch": batch, "planned_bytes": planned, "check_batch": check_batch,
                     "planned_check_bytes": planned_check, "allocator_check_bytes": allocator,
                     "plan_error": planned_check / allocator - 1, "width": width, "size": size,
                     "affine": bool(graph.affine), "plan_s": plan_s, "check_s": time.perf_counter() - start,
                     "model": f"ResNet-18 x{width:g} (CIFAR stem), 3x{size}x{size}, {optimizer}"})
    return pd.DataFrame(rows)

