"""The advisor's peers on the same model, installed and run in the same process (issue 19).

- Peak at the user's batch and at 3x it, which calibration never ran (fp32, AdamW: the one configuration every
  peer models): the advisor's prediction and PyTorch's `MemTracker` under fake tensors
  (torch.distributed._tools.mem_tracker) on the same program, each against `AllocatorMeter` over it, with the
  seconds each took per configuration answered (MemTracker answers one per run, the advisor every candidate at
  every batch from one planning; MemTracker's two traces run side by side in forked processes, as the advisor's
  do); DeepSpeed's model-state estimate where deepspeed is installed.
- Largest batch for a budget (fp32's real peak at twice the user's batch, the margin added; the suite's budget
  fits no fp32 batch of most models): the advisor's (zero trials) against accelerate's `find_executable_batch_size`
  and Lightning's `Tuner.scale_batch_size` (power, binsearch), whose trials run under a `BudgetGuard` (it
  counts tensors, as those tools see out-of-memory); every answer is then run once under `AllocatorMeter`,
  which sees kernel scratch too: an answer above the budget is one that would fail later.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import time

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from workbench.advisor import Advice
from workbench.calcgraph import search_max, training_program
from workbench.calcgraph.forked import run_forked, worker_count
from workbench.experiments.calcgraph.peers import _accelerate, _lightning
from workbench.measure import AllocatorMeter

from .suite import metered_run, suite_model

__all__ = ["memtracker_program_peak", "peer_table"]


class _NewIteration:
    """The hooks `training_program` calls on its `annotate`: none does anything but a new step's, which clears
    MemTracker's module statistics (it refuses a second iteration's otherwise; the peak is kept)."""

    def __init__(self, tracker) -> None:
        self.tracker, self.names = tracker, {}

    def mark(self, phase: str) -> None:
        if phase != "step1":
            self.tracker.reset_mod_stats()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def watch_model(self, *_) -> None: ...
    def tag(self, *_) -> None: ...
    def tag_grads(self, *_) -> None: ...
    def tag_state(self, *_) -> None: ...
    def point(self, *_) -> None: ...
    def grad_ready(self, *_) -> None: ...
    def unwatch(self) -> None: ...


def memtracker_program_peak(advice: Advice, config: str, batch_size: int) -> int:
    """PyTorch's MemTracker prediction of a candidate's own program (as the advisor plans and runs it: build and
    two steps, the user's rows as inputs, token ids too) under fake tensors, at `batch_size`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemTracker()
        with tracker:
            advice.program(config)(batch_size, _NewIteration(tracker))
    return int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


def _timed_memtracker(advice: Advice, batch_size: int) -> tuple[int, float]:
    """`memtracker_program_peak` of the fp32 program at `batch_size`, and the seconds it took."""
    start = time.perf_counter()
    return memtracker_program_peak(advice, "fp32", batch_size), time.perf_counter() - start


def _advisor_peak(advice: Advice, batch_size: int) -> int:
    """The allocator's peak of the advisor's own fp32 program (torch's fused AdamW) at `batch_size`."""
    return metered_run(advice, "fp32", batch_size).peak_bytes


def _allocator_peak(build, shape, batch_size: int, optimizer: str) -> int:
    gc.collect()
    with AllocatorMeter("cpu") as meter:
        training_program(build, shape, batch_size, optimizer=optimizer)
    return meter.peak_bytes


def _trial(finder, method: str) -> dict:
    try:
        return finder()
    except Exception as error:  # noqa: BLE001 - a finder that gives up (accelerate: "reached zero") is a row
        return {"method": method, "max_batch": None, "trials": None, "seconds": None,
                "note": f"failed: {type(error).__name__}: {error}"[:200]}


def peer_table(name: str, advice: Advice, *, width: float, image_size: int, start_batch: int = 256) -> pd.DataFrame:
    """Peak and largest-batch answers of the advisor and its peers for the suite model `name`, each checked
    by a real run (CPU)."""
    model = suite_model(name, width=width, image_size=image_size)
    build, shape = model.build, model.shape
    b = advice.batch_size
    rows = []
    # NOTE: MemTracker traces the advisor's own fp32 program (torch's fused AdamW, the user's rows, token ids too),
    # so both answer for one program, against one allocator run of it, at the suite's batch and at one calibration
    # never ran; the advisor's seconds are its whole planning over every candidate, shared out per candidate
    planned = sum(advice.planning_seconds.values())
    sizes = (b, 3 * b)
    forked = run_forked([functools.partial(_timed_memtracker, advice, size) for size in sizes])
    for size, traced in zip(sizes, forked, strict=True):
        answers = [("advisor (fp32 row)", advice._by_name["fp32"].peak(size), planned / len(advice.table),
                    len(advice.table), f"CalcGraph plan, calibrated; seconds: planning every candidate (traces in "
                    f"{worker_count()} processes), per candidate")]
        try:  # a trace no worker made (one process, or it failed there) is made here
            peak, seconds = traced or _timed_memtracker(advice, size)
            answers.append(("torch MemTracker (fake tensors)", peak, seconds, 1, "the same program, traced at this "
                            "batch" + (" in a forked process beside the other batch's" if traced else "")))
        except Exception as error:  # noqa: BLE001 - a peer that cannot trace this model is a row that says so
            answers.append(("torch MemTracker (fake tensors)", None, None, 0,
                            f"failed: {type(error).__name__}: {error}"[:200]))
        if size == b and importlib.util.find_spec("deepspeed") is None:
            answers.append(("DeepSpeed model-state estimate", None, None, 0, "deepspeed is not installed here"))
        real = _advisor_peak(advice, size)
        rows += [{"model": name, "question": f"peak at batch {size}" + (" (held out)" if size != b else ""),
                  "method": method, "answer": value, "trials": 0, "seconds": seconds, "configurations": answered,
                  "allocator_bytes": real, "error": None if value is None else (value - real) / real, "note": note}
                 for method, value, seconds, answered, note in answers]
    if model.vocab:  # the trial finders' programs draw float inputs and class targets
        return pd.DataFrame(rows + [{"model": name, "question": "largest batch", "method": "trial finders",
                                     "answer": None, "note": "not run: their training programs take float inputs "
                                     "and one class per example, this model token ids and a target per token"}])
    # NOTE: a budget of its own for this question: the suite's (the median candidate's predicted peak) is below what
    # fp32 needs at batch 1 for most models (on 2026-11-29 the advisor answered 0 for ResNet-50 and the ViT, and
    # accelerate "reached zero"), so no answer could be judged; here, the allocator's fp32 peak at twice the batch
    cap = _advisor_peak(advice, 2 * b)
    budget = cap / (1 - advice.margin)
    plan = advice._by_name["fp32"]
    mine = search_max(lambda n: plan.fits(n, cap), b, limit=2**20)[0]
    answers = [{"method": "advisor (fp32 row)", "max_batch": mine, "trials": 0, "seconds": None,
                "note": "zero trials"},
               _trial(lambda: _accelerate(build, shape, cap, start_batch), "accelerate find_executable_batch_size"),
               *(_trial(lambda m=mode: _lightning(build, shape, cap, m, max_val=4 * start_batch),
                        f"lightning scale_batch_size ({mode})") for mode in ("power", "binsearch"))]
    for answer in answers:
        batch = answer["max_batch"]
        # NOTE: the trial peers train Adam; AdamW keeps the same state, so one check serves both
        if not batch:
            real = None
        elif answer["method"].startswith("advisor"):
            real = _advisor_peak(advice, int(batch))
        else:
            real = _allocator_peak(build, shape, int(batch), "adamw")
        rows.append({"model": name, "question": f"largest batch in {budget / 2**20:.2f} MiB (fp32's peak at batch "
                                                f"{2 * b}, the margin added)", "method": answer["method"],
                     "answer": batch, "trials": answer["trials"], "seconds": answer["seconds"],
                     "allocator_bytes": real, "error": None if real is None else real / budget - 1,
                     "note": answer.get("note", "")})
    frame = pd.DataFrame(rows)
    frame["within_budget"] = [None if pd.isna(r["allocator_bytes"]) or r["question"].startswith("peak")
                              else bool(r["allocator_bytes"] <= budget) for _, r in frame.iterrows()]
    return frame
