"""Experiments and plots of the notebook ``packed_bit_optimizers`` (Memory Efficient Mixed Precision
Optimizers, Lewandowski & Kosson).

``bench``: formats, peak memory, step throughput and the fused backward; ``accuracy``: accuracy by
format and the addition-error study; ``plots``: the figures.
"""

from .accuracy import accuracy_by_format, addition_error, load_task, truncate_to_e5m2
from .bench import (
    FORMATS,
    Format,
    TokenClassifier,
    analytic_bytes_per_param,
    fused_backward,
    make_model,
    make_optimizer,
    measure_peak,
    memory_by_format,
    parse_format,
    peak_vs_amp,
    step_time_by_format,
)
from .speed import copy_bandwidth, step_throughput
from .plots import plot_accuracy, plot_addition_error, plot_fused_backward, plot_memory, plot_throughput

__all__ = [
    "FORMATS", "Format", "TokenClassifier", "accuracy_by_format", "addition_error", "analytic_bytes_per_param",
    "copy_bandwidth", "fused_backward", "load_task", "make_model", "make_optimizer", "measure_peak",
    "memory_by_format", "parse_format", "peak_vs_amp", "plot_accuracy", "plot_addition_error", "plot_fused_backward",
    "plot_memory", "plot_throughput", "step_throughput", "step_time_by_format", "truncate_to_e5m2",
]
