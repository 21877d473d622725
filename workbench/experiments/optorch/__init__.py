"""Experiments, plots and claims of the notebook ``optorch`` (OpTorch: optimized deep learning architectures
for resource limited environments, Ahmed & Naveed, 2021).

``pipelines``: the seven pipelines (B, E-D, M-P, S-C and combinations), Fig 9 and Fig 10;
``planning``: sequential checkpoints measured (Figs 8 and 11, the planners, the unit floor);
``dataflow``: encoding capacity and sizes, selective batch sampling, loaders (Sec. II-A);
``peers``: torch's own activation-memory budget under torch.compile beside our planner;
``paper_scale``: the memory claims of Figs 8 and 10 planned at the paper's own sizes (CalcGraph, fake tensors);
``plots``: the figures; ``claims``: the paper's claims, our targets and checks, and the ledger.
"""

from . import claims
from .dataflow import (
    ENCODED_FORMS,
    capacity_at,
    exact_capacity,
    experiment_capacity,
    experiment_encoded_bytes,
    experiment_loaders,
    experiment_sbs,
)
from .explore import explore_sc
from .paper_scale import experiment_paper_scale, experiment_planned_memory, experiment_planned_sc, plan_check
from .peers import experiment_peer, hook_retained_bytes, meter_retained_bytes, peer_comparison
from .pipelines import (
    PIPELINES,
    Pipeline,
    accuracy_over_seeds,
    autoencoder,
    experiment_pipeline_memory,
    experiment_time_accuracy,
    measure_step,
    prepare,
    time_accuracy_summary,
)
from .planning import (
    experiment_checkpoint_position,
    experiment_floor,
    experiment_planner_pareto,
    experiment_sc_resnet,
    floor_summary,
    optimal_vs_uniform,
    smallest_layer_rank,
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
from .plots import TOY_SCALE

__all__ = [
    "ENCODED_FORMS", "PIPELINES", "Pipeline", "TOY_SCALE", "accuracy_over_seeds", "autoencoder", "capacity_at",
    "claims", "exact_capacity",
    "experiment_capacity", "experiment_checkpoint_position", "experiment_encoded_bytes", "experiment_floor",
    "experiment_loaders", "experiment_paper_scale", "experiment_peer", "experiment_planned_memory",
    "experiment_planned_sc", "plan_check", "experiment_pipeline_memory", "experiment_planner_pareto",
    "experiment_sbs", "experiment_sc_resnet", "experiment_time_accuracy", "explore_sc", "floor_summary",
    "hook_retained_bytes",
    "measure_step", "meter_retained_bytes", "optimal_vs_uniform", "peer_comparison", "plot_capacity",
    "plot_checkpoint_position", "plot_loader_throughput", "plot_memory_over_iteration", "plot_pareto", "plot_peer",
    "plot_pipeline_memory", "plot_prediction", "plot_time_accuracy", "plot_unit_floor", "prepare",
    "smallest_layer_rank", "time_accuracy_summary", "unit_floor",
]
