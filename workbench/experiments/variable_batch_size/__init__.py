"""Experiments of the notebook ``variable_batch_size``: "Variable batch size across layers for
efficient prediction on CNNs" (Choudhury, Goyal, Sabharwal, Verma, IBM Research), Sections II-IV.

``tables``, ``planner``, ``budgets``, ``gains`` and ``plots`` hold the functions (re-exported
here), ``claims`` the paper's claims as data and the function that judges them. Each experiment
returns a pandas DataFrame; the plot functions are pure (`plot_x(df) -> Figure`). What is
reproduced:

- Section III's worked example: the DP against FBS and Greedy-VBS (`worked_example`).
- Fig 1: per-image time against batch size (`time_vs_batch`, from the measured tables).
- Fig 2: memory per layer at batch 1, input + output + workspace (`layer_memory`), each layer
  group's kind beside it (`layer_kinds`), read at the layers the paper names.
- Figs 7 and 8: per-image time against the memory budget for the DP ("vbs"), FBS and Greedy-VBS,
  predicted from the tables (`budget_sweep`) and executed on the model (`execute_sweep`), and how
  well the prediction holds (`agreement`).
- Table II: the largest throughput gain over FBS at tight and loose budgets (`gains`, `table_ii`).
- Fig 9 and Table III: the DP's batch sizes per layer and the memory each layer leaves unused,
  FBS against VBS, for GoogLeNet at the paper's 20 MB (`layer_batches`, `table_iii`).
- The planner's own speed, a target of ours (`planner_timing`).
- The explore widget: one budget and request at a time (`explore_budget`).
- The memory-only rows at the paper's 224x224, full width, from meta-tensor shapes (`paper_scale_sweep`,
  `fbs_unused`): beside the rows as context where the notebook ran smaller (working space not seen).

Figures made where the notebook's `verdicts` is False are marked `TOY_SCALE` on themselves.
"""

from . import claims
from .budgets import (
    LOOSE_MB, METHODS, PAPER_FLOOR_MB, TIGHT_MB, agreement, budget_sweep, execute_sweep, plan_at_ratio, sweep_plan,
)
from .explore import explore_budget
from .gains import (
    PAPER_BUDGET_MB, TABLE_II, TABLE_III, gains, layer_batches, reduction_pct, table_ii, table_iii, unused_memory,
)
from .paper_scale import SHAPES, fbs_unused, paper_scale_sweep, shape_tables
from .planner import example_tables, planner_timing, random_layers, worked_example
from .plots import (
    plot_budget_sweep, plot_layer_batches, plot_layer_memory, plot_planner_timing, plot_request_sizes,
    plot_time_vs_batch,
)
from .plots import TOY_SCALE
from .tables import (
    LABELS, NETWORKS, PAPER_IMAGE_SIZE, build_network, layer_kinds, layer_memory, measure_networks, tables_frame,
    time_vs_batch,
)

__all__ = [
    "claims", "NETWORKS", "LABELS", "PAPER_IMAGE_SIZE", "build_network", "measure_networks", "time_vs_batch",
    "layer_kinds", "layer_memory", "tables_frame", "example_tables", "worked_example", "random_layers",
    "planner_timing",
    "PAPER_FLOOR_MB", "TIGHT_MB", "LOOSE_MB", "METHODS", "budget_sweep", "sweep_plan", "plan_at_ratio",
    "execute_sweep", "agreement", "TABLE_II", "TABLE_III", "PAPER_BUDGET_MB", "reduction_pct", "gains", "table_ii",
    "unused_memory", "table_iii", "layer_batches", "plot_time_vs_batch", "plot_layer_memory", "plot_budget_sweep",
    "plot_request_sizes", "plot_layer_batches", "plot_planner_timing", "TOY_SCALE", "explore_budget",
    "SHAPES", "shape_tables", "paper_scale_sweep", "fbs_unused",
]
