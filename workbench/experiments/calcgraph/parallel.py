"""Models that fit in a memory budget at once (Fig 12 of "CalcGraph: taming the high costs of deep
learning using models", 2022, Section 4.5).

The paper runs its MLP in n parallel processes on a 5 GB GPU: CalcGraph knows each model's memory
in advance and splits the budget; for PyTorch, "we increase the number of models in steps of one,
till PyTorch fails". Its claim: CalcGraph fits the most models. Per budget and mode, this module
gives three counts:

- `planned_models`: CalcGraph's answer from the plan alone (zero trials, `max_parallel_models`);
- `trial_models`: the planned layout run for real, as many models as the budget guard lets run. The
  guard counts with the plan's own rule, so agreement is a consistency check;
- `pytorch_models`: plain PyTorch (ordinary models and Adam optimizers, `zero_grad()` with
  PyTorch's defaults) run until the guard refuses, the paper's way of finding PyTorch's count. This is
  the paper's comparison.

Modes: `loop` keeps k models resident and trains them one at a time (CalcGraph: k heaps with
persistent gradients); `vmap` steps k models together (CalcGraph: k stacked models in one vmapped
step; plain PyTorch: k forwards, one backward over the summed losses, k optimizer steps). Budgets
are made real on CPU by `BudgetGuard`; everything runs on the CPU.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.calcgraph import BudgetGuard, make_optimizer, max_parallel_models, search_max
from workbench.calcgraph.many import StackedGroup

from .workload import MNIST_SHAPE, paper_mlp

__all__ = ["MODES", "fits_in_budget", "layout_program", "parallel_models", "pytorch_program"]

MODES = ("loop", "vmap")


def fits_in_budget(program: Callable[[], None], budget: float) -> bool:
    """True if `program` runs with its live tensor bytes within `budget` (a `BudgetGuard`)."""
    guard = BudgetGuard(budget)
    try:
        with guard:
            program()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        guard.close()
        gc.collect()


def _batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, *MNIST_SHAPE), torch.zeros(batch_size, dtype=torch.long)


def layout_program(template: nn.Module, k: int, batch_size: int, mode: str, lr: float) -> None:
    """CalcGraph's layout of k models, run for real: two training steps, everything built inside.

    `loop`: k models with gradients kept for the whole run (zeroed in place, as a `Heap` does),
    trained one after another; `vmap`: one `StackedGroup` of k models."""
    x, y = _batch(batch_size)
    if mode == "vmap":
        group = StackedGroup(template, k, lr=lr)
        for _ in range(2):
            group.step(x, y)
        return
    slots = []
    for _ in range(k):
        m = copy.deepcopy(template)
        o = make_optimizer("adam", m.parameters(), lr=lr)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        slots.append((m, o))
    for _ in range(2):
        for m, o in slots:
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=False)


def pytorch_program(template: nn.Module, k: int, batch_size: int, mode: str, lr: float) -> None:
    """Plain PyTorch with k models: ordinary modules and Adam optimizers, `zero_grad()` (gradients
    freed between steps, PyTorch's default), two steps. `loop`: one model after another; `vmap`: all
    k forwards, one backward over the summed losses, then the k optimizer steps."""
    x, y = _batch(batch_size)
    models = [copy.deepcopy(template) for _ in range(k)]
    opts = [make_optimizer("adam", m.parameters(), lr=lr) for m in models]
    for _ in range(2):
        if mode == "loop":
            for m, o in zip(models, opts, strict=True):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
        else:
            for o in opts:
                o.zero_grad()
            sum(F.cross_entropy(m(x), y) for m in models).backward()
            for o in opts:
                o.step()


def _count(program: Callable[[int], None], budget: float, max_models: int) -> tuple[int, int, float]:
    """Models that run, found by trials under the guard: (k, trials, seconds).

    # NOTE: the paper adds one model per trial until PyTorch fails; the count is the same with
    # doubling and then bisection (more models never need less memory), which keeps the paper
    # profile's hundreds of models to a few dozen trials.
    """
    start = time.perf_counter()
    k, trials = search_max(lambda n: fits_in_budget(lambda: program(n), budget), 2, limit=max_models)
    return k, trials, time.perf_counter() - start


def parallel_models(budgets: Sequence[float], *, batch_size: int, modes: Sequence[str] = MODES,
                    lr: float = 1e-2, max_models: int = 4096, progress: bool = False) -> pd.DataFrame:
    """Fig 12: copies of the paper's MLP that fit in each budget at once, per mode: CalcGraph's plan
    (zero trials), its layout found by trials, and plain PyTorch found by trials. Trial searches stop
    at `max_models` (`capped` says a count reached it, so it is a lower bound)."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"modes must be among {MODES}, got {sorted(unknown)}")
    template = paper_mlp()
    rows = []
    for mode in modes:
        graph = None
        for budget in tqdm(budgets, desc=mode, disable=not progress, leave=False):
            start = time.perf_counter()
            plan = max_parallel_models(template, MNIST_SHAPE, budget, batch_size=batch_size, mode=mode, lr=lr,
                                       graph=graph)
            plan_s = time.perf_counter() - start
            graph = plan.graph
            layout = _count(lambda k, mode=mode: layout_program(template, k, batch_size, mode, lr), budget, max_models)
            plain = _count(lambda k, mode=mode: pytorch_program(template, k, batch_size, mode, lr), budget, max_models)
            rows.append({"mode": mode, "budget_bytes": budget, "batch_size": batch_size,
                         "planned_models": plan.models, "plan_evaluations": plan.evaluations, "plan_s": plan_s,
                         "trial_models": layout[0], "trials": layout[1], "trial_s": layout[2],
                         "pytorch_models": plain[0], "pytorch_trials": plain[1], "pytorch_s": plain[2],
                         "capped": max_models in (layout[0], plain[0])})
    return pd.DataFrame(rows)
