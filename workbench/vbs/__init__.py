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
    tables = vbs.measure_layers(model, torch.randn(3, 224, 224), 12).coarsen(256 * 1024)  # 256 KiB units
    p = vbs.plan(tables, memory=80, batch=12)          # 80 units = 20 MiB
    print(p.method, p.layer_batches, p.time_per_sample, vbs.fbs(tables, memory=80, batch=12).time_per_sample)
    result = vbs.run(model, p, images)                 # result.outputs == model(images)
"""

from .baselines import fbs, fbs_peak, fixed_batch_plan, greedy_vbs
from .dynamic_program import MAX_TABLE_CELLS, Planner, dp, plan
from .executor import Executor, RunResult, run
from .graph import Stage, run_stages, stages_of
from .layers import LayerProfile, measure_layers, unit_for
from .schedule import Plan, Step, check_request, uniform_step

__all__ = [
    "MAX_TABLE_CELLS", "Executor", "LayerProfile", "Plan", "Planner", "RunResult", "Stage", "Step", "check_request",
    "dp", "fbs", "fbs_peak", "fixed_batch_plan", "greedy_vbs", "measure_layers", "plan", "run", "run_stages",
    "stages_of", "uniform_step", "unit_for",
]
