"""Sequential checkpoints with planned placement (OpTorch, Ahmed & Naveed, 2021).

``sequential``: ``sc()``, the module wrapper that runs a model's units in checkpointed segments.
``planner``: the cost model, ``plan_checkpoints`` (uniform, smallest, optimal) and plan evaluation.
``profile``: the checkpoint units of a model (residual blocks opened) and the per-unit profile
(time, storages out and saved, forward/backward bytes, the loss) plans are made from.
"""

from workbench.checkpoint.planner import STRATEGIES, CheckpointPlan, evaluate_plan, plan_checkpoints
from workbench.checkpoint.profile import LayerProfile, layers_of, preserved_state, profile_layers, units_of
from workbench.checkpoint.sequential import CheckpointedSequential, sc

__all__ = [
    "STRATEGIES",
    "CheckpointPlan",
    "CheckpointedSequential",
    "LayerProfile",
    "evaluate_plan",
    "layers_of",
    "plan_checkpoints",
    "preserved_state",
    "profile_layers",
    "sc",
    "units_of",
]
