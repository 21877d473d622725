"""Experiments and plots of the notebook ``packed_bit_optimizers`` (Memory Efficient Mixed Precision Optimizers,
Lewandowski & Kosson).

``peak_memory``: formats and peak memory (with the phase where it falls and memory over the steps by category);
``dtypes``: the bf16 twins (same bytes) the memory runs take where fp16 is slow on a CPU; ``device_memory``:
the device's used memory beside the tensor peak (the tables' unit); ``step_times``: training-step times by format
(Table 3's speed); ``table2``: the step fused into backward on flan-T5 large's architecture (transformers' T5,
random weights); ``accuracy``: accuracy by format over seeds and the addition-error study; ``throughput``:
optimizer-step throughput (Fig 3); ``fused_step_limits``: section 4.1"s limits measured (memory of gradient accumulation
with the step in backward, fp16 loss scaling) and bytes per parameter by optimizer option; ``peers``: the
side-by-side table against torch, torchao, torch-optimi and bitsandbytes; ``plots``: the figures; ``claims``:
the paper"s claims and our targets as data, and the ledger.
"""

from . import claims
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
from .peak_memory import (
    FORMATS,
    Format,
    analytic_bytes_per_param,
    make_model,
    make_optimizer,
    measure_peak,
    memory_by_format,
    packed_option_available,
    find_row,
    parse_format,
    peak_vs_amp,
    saving_ceiling,
    step_timeline,
)
from .fused_step_limits import accumulation_memory, bytes_per_param_table, loss_scaling_curves
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
from .device_memory import DEVICE_COLUMNS, device_memory_by_format, used_memory
from .dtypes import FP16_ON_SLOW_CPU, bf16_twin, plan_formats
from .throughput import memory_bandwidth, step_throughput, throughput_share_ratio
from .step_times import paired_ratio, round_times, rounds_ratio, speed_workload, step_time_by_format
from .table2 import T5Classifier, flan_t5_config, fused_backward, t5_available
from .table2_plan import planned_fused_backward

__all__ = [
    "accumulation_memory", "accuracy_by_format", "accuracy_summary", "addition_error",
    "analytic_bytes_per_param", "bf16_twin", "bytes_per_param_table", "claims", "DEVICE_COLUMNS",
    "device_memory_by_format", "find_row", "flan_t5_config", "Format", "FORMATS", "FP16_ON_SLOW_CPU",
    "fp8_extra_bits", "fused_backward", "load_task", "loss_scaling_curves", "make_model", "make_optimizer",
    "make_peer", "measure_peak", "memory_bandwidth", "memory_by_format", "packed_option_available",
    "paired_gap", "paired_ratio", "parse_format", "plan_formats", "peak_vs_amp", "PEER_METHODS", "peer_methods",
    "peer_table", "PeerUnavailable", "planned_fused_backward", "plot_accuracy", "plot_addition_error",
    "plot_fused_backward", "plot_memory", "plot_peers", "plot_throughput", "plot_timeline", "round_times",
    "rounds_ratio", "saving_ceiling", "speed_workload", "step_throughput", "step_time_by_format", "step_timeline",
    "T5Classifier", "t5_available", "throughput_share_ratio", "truncate_significand", "truncate_to_e5m2",
    "used_memory",
]
