"""Packed-bit mixed precision optimizers: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers".

``bits``: split/merge fp32 <-> 16-bit + k extra bits (dense words, or byte planes for 8/16 bits),
stochastic rounding, counter-based random bits.
``update``: the elementwise merge / fp32 step / split, eager in chunks or ``torch.compile``d.
``packed``: PackedSGD, PackedAdamW, PackedAdam (per-parameter or fused flat step; fp32 or bf16
states; truncated or stochastic master rounding).
``backward``: step_in_backward (the update runs inside backward, gradients freed at once).
"""

from workbench.optim.backward import StepInBackwardHandle, step_in_backward
from workbench.optim.bits import merge, pack, packed_words, split, stochastic_round, unpack
from workbench.optim.packed import (
    PackedAdam,
    PackedAdamW,
    PackedOptimizer,
    PackedSGD,
    master_weight,
)

__all__ = [
    "PackedAdam",
    "PackedAdamW",
    "PackedOptimizer",
    "PackedSGD",
    "StepInBackwardHandle",
    "master_weight",
    "merge",
    "pack",
    "packed_words",
    "split",
    "step_in_backward",
    "stochastic_round",
    "unpack",
]
