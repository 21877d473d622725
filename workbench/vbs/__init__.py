"""Variable batch size across layers (VBS) for inference under a memory budget.

Implements "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et
al.): measure a per-layer profile (`profile`), plan the batch size of every layer with the
paper's dynamic program (`plan`, Section III), compare with the fixed-batch and greedy baselines
(`fbs`, `greedy_vbs`, Section IV), and execute the plan on the real model (`run`).

Example::

    from workbench import vbs
    prof = vbs.profile(model, torch.randn(3, 224, 224), 12).coarsen(256 * 1024)   # 256 KiB units
    p = vbs.plan(prof, memory=80, batch=12)          # 80 units = 20 MiB
    print(p.layer_batches, p.time_per_sample, vbs.fbs(prof, memory=80, batch=12).time_per_sample)
    result = vbs.run(model, p, images)               # result.outputs == model(images)
"""

from .baselines import fbs, fbs_peak, fixed_batch_plan, greedy_vbs
from .executor import Executor, RunResult, run
from .graph import Stage, run_stages, stages_of
from .plan import Plan, Planner, Step, plan
from .profile import Profile, profile, unit_for

__all__ = [
    "Executor", "Plan", "Planner", "Profile", "RunResult", "Stage", "Step", "fbs", "fbs_peak",
    "fixed_batch_plan", "greedy_vbs", "plan", "profile", "run", "run_stages", "stages_of", "unit_for",
]
