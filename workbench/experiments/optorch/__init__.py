"""Experiments and plots of the notebook ``optorch`` (OpTorch: optimized deep learning architectures
for resource limited environments, Ahmed & Naveed).

``pipelines``: the six pipelines (B, E-D, M-P, S-C and combinations) and their measurements;
``plots``: the figures.
"""

from .pipelines import (
    PIPELINES,
    Pipeline,
    autoencoder,
    build_model,
    experiment_checkpoint_position,
    experiment_pipeline_memory,
    experiment_planner_pareto,
    experiment_sc_resnet,
    experiment_time_accuracy,
    measure_step,
    prepare,
)
from .plots import (
    plot_capacity,
    plot_checkpoint_position,
    plot_loader_throughput,
    plot_memory_over_iteration,
    plot_pareto,
    plot_pipeline_memory,
    plot_time_accuracy,
)

__all__ = [
    "PIPELINES", "Pipeline", "autoencoder", "build_model", "experiment_checkpoint_position",
    "experiment_pipeline_memory", "experiment_planner_pareto", "experiment_sc_resnet", "experiment_time_accuracy",
    "measure_step", "plot_capacity", "plot_checkpoint_position", "plot_loader_throughput",
    "plot_memory_over_iteration", "plot_pareto", "plot_pipeline_memory", "plot_time_accuracy", "prepare",
]
