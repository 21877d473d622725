"""Experiments for the memory-efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten,
Weinberger, "Memory-Efficient Implementation of DenseNets" (2017).

``memory``, ``timing`` and ``plots`` hold the functions; everything is re-exported here. Each
function measures on the chosen device and returns a pandas DataFrame; the plot functions are
pure (`plot_x(df) -> Figure`). What is reproduced:

- Fig 4 / Section 5: peak training memory against depth for the DenseNet-BC (k=12) variants in
  `VARIANTS` (two naive baselines, checkpointed, shared storage with either buffer policy), with
  the growth exponent fitted in log-log space (`memory_vs_depth`, `fit_growth_exponents`).
- Section 5, "Under the same memory budget": the deepest model each variant fits in a budget,
  read off the measured sweep (`deepest_within_budget`), and at the paper's scale (batch 64,
  12 GB) extrapolated per sample from the sweep (`extrapolate_to_budget`).
- Fig 5: time per minibatch of the 100-layer DenseNet-BC per variant, as paired ratios measured
  in interleaved rounds of one run, with their spread (`time_per_minibatch`).
- Section 4, "roughly 5% of one forward-backward pass": the share of training time spent in
  batch normalization, by ablation (`bn_time_share`).
- Fig 2 right: 3x3 convolution on contiguous vs non-contiguous (strided) input
  (`conv_contiguity`, `contiguity_ratio`).
- Sections 1 and 5: parameter counts of the paper's models (`parameter_counts`).
"""

from .memory import (
    LABELS,
    VARIANTS,
    cifar_bc_params,
    deepest_within_budget,
    extrapolate_to_budget,
    fit_growth_exponents,
    memory_vs_depth,
    parameter_counts,
    parity,
    step_memory,
)
from .plots import plot_budget, plot_conv_contiguity, plot_memory_vs_depth, plot_time_per_minibatch
from .timing import bn_time_share, contiguity_ratio, conv_contiguity, time_per_minibatch

__all__ = [
    "VARIANTS", "LABELS", "parity", "step_memory", "memory_vs_depth", "fit_growth_exponents",
    "deepest_within_budget", "extrapolate_to_budget", "time_per_minibatch", "bn_time_share",
    "conv_contiguity", "contiguity_ratio", "parameter_counts", "cifar_bc_params", "plot_memory_vs_depth",
    "plot_budget", "plot_time_per_minibatch", "plot_conv_contiguity",
]
