"""Experiments and plots of the notebook ``packed_bit_optimizers`` (Memory Efficient Mixed Precision
Optimizers, Lewandowski & Kosson).

``bench``: formats, peak memory (with the phase where it falls and memory over the steps by
category), training-step times and the fused backward; ``accuracy``: accuracy by format over seeds
and the addition-error study; ``speed``: optimizer-step throughput; ``peers``: the side-by-side
table against torch, torchao, torch-optimi and bitsandbytes; ``plots``: the figures.
"""

from .accuracy import (
    accuracy_by_format,
    accuracy_summary,
    addition_error,
    fp8_extra_bits,
    load_task,
    paired_gap,
    truncate_significand,
    truncate_to_e5m2,
)
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
    packed_option_available,
    paired_ratio,
    parse_format,
    peak_vs_amp,
    step_time_by_format,
    step_timeline,
)
from .peers import PEER_METHODS, PeerUnavailable, make_peer, peer_methods, peer_table
from .plots import (
    plot_accuracy,
    plot_addition_error,
    plot_fused_backward,
    plot_memory,
    plot_peers,
    plot_throughput,
    plot_timeline,
)
from .speed import memory_bandwidth, step_throughput

__all__ = [
    "FORMATS", "Format", "PEER_METHODS", "PeerUnavailable", "TokenClassifier", "accuracy_by_format",
    "accuracy_summary", "addition_error", "analytic_bytes_per_param", "fp8_extra_bits", "fused_backward",
    "load_task", "make_model", "make_optimizer", "make_peer", "measure_peak", "memory_bandwidth", "memory_by_format",
    "packed_option_available", "paired_gap", "paired_ratio", "parse_format", "peak_vs_amp", "peer_methods",
    "peer_table", "plot_accuracy", "plot_addition_error", "plot_fused_backward", "plot_memory", "plot_peers",
    "plot_throughput", "plot_timeline", "step_throughput", "step_time_by_format", "step_timeline",
    "truncate_significand", "truncate_to_e5m2",
]
