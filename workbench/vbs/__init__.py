"""Variable batch size across layers (VBS) for inference under a memory budget.

Implements "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et
al.): measure the per-layer tables of a model (`measure_layers` -> `LayerProfile`), plan the
batch size of every layer (`plan`), compare with the fixed-batch and greedy baselines (`fbs`,
`greedy_vbs`, Section IV), and execute the plan on the real model (`run`).

`dp` is the paper's dynamic program alone (Section III), optimal among its *nested* schedules
(each phase carries its samples through a span of layers); Greedy-VBS's layer-by-layer schedules
lie outside that space and are sometimes faster, so `plan` returns the fastest of the DP, FBS
and Greedy-VBS, and `Plan.method` says which ("vbs", "fbs" or "greedy").

Example::

    from workbench import vbs
    tables = vbs.measure_layers(model, torch.randn(3, 224, 224), 12)   # in bytes
    p = vbs.plan(tables, memory=20 * 2**20, batch=12, request="kept")   # 20 MiB, `images` included
    print(p.method, p.layer_batches, p.time_per_sample, p.peak_bytes)
    result = vbs.run(model, p, images)                 # result.outputs == model(images), checked

The request counts in the budget as it is handed over (`Plan.request`): the paper's accounting
("pieces", the default of every planner) frees each sample once the first layer consumed it, as
`Executor` does with a list of per-sample tensors; a tensor the caller keeps ("kept", what
`run(model, p, images)` gets) is held for the whole call.

`smallest_budget` is the least memory a request fits in (what `plan`'s error names). The layers
are read from the model's real forward (`torch.fx`, `stages_of`); the executor checks its first
batch against `model(x)` and raises `ExecutionMismatch` rather than return wrong outputs.

A plan's `peak_bytes` is what the executor allocates, the request included: the DP's accounting
plus the copies a PyTorch executor needs to gather or split phases (`flow`). The executor keeps
every sample in one place between steps, reads shapes with fake tensors, checks outputs one sample
at a time (`check`), refuses a plan it cannot run within that prediction (`UnexecutablePlan`), and
`measure_peak` reads the allocator's own count to check it.
"""

from .baselines import fbs, fbs_peak, fixed_batch_plan, greedy_vbs
from .dynamic_program import DEFAULT_RESOLUTION, MAX_TABLE_CELLS, Planner, dp, plan, smallest_budget
from .check import ExecutionMismatch, tolerances
from .executor import Executor, UnexecutablePlan
from .floor import least_memory_plan
from .graph import Decomposition, Stage, decompose, run_stages, stages_of
from .layers import LayerProfile, measure_layers, unit_for
from .run_plan import RunResult, measure_peak, run
from .schedule import REQUESTS, Plan, Step, check_request, uniform_step

__all__ = [
    "DEFAULT_RESOLUTION", "MAX_TABLE_CELLS", "REQUESTS", "Decomposition", "ExecutionMismatch", "Executor",
    "LayerProfile", "Plan", "Planner", "RunResult", "Stage", "Step", "check_request", "decompose", "dp", "fbs",
    "fbs_peak", "fixed_batch_plan", "greedy_vbs", "least_memory_plan", "measure_layers", "plan", "run", "run_stages",
    "smallest_budget", "stages_of", "tolerances", "uniform_step", "unit_for", "UnexecutablePlan", "measure_peak",
]
