"""Packed-bit mixed precision optimizers (paper 004, Lewandowski & Kosson).

``bits``: split/merge fp32 <-> 16-bit + k packed extra bits, stochastic rounding.
``packed``: PackedSGD, PackedAdamW, PackedAdam (per-parameter or fused flat step).
``backward``: step_in_backward (the update runs inside backward, gradients freed at once).
``bench``: the measurements the notebook ``packed_bit_optimizers`` reports.
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
