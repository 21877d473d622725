"""Experiments and plots of the notebook ``optorch`` (OpTorch: optimized deep learning architectures
for resource limited environments, Ahmed & Naveed, 2021).

``pipelines``: the seven pipelines (B, E-D, M-P, S-C and combinations) and their measurements;
``planning``: sequential checkpoints measured (Figs 8 and 11, the planners, the unit floor);
``peer``: torch's own activation-memory budget under torch.compile beside our planner;
``plots``: the figures.
"""

from .peer import experiment_peer, hook_retained_bytes, meter_retained_bytes
from .pipelines import (
    PIPELINES,
    Pipeline,
    autoencoder,
    build_model,
    experiment_pipeline_memory,
    experiment_sbs,
    experiment_time_accuracy,
    measure_step,
    prepare,
)
from .planning import (
    experiment_checkpoint_position,
    experiment_floor,
    experiment_planner_pareto,
    experiment_sc_resnet,
    unit_floor,
)
from .plots import (
    plot_capacity,
    plot_checkpoint_position,
    plot_loader_throughput,
    plot_memory_over_iteration,
    plot_pareto,
    plot_peer,
    plot_pipeline_memory,
    plot_prediction,
    plot_time_accuracy,
    plot_unit_floor,
)

__all__ = [
    "PIPELINES", "Pipeline", "autoencoder", "build_model", "experiment_checkpoint_position",
    "experiment_floor", "experiment_peer", "experiment_pipeline_memory", "experiment_planner_pareto", "experiment_sbs",
    "experiment_sc_resnet", "experiment_time_accuracy", "hook_retained_bytes", "measure_step",
    "meter_retained_bytes", "plot_capacity", "plot_checkpoint_position", "plot_loader_throughput",
    "plot_memory_over_iteration", "plot_pareto", "plot_peer", "plot_pipeline_memory", "plot_prediction",
    "plot_time_accuracy", "plot_unit_floor", "prepare", "unit_floor",
]
