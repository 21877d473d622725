"""Table 2's memory at the paper's own size, planned: flan-T5 large fine-tuned at batch 16 x 128 tokens.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.2 and Table 2 (the step
fused into backward lowers the peak of fine-tuning a large flan-T5 on GLUE by 11%: 29,930 -> 26,818 MB on MNLI,
batch 16, 128 tokens, AdamW). Section 3.2 says why it can: "every gradient of every parameter has to be stored in
the memory at all time (or at least as long as the optimizer has not stepped)".

Issue 44: a memory claim is judged at the paper's model, input size and batch, which a CPU cannot train but can
plan. Table 2's program (`table2.fused_backward`'s model: `T5Classifier` of `flan_t5_config`, fp32 weights, AdamW,
two steps with a fresh optimizer) is traced under fake tensors (CalcGraph's tracker, `workbench.calcgraph`) once at
the batch asked, each way: no fit, since only that batch is answered. A trace is exact for the program it runs
(tensors, not the kernels' scratch); the token ids are real, so the classifier's end-of-sequence mask indexes as
in a real run (`calcgraph.values`). The planner is checked in the same run on the same program at a size that runs
here (`check`): that program run for real under `workbench.measure.AllocatorMeter` (the c10 allocator's own total,
scratch included: another count than the plan's tensors).

What the saving can be is read off the plan itself: ``gradients_at_peak``, the gradient bytes live at the ordinary
run's peak, is all the step in backward can free there (its ``ceiling`` over the peak). Where a step ends with
``zero_grad(set_to_none=True)`` (torch's default since 2.0) no gradient is alive during the next forward; where
the gradients are kept between steps (zeroed in place, the loop section 3.2 describes) they are: ``keep_grads``
plans that loop too.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from workbench.calcgraph import training_program
from workbench.calcgraph.forked import run_forked, trace_program
from workbench.measure import AllocatorMeter

from .table2 import T5Classifier, _token_batches, flan_t5_config

__all__ = ["PAPER_T2", "planned_fused_backward", "t2_program"]

#: Table 2's fine-tuning: flan-T5 large (d_model 1024, 24 + 24 layers), batch 16 x 128 tokens, AdamW lr 2e-5
PAPER_T2 = {"d_model": 1024, "layers": 24, "batch": 16, "seq": 128}
#: the programs planned: (name, step in backward, gradients kept between steps)
_PROGRAMS = (("ordinary", False, False), ("in backward", True, False), ("ordinary, gradients kept", False, True))


def t2_program(d_model: int, layers: int, seq: int, *, in_backward: bool, keep_grads: bool = False,
               lr: float = 2e-5) -> Callable:
    """``program(batch, tracker=None)``: two fp32 AdamW steps of Table 2's T5 classifier on token batches that end
    in </s> (``keep_grads``: gradients zeroed in place between steps instead of freed)."""
    config = flan_t5_config(d_model, layers)

    def model_fn() -> torch.nn.Module:
        torch.manual_seed(0)
        return T5Classifier(config)

    def make_batch(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with unset_fake_temporarily():  # token ids are data: real even under a plan's fake tensors
            tokens, labels = _token_batches(config.vocab_size, size, seq, 1, seed=0)[0]
        return tokens.to(device), labels.to(device)

    def program(batch: int, tracker=None) -> None:
        training_program(model_fn, (seq,), batch, optimizer="adamw", lr=lr, device="cpu", annotate=tracker,
                         input_dtype=torch.long, in_backward=in_backward, persistent_grads=keep_grads,
                         make_batch=make_batch)
    return program


def _peak(trace) -> tuple[int, int, str]:
    """(peak tensor bytes, gradient bytes live at it, the step it falls in) of one trace."""
    live, (born, died) = trace.live(), trace.lifetimes()
    at = int(live.argmax())
    alive = np.nonzero((born <= at) & (died > at))[0]
    grads = sum(int(trace.sizes[i]) for i in alive if trace.info[i]["kind"] == "gradient")
    event = int(trace.events[at])
    return int(live[at]), grads, trace.info[event if event >= 0 else -event - 1]["phase"]


def planned_fused_backward(*, d_model: int = 1024, layers: int = 24, batch: int = 16, seq: int = 128,
                           check: tuple[int, int, int, int] | None = None, keep_grads: bool = True) -> pd.DataFrame:
    """Planned peak of Table 2's program at ``(d_model, layers, batch, seq)`` each way (and, with ``keep_grads``,
    the ordinary loop that keeps its gradients), and at ``check`` (the same four, the size a real run measures
    beside it) ordinary and in backward, each also run for real there (``allocator_bytes``: AllocatorMeter's peak;
    ``plan_error`` = planned / allocator - 1; NaN at the paper's size). One row per program and size: ``size``
    ("paper" / "check"), ``program``, ``step_in_backward``, ``keep_grads``, ``params``, ``planned_bytes``,
    ``gradients_at_peak``, ``peak_step``, ``trace_s`` (each program's trace, run side by side in forked workers),
    ``model``."""
    if min(d_model, layers, batch, seq) < 1:
        raise ValueError(f"need d_model, layers, batch, seq >= 1, got {d_model}, {layers}, {batch}, {seq}")
    if check is not None and (len(check) != 4 or min(check) < 1):
        raise ValueError(f"check: (d_model, layers, batch, seq), each >= 1, got {check!r}")
    jobs = [("paper", (d_model, layers, batch, seq), p) for p in _PROGRAMS if keep_grads or not p[2]]
    jobs += [("check", check, p) for p in _PROGRAMS[:2]] if check is not None else []

    def traced(dims, program) -> tuple:
        start = time.perf_counter()
        trace = trace_program(t2_program(dims[0], dims[1], dims[3], in_backward=program[1],
                                         keep_grads=program[2]), dims[2], torch.device("cpu"))
        return _peak(trace), sum(int(np.prod(s)) for _, s, _ in trace.spec["parameters"]), \
            time.perf_counter() - start
    calls = [lambda dims=dims, program=program: traced(dims, program) for _, dims, program in jobs]
    made = run_forked(calls)  # None for a job a worker did not run: run here
    rows = []
    for (size, dims, (name, sib, kept)), result in zip(jobs, made, strict=True):
        (peak, grads, step), params, seconds = result if result is not None else traced(dims, (name, sib, kept))
        allocator = math.nan
        if size == "check":  # the same program for real, after every trace: the allocator's own count
            gc.collect()
            with AllocatorMeter("cpu") as meter:
                t2_program(dims[0], dims[1], dims[3], in_backward=sib, keep_grads=kept)(dims[2])
            allocator = meter.peak_bytes
        rows.append({"size": size, "program": name, "step_in_backward": sib, "keep_grads": kept, "params": params,
                     "d_model": dims[0], "layers": dims[1], "batch": dims[2], "seq": dims[3], "planned_bytes": peak,
                     "allocator_bytes": allocator, "plan_error": peak / allocator - 1,
                     "gradients_at_peak": grads, "peak_step": step, "trace_s": seconds,
                     "model": f"T5 d_model {dims[0]}, {dims[1]}+{dims[1]} layers, batch {dims[2]} x {dims[3]} "
                              f"tokens, AdamW fp32"})
    return pd.DataFrame(rows)
