"""Sequential checkpoints with planned placement (OpTorch, Ahmed & Naveed, 2021).

``sequential``: ``sc()``, ``plan_checkpoints`` (uniform, smallest, optimal) and plan evaluation.
``profile``: the checkpoint units of a model (residual blocks opened) and the per-unit profile
(time, storages out and saved, forward/backward bytes, the loss) plans are made from.
"""

from workbench.checkpoint.profile import LayerProfile, layers_of, preserved_state, profile_layers, units_of
from workbench.checkpoint.sequential import (
    STRATEGIES,
    CheckpointedSequential,
    CheckpointPlan,
    evaluate_plan,
    plan_checkpoints,
    sc,
)

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
