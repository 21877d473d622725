"""Packed-bit mixed precision optimizers: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers".

``formats``: the 16-bit formats and the extra bits that complete them to fp32 (Table 1).
``packing``: k-bit values densely in int32 words (Fig 1), or byte planes for 8/16 bits.
``rng``: random bits for stochastic rounding (counter-based hash, torch-drawn noise).
``split_merge``: fp32 <-> 16-bit value + extra bits, with stochastic rounding (3.1).
``update``: the elementwise merge / fp32 step / split, eager in chunks or ``torch.compile``d.
``options``: ``PackedOptions``, the keyword options of every packed optimizer, declared once.
``fused``: the flat buffers of the fused step ("Fused" in 3.1).
``packed``: PackedSGD, PackedAdamW, PackedAdam (per-parameter or fused flat step; fp32 or bf16
states; truncated or stochastic master rounding).
``backward``: step_in_backward (the update runs inside backward, gradients freed at once; 3.2).
"""

from workbench.optim.backward import StepInBackwardHandle, step_in_backward
from workbench.optim.options import PackedOptions
from workbench.optim.packed import (
    PackedAdam,
    PackedAdamW,
    PackedOptimizer,
    PackedSGD,
    master_weight,
)
from workbench.optim.packing import pack, packed_words, unpack
from workbench.optim.split_merge import merge, split, stochastic_round

__all__ = [
    "PackedAdam",
    "PackedAdamW",
    "PackedOptimizer",
    "PackedOptions",
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
