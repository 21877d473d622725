"""Sequential checkpoints with planned placement (OpTorch, Ahmed & Naveed).

``sequential``: ``sc()``, ``plan_checkpoints`` (uniform, smallest, optimal) and plan evaluation.
``profile``: the per-layer profile (time, output bytes, bytes saved for backward) plans are made from.
"""

from workbench.checkpoint.profile import LayerProfile, layers_of, preserved_state, profile_layers
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
]
