"""Experiments for the memory-efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten,
Weinberger, "Memory-Efficient Implementation of DenseNets" (2017).

``memory``, ``budget``, ``timing`` and ``plots`` hold the functions (re-exported here), ``claims``
the paper's claims as data and the function that judges them. Each experiment measures on the
chosen device and returns a pandas DataFrame; the plot functions are pure (`plot_x(df) -> Figure`).
What is reproduced:

- Fig 4 / Sections 3-5: peak training memory against depth for the DenseNet-BC (k=12) variants in
  `VARIANTS` (two naive baselines, checkpointed, shared storage with either buffer policy), with
  the growth exponent fitted in log-log space (`memory_vs_depth`, `fit_growth_exponents`).
- Section 5, "Under the same memory budget": the deepest model each variant fits in a budget,
  read off the measured sweep (`memory_budget`), and at the paper's scale (batch 64, 12 GB)
  extrapolated per sample from the sweep (`extrapolate_to_budget`).
- Fig 5: time per minibatch of the 100-layer DenseNet-BC per variant, as paired ratios measured
  in interleaved rounds of one run, with their spread (`time_per_minibatch`).
- Section 4, "roughly 5% of one forward-backward pass": the share of training time spent in
  batch normalization, by ablation (`bn_time_share`).
- Fig 2 right: 3x3 convolution on contiguous vs non-contiguous (strided) input
  (`conv_contiguity`, `contiguity_ratio`).
- Sections 1 and 5: parameter counts of the paper's models (`parameter_counts` of `PAPER_MODELS`).
"""

from . import claims
from .budget import (
    PAPER_BATCH_SIZE,
    PAPER_BUDGET_BYTES,
    PAPER_MODELS,
    STEP_BYTES,
    cifar_bc_params,
    deepest_within_budget,
    extrapolate_to_budget,
    memory_budget,
    parameter_counts,
    with_state,
)
from .memory import LABELS, VARIANTS, fit_growth_exponents, memory_table, memory_vs_depth, parity, step_memory
from .plots import plot_budget, plot_conv_contiguity, plot_memory_vs_depth, plot_time_per_minibatch
from .timing import bn_time_share, contiguity_ratio, conv_contiguity, time_per_minibatch

__all__ = [
    "claims", "VARIANTS", "LABELS", "parity", "step_memory", "memory_vs_depth", "fit_growth_exponents",
    "memory_table", "PAPER_BUDGET_BYTES", "PAPER_BATCH_SIZE", "PAPER_MODELS", "STEP_BYTES", "with_state",
    "memory_budget", "deepest_within_budget", "extrapolate_to_budget", "parameter_counts", "cifar_bc_params",
    "time_per_minibatch", "bn_time_share", "conv_contiguity", "contiguity_ratio", "plot_memory_vs_depth",
    "plot_budget", "plot_time_per_minibatch", "plot_conv_contiguity",
]
