"""CalcGraph: "CalcGraph: taming the high costs of deep learning using models (2022)".

A training step's memory is compiled before it runs (`plan_training`, Section 3.2): four zones,
the peak for any batch size and the largest batch for a budget with zero trial runs at that batch. A
pre-allocated `Heap` holds parameters, gradients and optimizer state and switches models in
and out with one copy per zone (Section 3.3); `train_many` trains many models in one budget
(Sections 4.4-4.5). `BudgetGuard` makes a memory budget real on CPU for trial-based peers. On CPU a
plan is calibrated against the allocator by default: the workspaces and scratch real kernels allocate
beyond their fake tensors, measured in real steps at small batches (`calibrate=False`: the paper's
plan, fake tensors alone). The traced program is the user's (`workbench.inplace`: the in-place paths torch
leaves under a dispatch mode; `values`: integer values that shape memory, packed sequences).
`plan_sharded_training` plans one rank of a model sharded by FSDP2 in a fake process group (`sharded`).
"""

from .guard import BudgetGuard, cuda_memory_budget
from .heap import Heap, HeapSnapshot
from .many import max_parallel_models, plan_parallel_training, train_many
from .sharded import fake_group, plan_sharded_training, run_on_ranks, sharded_memory_check
from .plan import (
    CALIBRATED_ZONE, ZONES, CompiledGraph, make_optimizer, measure_required_bytes, plan_training, search_max,
    training_program,
)
from .tracker import Unplannable

__all__ = [
    "CALIBRATED_ZONE", "ZONES", "BudgetGuard", "CompiledGraph", "Heap", "HeapSnapshot", "cuda_memory_budget",
    "make_optimizer",
    "max_parallel_models", "measure_required_bytes", "plan_parallel_training", "plan_training", "search_max",
    "train_many", "training_program", "Unplannable",
    "fake_group", "plan_sharded_training", "run_on_ranks", "sharded_memory_check",
]
